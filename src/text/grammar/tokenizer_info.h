// What constrained decoding needs to know about a tokenizer, computed once per tokenizer and shared
// by every grammar compiled for it: the bytes of every token, which tokens are special (never
// produced by a grammar unless it names them) and a trie of the token byte strings.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/grammar/mask_cache.h"
#include "text/grammar/prefix_tree.h"

namespace metrale {
class Tokenizer;
}

namespace metrale::grammar {

class TokenizerInfo {
 public:
  // `vocab_size` is the width of the model's logits (at least the tokenizer's, which is the default);
  // ids past the tokenizer's vocabulary are never allowed. Stop tokens default to the tokenizer's
  // EOS token.
  static std::shared_ptr<const TokenizerInfo> from_tokenizer(const Tokenizer& tokenizer,
                                                             std::optional<int64_t> vocab_size = std::nullopt);
  // For tests and fuzzing: tokens[i] is the byte string of id i ("" for an unused id).
  static std::shared_ptr<const TokenizerInfo> from_tokens(std::vector<std::string> tokens,
                                                          std::vector<int32_t> special_ids = {},
                                                          std::vector<int32_t> stop_ids = {},
                                                          std::optional<int64_t> vocab_size = std::nullopt);

  int64_t vocab_size() const { return vocab_size_; }
  int32_t bitmask_words() const { return static_cast<int32_t>((vocab_size_ + 31) / 32); }
  int32_t num_tokens() const { return static_cast<int32_t>(tokens_.size()); }  // ids with bytes known
  std::string_view token_bytes(int32_t id) const {
    return id >= 0 && id < num_tokens() ? std::string_view(tokens_[static_cast<size_t>(id)]) : std::string_view();
  }
  bool is_special(int32_t id) const { return id >= 0 && id < num_tokens() && special_[static_cast<size_t>(id)] != 0; }
  const std::vector<int32_t>& stop_token_ids() const { return stop_ids_; }
  // The special token whose bytes are `text`, if any.
  std::optional<int32_t> special_token(std::string_view text) const;

  // Every token with bytes, special or not (walks filter the special ones).
  const PrefixTree& trie() const { return trie_; }
  size_t memory_bytes() const;

  // Token classes of rules already computed for this tokenizer, shared by every grammar compiled
  // for it (thread-safe).
  RuleMaskCache& mask_cache() const { return *mask_cache_; }

 private:
  TokenizerInfo() = default;
  void finish();

  int64_t vocab_size_ = 0;
  std::vector<std::string> tokens_;
  std::vector<uint8_t> special_;
  std::vector<int32_t> stop_ids_;
  PrefixTree trie_;
  std::unique_ptr<RuleMaskCache> mask_cache_ = std::make_unique<RuleMaskCache>();
};

}  // namespace metrale::grammar
