// tokenizer.json (and tokenizer_config.json) loading: Tokenizer::from_json_text builds a tokenizer
// or throws a metrale::Error that is not internal. A tokenizer that loads encodes text to ids inside
// its vocabulary, and decoding them, whole or one id at a time (IncrementalDetokenizer), gives the
// same valid UTF-8.
//   input: tokenizer.json \0 tokenizer_config.json \0 text
#include <cstdint>

#include "core/error.h"
#include "fuzz_input.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metrale::fuzz::FuzzInput input(data, size);
  const std::string_view tokenizer_json = input.until('\0');
  const std::string_view config_json = input.until('\0');
  const std::string_view text = input.take(4096);
  std::optional<metrale::Tokenizer> tokenizer;
  try {
    tokenizer = metrale::Tokenizer::from_json_text(tokenizer_json, config_json);
  } catch (const metrale::Error& e) {
    FUZZ_CHECK(e.code() != metrale::ErrorCode::kInternal, e.what());
    return 0;
  }
  const std::vector<int32_t> ids = tokenizer->encode(text, /*add_special_tokens=*/true);
  for (const int32_t id : ids) FUZZ_CHECK(id >= 0 && id < tokenizer->vocab_size());
  const std::string decoded = tokenizer->decode(ids, /*skip_special_tokens=*/false);
  FUZZ_CHECK(metrale::text::is_valid_utf8(decoded));
  metrale::IncrementalDetokenizer detokenizer(*tokenizer, /*skip_special_tokens=*/false);
  std::string streamed;
  for (const int32_t id : ids) streamed += detokenizer.push(id);
  streamed += detokenizer.flush();
  FUZZ_CHECK(streamed == decoded, "incremental and whole decoding differ");
  return 0;
}
