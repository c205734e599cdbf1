// config.json: the path load_model_config takes (a nesting check, nlohmann's parser, then
// parse_model_config) accepts a config only with every size in its range, and rejects anything else
// with a metrale::Error that is not an internal one; no other exception, no crash.
#include <cstdint>

#include "core/error.h"
#include "core/json_depth.h"
#include "fuzz_input.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (metrale::json_nests_deeper_than(text, 64)) return 0;  // what read_json refuses
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;  // what read_json reports as invalid JSON
  }
  try {
    const metrale::ModelConfig config = metrale::parse_model_config(json, "fuzz/config.json");
    FUZZ_CHECK(config.vocab_size >= 1 && config.vocab_size <= INT32_MAX);
    FUZZ_CHECK(config.hidden_size >= 1 && config.num_layers >= 1 && config.num_heads >= 1);
    FUZZ_CHECK(config.num_kv_heads >= 1 && config.num_heads % config.num_kv_heads == 0);
    FUZZ_CHECK(config.head_dim >= 1 && config.max_position_embeddings >= 1);
    FUZZ_CHECK(config.max_position_embeddings <= (int64_t{1} << 28));
    FUZZ_CHECK(config.rms_norm_eps > 0 && config.rope.theta > 0 && config.rope.partial_rotary_factor > 0);
    for (const int64_t id : config.eos_token_ids) FUZZ_CHECK(id >= 0 && id <= INT32_MAX);
  } catch (const metrale::Error& e) {
    FUZZ_CHECK(e.code() != metrale::ErrorCode::kInternal, e.what());
  }
  return 0;
}
