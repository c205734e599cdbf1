// BPE on a tiny hand-written tokenizer.json. Expected ids come from HF tokenizers 0.23.2 run on
// the same document (tests/text/tiny_tokenizer.h).
#include "text/bpe.h"

#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "core/error.h"
#include "text/tokenizer.h"
#include "text/tokenizer_data.h"
#include "tiny_tokenizer.h"

namespace metrale {
namespace {

using testing::TempDir;
using testing::tiny_tokenizer_json;

Tokenizer load_tiny(bool legacy_merges) {
  static TempDir pairs;
  static TempDir legacy;
  const TempDir& dir = legacy_merges ? legacy : pairs;
  dir.write("tokenizer.json", tiny_tokenizer_json(legacy_merges).dump());
  return Tokenizer::from_dir(dir.path());
}

struct Case {
  std::string text;
  std::vector<int32_t> ids;
};

// Ids of the merged tokens: 256 + merge rank (see tiny_merges()).
const std::vector<Case>& tiny_cases() {
  static const std::vector<Case> cases = {
      {"hello world", {259, 264}},
      {"hello  world", {259, 32, 264}},
      {"this is hello", {116, 270, 115, 32, 105, 115, 32, 259}},
      {"😀😀", {275, 275}},
      {"aaaaaaa", {268, 267, 97}},  // leftmost pairs first: aaaa aa a
      {"     x", {266, 32, 120}},
      {"he's", {256, 39, 115}},
      {"", {}},
      {"é", {195, 169}},
  };
  return cases;
}

TEST(Bpe, TinyTokenizerMatchesHfWithPairMerges) {
  const Tokenizer tokenizer = load_tiny(false);
  for (const Case& c : tiny_cases()) EXPECT_EQ(tokenizer.encode(c.text), c.ids) << c.text;
}

TEST(Bpe, LegacyStringMergesGiveTheSameModel) {
  const Tokenizer tokenizer = load_tiny(true);
  for (const Case& c : tiny_cases()) EXPECT_EQ(tokenizer.encode(c.text), c.ids) << c.text;
}

TEST(Bpe, DecodeInvertsEncode) {
  const Tokenizer tokenizer = load_tiny(false);
  for (const Case& c : tiny_cases()) EXPECT_EQ(tokenizer.decode(c.ids), c.text);
  EXPECT_EQ(tokenizer.vocab_size(), 276);
  EXPECT_EQ(tokenizer.token_to_id("Ġworld"), 264);
  EXPECT_EQ(tokenizer.id_to_token(264), "Ġworld");
  EXPECT_EQ(tokenizer.id_to_token(9999), "");
}

TEST(Bpe, DecodeSkipsUnknownIdsAndRepairsBrokenUtf8) {
  const Tokenizer tokenizer = load_tiny(false);
  const std::vector<int32_t> ids = {104, 100000, 105, 0xF0 /* "ð": byte F0 */, 33};
  EXPECT_EQ(tokenizer.decode(ids), "hi\xEF\xBF\xBD!");
}

// Random merge tables and words: the rescanning and heap strategies must agree, since both apply
// the lowest-ranked, leftmost merge first.
TEST(Bpe, MergeStrategiesAgree) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int alphabet = 3 + trial % 5;
    text::MergeTable table(64);
    int32_t next_id = alphabet;
    std::vector<int32_t> symbols_so_far;
    for (int32_t id = 0; id < alphabet; ++id) symbols_so_far.push_back(id);
    for (uint32_t rank = 0; rank < 40; ++rank) {
      const int32_t left = symbols_so_far[rng() % symbols_so_far.size()];
      const int32_t right = symbols_so_far[rng() % symbols_so_far.size()];
      if (table.find(left, right) != nullptr) continue;
      table.insert(left, right, {rank, next_id});
      symbols_so_far.push_back(next_id++);
    }
    for (int word = 0; word < 20; ++word) {
      std::vector<int32_t> symbols(1 + rng() % 120);
      for (int32_t& symbol : symbols) symbol = static_cast<int32_t>(rng() % alphabet);
      std::vector<int32_t> by_scan = symbols;
      std::vector<int32_t> by_heap = symbols;
      text::apply_merges(table, by_scan, text::MergeStrategy::kScan);
      text::apply_merges(table, by_heap, text::MergeStrategy::kHeap);
      ASSERT_EQ(by_scan, by_heap) << "trial " << trial << " word " << word;
    }
  }
}

TEST(Bpe, MergeTableLaterDuplicateWins) {
  text::MergeTable table(2);
  // The merge of (left, right), or {max, -1} when there is none.
  const auto merge_of = [&](int32_t left, int32_t right) {
    const text::MergeTable::Merge* merge = table.find(left, right);
    return merge != nullptr ? *merge : text::MergeTable::Merge{~0u, -1};
  };
  table.insert(1, 2, {0, 10});
  table.insert(1, 2, {5, 11});
  EXPECT_EQ(merge_of(1, 2).rank, 5u);
  EXPECT_EQ(merge_of(1, 2).merged_id, 11);
  EXPECT_EQ(merge_of(2, 1).merged_id, -1);
  for (int32_t i = 0; i < 1000; ++i) table.insert(i, i + 1, {static_cast<uint32_t>(i), i});  // grows
  EXPECT_EQ(merge_of(999, 1000).merged_id, 999);
  EXPECT_EQ(table.size(), 1000u);  // (1, 2) was replaced, not added
}

TEST(Bpe, WordCacheDoesNotChangeResults) {
  const auto json = tiny_tokenizer_json(false);
  const auto cached = text::build_tokenizer_data(json, /*enable_cache=*/true);
  const auto uncached = text::build_tokenizer_data(json, /*enable_cache=*/false);
  std::mt19937 rng(11);
  const std::string pieces[] = {"hello", " world", "aa", " ", "this", "😀", "h", "é", "\n", "x"};
  for (int i = 0; i < 2000; ++i) {
    std::string text;
    for (int k = 0; k < 6; ++k) text += pieces[rng() % std::size(pieces)];
    std::vector<int32_t> a;
    std::vector<int32_t> b;
    cached->encode(text, a);
    uncached->encode(text, b);
    ASSERT_EQ(a, b) << text;
  }
}

TEST(Bpe, ConcurrentEncodingIsConsistent) {
  const Tokenizer tokenizer = load_tiny(false);
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) texts.push_back("hello world " + std::to_string(i) + std::string(i % 7, 'a') + " this");
  std::vector<std::vector<int32_t>> expected;
  for (const auto& text : texts) expected.push_back(tokenizer.encode(text));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 50; ++round) {
        for (size_t i = (t + round) % texts.size(); i < texts.size(); i += 3) {
          if (tokenizer.encode(texts[i]) != expected[i]) ++mismatches;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(Bpe, MergeNamingAnUnknownTokenIsBadFormat) {
  auto json = tiny_tokenizer_json(false);
  json["model"]["merges"].push_back({"hello", "zzz"});
  TempDir dir;
  dir.write("tokenizer.json", json.dump());
  try {
    Tokenizer::from_dir(dir.path());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBadFormat);
    EXPECT_NE(std::string(e.what()).find("'zzz' is not in the vocab"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace metrale
