// The <think> reasoning parser over streamed text: however the text is split into pieces, the
// reasoning and the content it gives are the same as for the text fed whole, and together they hold
// no more than the text.
//   input: flags, split count, split offsets, then the text
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz_input.h"
#include "text/reasoning_parser.h"

namespace {

struct Split {
  std::string reasoning;
  std::string content;
};

Split run(bool starts_in_reasoning, std::string_view text, const std::vector<size_t>& cuts) {
  metrale::ReasoningParser parser(starts_in_reasoning);
  Split out;
  size_t at = 0;
  const auto add = [&](const metrale::ReasoningDelta& delta) {
    out.reasoning += delta.reasoning;
    out.content += delta.content;
  };
  for (const size_t cut : cuts) {
    add(parser.feed(text.substr(at, cut - at)));
    at = cut;
  }
  add(parser.feed(text.substr(at)));
  add(parser.finish());
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metrale::fuzz::FuzzInput input(data, size);
  const bool starts_in_reasoning = (input.byte() & 1) != 0;
  const size_t count = input.byte() % 16;
  std::vector<uint8_t> offsets;
  for (size_t i = 0; i < count; ++i) offsets.push_back(input.byte());
  const std::string_view text = input.take(1 << 16);
  std::vector<size_t> cuts;
  for (const uint8_t offset : offsets) cuts.push_back(text.empty() ? 0 : offset % (text.size() + 1));
  std::sort(cuts.begin(), cuts.end());
  const Split whole = run(starts_in_reasoning, text, {});
  const Split pieces = run(starts_in_reasoning, text, cuts);
  FUZZ_CHECK(whole.reasoning == pieces.reasoning, "the reasoning depends on how the text was split");
  FUZZ_CHECK(whole.content == pieces.content, "the content depends on how the text was split");
  FUZZ_CHECK(whole.reasoning.size() + whole.content.size() <= text.size());
  return 0;
}
