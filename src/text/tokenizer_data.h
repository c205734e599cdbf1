// The immutable tables behind a Tokenizer handle (internal to src/text).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "text/added_tokens.h"
#include "text/bpe.h"
#include "text/normalizer.h"
#include "text/pre_tokenizer.h"

namespace metrale::text {

struct TokenizerData {
  // The encoding pipeline, in the order HF runs it: added tokens are split out of the raw input
  // (raw_matcher); the rest is normalized; tokens with normalized=true are split out of that
  // (normalized_matcher); the rest is pre-tokenized and each piece goes through BPE.
  AddedTokenMatcher raw_matcher;
  Normalizer normalizer;
  AddedTokenMatcher normalized_matcher;
  PreTokenizer pre_tokenizer;
  BpeModel model;
  // What encode(..., add_special_tokens = true) puts around the ids (the post_processor).
  std::vector<int32_t> special_prefix;
  std::vector<int32_t> special_suffix;

  std::vector<AddedToken> added_tokens;  // with the ids HF assigns, sorted by id
  TokenIdMap added_token_ids;            // content -> id

  // Decoding, indexed by id in [0, vocab_size): the bytes each token stands for, as HF's
  // ByteLevel decoder maps it, and whether skip_special_tokens drops it.
  int64_t vocab_size = 0;
  std::vector<uint32_t> token_bytes_offsets;  // vocab_size + 1 offsets into token_bytes
  std::string token_bytes;
  std::vector<uint8_t> special;

  std::optional<int32_t> eos_id;
  std::optional<int32_t> bos_id;
  bool add_bos_token = false;
  std::string chat_template;

  // Appends the ids of `text` (without the post_processor's tokens). Thread-safe.
  void encode(std::string_view text, std::vector<int32_t>& ids) const;

  std::string_view bytes_of(int32_t id) const {
    if (id < 0 || id >= vocab_size) return {};
    return std::string_view(token_bytes).substr(token_bytes_offsets[id], token_bytes_offsets[id + 1] - token_bytes_offsets[id]);
  }
  bool is_special(int32_t id) const { return id >= 0 && id < vocab_size && special[id] != 0; }

 private:
  void encode_text(std::string_view text, std::vector<int32_t>& ids) const;
  void encode_pre_tokenized(std::string_view text, std::vector<int32_t>& ids) const;
};

// Builds the tables from parsed tokenizer.json. Errors carry no file name; the caller adds it.
// `enable_cache` exists for tests.
std::shared_ptr<TokenizerData> build_tokenizer_data(const nlohmann::json& tokenizer_json, bool enable_cache = true);

// Reads the special tokens, add_bos_token and the chat template from parsed tokenizer_config.json.
void apply_tokenizer_config(TokenizerData& data, const nlohmann::json& tokenizer_config);

}  // namespace metrale::text
