// The tokenizer of a Hugging Face model directory: byte-level BPE from tokenizer.json, with the
// extras of tokenizer_config.json (special tokens, chat template). Encoding and decoding are
// identical to Hugging Face `tokenizers` (the Rust library) for the tokenizer.json features
// listed in text/tokenizer.cpp; anything else is rejected at load time with kUnsupported rather
// than tokenized differently.
//
// A Tokenizer is a cheap handle to immutable shared tables: copy it freely, and call it from any
// number of threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace metrale {

namespace text {
struct TokenizerData;
}

class Tokenizer {
 public:
  // Reads <dir>/tokenizer.json and, when present, <dir>/tokenizer_config.json (chat_template,
  // eos_token, bos_token, add_bos_token) and <dir>/chat_template.jinja (which takes precedence
  // over the config's template). Throws metrale::Error naming the file: kNotFound when
  // tokenizer.json is missing, kBadFormat when a file is malformed, kUnsupported for features
  // this implementation does not have.
  static Tokenizer from_dir(const std::filesystem::path& dir);
  // The same from the contents of those files: `config_json` and `chat_template` may be empty
  // (absent); `source` names the directory in errors. JSON nested deeper than 64 is kBadFormat.
  static Tokenizer from_json_text(std::string_view tokenizer_json, std::string_view config_json = {},
                                  std::string_view chat_template = {}, std::string_view source = "<memory>");

  // Encodes UTF-8 text; invalid UTF-8 is first repaired (each ill-formed subpart becomes U+FFFD).
  // With `add_special_tokens`, applies tokenizer.json's post_processor as HF does: a
  // TemplateProcessing adds its tokens, a ByteLevel processor adds none. (Python transformers'
  // add_bos_token flag is not consulted: see add_bos_token().)
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;

  // Decodes ids to text: the concatenated bytes of the tokens, with each ill-formed UTF-8 subpart
  // replaced by U+FFFD. Ids that name no token are skipped, as HF does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  int64_t vocab_size() const;  // the largest id + 1 over the vocab and the added tokens
  std::optional<int32_t> token_to_id(std::string_view token) const;  // added tokens first, then the vocab
  std::string id_to_token(int32_t id) const;  // the raw token string ("Ġthe"); "" if unknown
  bool is_special(int32_t id) const;          // skipped by decode(..., skip_special_tokens = true)

  // The bytes token `id` stands for (may be part of a UTF-8 character); empty if unknown.
  std::string_view token_bytes(int32_t id) const;

  // From tokenizer_config.json; eos_token/bos_token may be strings or AddedToken objects.
  std::optional<int32_t> eos_token_id() const;
  std::optional<int32_t> bos_token_id() const;
  // tokenizer_config.json's add_bos_token (false when absent). encode() does not act on it; a chat
  // template normally writes the BOS token itself.
  bool add_bos_token() const;
  const std::string& chat_template() const;  // "" when none

 private:
  explicit Tokenizer(std::shared_ptr<const text::TokenizerData> data) : data_(std::move(data)) {}
  std::shared_ptr<const text::TokenizerData> data_;
};

// Turns a stream of token ids into text as the ids arrive. Emits only complete UTF-8: the bytes of
// a character split across tokens are held back until the character is complete. The
// concatenation of all push() results and flush() equals Tokenizer::decode of all the ids.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens = true);

  std::string push(int32_t id);  // the text completed by this token (often "")
  std::string flush();           // whatever remains; an incomplete trailing character becomes U+FFFD

 private:
  Tokenizer tokenizer_;  // a handle: keeps the tables alive
  bool skip_special_tokens_;
  std::string pending_;  // at most 3 bytes: the start of an incomplete character
};

}  // namespace metrale
