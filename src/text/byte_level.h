// The GPT-2 byte-level alphabet: every byte 0..255 is shown as one printable code point, so that a
// BPE vocabulary of strings can cover arbitrary bytes. Printable Latin-1 bytes ('!'..'~',
// U+00A1..U+00AC, U+00AE..U+00FF) stand for themselves; the other 68 bytes take U+0100 onwards
// in byte order (so ' ' is 'Ġ' U+0120 and '\n' is 'Ċ' U+010A).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace metrale::text {

// The code point that stands for `byte`.
char32_t byte_level_char(uint8_t byte);

// The byte a code point stands for, or -1 when it is not in the alphabet.
int byte_level_byte(char32_t code_point);

// Maps raw bytes to their alphabet form (UTF-8 encoded): "a b" -> "aĠb".
std::string byte_level_encode(std::string_view raw);

// Maps an alphabet string back to raw bytes; nullopt when some code point is outside the alphabet
// (the HF ByteLevel decoder then keeps the token's text as it is). `text` must be valid UTF-8.
std::optional<std::string> byte_level_decode(std::string_view text);

}  // namespace metrale::text
