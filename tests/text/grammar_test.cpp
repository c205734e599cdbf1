#include <gtest/gtest.h>

#include "core/error.h"
#include "text/grammar/compiled_grammar.h"
#include "text/grammar/matcher.h"
#include "text/grammar_helpers.h"

namespace metrale::grammar {
namespace {

using testing::expect_mask_matches_brute_force;
using testing::random_walk;
using testing::small_vocabulary;

bool accepts(const std::shared_ptr<const CompiledGrammar>& grammar, std::string_view text, bool complete = true) {
  GrammarMatcher matcher(grammar);
  if (!matcher.accept_string(text)) return false;
  return !complete || matcher.can_terminate();
}

TEST(Grammar, LiteralsAndAlternatives) {
  Grammar g;
  const RuleId root = g.add_rule("root");
  g.set_body(root, g.seq({g.literal("ab"), g.alt({g.literal("c"), g.literal("de")}), g.optional(g.literal("!"))}));
  g.set_root(root);
  const auto compiled = compile_grammar(g, small_vocabulary());
  EXPECT_TRUE(accepts(compiled, "abc"));
  EXPECT_TRUE(accepts(compiled, "abde!"));
  EXPECT_FALSE(accepts(compiled, "abd"));
  EXPECT_TRUE(accepts(compiled, "abd", /*complete=*/false));  // a prefix of "abde"
  EXPECT_FALSE(accepts(compiled, "abx", false));
  EXPECT_FALSE(accepts(compiled, "abc!!", false));
  GrammarMatcher matcher(compiled);
  expect_mask_matches_brute_force(matcher, "start");
  ASSERT_TRUE(matcher.accept_string("ab"));
  expect_mask_matches_brute_force(matcher, "after ab");
  ASSERT_TRUE(matcher.accept_string("c"));
  EXPECT_TRUE(matcher.can_terminate());
  EXPECT_FALSE(matcher.is_complete());  // "!" may follow
  expect_mask_matches_brute_force(matcher, "after abc");
  ASSERT_TRUE(matcher.accept_token(0));
  EXPECT_TRUE(matcher.is_terminated());
}

// S ::= "(" S ")" S | "" : nesting through a recursive rule.
TEST(Grammar, RecursiveRuleMasksMatchBruteForce) {
  Grammar g;
  const RuleId s = g.add_rule("S");
  g.set_body(s, g.alt({g.seq({g.literal("("), g.ref(s), g.literal(")"), g.ref(s)}), g.empty()}));
  g.set_root(s);
  const auto compiled = compile_grammar(g, small_vocabulary());
  EXPECT_TRUE(accepts(compiled, "(()())()"));
  EXPECT_TRUE(accepts(compiled, ""));
  EXPECT_FALSE(accepts(compiled, "(()"));
  EXPECT_FALSE(accepts(compiled, "())", false));
  std::mt19937 random(1);
  for (int walk = 0; walk < 20; ++walk) {
    GrammarMatcher matcher(compiled);
    random_walk(matcher, random, 30, /*check_masks=*/true);
    if (HasFatalFailure()) return;
  }
}

TEST(Grammar, RollbackAndFork) {
  Grammar g;
  const RuleId root = g.add_rule("root");
  g.set_body(root, g.seq({g.literal("{"), g.star(g.bytes(ByteSet::range('a', 'z'))), g.literal("}")}));
  g.set_root(root);
  const auto compiled = compile_grammar(g, small_vocabulary());
  const auto vocabulary = small_vocabulary();
  GrammarMatcher matcher(compiled);
  ASSERT_TRUE(matcher.accept_string("{"));
  GrammarMatcher fork = matcher.fork();
  ASSERT_TRUE(matcher.accept_string("ab"));
  ASSERT_TRUE(matcher.accept_string("c"));
  EXPECT_EQ(matcher.num_accepted(), 3);
  matcher.rollback(2);
  EXPECT_EQ(matcher.num_accepted(), 1);
  EXPECT_FALSE(matcher.can_terminate());
  ASSERT_TRUE(matcher.accept_string("}"));
  EXPECT_TRUE(matcher.can_terminate());
  EXPECT_TRUE(matcher.is_complete());
  // The fork is where it was.
  EXPECT_FALSE(fork.can_terminate());
  EXPECT_TRUE(fork.accept_string("zz}"));
  EXPECT_THROW(fork.rollback(5), Error);
  // A stop token ends the matcher; rolling it back reopens it.
  ASSERT_TRUE(fork.accept_token(0));
  EXPECT_TRUE(fork.is_terminated());
  EXPECT_FALSE(fork.accept_string("}"));
  fork.rollback(1);
  EXPECT_FALSE(fork.is_terminated());
  EXPECT_TRUE(fork.can_terminate());
  // Moving a matcher keeps it working.
  GrammarMatcher moved = std::move(fork);
  EXPECT_TRUE(moved.can_terminate());
  moved.rollback(1);
  EXPECT_TRUE(moved.accept_string("}"));
}

TEST(Grammar, SpecialTokensOnlyWhenNamed) {
  Grammar g;
  const RuleId root = g.add_rule("root");
  g.set_body(root, g.seq({g.literal("<|special|>"), g.literal("x")}));
  g.set_root(root);
  const auto without = compile_grammar(g, small_vocabulary());
  GrammarMatcher a(without);
  EXPECT_FALSE(a.accept_token(1));  // the special token is not text
  EXPECT_TRUE(a.accept_string("<|special|>"));
  g.allow_special_token("<|special|>");
  GrammarMatcher b(compile_grammar(g, small_vocabulary()));
  EXPECT_TRUE(b.accept_token(1));
  EXPECT_TRUE(b.accept_string("x"));
}

TEST(Grammar, ErrorsNameTheProblem) {
  Grammar empty_language;
  const RuleId r = empty_language.add_rule("r");
  empty_language.set_body(r, empty_language.seq({empty_language.literal("a"), empty_language.ref(r)}));
  empty_language.set_root(r);
  EXPECT_THROW(compile_grammar(empty_language, small_vocabulary()), Error);

  Grammar left;
  const RuleId a = left.add_rule("a");
  left.set_body(a, left.alt({left.seq({left.ref(a), left.literal("x")}), left.literal("y")}));
  left.set_root(a);
  try {
    compile_grammar(left, small_vocabulary());
    FAIL() << "left recursion must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("left-recursive"), std::string::npos) << e.what();
  }
}

TEST(Grammar, LazyMasksEqualPrecomputed) {
  Grammar g;
  const RuleId s = g.add_rule("S");
  g.set_body(s, g.alt({g.seq({g.literal("["), g.ref(s), g.star(g.seq({g.literal(","), g.ref(s)})), g.literal("]")}),
                       g.plus(g.bytes(ByteSet::range('0', '9')))}));
  g.set_root(s);
  GrammarCompileOptions lazy;
  lazy.precompute = false;
  const auto eager_grammar = compile_grammar(g, small_vocabulary());
  const auto lazy_grammar = compile_grammar(g, small_vocabulary(), lazy);
  GrammarMatcher eager(eager_grammar);
  GrammarMatcher lazy_matcher(lazy_grammar);
  std::vector<uint32_t> a(static_cast<size_t>(eager.bitmask_words()));
  std::vector<uint32_t> b(a.size());
  for (std::string_view piece : {"[", "1", "2", ",", "[", "3", "]"}) {
    eager.fill_next_token_bitmask(a);
    lazy_matcher.fill_next_token_bitmask(b);
    EXPECT_EQ(a, b) << piece;
    expect_mask_matches_brute_force(eager, std::string(piece));
    ASSERT_TRUE(eager.accept_string(piece));
    ASSERT_TRUE(lazy_matcher.accept_string(piece));
  }
}

}  // namespace
}  // namespace metrale::grammar

namespace metrale::grammar {
namespace {

// A rule with more positions than the precompute budget is built on first use, with the same masks.
TEST(Grammar, RulesOverTheBudgetAreLazy) {
  Grammar g;
  const RuleId root = g.add_rule("root");
  g.set_body(root, g.seq({g.literal("\""), g.repeat(g.bytes(ByteSet::range('a', 'z')), 0, 40), g.literal("\"")}));
  g.set_root(root);
  GrammarCompileOptions small;
  small.max_precomputed_positions = 10;
  const auto lazy = compile_grammar(g, small_vocabulary(), small);
  EXPECT_EQ(lazy->stats().lazy_rules, 1);
  const auto eager = compile_grammar(g, small_vocabulary());
  EXPECT_EQ(eager->stats().lazy_rules, 0);
  GrammarMatcher a(lazy);
  GrammarMatcher b(eager);
  std::vector<uint32_t> mask_a(static_cast<size_t>(a.bitmask_words()));
  std::vector<uint32_t> mask_b(mask_a.size());
  for (std::string_view piece : {"\"", "abc", "name", "z"}) {
    a.fill_next_token_bitmask(mask_a);
    b.fill_next_token_bitmask(mask_b);
    EXPECT_EQ(mask_a, mask_b) << piece;
    ASSERT_TRUE(a.accept_string(piece));
    ASSERT_TRUE(b.accept_string(piece));
  }
}

}  // namespace
}  // namespace metrale::grammar
