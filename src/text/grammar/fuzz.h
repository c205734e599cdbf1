// Entry points for libFuzzer targets of the grammar engine (the targets themselves live with the
// other fuzzers). Each returns 0 and aborts when an invariant breaks.
#pragma once

#include <cstddef>
#include <cstdint>

namespace metrale::grammar {

// The input is a JSON schema, a NUL byte, then bytes that choose tokens. A schema that does not
// parse or that the engine refuses (metrale::Error) ends the run; any other exception escapes (a
// bug). Otherwise the bytes drive a walk over a small built-in vocabulary, which must always have an
// allowed token, accept every token its mask allows, and end, if it ends, in valid JSON.
int fuzz_json_schema_grammar(const uint8_t* data, size_t size);

}  // namespace metrale::grammar
