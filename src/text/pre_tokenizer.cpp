#include "text/pre_tokenizer.h"

#include <cctype>

#include "core/error.h"
#include "text/json_util.h"

namespace metrale::text {

namespace {

// The GPT-2 pre-tokenization regex that ByteLevel applies when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A literal Split pattern, escaped so that Oniguruma matches it verbatim (a backslash before an
// ASCII punctuation character always means that character).
std::string escape_literal(std::string_view literal) {
  std::string escaped;
  for (const char c : literal) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x80 && std::ispunct(byte)) escaped.push_back('\\');
    escaped.push_back(c);
  }
  return escaped;
}

SplitBehavior parse_behavior(const json::Json& step) {
  const auto name = json::string(step, "behavior");
  if (!name) raise(ErrorCode::kBadFormat, "Split: missing \"behavior\"");
  if (*name == "Removed") return SplitBehavior::kRemoved;
  if (*name == "Isolated") return SplitBehavior::kIsolated;
  if (*name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (*name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (*name == "Contiguous") return SplitBehavior::kContiguous;
  raise(ErrorCode::kBadFormat, "Split: unknown behavior '{}'", *name);
}

// The Oniguruma pattern of a Split: {"Regex": "..."} verbatim, {"String": "..."} escaped.
std::string split_pattern(const json::Json& step) {
  const json::Json* pattern = json::member(step, "pattern");
  if (pattern == nullptr || !pattern->is_object()) raise(ErrorCode::kBadFormat, "Split: \"pattern\" must be an object");
  if (auto regex = json::string(*pattern, "Regex")) return std::move(*regex);
  if (const auto literal = json::string(*pattern, "String")) return escape_literal(*literal);
  raise(ErrorCode::kBadFormat, "Split: \"pattern\" must hold a string \"Regex\" or \"String\"");
}

void flatten(const json::Json& spec, std::vector<const json::Json*>& steps) {
  if (json::type_of(spec, "pre_tokenizer") == "Sequence") {
    const json::Json* children = json::member(spec, "pretokenizers");
    if (children == nullptr) raise(ErrorCode::kBadFormat, "pre_tokenizer Sequence: missing \"pretokenizers\"");
    for (const auto& child : json::array(*children, "pretokenizers")) flatten(child, steps);
  } else {
    steps.push_back(&spec);
  }
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const json::Json& spec) {
  if (spec.is_null()) {
    raise(ErrorCode::kUnsupported, "pre_tokenizer is null: only byte-level BPE tokenizers (a ByteLevel pre-tokenizer) are supported");
  }
  std::vector<const json::Json*> steps;
  flatten(spec, steps);
  PreTokenizer result;
  bool seen_byte_level = false;
  for (const json::Json* step : steps) {
    const std::string type = json::type_of(*step, "pre_tokenizer");
    if (seen_byte_level) {
      // After ByteLevel the text is in the byte alphabet; no tokenizer we know splits it further.
      raise(ErrorCode::kUnsupported, "pre_tokenizer: '{}' after ByteLevel is not supported", type);
    }
    if (type == "Split") {
      result.steps_.push_back({Regex(split_pattern(*step)), parse_behavior(*step), json::boolean(*step, "invert", false)});
    } else if (type == "ByteLevel") {
      seen_byte_level = true;
      result.byte_level_step_ = result.steps_.size();
      result.add_prefix_space_ = json::boolean(*step, "add_prefix_space", true);
      if (json::boolean(*step, "use_regex", true)) {
        result.steps_.push_back({Regex(kGpt2Pattern), SplitBehavior::kIsolated, false});
      }
    } else {
      raise(ErrorCode::kUnsupported, "pre_tokenizer type '{}' is not supported (supported: Sequence, Split, ByteLevel)",
            type);
    }
  }
  if (!seen_byte_level) {
    raise(ErrorCode::kUnsupported, "pre_tokenizer has no ByteLevel step: only byte-level BPE tokenizers are supported");
  }
  return result;
}

void PreTokenizer::apply_split(const SplitStep& step, std::string_view piece, std::vector<ByteRange>& matches,
                               std::vector<std::string_view>& out) {
  matches.clear();
  step.regex.find_all(piece, matches);

  // Emits piece[begin, end) unless it is empty (HF drops empty splits).
  const auto emit = [&](size_t begin, size_t end) {
    if (end > begin) out.push_back(piece.substr(begin, end - begin));
  };
  // The matches and the gaps between them cover the piece; `is_delimiter` is the match flag
  // after `invert`.
  struct Segment {
    size_t begin;
    size_t end;
    bool is_delimiter;
  };
  const auto for_each_segment = [&](auto&& visit) {
    size_t previous = 0;
    for (const ByteRange& match : matches) {
      if (match.begin > previous) visit(Segment{previous, match.begin, step.invert});
      visit(Segment{match.begin, match.end, !step.invert});
      previous = match.end;
    }
    if (previous < piece.size()) visit(Segment{previous, piece.size(), step.invert});
  };

  switch (step.behavior) {
    case SplitBehavior::kIsolated:
      for_each_segment([&](const Segment& s) { emit(s.begin, s.end); });
      return;
    case SplitBehavior::kRemoved:
      for_each_segment([&](const Segment& s) {
        if (!s.is_delimiter) emit(s.begin, s.end);
      });
      return;
    case SplitBehavior::kContiguous:
    case SplitBehavior::kMergedWithPrevious: {
      // Contiguous joins runs of segments with the same flag; MergedWithPrevious appends each
      // delimiter that follows a non-delimiter to it. The first segment always opens a split.
      const bool contiguous = step.behavior == SplitBehavior::kContiguous;
      bool have_open = false;
      size_t open_begin = 0;
      size_t open_end = 0;
      bool previous_delimiter = false;
      for_each_segment([&](const Segment& s) {
        const bool join = have_open && (contiguous ? s.is_delimiter == previous_delimiter
                                                   : s.is_delimiter && !previous_delimiter);
        if (join) {
          open_end = s.end;
        } else {
          if (have_open) emit(open_begin, open_end);
          open_begin = s.begin;
          open_end = s.end;
          have_open = true;
        }
        previous_delimiter = s.is_delimiter;
      });
      if (have_open) emit(open_begin, open_end);
      return;
    }
    case SplitBehavior::kMergedWithNext: {
      // Each delimiter that precedes a non-delimiter is prepended to it: walk backwards.
      std::vector<Segment> segments;
      for_each_segment([&](const Segment& s) { segments.push_back(s); });
      std::vector<ByteRange> merged;
      bool previous_delimiter = false;
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_delimiter && !previous_delimiter && !merged.empty()) {
          merged.back().begin = it->begin;
        } else {
          merged.push_back({it->begin, it->end});
        }
        previous_delimiter = it->is_delimiter;
      }
      for (auto it = merged.rbegin(); it != merged.rend(); ++it) emit(it->begin, it->end);
      return;
    }
  }
}

void PreTokenizer::split(std::string_view text, PreTokenizeScratch& scratch,
                         std::vector<std::string_view>& pieces) const {
  if (text.empty()) return;
  auto& current = scratch.current;
  auto& next = scratch.next;
  current.clear();
  current.push_back(text);
  scratch.prefixed.clear();
  for (size_t i = 0; i < steps_.size(); ++i) {
    if (i == byte_level_step_) prefix_spaces(scratch);
    next.clear();
    for (const std::string_view piece : current) apply_split(steps_[i], piece, scratch.matches, next);
    current.swap(next);
  }
  if (byte_level_step_ == steps_.size()) prefix_spaces(scratch);
  pieces.insert(pieces.end(), current.begin(), current.end());
}

void PreTokenizer::prefix_spaces(PreTokenizeScratch& scratch) const {
  if (!add_prefix_space_) return;
  // ByteLevel prepends a space to every piece that does not start with one.
  for (std::string_view& piece : scratch.current) {
    if (piece.front() == ' ') continue;
    std::string& copy = scratch.prefixed.emplace_back();
    copy.reserve(piece.size() + 1);
    copy.push_back(' ');
    copy.append(piece);
    piece = copy;
  }
}

}  // namespace metrale::text
