#include "text/grammar/prefix_tree.h"

#include <algorithm>

#include "core/error.h"

namespace metrale::grammar {

PrefixTree PrefixTree::build(std::vector<std::pair<std::string, int32_t>> entries) {
  std::sort(entries.begin(), entries.end());
  PrefixTree tree;
  std::vector<int32_t> counts;  // values per node
  // path[d] is the node of the current string's first d + 1 bytes.
  std::vector<int32_t> path;
  const std::string* previous = nullptr;
  for (const auto& [text, value] : entries) {
    if (text.empty()) continue;
    METRALE_CHECK(text.size() <= 65535, "prefix tree strings are at most 65535 bytes");
    size_t common = 0;
    if (previous != nullptr) {
      const size_t limit = std::min(previous->size(), text.size());
      while (common < limit && (*previous)[common] == text[common]) ++common;
    }
    // Close the subtrees of the previous string below the common prefix.
    while (path.size() > common) {
      tree.end[path.back()] = tree.size();
      path.pop_back();
    }
    for (size_t d = common; d < text.size(); ++d) {
      tree.byte.push_back(static_cast<uint8_t>(text[d]));
      tree.depth.push_back(static_cast<uint16_t>(d + 1));
      tree.end.push_back(-1);
      counts.push_back(0);
      path.push_back(tree.size() - 1);
    }
    // Sorted input: the strings ending at a node come right after the node is made (or are equal to
    // the one that made it), so values are appended in node order.
    tree.values.push_back(value);
    ++counts[path.back()];
    tree.max_depth_ = std::max(tree.max_depth_, static_cast<int32_t>(text.size()));
    previous = &text;
  }
  while (!path.empty()) {
    tree.end[path.back()] = tree.size();
    path.pop_back();
  }
  tree.values_offset.assign(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) tree.values_offset[i + 1] = tree.values_offset[i] + counts[i];
  return tree;
}

size_t PrefixTree::memory_bytes() const {
  return byte.size() * (sizeof(uint8_t) + sizeof(uint16_t) + sizeof(int32_t) * 2) + values.size() * sizeof(int32_t);
}

}  // namespace metrale::grammar
