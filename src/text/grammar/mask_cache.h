// The token classes of grammar positions (see compiled_grammar.h), and a cache of them per tokenizer:
// a rule's classes depend only on its automaton and the rules it reaches, so grammars that share a
// rule (the string contents of every tool-call grammar of a format, a repeated schema, any JSON
// value) compute it once.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "text/grammar/prefix_tree.h"

namespace metrale::grammar {

struct PositionMask {
  std::vector<uint32_t> accepted_bits;  // [bitmask words] when many tokens are accepted, else empty
  std::vector<int32_t> accepted_ids;    // sorted, when few are
  PrefixTree uncertain;                 // remainders; values are token ids
  int32_t num_accepted = 0;
  int32_t num_uncertain = 0;
  size_t memory_bytes() const;
};

// The classes of every position of one rule, indexed by state (empty for states without bytes).
using RuleMasks = std::vector<PositionMask>;

class RuleMaskCache {
 public:
  explicit RuleMaskCache(size_t max_bytes = size_t{256} << 20) : max_bytes_(max_bytes) {}

  // The masks stored under `key` (a rule's fingerprint), or nullptr.
  std::shared_ptr<const RuleMasks> find(const std::string& key);
  // Stores masks, dropping the least recently used entries beyond the byte budget.
  void insert(const std::string& key, std::shared_ptr<const RuleMasks> masks);

  size_t size() const;
  size_t bytes() const;

 private:
  struct Entry {
    std::shared_ptr<const RuleMasks> masks;
    size_t bytes = 0;
    std::list<std::string>::iterator age;
  };
  mutable std::mutex mutex_;
  size_t max_bytes_;
  size_t bytes_ = 0;
  std::unordered_map<std::string, Entry> entries_;
  std::list<std::string> ages_;  // most recent first
};

}  // namespace metrale::grammar
