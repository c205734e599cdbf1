// Requests as the engine tests build them.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "engine/request.h"

namespace metrale::testing {

// A request that generates exactly `max_tokens` tokens (EOS ignored): greedy at temperature 0, else
// sampled with `seed` (none: the engine draws one).
Request make_request(std::vector<int32_t> prompt, int32_t max_tokens, float temperature = 0.0f,
                     std::optional<uint64_t> seed = std::nullopt);

}  // namespace metrale::testing
