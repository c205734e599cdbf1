// safetensors headers: parse_safetensors_header accepts a file only when its tensors tile the data
// section exactly (sorted: contiguous from 0 to the end, each the size its shape and dtype say), and
// rejects everything else with kBadFormat; no other exception, no crash.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "fuzz_input.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const metrale::SafetensorsHeader header = metrale::parse_safetensors_header(bytes, "fuzz.safetensors");
    FUZZ_CHECK(header.data_start >= 8 && header.data_start <= size);
    std::vector<const metrale::SafetensorsEntry*> entries;
    for (const auto& [name, entry] : header.entries) {
      FUZZ_CHECK(name != "__metadata__");
      FUZZ_CHECK(entry.begin <= entry.end);
      FUZZ_CHECK(entry.shape.size() <= static_cast<size_t>(metrale::Shape::kMaxDims));
      entries.push_back(&entry);
    }
    std::sort(entries.begin(), entries.end(), [](const auto* a, const auto* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    uint64_t expected = 0;
    for (const auto* entry : entries) {
      FUZZ_CHECK(entry->begin == expected, "the accepted tensors overlap or leave a gap");
      expected = entry->end;
    }
    FUZZ_CHECK(expected == size - header.data_start, "the accepted tensors do not cover the data section");
  } catch (const metrale::Error& e) {
    FUZZ_CHECK(e.code() == metrale::ErrorCode::kBadFormat, e.what());
  }
  return 0;
}
