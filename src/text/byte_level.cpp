#include "text/byte_level.h"

#include <array>

#include "text/utf8.h"

namespace metrale::text {

namespace {

struct ByteLevelTables {
  std::array<char32_t, 256> char_of_byte{};
  // Every alphabet code point is below U+0144 (U+0100 + 68 shifted bytes).
  static constexpr char32_t kLimit = 0x144;
  std::array<int16_t, kLimit> byte_of_char{};

  constexpr ByteLevelTables() {
    const auto printable = [](int byte) {
      return (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE && byte <= 0xFF);
    };
    for (auto& entry : byte_of_char) entry = -1;
    char32_t next_shifted = 0x100;
    for (int byte = 0; byte < 256; ++byte) {
      const char32_t cp = printable(byte) ? static_cast<char32_t>(byte) : next_shifted++;
      char_of_byte[byte] = cp;
      byte_of_char[cp] = static_cast<int16_t>(byte);
    }
  }
};

constexpr ByteLevelTables kTables{};
static_assert(kTables.char_of_byte[' '] == 0x120 && kTables.char_of_byte['\n'] == 0x10A);

}  // namespace

char32_t byte_level_char(uint8_t byte) { return kTables.char_of_byte[byte]; }

int byte_level_byte(char32_t code_point) {
  return code_point < ByteLevelTables::kLimit ? kTables.byte_of_char[code_point] : -1;
}

std::string byte_level_encode(std::string_view raw) {
  std::string out;
  out.reserve(raw.size() * 2);
  for (const char c : raw) append_utf8(out, byte_level_char(static_cast<uint8_t>(c)));
  return out;
}

std::optional<std::string> byte_level_decode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const int byte = byte_level_byte(next_code_point(text, pos));
    if (byte < 0) return std::nullopt;
    out.push_back(static_cast<char>(byte));
  }
  return out;
}

}  // namespace metrale::text
