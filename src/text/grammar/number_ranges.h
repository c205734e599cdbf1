// Integer ranges as grammar expressions: the decimal numerals (no leading zeros, no "-0") of the
// integers between two bounds, for JSON Schema minimum / maximum on integers.
#pragma once

#include <cstdint>
#include <optional>

#include "text/grammar/grammar.h"

namespace metrale::grammar {

// The numerals of the integers in [lo, hi]; an absent bound is unbounded. lo <= hi.
ExprId integer_range(Grammar& grammar, std::optional<int64_t> lo, std::optional<int64_t> hi);

}  // namespace metrale::grammar
