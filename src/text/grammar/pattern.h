// JSON Schema `pattern` (an ECMA-262 regular expression) as a grammar expression over the characters
// of a string, encoded (JSON-escaped or raw). The subset:
//   literals (any UTF-8), escaped metacharacters, \t \n \r \f \v \0 \xHH \uHHHH \u{H...};
//   . \d \D \w \W \s \S, classes [...] and [^...] with ranges and those escapes;
//   groups (...), (?:...), (?<name>...); alternation |; quantifiers * + ? {n} {n,} {n,m} (lazy ones
//   are the same language); ^ at the start and $ at the end of the pattern or of a top-level branch.
// A pattern matches anywhere in the string unless anchored, as JSON Schema says: a branch without ^
// may be preceded by any text, without $ followed by any.
// Refused with kUnsupported naming the construct: backreferences, lookaround, \b \B, \p{...}, anchors
// elsewhere, flags.
#pragma once

#include <string_view>

#include "text/grammar/char_class.h"
#include "text/grammar/grammar.h"

namespace metrale::grammar {

// `allowed` restricts every character (the raw tool-call values keep '<' out, see json_schema.h).
ExprId pattern_expr(Grammar& grammar, std::string_view pattern, StringEncoding encoding,
                    const CharSet& allowed = CharSet::all());

// The pattern of a JSON Schema `format`, or "" when the format is not supported. Supported:
// date-time, date, time, email, hostname, ipv4, uuid, uri.
std::string_view format_pattern(std::string_view format);

}  // namespace metrale::grammar
