#include "text/grammar/char_class.h"

#include <algorithm>
#include <array>
#include <map>
#include <string>

#include "core/error.h"
#include "text/utf8.h"

namespace metrale::grammar {
namespace {

constexpr char32_t kSurrogateLo = 0xD800;
constexpr char32_t kSurrogateHi = 0xDFFF;

// --- UTF-8 sequences of a code point range (the classic split into byte-range sequences) ---

using ByteRange = std::pair<uint8_t, uint8_t>;

int encoded_length(char32_t c) {
  return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
}

std::array<uint8_t, 4> encode(char32_t c, int length) {
  std::array<uint8_t, 4> bytes{};
  switch (length) {
    case 1:
      bytes[0] = static_cast<uint8_t>(c);
      break;
    case 2:
      bytes[0] = static_cast<uint8_t>(0xC0 | (c >> 6));
      bytes[1] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      break;
    case 3:
      bytes[0] = static_cast<uint8_t>(0xE0 | (c >> 12));
      bytes[1] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
      bytes[2] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      break;
    default:
      bytes[0] = static_cast<uint8_t>(0xF0 | (c >> 18));
      bytes[1] = static_cast<uint8_t>(0x80 | ((c >> 12) & 0x3F));
      bytes[2] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
      bytes[3] = static_cast<uint8_t>(0x80 | (c & 0x3F));
  }
  return bytes;
}

// Splits [lo, hi] (no surrogates) into ranges whose encodings are a sequence of byte ranges.
void utf8_sequences(char32_t lo, char32_t hi, std::vector<std::vector<ByteRange>>& out) {
  for (char32_t bound : {char32_t{0x7F}, char32_t{0x7FF}, char32_t{0xFFFF}}) {
    if (lo <= bound && bound < hi) {
      utf8_sequences(lo, bound, out);
      utf8_sequences(bound + 1, hi, out);
      return;
    }
  }
  const int length = encoded_length(lo);
  for (int i = 1; i < length; ++i) {
    const char32_t mask = (char32_t{1} << (6 * i)) - 1;
    if ((lo & ~mask) != (hi & ~mask)) {
      if ((lo & mask) != 0) {
        utf8_sequences(lo, lo | mask, out);
        utf8_sequences((lo | mask) + 1, hi, out);
        return;
      }
      if ((hi & mask) != mask) {
        utf8_sequences(lo, (hi & ~mask) - 1, out);
        utf8_sequences(hi & ~mask, hi, out);
        return;
      }
    }
  }
  const std::array<uint8_t, 4> a = encode(lo, length);
  const std::array<uint8_t, 4> b = encode(hi, length);
  std::vector<ByteRange> sequence;
  for (int i = 0; i < length; ++i) sequence.emplace_back(a[i], b[i]);
  out.push_back(std::move(sequence));
}

}  // namespace

CharSet CharSet::all() {
  CharSet set;
  set.add(0, kMax);
  return set;
}

CharSet CharSet::range(char32_t lo, char32_t hi) {
  CharSet set;
  set.add(lo, hi);
  return set;
}

void CharSet::add(char32_t lo, char32_t hi) {
  hi = std::min(hi, kMax);
  if (lo > hi) return;
  // Drop the surrogates.
  if (lo <= kSurrogateHi && hi >= kSurrogateLo) {
    if (lo < kSurrogateLo) add(lo, kSurrogateLo - 1);
    if (hi > kSurrogateHi) add(kSurrogateHi + 1, hi);
    return;
  }
  ranges_.emplace_back(lo, hi);
  std::sort(ranges_.begin(), ranges_.end());
  std::vector<std::pair<char32_t, char32_t>> merged;
  for (const auto& range : ranges_) {
    // Ranges adjacent across the surrogate gap stay apart; that is harmless.
    if (!merged.empty() && range.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, range.second);
    } else {
      merged.push_back(range);
    }
  }
  ranges_ = std::move(merged);
}

void CharSet::add(const CharSet& other) {
  for (const auto& [lo, hi] : other.ranges_) add(lo, hi);
}

CharSet CharSet::complement() const {
  CharSet set;
  char32_t next = 0;
  for (const auto& [lo, hi] : ranges_) {
    if (lo > next) set.add(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMax) set.add(next, kMax);
  return set;
}

CharSet CharSet::intersect(const CharSet& other) const {
  CharSet set;
  for (const auto& [a, b] : ranges_) {
    for (const auto& [c, d] : other.ranges_) {
      const char32_t lo = std::max(a, c);
      const char32_t hi = std::min(b, d);
      if (lo <= hi) set.add(lo, hi);
    }
  }
  return set;
}

bool CharSet::contains(char32_t c) const {
  for (const auto& [lo, hi] : ranges_) {
    if (c >= lo && c <= hi) return true;
  }
  return false;
}

namespace {

// A character's encodings as sequences of byte sets (one set per byte).
using Sequence = std::vector<ByteSet>;

void add_utf8(const CharSet& set, std::vector<Sequence>& out) {
  std::vector<std::vector<ByteRange>> ranges;
  for (const auto& [lo, hi] : set.ranges()) utf8_sequences(lo, hi, ranges);
  for (const auto& sequence : ranges) {
    Sequence bytes;
    for (const auto& [lo, hi] : sequence) bytes.push_back(ByteSet::range(lo, hi));
    out.push_back(std::move(bytes));
  }
}

ByteSet hex_digits() {
  ByteSet set = ByteSet::range('0', '9');
  set.add(ByteSet::range('a', 'f'));
  set.add(ByteSet::range('A', 'F'));
  return set;
}

// The sequences as one minimal automaton: a trie of the sets (the sequences of a character class
// have, position by position, sets that are equal or disjoint), with equal suffixes merged. This
// keeps a character at the dozen states it needs, which matters when a counted string repeats it
// hundreds of times. Falls back to a plain alternative if the sets are not equal-or-disjoint.
ExprId sequences_expr(Grammar& grammar, const std::vector<Sequence>& sequences) {
  struct Node {
    std::vector<std::pair<ByteSet, int32_t>> children;
    bool final = false;
  };
  std::vector<Node> nodes(1);
  bool deterministic = true;
  for (const Sequence& sequence : sequences) {
    int32_t at = 0;
    for (const ByteSet& set : sequence) {
      int32_t next = -1;
      for (const auto& [child_set, child] : nodes[static_cast<size_t>(at)].children) {
        if (child_set == set) {
          next = child;
        } else if (!child_set.intersect(set).empty()) {
          deterministic = false;
        }
      }
      if (next < 0) {
        next = static_cast<int32_t>(nodes.size());
        nodes[static_cast<size_t>(at)].children.emplace_back(set, next);
        nodes.emplace_back();
      }
      at = next;
    }
    nodes[static_cast<size_t>(at)].final = true;
  }
  if (!deterministic) {
    std::vector<ExprId> branches;
    for (const Sequence& sequence : sequences) {
      std::vector<ExprId> bytes;
      for (const ByteSet& set : sequence) bytes.push_back(grammar.bytes(set));
      branches.push_back(grammar.seq(std::move(bytes)));
    }
    return grammar.alt(std::move(branches));
  }
  // Merge equal suffixes: children always have larger numbers, so canonical ids come bottom up.
  std::vector<int32_t> canonical(nodes.size(), -1);
  std::map<std::vector<uint64_t>, int32_t> ids;
  for (size_t n = nodes.size(); n-- > 0;) {
    std::vector<std::pair<std::array<uint64_t, 4>, int32_t>> edges;
    for (const auto& [set, child] : nodes[n].children)
      edges.emplace_back(set.words(), canonical[static_cast<size_t>(child)]);
    std::sort(edges.begin(), edges.end());
    std::vector<uint64_t> key{nodes[n].final ? 1u : 0u};
    for (const auto& [words, child] : edges) {
      key.insert(key.end(), words.begin(), words.end());
      key.push_back(static_cast<uint64_t>(child));
    }
    canonical[n] = ids.emplace(std::move(key), static_cast<int32_t>(ids.size())).first->second;
  }
  // Graph nodes: the canonical ones, numbered so that the root is 0.
  const auto count = static_cast<int32_t>(ids.size());
  const int32_t root = canonical.at(0);
  const auto number = [&](int32_t id) { return id == root ? 0 : id == 0 ? root : id; };
  std::vector<uint8_t> done(static_cast<size_t>(count), 0);
  std::vector<GraphEdge> edges;
  std::vector<int32_t> finals;
  for (size_t n = 0; n < nodes.size(); ++n) {
    const int32_t id = canonical[n];
    if (done[static_cast<size_t>(id)]) continue;
    done[static_cast<size_t>(id)] = 1;
    if (nodes[n].final) finals.push_back(number(id));
    for (const auto& [set, child] : nodes[n].children) {
      edges.push_back(GraphEdge{number(id), number(canonical[static_cast<size_t>(child)]), grammar.bytes(set)});
    }
  }
  return grammar.graph(count, std::move(edges), std::move(finals));
}

}  // namespace

ExprId utf8_chars(Grammar& grammar, const CharSet& set) {
  METRALE_CHECK(!set.empty(), "utf8_chars needs a non-empty set");
  std::vector<Sequence> sequences;
  add_utf8(set, sequences);
  return sequences_expr(grammar, sequences);
}

ExprId encoded_char(Grammar& grammar, const CharSet& set, StringEncoding encoding) {
  METRALE_CHECK(!set.empty(), "encoded_char needs a non-empty set");
  if (encoding == StringEncoding::kRaw) return utf8_chars(grammar, set);
  std::vector<Sequence> sequences;
  const CharSet plain = set.minus(CharSet::range(0, 0x1F)).minus(CharSet::of('"')).minus(CharSet::of('\\'));
  add_utf8(plain, sequences);
  const ByteSet backslash = ByteSet::of('\\');
  if (set.complement().empty()) {
    // Any escape JSON has, \uXXXX of any code unit included.
    sequences.push_back({backslash, ByteSet::of_chars("\"\\/bfnrt")});
    sequences.push_back({backslash, ByteSet::of('u'), hex_digits(), hex_digits(), hex_digits(), hex_digits()});
    return sequences_expr(grammar, sequences);
  }
  ByteSet letters;
  static constexpr std::pair<char32_t, char> kShort[] = {{'"', '"'},  {'\\', '\\'}, {'/', '/'},  {'\b', 'b'},
                                                         {'\f', 'f'}, {'\n', 'n'},  {'\r', 'r'}, {'\t', 't'}};
  for (const auto& [c, letter] : kShort) {
    if (set.contains(c)) letters.add(static_cast<uint8_t>(letter));
  }
  if (!letters.empty()) sequences.push_back({backslash, letters});
  for (char32_t c = 0; c < 0x20; ++c) {
    if (!set.contains(c)) continue;
    // \u00XX in either case.
    static constexpr std::string_view kDigits = "0123456789abcdef";
    const auto digit = [](char d) {
      ByteSet both = ByteSet::of(static_cast<uint8_t>(d));
      if (d >= 'a') both.add(static_cast<uint8_t>(d - 'a' + 'A'));
      return both;
    };
    sequences.push_back({backslash, ByteSet::of('u'), ByteSet::of('0'), ByteSet::of('0'), digit(kDigits[c >> 4]),
                         digit(kDigits[c & 15])});
  }
  return sequences_expr(grammar, sequences);
}

ExprId encoded_literal(Grammar& grammar, std::string_view utf8, StringEncoding encoding) {
  if (encoding == StringEncoding::kRaw) return grammar.literal(utf8);
  std::string escaped;
  for (char c : utf8) {
    const auto byte = static_cast<uint8_t>(c);
    switch (c) {
      case '"':
        escaped += "\\\"";
        break;
      case '\\':
        escaped += "\\\\";
        break;
      case '\b':
        escaped += "\\b";
        break;
      case '\f':
        escaped += "\\f";
        break;
      case '\n':
        escaped += "\\n";
        break;
      case '\r':
        escaped += "\\r";
        break;
      case '\t':
        escaped += "\\t";
        break;
      default:
        if (byte < 0x20) {
          static constexpr std::string_view kDigits = "0123456789abcdef";
          escaped += "\\u00";
          escaped += kDigits[byte >> 4];
          escaped += kDigits[byte & 15];
        } else {
          escaped += c;
        }
    }
  }
  return grammar.literal(escaped);
}

namespace {

// Byte automata of encoded text: state 0 is between characters (and accepting); the others are inside
// a character (UTF-8 continuation bytes, or an escape of a JSON string).
enum TextState : int32_t { kTextBoundary, kOne, kTwo, kThree, kE0, kED, kF0, kF4, kEscape, kHex4, kHex3, kHex2, kHex1 };

bool is_hex(uint8_t b) {
  return (b >= '0' && b <= '9') || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F');
}

int32_t text_next(int32_t state, uint8_t b, StringEncoding encoding) {
  const bool cont = b >= 0x80 && b <= 0xBF;
  switch (state) {
    case kTextBoundary:
      if (encoding == StringEncoding::kJson) {
        if (b == '\\') return kEscape;
        if (b < 0x20 || b == '"') return -1;
      }
      if (b >= 0x01 && b <= 0x7F) return kTextBoundary;
      if (b >= 0xC2 && b <= 0xDF) return kOne;
      if (b == 0xE0) return kE0;
      if (b == 0xED) return kED;
      if (b >= 0xE1 && b <= 0xEF) return kTwo;
      if (b == 0xF0) return kF0;
      if (b >= 0xF1 && b <= 0xF3) return kThree;
      if (b == 0xF4) return kF4;
      return -1;
    case kOne:
      return cont ? kTextBoundary : -1;
    case kTwo:
      return cont ? kOne : -1;
    case kThree:
      return cont ? kTwo : -1;
    case kE0:
      return b >= 0xA0 && b <= 0xBF ? kOne : -1;
    case kED:
      return b >= 0x80 && b <= 0x9F ? kOne : -1;
    case kF0:
      return b >= 0x90 && b <= 0xBF ? kTwo : -1;
    case kF4:
      return b >= 0x80 && b <= 0x8F ? kTwo : -1;
    case kEscape:
      if (b == 'u') return kHex4;
      return std::string_view("\"\\/bfnrt").find(static_cast<char>(b)) != std::string_view::npos ? kTextBoundary : -1;
    case kHex4:
      return is_hex(b) ? kHex3 : -1;
    case kHex3:
      return is_hex(b) ? kHex2 : -1;
    case kHex2:
      return is_hex(b) ? kHex1 : -1;
    case kHex1:
      return is_hex(b) ? kTextBoundary : -1;
    default:
      return -1;
  }
}

}  // namespace

// The product of an Aho-Corasick automaton of `forbidden` (without its matching states) and the
// encoding's byte automaton, as a graph whose edges are byte sets.
ExprId text_avoiding(Grammar& grammar, const std::vector<std::string_view>& forbidden, StringEncoding encoding) {
  struct AcNode {
    std::array<int32_t, 256> next;
    bool match = false;
  };
  std::vector<AcNode> ac(1);
  ac[0].next.fill(-1);
  for (std::string_view word : forbidden) {
    METRALE_CHECK(!word.empty(), "forbidden strings must not be empty");
    int32_t at = 0;
    for (char c : word) {
      const auto b = static_cast<uint8_t>(c);
      if (ac[static_cast<size_t>(at)].next[b] < 0) {
        ac[static_cast<size_t>(at)].next[b] = static_cast<int32_t>(ac.size());
        ac.emplace_back();
        ac.back().next.fill(-1);
      }
      at = ac[static_cast<size_t>(at)].next[b];
    }
    ac[static_cast<size_t>(at)].match = true;
  }
  // Failure links, breadth first; missing edges become the failure's edges (a full DFA).
  std::vector<int32_t> fail(ac.size(), 0);
  std::vector<int32_t> queue;
  for (int b = 0; b < 256; ++b) {
    int32_t& child = ac[0].next[b];
    if (child < 0) {
      child = 0;
    } else {
      queue.push_back(child);
    }
  }
  for (size_t q = 0; q < queue.size(); ++q) {
    const int32_t node = queue[q];
    if (ac[static_cast<size_t>(fail[static_cast<size_t>(node)])].match) ac[static_cast<size_t>(node)].match = true;
    for (int b = 0; b < 256; ++b) {
      const int32_t via_fail = ac[static_cast<size_t>(fail[static_cast<size_t>(node)])].next[b];
      int32_t& child = ac[static_cast<size_t>(node)].next[b];
      if (child < 0) {
        child = via_fail;
      } else {
        fail[static_cast<size_t>(child)] = via_fail;
        queue.push_back(child);
      }
    }
  }
  std::map<std::pair<int32_t, int32_t>, int32_t> ids;
  std::vector<std::pair<int32_t, int32_t>> states;
  const auto id_of = [&](int32_t a, int32_t t) {
    const auto [it, inserted] = ids.emplace(std::make_pair(a, t), static_cast<int32_t>(states.size()));
    if (inserted) states.emplace_back(a, t);
    return it->second;
  };
  id_of(0, kTextBoundary);
  std::vector<GraphEdge> edges;
  std::vector<int32_t> finals;
  for (size_t s = 0; s < states.size(); ++s) {
    const auto [a, t] = states[s];
    if (t == kTextBoundary) finals.push_back(static_cast<int32_t>(s));
    std::map<int32_t, ByteSet> by_target;
    for (int b = 0; b < 256; ++b) {
      const int32_t tn = text_next(t, static_cast<uint8_t>(b), encoding);
      const int32_t an = ac[static_cast<size_t>(a)].next[b];
      if (tn < 0 || ac[static_cast<size_t>(an)].match) continue;
      by_target[id_of(an, tn)].add(static_cast<uint8_t>(b));
    }
    for (const auto& [target, set] : by_target) {
      edges.push_back(GraphEdge{static_cast<int32_t>(s), target, grammar.bytes(set)});
    }
  }
  return grammar.graph(static_cast<int32_t>(states.size()), std::move(edges), std::move(finals));
}

}  // namespace metrale::grammar
