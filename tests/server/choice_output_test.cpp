// One choice's text pipeline on a tiny byte-level tokenizer: incremental detokenization, stop
// strings, end-of-sequence tokens, <think> reasoning and logprob rendering. Expected texts come
// from Tokenizer::decode of the same ids.
#include "server/choice_output.h"

#include <gtest/gtest.h>

#include "text/tiny_tokenizer.h"

namespace metrale::server {
namespace {

class ChoiceOutputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_.write("tokenizer.json",
               testing::tiny_tokenizer_json(false, {{"<think>", false}, {"</think>", false}, {"<|end|>", true}}).dump());
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_dir(dir_.path()));
  }

  std::vector<int32_t> encode(const std::string& text) const { return tokenizer_->encode(text); }

  // Feeds `ids` (the last with `last_finish`); returns the concatenated deltas.
  ChoiceText run(ChoiceOutput& output, const std::vector<int32_t>& ids, FinishReason last_finish = FinishReason::kLength,
                 std::vector<ChoiceText>* deltas = nullptr) const {
    ChoiceText total;
    for (size_t i = 0; i < ids.size(); ++i) {
      SampledToken token;
      token.token = ids[i];
      token.logprob = -0.5f - static_cast<float>(i);
      token.top_logprobs = {{ids[i], token.logprob}, {(ids[i] + 1) % 256, -9.0f}, {(ids[i] + 2) % 256, -10.0f}};
      const ChoiceText delta =
          output.on_token(token, i + 1 == ids.size() ? last_finish : FinishReason::kNone, SteadyClock::now());
      total.text += delta.text;
      total.reasoning += delta.reasoning;
      total.logprobs.insert(total.logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
      if (!delta.finish_reason.empty()) total.finish_reason = delta.finish_reason;
      if (deltas) deltas->push_back(delta);
    }
    return total;
  }

  testing::TempDir dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(ChoiceOutputTest, TextEqualsDecode) {
  const std::vector<int32_t> ids = encode("hello world, this is it");
  ChoiceOutput output(*tokenizer_, ChoiceOptions{});
  const ChoiceText total = run(output, ids);
  EXPECT_EQ(total.text, tokenizer_->decode(ids));
  EXPECT_EQ(total.finish_reason, "length");
  EXPECT_EQ(output.num_tokens(), static_cast<int64_t>(ids.size()));
  EXPECT_EQ(output.accumulated().text, total.text);
  EXPECT_TRUE(output.finished());
  EXPECT_TRUE(output.first_token_time().has_value());
  EXPECT_FALSE(output.accumulated().has_logprobs);
}

TEST_F(ChoiceOutputTest, StopStringCutsAndEndsTheChoice) {
  const std::vector<int32_t> ids = encode("hello world, this is it");
  ChoiceOptions options;
  options.stop = {"ld, th"};
  ChoiceOutput output(*tokenizer_, options);
  const ChoiceText total = run(output, ids, FinishReason::kNone);
  EXPECT_EQ(total.text, "hello wor");
  EXPECT_EQ(total.finish_reason, "stop");
  EXPECT_TRUE(output.stopped_by_string());
  // Tokens after the match (the engine had not seen the cancel yet) change nothing.
  const int64_t counted = output.num_tokens();
  EXPECT_LT(counted, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(output.on_end(FinishReason::kAbort).text, "");
  EXPECT_EQ(output.finish_reason(), "stop");
  EXPECT_EQ(output.accumulated().text, "hello wor");
}

TEST_F(ChoiceOutputTest, HeldBackTextIsReleasedAtTheEnd) {
  ChoiceOptions options;
  options.stop = {"is ok"};
  ChoiceOutput output(*tokenizer_, options);
  std::vector<ChoiceText> deltas;
  const ChoiceText total = run(output, encode("this is"), FinishReason::kLength, &deltas);
  EXPECT_EQ(total.text, "this is");
  EXPECT_EQ(total.finish_reason, "length");
  ChoiceOutput aborted(*tokenizer_, options);
  const ChoiceText partial = run(aborted, encode("this i"), FinishReason::kNone);
  EXPECT_EQ(partial.text, "this ");  // "i" may start "is ok": held back
  const ChoiceText end = aborted.on_end(FinishReason::kAbort);
  EXPECT_EQ(partial.text + end.text, "this i");
  EXPECT_EQ(end.finish_reason, "abort");
}

TEST_F(ChoiceOutputTest, TokenIdsRideWithEveryTokenEvenWhenItsTextIsHeldBack) {
  const std::vector<int32_t> prompt = {7, 8, 9};
  ChoiceOptions options;
  options.stop = {"is ok"};
  options.return_token_ids = true;
  options.prompt_token_ids = prompt;
  ChoiceOutput output(*tokenizer_, options);
  const std::vector<int32_t> ids = encode("this is");
  std::vector<ChoiceText> deltas;
  run(output, ids, FinishReason::kNone, &deltas);
  ASSERT_EQ(deltas.size(), ids.size());
  std::vector<int32_t> streamed;
  for (size_t i = 0; i < deltas.size(); ++i) {
    EXPECT_TRUE(deltas[i].has_token_ids);
    ASSERT_EQ(deltas[i].token_ids.size(), 1u) << "delta " << i;
    streamed.push_back(deltas[i].token_ids[0]);
    // The prompt's ids come once, with the first token.
    EXPECT_EQ(deltas[i].prompt_token_ids, i == 0 ? prompt : std::vector<int32_t>{}) << "delta " << i;
  }
  EXPECT_EQ(streamed, ids);
  EXPECT_TRUE(deltas.back().text.empty());  // "is" may start "is ok": its text is held back, its id is not
  const ChoiceText end = output.on_end(FinishReason::kAbort);
  EXPECT_TRUE(end.has_token_ids);
  EXPECT_TRUE(end.token_ids.empty());
  EXPECT_EQ(output.accumulated().token_ids, ids);
  EXPECT_EQ(output.accumulated().prompt_token_ids, prompt);

  // A stop string ends the choice: tokens the engine produced after it are not reported.
  ChoiceOptions stopping = options;
  stopping.stop = {"ld, th"};
  ChoiceOutput stopped(*tokenizer_, stopping);
  const std::vector<int32_t> long_ids = encode("hello world, this is it");
  run(stopped, long_ids, FinishReason::kNone);
  EXPECT_EQ(static_cast<int64_t>(stopped.accumulated().token_ids.size()), stopped.num_tokens());
  EXPECT_LT(stopped.num_tokens(), static_cast<int64_t>(long_ids.size()));

  ChoiceOutput plain(*tokenizer_, ChoiceOptions{});
  run(plain, ids);
  EXPECT_FALSE(plain.accumulated().has_token_ids);
  EXPECT_TRUE(plain.accumulated().token_ids.empty());
}

TEST_F(ChoiceOutputTest, EndOfSequenceTokenIsNotText) {
  std::vector<int32_t> ids = encode("hello");
  const int32_t end = *tokenizer_->token_to_id("<|end|>");
  ids.push_back(end);
  ChoiceOptions options;
  options.skip_special_tokens = false;  // even when special tokens would be printed
  ChoiceOutput output(*tokenizer_, options);
  const ChoiceText total = run(output, ids, FinishReason::kStop);
  EXPECT_EQ(total.text, "hello");
  EXPECT_EQ(total.finish_reason, "stop");
  EXPECT_EQ(output.num_tokens(), static_cast<int64_t>(ids.size()));
}

TEST_F(ChoiceOutputTest, ReasoningIsSplitOff) {
  ChoiceOptions options;
  options.reasoning = true;
  ChoiceOutput output(*tokenizer_, options);
  const ChoiceText total = run(output, encode("<think>hello world</think>this"));
  EXPECT_EQ(total.reasoning, "hello world");
  EXPECT_EQ(total.text, "this");

  options.starts_in_reasoning = true;
  ChoiceOutput opened(*tokenizer_, options);
  const ChoiceText continued = run(opened, encode("hi</think>hello"));
  EXPECT_EQ(continued.reasoning, "hi");
  EXPECT_EQ(continued.text, "hello");

  ChoiceOutput never_closed(*tokenizer_, options);
  const ChoiceText cut = run(never_closed, encode("thinking"));
  EXPECT_EQ(cut.reasoning, "thinking");
  EXPECT_EQ(cut.text, "");
}

TEST_F(ChoiceOutputTest, LogprobsRenderTokensAndOffsets) {
  // "😀" is four bytes; byte tokens 0xF0 0x9F 0x98 0x80 complete it only together.
  std::vector<int32_t> ids = encode("hi ");
  for (const int32_t byte : {0xF0, 0x9F, 0x98, 0x80}) ids.push_back(byte);
  const std::vector<int32_t> tail = encode(" world");
  ids.insert(ids.end(), tail.begin(), tail.end());
  ChoiceOptions options;
  options.logprobs = 2;
  options.text_offset = 5;  // an echoed prompt of 5 characters
  ChoiceOutput output(*tokenizer_, options);
  const ChoiceText total = run(output, ids);
  ASSERT_EQ(total.logprobs.size(), ids.size());
  EXPECT_TRUE(output.accumulated().has_logprobs);
  int64_t code_points = 0;
  std::string decoded;
  for (size_t i = 0; i < ids.size(); ++i) {
    const LogprobEntry& entry = total.logprobs[i];
    EXPECT_EQ(entry.text_offset, 5 + code_points) << i;
    EXPECT_EQ(entry.chosen.bytes, tokenizer_->token_bytes(ids[i]));
    EXPECT_EQ(entry.chosen.token, tokenizer_->decode(std::vector<int32_t>{ids[i]}));
    EXPECT_FLOAT_EQ(entry.chosen.logprob, -0.5f - static_cast<float>(i));
    ASSERT_EQ(entry.top.size(), 2u);  // three offered, two asked for
    EXPECT_EQ(entry.top[1].logprob, -9.0f);
    std::vector<int32_t> prefix(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    // Offsets count only completed characters: a partial "😀" adds none until its last byte.
    const std::string now = tokenizer_->decode(prefix);
    const bool complete = now.find("\xEF\xBF\xBD") == std::string::npos;
    if (complete) code_points = count_code_points(now);
  }
  EXPECT_EQ(total.logprobs[3].chosen.token, "\xEF\xBF\xBD");  // a partial character renders as U+FFFD
  EXPECT_EQ(total.text, "hi \xF0\x9F\x98\x80 world");
}

TEST(CountCodePoints, Utf8) {
  EXPECT_EQ(count_code_points(""), 0);
  EXPECT_EQ(count_code_points("abc"), 3);
  EXPECT_EQ(count_code_points("\xC3\xA9\xF0\x9F\x98\x80"), 2);
}

}  // namespace
}  // namespace metrale::server
