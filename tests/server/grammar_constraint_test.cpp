// GrammarConstraint (server/grammar_constraint.h) on a small vocabulary: a random "model" that picks
// any allowed token always ends with a stop token inside its budget, with the answer after the
// reasoning block valid JSON of the schema; the think block is free but cannot end the output;
// rollback restores the masks.
#include "server/grammar_constraint.h"

#include <gtest/gtest.h>

#include <random>

#include <nlohmann/json.hpp>

#include "text/grammar/json_schema.h"

namespace metrale::server {
namespace {

using json = nlohmann::ordered_json;

struct Vocabulary {
  std::vector<std::string> tokens;
  int32_t think_open = -1, think_close = -1, end = -1;
};

Vocabulary make_vocabulary() {
  Vocabulary v;
  for (int c = 32; c < 127; ++c) v.tokens.emplace_back(1, static_cast<char>(c));
  v.tokens.emplace_back("\n");
  for (const char* piece : {"{\"", "\":", "name", "\"n\": ", "12", "hello", "\"}", "true", ", \""}) v.tokens.emplace_back(piece);
  v.think_open = static_cast<int32_t>(v.tokens.size());
  v.tokens.emplace_back("<think>");
  v.think_close = static_cast<int32_t>(v.tokens.size());
  v.tokens.emplace_back("</think>");
  v.end = static_cast<int32_t>(v.tokens.size());
  v.tokens.emplace_back("<|end|>");
  return v;
}

const json kSchema = json::parse(R"({"type": "object", "properties": {"name": {"type": "string"},
  "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "n"]})");

class GrammarConstraintTest : public ::testing::Test {
 protected:
  void SetUp() override {
    vocab_ = make_vocabulary();
    info_ = grammar::TokenizerInfo::from_tokens(vocab_.tokens, {vocab_.end}, {vocab_.end});
    grammar_ = grammar::compile_grammar(grammar::json_schema_grammar(kSchema), info_);
    auto shared = std::make_shared<ConstraintVocabulary>();
    shared->think_open = vocab_.think_open;
    shared->think_close = vocab_.think_close;
    for (int32_t id = 0; id < static_cast<int32_t>(vocab_.tokens.size()); ++id) {
      const std::string& bytes = vocab_.tokens[static_cast<size_t>(id)];
      const bool special = id == vocab_.end;
      shared->first_byte.push_back(special ? ConstraintVocabulary::kNoFirstByte : static_cast<uint8_t>(bytes[0]));
      if (bytes.size() == 1) shared->byte_tokens.push_back(id);
    }
    shared->stop_token_ids = {vocab_.end};
    shared_ = shared;
  }

  std::vector<int32_t> allowed(GrammarConstraint& constraint, bool& masked) const {
    std::vector<uint32_t> mask(static_cast<size_t>(info_->bitmask_words()), 0u);
    masked = constraint.fill_next_mask(mask);
    std::vector<int32_t> ids;
    for (int32_t id = 0; id < static_cast<int32_t>(vocab_.tokens.size()); ++id) {
      if (!masked || token_allowed(mask, id)) ids.push_back(id);
    }
    return ids;
  }

  Vocabulary vocab_;
  std::shared_ptr<const grammar::TokenizerInfo> info_;
  std::shared_ptr<const grammar::CompiledGrammar> grammar_;
  std::shared_ptr<const ConstraintVocabulary> shared_;
};

TEST_F(GrammarConstraintTest, RandomOutputsEndValidWithinTheirBudget) {
  for (uint64_t seed = 0; seed < 120; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937_64 rng(seed);
    GrammarConstraintOptions options;
    options.reasoning = true;
    options.starts_in_reasoning = seed % 3 == 0;
    options.max_tokens = 30 + static_cast<int64_t>(seed % 40);
    GrammarConstraint constraint(grammar_, shared_, options);
    std::string answer;
    bool in_reasoning = options.starts_in_reasoning;
    bool ended = false;
    for (int64_t step = 0; step < options.max_tokens && !ended; ++step) {
      bool masked = false;
      std::vector<int32_t> ids = allowed(constraint, masked);
      ASSERT_TRUE(masked) << "every row of a constrained choice is masked (the think block keeps stop tokens out)";
      ASSERT_FALSE(ids.empty());
      // Open the think block now and then, to exercise that path.
      int32_t token = ids[rng() % ids.size()];
      if (step == 0 && seed % 3 == 1 && std::find(ids.begin(), ids.end(), vocab_.think_open) != ids.end())
        token = vocab_.think_open;
      ASSERT_TRUE(constraint.accept(token)) << vocab_.tokens[static_cast<size_t>(token)];
      if (token == vocab_.end) {
        ended = true;
      } else if (token == vocab_.think_open && step == 0) {
        in_reasoning = true;
      } else if (in_reasoning) {
        if (token == vocab_.think_close) in_reasoning = false;
      } else {
        answer += vocab_.tokens[static_cast<size_t>(token)];
      }
    }
    ASSERT_TRUE(ended) << "no stop token within " << options.max_tokens << " tokens; answer so far: " << answer;
    const json value = json::parse(answer, nullptr, false);
    ASSERT_FALSE(value.is_discarded()) << answer;
    EXPECT_TRUE(value["name"].is_string()) << answer;
    EXPECT_TRUE(value["n"].is_number_integer()) << answer;
  }
}

TEST_F(GrammarConstraintTest, RollbackRestoresTheMasks) {
  GrammarConstraintOptions options;
  options.reasoning = true;
  GrammarConstraint constraint(grammar_, shared_, options);
  bool masked = false;
  const std::vector<int32_t> start = allowed(constraint, masked);
  EXPECT_NE(std::find(start.begin(), start.end(), vocab_.think_open), start.end());
  EXPECT_EQ(std::find(start.begin(), start.end(), vocab_.end), start.end());
  ASSERT_TRUE(constraint.accept(vocab_.think_open));
  ASSERT_TRUE(constraint.accept(0));  // " " inside the block
  ASSERT_TRUE(constraint.accept(vocab_.think_close));
  const std::vector<int32_t> after_reasoning = allowed(constraint, masked);
  EXPECT_EQ(std::find(after_reasoning.begin(), after_reasoning.end(), vocab_.think_open), after_reasoning.end());
  const int32_t open_brace = '{' - 32;
  ASSERT_TRUE(constraint.accept(open_brace));
  EXPECT_FALSE(constraint.accept(open_brace)) << "'{{' is not JSON";
  constraint.rollback(4);
  EXPECT_EQ(allowed(constraint, masked), start);
}

TEST_F(GrammarConstraintTest, WithoutReasoningTheGrammarStartsAtOnce) {
  GrammarConstraint constraint(grammar_, shared_, GrammarConstraintOptions{});
  bool masked = false;
  const std::vector<int32_t> ids = allowed(constraint, masked);
  EXPECT_TRUE(masked);
  EXPECT_EQ(std::find(ids.begin(), ids.end(), vocab_.think_open), ids.end());
  EXPECT_FALSE(constraint.accept('a' - 32));
  EXPECT_TRUE(constraint.accept('{' - 32));
}

}  // namespace
}  // namespace metrale::server
