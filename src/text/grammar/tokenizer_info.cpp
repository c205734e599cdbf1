#include "text/grammar/tokenizer_info.h"

#include <algorithm>

#include "core/error.h"
#include "text/tokenizer.h"

namespace metrale::grammar {

std::shared_ptr<const TokenizerInfo> TokenizerInfo::from_tokenizer(const Tokenizer& tokenizer,
                                                                   std::optional<int64_t> vocab_size) {
  auto info = std::shared_ptr<TokenizerInfo>(new TokenizerInfo());
  const int64_t n = tokenizer.vocab_size();
  info->tokens_.resize(static_cast<size_t>(n));
  info->special_.assign(static_cast<size_t>(n), 0);
  for (int64_t id = 0; id < n; ++id) {
    info->tokens_[static_cast<size_t>(id)] = std::string(tokenizer.token_bytes(static_cast<int32_t>(id)));
    info->special_[static_cast<size_t>(id)] = tokenizer.is_special(static_cast<int32_t>(id)) ? 1 : 0;
  }
  if (const std::optional<int32_t> eos = tokenizer.eos_token_id()) info->stop_ids_.push_back(*eos);
  info->vocab_size_ = std::max(vocab_size.value_or(n), n);
  info->finish();
  return info;
}

std::shared_ptr<const TokenizerInfo> TokenizerInfo::from_tokens(std::vector<std::string> tokens,
                                                                std::vector<int32_t> special_ids,
                                                                std::vector<int32_t> stop_ids,
                                                                std::optional<int64_t> vocab_size) {
  auto info = std::shared_ptr<TokenizerInfo>(new TokenizerInfo());
  const auto n = static_cast<int64_t>(tokens.size());
  info->tokens_ = std::move(tokens);
  info->special_.assign(info->tokens_.size(), 0);
  for (int32_t id : special_ids) {
    if (id < 0 || id >= n) raise(ErrorCode::kInvalidArgument, "special token id {} out of range", id);
    info->special_[static_cast<size_t>(id)] = 1;
  }
  for (int32_t id : stop_ids) {
    if (id < 0 || id >= std::max(n, vocab_size.value_or(n))) {
      raise(ErrorCode::kInvalidArgument, "stop token id {} out of range", id);
    }
  }
  info->stop_ids_ = std::move(stop_ids);
  info->vocab_size_ = std::max(vocab_size.value_or(n), n);
  info->finish();
  return info;
}

void TokenizerInfo::finish() {
  std::vector<std::pair<std::string, int32_t>> entries;
  entries.reserve(tokens_.size());
  for (size_t id = 0; id < tokens_.size(); ++id) {
    if (!tokens_[id].empty()) entries.emplace_back(tokens_[id], static_cast<int32_t>(id));
  }
  trie_ = PrefixTree::build(std::move(entries));
}

std::optional<int32_t> TokenizerInfo::special_token(std::string_view text) const {
  for (size_t id = 0; id < tokens_.size(); ++id) {
    if (special_[id] && tokens_[id] == text) return static_cast<int32_t>(id);
  }
  return std::nullopt;
}

size_t TokenizerInfo::memory_bytes() const {
  size_t bytes = trie_.memory_bytes() + special_.size();
  for (const std::string& token : tokens_) bytes += token.size() + sizeof(std::string);
  return bytes;
}

}  // namespace metrale::grammar
