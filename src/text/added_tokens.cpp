#include "text/added_tokens.h"

#include <utf8proc.h>

#include <algorithm>
#include <map>

#include "text/utf8.h"

namespace metrale::text {

namespace {

// Rust's char::is_whitespace / regex \s: the Unicode White_Space property.
bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// Rust regex's Unicode \w: Alphabetic, marks, decimal digits, connector punctuation and the
// joiners. Alphabetic is taken as letters plus letter numbers (Other_Alphabetic code points are
// almost all marks, which are included anyway).
bool is_word_character(char32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// The code point that ends text[0, end).
char32_t code_point_before(std::string_view text, size_t end) {
  size_t begin = end - 1;
  while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
  return next_code_point(text, begin);
}

// Start of the whitespace run that ends text[0, end) (end itself when there is none).
size_t trailing_space_start(std::string_view text, size_t end) {
  while (end > 0) {
    size_t begin = end - 1;
    while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
    size_t pos = begin;
    if (!is_white_space(next_code_point(text, pos))) break;
    end = begin;
  }
  return end;
}

// End of the whitespace run that starts at text[begin].
size_t leading_space_end(std::string_view text, size_t begin) {
  while (begin < text.size()) {
    size_t pos = begin;
    if (!is_white_space(next_code_point(text, pos))) break;
    begin = pos;
  }
  return begin;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<std::string>& patterns, const std::vector<AddedToken>& tokens)
    : tokens_(tokens) {
  // Build with ordered maps, then flatten into sorted edge ranges.
  std::vector<std::map<uint8_t, int32_t>> children(1);
  std::vector<int32_t> token_of(1, -1);
  for (size_t i = 0; i < patterns.size(); ++i) {
    if (patterns[i].empty()) continue;  // HF ignores empty added tokens
    int32_t node = 0;
    for (const char c : patterns[i]) {
      const auto byte = static_cast<uint8_t>(c);
      auto it = children[node].find(byte);
      if (it == children[node].end()) {
        const auto created = static_cast<int32_t>(children.size());
        children[node].emplace(byte, created);
        children.emplace_back();
        token_of.push_back(-1);
        node = created;
      } else {
        node = it->second;
      }
    }
    token_of[node] = static_cast<int32_t>(i);
  }
  nodes_.resize(children.size());
  for (size_t node = 0; node < children.size(); ++node) {
    nodes_[node].first_edge = static_cast<int32_t>(edges_.size());
    nodes_[node].edge_count = static_cast<int32_t>(children[node].size());
    nodes_[node].token = token_of[node];
    for (const auto& [byte, child] : children[node]) edges_.push_back({byte, child});
  }
  for (const auto& [byte, child] : children[0]) root_children_[byte] = child;
  if (children.size() == 1) tokens_.clear();  // nothing to match
}

int32_t AddedTokenMatcher::child(int32_t node, uint8_t byte) const {
  const Node& n = nodes_[node];
  const Edge* first = edges_.data() + n.first_edge;
  const Edge* last = first + n.edge_count;
  const Edge* it = std::lower_bound(first, last, byte, [](const Edge& edge, uint8_t b) { return edge.byte < b; });
  return it != last && it->byte == byte ? it->child : -1;
}

std::pair<size_t, int32_t> AddedTokenMatcher::longest_at(std::string_view text, size_t pos) const {
  int32_t node = root_children_[static_cast<uint8_t>(text[pos])];
  if (node == 0) return {0, -1};
  size_t length = 1;
  std::pair<size_t, int32_t> best{0, -1};
  while (true) {
    if (nodes_[node].token >= 0) best = {length, nodes_[node].token};
    if (pos + length >= text.size()) break;
    node = child(node, static_cast<uint8_t>(text[pos + length]));
    if (node < 0) break;
    ++length;
  }
  return best;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& segments) const {
  size_t covered = 0;  // HF's start_offset: where the previous token's segment ended
  const auto add_text = [&](size_t begin, size_t end) {
    if (end > begin) segments.push_back({begin, end, -1});
  };
  if (!tokens_.empty()) {
    size_t pos = 0;
    while (pos < text.size()) {
      const auto [length, index] = longest_at(text, pos);
      if (index < 0) {
        ++pos;
        continue;
      }
      size_t start = pos;
      size_t stop = pos + length;
      pos = stop;  // the search resumes after the match even if it is discarded below
      const AddedToken& token = tokens_[index];
      if (token.single_word) {
        const bool word_before = start > 0 && is_word_character(code_point_before(text, start));
        size_t after = stop;
        const bool word_after = stop < text.size() && is_word_character(next_code_point(text, after));
        if (word_before || word_after) continue;
      }
      if (token.lstrip) start = std::max(trailing_space_start(text, start), covered);
      if (token.rstrip) stop = leading_space_end(text, stop);
      if (covered < start) add_text(covered, start);
      segments.push_back({start, stop, token.id});
      covered = stop;
    }
  }
  add_text(covered, text.size());
}

}  // namespace metrale::text
