#include "engine/request_helpers.h"

#include <utility>

namespace metrale::testing {

Request make_request(std::vector<int32_t> prompt, int32_t max_tokens, float temperature, std::optional<uint64_t> seed) {
  Request request;
  request.prompt = std::move(prompt);
  request.max_tokens = max_tokens;
  request.ignore_eos = true;
  request.sampling.temperature = temperature;
  request.sampling.seed = seed;
  return request;
}

}  // namespace metrale::testing
