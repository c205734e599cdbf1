// PLE n-gram hashing (qwen.md §7.2 a-d, §8): the multipliers against the reference values of §7.2,
// the prime table sizes against trial division, and the CPU id op against a direct formula of the
// whole sequence (transformers' segment-start form of the EOS rule), fed whole, in chunks, one token
// at a time and as a ragged batch, with the EOS-padded first call and the history slot rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/kernel_helpers.h"
#include "kernels/ple_ngram.h"

namespace metrale {
namespace {

using testing::Random;

TEST(PleHash, MultipliersMatchTheReferenceValues) {
  // qwen.md §7.2 (a): vocab 248320, seed 1234, PLE layer 0.
  EXPECT_EQ(kernels::ple_layer_multipliers(248320, 3, 0, 1234),
            (std::vector<int64_t>{23703573157769, 20109073645365, 8052911324071}));
  // Every multiplier is odd and keeps t * m below 2^63 for t < vocab.
  for (int64_t layer = 0; layer < 4; ++layer) {
    for (int64_t m : kernels::ple_layer_multipliers(248320, 5, layer, 77)) {
      EXPECT_EQ(m % 2, 1);
      EXPECT_LT(m, INT64_MAX / 248320);
    }
  }
  // Different layers hash differently.
  EXPECT_NE(kernels::ple_layer_multipliers(248320, 3, 0, 1234), kernels::ple_layer_multipliers(248320, 3, 1, 1234));
}

TEST(PleHash, SplitMixMatchesItsDefinition) {
  // splitmix64(0) is the published first output of SplitMix64 seeded with 0.
  EXPECT_EQ(kernels::splitmix64(0), 0xE220A8397B1DCDAFull);
}

bool trial_division_prime(int64_t value) {
  if (value < 2) return false;
  for (int64_t d = 2; d * d <= value; ++d) {
    if (value % d == 0) return false;
  }
  return true;
}

TEST(PleHash, PrimesAgreeWithTrialDivision) {
  for (int64_t v = 0; v < 5000; ++v) EXPECT_EQ(kernels::is_prime_u64(static_cast<uint64_t>(v)), trial_division_prime(v)) << v;
  // Strong pseudoprimes to small bases and large primes / composites.
  EXPECT_FALSE(kernels::is_prime_u64(3215031751ull));          // spsp(2, 3, 5, 7)
  EXPECT_FALSE(kernels::is_prime_u64(3825123056546413051ull));  // spsp to bases up to 23
  EXPECT_TRUE(kernels::is_prime_u64(18446744073709551557ull));  // largest prime below 2^64
  EXPECT_FALSE(kernels::is_prime_u64(18446744073709551559ull));
  const std::vector<int64_t> primes = kernels::primes_at_least(20000000, 64);
  int64_t candidate = 20000000;
  for (int64_t p : primes) {
    while (!trial_division_prime(candidate)) ++candidate;
    EXPECT_EQ(p, candidate);
    ++candidate;
  }
  EXPECT_EQ(primes.front(), 20000003);
}

TEST(PleHash, HeadTablesTakeConsecutivePrimesPerLayer) {
  const int64_t heads = 16;
  const std::vector<int64_t> primes = kernels::primes_at_least(20000000, 3 * heads);
  for (int64_t layer = 0; layer < 3; ++layer) {
    const kernels::PleHeadTable table = kernels::ple_head_table(20000000, heads, layer, 128);
    ASSERT_EQ(static_cast<int64_t>(table.sizes.size()), heads);
    int64_t offset = 0;
    for (int64_t h = 0; h < heads; ++h) {
      EXPECT_EQ(table.sizes[static_cast<size_t>(h)], primes[static_cast<size_t>(layer * heads + h)]);
      EXPECT_EQ(table.offsets[static_cast<size_t>(h)], offset);  // offsets restart in every layer
      offset += table.sizes[static_cast<size_t>(h)];
    }
    EXPECT_EQ(table.total, offset);
    EXPECT_EQ(table.padded_rows % 128, 0);
    EXPECT_GE(table.padded_rows, table.total);
    EXPECT_LT(table.padded_rows - table.total, 128);
  }
  // Small bases (test models).
  const kernels::PleHeadTable small = kernels::ple_head_table(100, 4, 1, 8);
  EXPECT_EQ(small.sizes, (std::vector<int64_t>{113, 127, 131, 137}));  // primes 5..8 that are >= 100
  EXPECT_EQ(small.padded_rows, 512);
}

// ---------------------------------------------------------------------------------------------
// The id op.

struct HashSetup {
  int n_max = 3, hpn = 2;
  int64_t eos = 7;
  std::vector<int64_t> multipliers, sizes, offsets;
  int64_t heads() const { return static_cast<int64_t>(n_max - 1) * hpn; }
};

HashSetup make_setup(int n_max, int hpn, int64_t eos, int64_t vocab) {
  HashSetup setup;
  setup.n_max = n_max;
  setup.hpn = hpn;
  setup.eos = eos;
  setup.multipliers = kernels::ple_layer_multipliers(vocab, n_max, 1, 1234);
  const kernels::PleHeadTable table = kernels::ple_head_table(1000, setup.heads(), 1, 128);
  setup.sizes = table.sizes;
  setup.offsets = table.offsets;
  return setup;
}

// Ids of a whole sequence seen from its start, written the way transformers does it: the history is
// [EOS]*(n-1) ++ tokens; the shift-k stream takes hist[p-k] when p - k is at least the start of p's
// segment (one past the last EOS strictly before p), else EOS.
std::vector<int64_t> reference_ids(const std::vector<int32_t>& tokens, const HashSetup& setup) {
  const int64_t context = setup.n_max - 1;
  std::vector<int64_t> hist(static_cast<size_t>(context), setup.eos);
  hist.insert(hist.end(), tokens.begin(), tokens.end());
  const auto length = static_cast<int64_t>(hist.size());
  std::vector<int64_t> segment_start(static_cast<size_t>(length));
  int64_t last_eos = -1;
  for (int64_t p = 0; p < length; ++p) {
    segment_start[static_cast<size_t>(p)] = last_eos + 1;  // EOS strictly before p
    if (hist[static_cast<size_t>(p)] == setup.eos) last_eos = p;
  }
  std::vector<int64_t> ids;
  for (int64_t p = context; p < length; ++p) {
    for (int n = 2; n <= setup.n_max; ++n) {
      int64_t mixed = 0;
      for (int k = 0; k < n; ++k) {
        const bool valid = p - k >= segment_start[static_cast<size_t>(p)] || k == 0;
        const int64_t t = valid ? hist[static_cast<size_t>(p - k)] : setup.eos;
        mixed ^= t * setup.multipliers[static_cast<size_t>(k)];
      }
      for (int j = 0; j < setup.hpn; ++j) {
        const size_t h = static_cast<size_t>((n - 2) * setup.hpn + j);
        ids.push_back(mixed % setup.sizes[h] + setup.offsets[h]);
      }
    }
  }
  return ids;
}

// The op's inputs: a ragged batch over host vectors.
struct IdBatch {
  std::vector<int32_t> tokens, cu_q{0}, kv_lens, slots;
  void add(const std::vector<int32_t>& rows, int32_t ctx, int32_t slot) {
    tokens.insert(tokens.end(), rows.begin(), rows.end());
    cu_q.push_back(static_cast<int32_t>(tokens.size()));
    kv_lens.push_back(ctx + static_cast<int32_t>(rows.size()));
    slots.push_back(slot);
  }
};

Tensor i32(std::vector<int32_t>& v) { return Tensor(v.data(), DType::kI32, {static_cast<int64_t>(v.size())}); }
Tensor i64(std::vector<int64_t>& v) { return Tensor(v.data(), DType::kI64, {static_cast<int64_t>(v.size())}); }

std::vector<int64_t> run_ids(IdBatch& batch, HashSetup& setup, std::vector<int64_t>& history, bool write = true) {
  const auto tokens = static_cast<int64_t>(batch.tokens.size());
  std::vector<int64_t> ids(static_cast<size_t>(tokens * setup.heads()), -1);
  kernels::PleNgramParams params;
  params.eos_token_id = setup.eos;
  params.ngram_size = setup.n_max;
  params.heads_per_ngram = setup.hpn;
  params.write_history = write;
  const int64_t context = setup.n_max - 1;
  Tensor hist(history.data(), DType::kI64, {static_cast<int64_t>(history.size()) / context, context});
  Tensor out(ids.data(), DType::kI64, {tokens, setup.heads()});
  kernels::ple_ngram_ids(i32(batch.tokens), hist, i32(batch.cu_q), i32(batch.kv_lens), i32(batch.slots),
                         i64(setup.multipliers), i64(setup.sizes), i64(setup.offsets), out, params);
  return ids;
}

// Random tokens below `vocab` with EOS runs and single EOS tokens mixed in.
std::vector<int32_t> random_tokens(Random& rng, int64_t count, int64_t vocab, int64_t eos) {
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = rng.integer(0, 9);
    tokens.push_back(static_cast<int32_t>(r == 0 ? eos : rng.integer(0, vocab - 1)));
  }
  return tokens;
}

TEST(PleNgramIds, WholeSequenceMatchesTheReference) {
  Random rng(5);
  for (int n_max : {2, 3, 4, 5}) {
    HashSetup setup = make_setup(n_max, 3, 11, 500);
    const std::vector<int32_t> tokens = random_tokens(rng, 200, 500, setup.eos);
    IdBatch batch;
    batch.add(tokens, 0, 0);
    std::vector<int64_t> history(static_cast<size_t>(n_max - 1), 12345);  // stale values: a fresh start ignores them
    EXPECT_EQ(run_ids(batch, setup, history), reference_ids(tokens, setup)) << "n_max " << n_max;
    // The history keeps the last n - 1 tokens.
    EXPECT_EQ(history, std::vector<int64_t>(tokens.end() - (n_max - 1), tokens.end()));
  }
}

TEST(PleNgramIds, EosRulesAtSegmentBoundaries) {
  HashSetup setup = make_setup(3, 1, 9, 100);
  // An EOS sees its own predecessors; the token after an EOS sees only EOS; two EOS in a row.
  const std::vector<int32_t> tokens = {4, 5, 9, 6, 9, 9, 8, 3, 2};
  IdBatch batch;
  batch.add(tokens, 0, 0);
  std::vector<int64_t> history(2, 0);
  const std::vector<int64_t> ids = run_ids(batch, setup, history);
  const auto hash = [&](std::vector<int64_t> grams, int head) {
    int64_t mixed = 0;
    for (size_t k = 0; k < grams.size(); ++k) mixed ^= grams[k] * setup.multipliers[k];
    return mixed % setup.sizes[static_cast<size_t>(head)] + setup.offsets[static_cast<size_t>(head)];
  };
  // rows: heads (order 2, order 3)
  const std::vector<std::vector<int64_t>> expected = {
      {hash({4, 9}, 0), hash({4, 9, 9}, 1)},  // first token: EOS padding
      {hash({5, 4}, 0), hash({5, 4, 9}, 1)},  // the padding EOS cuts the trigram
      {hash({9, 5}, 0), hash({9, 5, 4}, 1)},  // EOS keeps its predecessors
      {hash({6, 9}, 0), hash({6, 9, 9}, 1)},  // right after an EOS
      {hash({9, 6}, 0), hash({9, 6, 9}, 1)},
      {hash({9, 9}, 0), hash({9, 9, 9}, 1)},
      {hash({8, 9}, 0), hash({8, 9, 9}, 1)},
      {hash({3, 8}, 0), hash({3, 8, 9}, 1)},
      {hash({2, 3}, 0), hash({2, 3, 8}, 1)},
  };
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(ids[2 * i], expected[i][0]) << "row " << i;
    EXPECT_EQ(ids[2 * i + 1], expected[i][1]) << "row " << i;
  }
}

TEST(PleNgramIds, ChunkedAndSingleTokenCallsMatchTheWholeSequence) {
  Random rng(6);
  for (int n_max : {3, 4}) {
    HashSetup setup = make_setup(n_max, 2, 3, 64);
    const std::vector<int32_t> tokens = random_tokens(rng, 90, 64, setup.eos);
    const std::vector<int64_t> expected = reference_ids(tokens, setup);
    const int64_t context = n_max - 1;
    // Chunks: one token first (shorter than the history: EOS padding kept), then mixed sizes, then decode.
    const std::vector<int> chunks = {1, 2, 7, 1, 30, 3, 1, 1, 44};
    std::vector<int64_t> history(static_cast<size_t>(2 * context), -5);  // slot 1 is used; slot 0 must stay
    std::vector<int64_t> got;
    int32_t done = 0;
    for (int chunk : chunks) {
      IdBatch batch;
      batch.add(std::vector<int32_t>(tokens.begin() + done, tokens.begin() + done + chunk), done, 1);
      const std::vector<int64_t> ids = run_ids(batch, setup, history);
      got.insert(got.end(), ids.begin(), ids.end());
      done += chunk;
      if (done == 1) {
        // First call of one token: EOS-padded on the left.
        std::vector<int64_t> padded(static_cast<size_t>(context - 1), setup.eos);
        padded.push_back(tokens[0]);
        EXPECT_EQ(std::vector<int64_t>(history.begin() + context, history.end()), padded);
      }
    }
    ASSERT_EQ(done, static_cast<int32_t>(tokens.size()));
    EXPECT_EQ(got, expected) << "n_max " << n_max;
    EXPECT_EQ(std::vector<int64_t>(history.begin(), history.begin() + context), std::vector<int64_t>(context, -5));
  }
}

TEST(PleNgramIds, RaggedBatchMatchesEachSequenceAloneAndHonoursSlotRules) {
  Random rng(7);
  HashSetup setup = make_setup(3, 4, 0, 1000);
  const int64_t context = 2;
  // Three sequences with history: each has a prefix already fed through slot s.
  std::vector<std::vector<int32_t>> prefixes = {random_tokens(rng, 5, 1000, 0), random_tokens(rng, 1, 1000, 0),
                                                random_tokens(rng, 12, 1000, 0)};
  std::vector<std::vector<int32_t>> steps = {random_tokens(rng, 1, 1000, 0), random_tokens(rng, 6, 1000, 0),
                                             random_tokens(rng, 1, 1000, 0)};
  std::vector<int64_t> history(static_cast<size_t>(6 * context), 999);
  const std::vector<int32_t> slot_of = {4, 0, 2};
  for (size_t s = 0; s < prefixes.size(); ++s) {
    IdBatch batch;
    batch.add(prefixes[s], 0, slot_of[s]);
    run_ids(batch, setup, history);
  }
  const std::vector<int64_t> before = history;
  // The ragged step: the three continuations, a fresh sequence (slot 5), an empty one (slot 1) and a
  // sequence with cached tokens but no slot (-1: EOS context, nothing written).
  const std::vector<int32_t> fresh = random_tokens(rng, 4, 1000, 0), no_slot = random_tokens(rng, 3, 1000, 0);
  IdBatch batch;
  batch.add(steps[0], 5, 4);
  batch.add(steps[1], 1, 0);
  batch.add({}, 3, 1);
  batch.add(fresh, 0, 5);
  batch.add(steps[2], 12, 2);
  batch.add(no_slot, 8, -1);
  for (bool write : {false, true}) {
    std::vector<int64_t> state = before;
    const std::vector<int64_t> ids = run_ids(batch, setup, state, write);
    std::vector<int64_t> expected;
    const auto append_tail = [&](const std::vector<int32_t>& prefix, const std::vector<int32_t>& step) {
      std::vector<int32_t> whole = prefix;
      whole.insert(whole.end(), step.begin(), step.end());
      const std::vector<int64_t> all = reference_ids(whole, setup);
      expected.insert(expected.end(), all.end() - static_cast<int64_t>(step.size()) * setup.heads(), all.end());
    };
    append_tail(prefixes[0], steps[0]);
    append_tail(prefixes[1], steps[1]);
    append_tail({}, fresh);
    append_tail(prefixes[2], steps[2]);
    append_tail({}, no_slot);
    EXPECT_EQ(ids, expected) << "write " << write;
    if (!write) {
      EXPECT_EQ(state, before);
      continue;
    }
    const auto slot_state = [&](int slot) {
      return std::vector<int64_t>(state.begin() + slot * context, state.begin() + (slot + 1) * context);
    };
    EXPECT_EQ(slot_state(4), (std::vector<int64_t>{prefixes[0].back(), steps[0][0]}));
    EXPECT_EQ(slot_state(0), (std::vector<int64_t>{steps[1][4], steps[1][5]}));
    EXPECT_EQ(slot_state(1), std::vector<int64_t>(before.begin() + 2, before.begin() + 4));  // q_len 0
    EXPECT_EQ(slot_state(5), (std::vector<int64_t>{fresh[2], fresh[3]}));
    EXPECT_EQ(slot_state(2), (std::vector<int64_t>{prefixes[2].back(), steps[2][0]}));
    EXPECT_EQ(slot_state(3), std::vector<int64_t>(before.begin() + 6, before.begin() + 8));  // nobody's
  }
}

}  // namespace
}  // namespace metrale
