// The nesting depth of JSON text, measured before it is parsed. nlohmann's parser is iterative, but
// copying, dumping and converting the value it builds recurse once per level, so text from outside
// (request bodies, config.json, tokenizer.json, safetensors headers) is checked against a depth limit
// first: a 100 KB body of nested brackets must be a clean error, not a stack overflow.
#pragma once

#include <cstddef>
#include <string_view>

namespace metrale {

// The deepest nesting of arrays and objects in `text` (0 for a scalar), counting only brackets
// outside strings. Stops counting once the depth exceeds `stop_after` (and returns that depth), so a
// hostile document costs one pass at most. Malformed text gets some depth; the parser rejects it.
size_t json_nesting_depth(std::string_view text, size_t stop_after = static_cast<size_t>(-1));

// Whether `text` nests deeper than `limit`.
inline bool json_nests_deeper_than(std::string_view text, size_t limit) {
  return json_nesting_depth(text, limit) > limit;
}

}  // namespace metrale
