#include "text/grammar/number_ranges.h"

#include <algorithm>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace metrale::grammar {
namespace {

std::string digits_of(uint64_t value) {
  return std::to_string(value);
}

// Same-length decimal strings x <= y: every string between them.
ExprId digit_range(Grammar& g, std::string_view x, std::string_view y) {
  if (x.empty()) return g.empty();
  if (x == y) return g.literal(x);
  const size_t rest = x.size() - 1;
  if (x[0] == y[0]) return g.seq({g.byte(static_cast<uint8_t>(x[0])), digit_range(g, x.substr(1), y.substr(1))});
  const std::string nines(rest, '9');
  const std::string zeros(rest, '0');
  const ExprId any_rest =
      g.repeat(g.bytes(ByteSet::range('0', '9')), static_cast<int32_t>(rest), static_cast<int32_t>(rest));
  if (x.substr(1) == zeros && y.substr(1) == nines) {
    return g.seq({g.bytes(ByteSet::range(static_cast<uint8_t>(x[0]), static_cast<uint8_t>(y[0]))), any_rest});
  }
  std::vector<ExprId> branches;
  branches.push_back(g.seq({g.byte(static_cast<uint8_t>(x[0])), digit_range(g, x.substr(1), nines)}));
  if (x[0] + 1 <= y[0] - 1) {
    branches.push_back(
        g.seq({g.bytes(ByteSet::range(static_cast<uint8_t>(x[0] + 1), static_cast<uint8_t>(y[0] - 1))), any_rest}));
  }
  branches.push_back(g.seq({g.byte(static_cast<uint8_t>(y[0])), digit_range(g, zeros, y.substr(1))}));
  return g.alt(std::move(branches));
}

// Decimal numerals (no leading zeros) of the integers in [a, b], a >= 1; b absent: unbounded.
ExprId positive_range(Grammar& g, uint64_t a, std::optional<uint64_t> b) {
  std::vector<ExprId> branches;
  const size_t first = digits_of(a).size();
  const size_t last = b ? digits_of(*b).size() : first;
  uint64_t power = 1;
  for (size_t i = 1; i < first; ++i) power *= 10;  // 10^(first-1)
  for (size_t length = first; length <= last; ++length) {
    const uint64_t lo = std::max(a, power);
    const uint64_t top = length >= 20 ? std::numeric_limits<uint64_t>::max() : power * 10 - 1;
    const uint64_t hi = b ? std::min(*b, top) : top;
    if (lo <= hi) branches.push_back(digit_range(g, digits_of(lo), digits_of(hi)));
    if (length < 20) power *= 10;
  }
  if (!b) {
    // Every numeral with more digits than a's.
    branches.push_back(g.seq({g.bytes(ByteSet::range('1', '9')),
                              g.repeat(g.bytes(ByteSet::range('0', '9')), static_cast<int32_t>(first), -1)}));
  }
  return g.alt(std::move(branches));
}

}  // namespace

ExprId integer_range(Grammar& g, std::optional<int64_t> lo, std::optional<int64_t> hi) {
  std::vector<ExprId> branches;
  // Negative integers: -n for n in [max(1, -hi), -lo].
  if (!lo || *lo < 0) {
    const uint64_t n_lo = hi && *hi < 0 ? static_cast<uint64_t>(-(*hi + 1)) + 1 : 1;
    const std::optional<uint64_t> n_hi =
        lo ? std::optional<uint64_t>(static_cast<uint64_t>(-(*lo + 1)) + 1) : std::nullopt;
    if (!n_hi || n_lo <= *n_hi) branches.push_back(g.seq({g.byte('-'), positive_range(g, n_lo, n_hi)}));
  }
  if ((!lo || *lo <= 0) && (!hi || *hi >= 0)) branches.push_back(g.byte('0'));
  if (!hi || *hi >= 1) {
    const uint64_t p_lo = lo && *lo > 1 ? static_cast<uint64_t>(*lo) : 1;
    const std::optional<uint64_t> p_hi = hi ? std::optional<uint64_t>(static_cast<uint64_t>(*hi)) : std::nullopt;
    if (!p_hi || p_lo <= *p_hi) branches.push_back(positive_range(g, p_lo, p_hi));
  }
  return g.alt(std::move(branches));
}

}  // namespace metrale::grammar
