// A trie of byte strings for walks that prune whole subtrees: the tokenizer's vocabulary, and the
// remainders of a position's uncertain tokens.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace metrale::grammar {

// A trie of byte strings stored in depth-first preorder, so that a walk is a forward scan that skips
// whole subtrees: node i is reached by appending byte[i] to the string of its parent (the node at
// depth[i] - 1 most recently visited); its subtree is [i, end[i]). The root (the empty string) is
// implicit.
struct PrefixTree {
  std::vector<uint8_t> byte;           // [n]
  std::vector<uint16_t> depth;         // [n], >= 1
  std::vector<int32_t> end;            // [n]
  std::vector<int32_t> values_offset;  // [n + 1]: the values of the strings ending at node i
  std::vector<int32_t> values;

  // `entries` need not be sorted; equal strings share a node. Strings must be at most 65535 bytes.
  static PrefixTree build(std::vector<std::pair<std::string, int32_t>> entries);
  int32_t size() const { return static_cast<int32_t>(byte.size()); }
  int32_t max_depth() const { return max_depth_; }
  size_t memory_bytes() const;

  int32_t max_depth_ = 0;
};

}  // namespace metrale::grammar
