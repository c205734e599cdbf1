// Added tokens (tokenizer.json "added_tokens"): strings matched in the input before the model
// sees it and encoded as one id each. Special or not, they are split out the same way; `special`
// only matters for decoding with skip_special_tokens.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace metrale::text {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false;  // match only when not inside a word (\w on neither side)
  bool lstrip = false;       // the match swallows the whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool normalized = true;    // matched against the normalized text instead of the raw input
  bool special = false;
};

// Splits text around added tokens exactly as HF's AddedVocabulary::find_matches does:
// leftmost-longest non-overlapping matches of the token strings, filtered by single_word and
// widened by lstrip/rstrip.
class AddedTokenMatcher {
 public:
  // A part of the text: an added token (id >= 0) or plain text (id == -1).
  struct Segment {
    size_t begin;
    size_t end;
    int32_t id;
  };

  AddedTokenMatcher() = default;
  // `patterns[i]` is what to look for (the content, or its normalized form) for `tokens[i]`.
  AddedTokenMatcher(const std::vector<std::string>& patterns, const std::vector<AddedToken>& tokens);

  bool empty() const { return tokens_.empty(); }

  // Appends the segments of `text` (valid UTF-8) in order. Plain-text segments are never empty
  // and together with the tokens they cover the text. (As in HF, an rstrip token may swallow
  // whitespace that a following token match also starts in; the segments then overlap.)
  void split(std::string_view text, std::vector<Segment>& segments) const;

 private:
  // A byte trie. Node 0 is the root; the root's children are looked up in a 256-entry table since
  // most positions of typical text fail right there.
  struct Edge {
    uint8_t byte;
    int32_t child;
  };
  struct Node {
    int32_t first_edge = 0;  // edges_[first_edge, first_edge + edge_count), sorted by byte
    int32_t edge_count = 0;
    int32_t token = -1;      // index into tokens_ of the pattern ending here, or -1
  };
  int32_t child(int32_t node, uint8_t byte) const;
  // The longest pattern starting at text[pos]: its length and token index, or token -1.
  std::pair<size_t, int32_t> longest_at(std::string_view text, size_t pos) const;

  std::vector<AddedToken> tokens_;
  std::vector<Node> nodes_;
  std::vector<Edge> edges_;
  int32_t root_children_[256] = {};  // 0: no child (node 0 is the root, never a child)
};

}  // namespace metrale::text
