// Shared pieces of the grammar tests: small vocabularies and the byte-level brute force that the
// token masks must agree with.
#pragma once

#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "text/grammar/matcher.h"
#include "text/grammar/tokenizer_info.h"

namespace metrale::grammar::testing {

// Every printable ASCII byte, whitespace, a few UTF-8 pieces (whole characters and a character split
// in two), and multi-byte tokens that straddle JSON structure ("\":", "},", "\", \"", ...). Id 0 is the
// stop token (special), id 1 another special token that no grammar may produce.
inline std::shared_ptr<const TokenizerInfo> small_vocabulary() {
  std::vector<std::string> tokens = {"<eos>", "<|special|>"};
  for (int c = 0x20; c < 0x7f; ++c) tokens.emplace_back(1, static_cast<char>(c));
  for (const char* piece :
       {"\n",    "\t",    "\r",   "é",      "日本",       "\xe6",        "\x97\xa5",     "\xf0\x9f\x98\x80",
        "{\"",   "\":",   "\": ", "\", \"", "\",",        "\"}",         "},",           "}}",
        "]}",    "[]",    "{}",   "\"\"",   "true",       "false",       "null",         "12",
        "0.",    "-1",    "e+",   "1e",     "  ",         "\n  ",        " \"",          "\\n",
        "\\u00", "\\\"",  "abc",  "name",   "\"name\"",   "<tool_call>", "</tool_call>", "\n</",
        "tool",  "_call", ">\n",  "=",      "<function=", "<parameter=", "</parameter>", "</function>",
        "\"]",   ", ",    ",\"",  "2023",   "-01",        "T12",         ":00",          "Z\"",
        "@",     ".com"}) {
    tokens.emplace_back(piece);
  }
  return TokenizerInfo::from_tokens(tokens, {0, 1}, {0});
}

// The mask must hold exactly the tokens that accept_token takes (checked token by token on a copy).
inline void expect_mask_matches_brute_force(const GrammarMatcher& matcher, const std::string& where) {
  const TokenizerInfo& vocabulary = matcher.grammar().tokenizer();
  std::vector<uint32_t> bitmask(static_cast<size_t>(matcher.bitmask_words()));
  matcher.fill_next_token_bitmask(bitmask);
  for (int32_t token = 0; token < vocabulary.num_tokens(); ++token) {
    const bool in_mask = (bitmask[static_cast<size_t>(token) >> 5] >> (token & 31)) & 1;
    GrammarMatcher copy(matcher);
    const bool accepted = copy.accept_token(token);
    ASSERT_EQ(in_mask, accepted) << where << ": token " << token << " \"" << vocabulary.token_bytes(token)
                                 << "\" state " << matcher.describe();
  }
}

// Samples allowed tokens until a stop token (or `max_tokens`); returns the text. Checks the mask
// against the brute force at every step when `check_masks`.
inline std::string random_walk(GrammarMatcher& matcher, std::mt19937& random, int max_tokens, bool check_masks,
                               bool* terminated = nullptr) {
  const TokenizerInfo& vocabulary = matcher.grammar().tokenizer();
  std::vector<uint32_t> bitmask(static_cast<size_t>(matcher.bitmask_words()));
  std::string text;
  for (int step = 0; step < max_tokens; ++step) {
    if (check_masks) {
      expect_mask_matches_brute_force(matcher, "after \"" + text + "\"");
      if (::testing::Test::HasFatalFailure()) return text;
    }
    matcher.fill_next_token_bitmask(bitmask);
    std::vector<int32_t> allowed;
    for (int32_t token = 0; token < static_cast<int32_t>(vocabulary.vocab_size()); ++token) {
      if ((bitmask[static_cast<size_t>(token) >> 5] >> (token & 31)) & 1) allowed.push_back(token);
    }
    EXPECT_FALSE(allowed.empty()) << "no token allowed after \"" << text << "\"";
    if (allowed.empty()) return text;
    // Mostly avoid tokens that are only whitespace (a large vocabulary has hundreds, and JSON allows
    // whitespace almost everywhere), and lean towards closing and stopping as the walk gets long, so
    // that most walks finish.
    std::vector<int32_t> visible;
    for (int32_t id : allowed) {
      const std::string_view bytes = vocabulary.token_bytes(id);
      if (bytes.find_first_not_of(" \t\n\r") != std::string_view::npos || bytes.empty()) visible.push_back(id);
    }
    const std::vector<int32_t>& pool = visible.empty() || random() % 8 == 0 ? allowed : visible;
    int32_t token = pool[random() % pool.size()];
    const bool late = static_cast<int>(random() % static_cast<unsigned>(max_tokens)) < 2 * step;
    if (late) {
      // Head for the end: of a sample of the allowed tokens, the one after which the fewest bytes
      // complete the output.
      int32_t best = std::numeric_limits<int32_t>::max();
      for (int sample = 0; sample < 64; ++sample) {
        const int32_t candidate = allowed[random() % allowed.size()];
        if (candidate == vocabulary.stop_token_ids()[0]) continue;
        GrammarMatcher copy(matcher);
        if (!copy.accept_token(candidate)) continue;
        const int32_t remaining = copy.min_remaining_bytes();
        if (remaining < best) {
          best = remaining;
          token = candidate;
        }
      }
    }
    if (matcher.can_terminate() && late) token = vocabulary.stop_token_ids()[0];
    EXPECT_TRUE(matcher.accept_token(token)) << "token " << token << " after \"" << text << "\"";
    if (matcher.is_terminated()) {
      if (terminated != nullptr) *terminated = true;
      return text;
    }
    text += vocabulary.token_bytes(token);
  }
  if (terminated != nullptr) *terminated = false;
  return text;
}

}  // namespace metrale::grammar::testing
