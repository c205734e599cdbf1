// causal_conv1d with dilation and a residual (PLE's short conv, qwen.md §7.2 g-h and §8's conv-state
// rule) on the CPU against the direct formula, on ragged batches with fresh sequences, continuations
// shorter than the (K-1)*d history, decode rows, slot -1 and read-only verify steps; and one long call
// against consecutive calls that continue from the state slot.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/causal_conv1d.h"
#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct Ragged {
  std::vector<int32_t> cu_q{0}, kv_lens, slots;
  void add(int32_t q_len, int32_t ctx, int32_t slot) {
    cu_q.push_back(cu_q.back() + q_len);
    kv_lens.push_back(ctx + q_len);
    slots.push_back(slot);
  }
  Tensor cu() { return Tensor(cu_q.data(), DType::kI32, {static_cast<int64_t>(cu_q.size())}); }
  Tensor lens() { return Tensor(kv_lens.data(), DType::kI32, {static_cast<int64_t>(kv_lens.size())}); }
  Tensor slot_tensor() { return Tensor(slots.data(), DType::kI32, {static_cast<int64_t>(slots.size())}); }
};

// Output rows of one sequence: W = history (L rows) ++ x; out[i] = res[i] + silu(sum_j w[c, j] W[i + j d]).
std::vector<double> reference(const std::vector<double>& history, const std::vector<double>& x,
                              const std::vector<double>& res, const std::vector<double>& w, int64_t channels,
                              int64_t kernel, int64_t dilation) {
  std::vector<double> window = history;
  window.insert(window.end(), x.begin(), x.end());
  const int64_t rows = static_cast<int64_t>(x.size()) / channels;
  std::vector<double> out(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < channels; ++c) {
      double sum = 0.0;
      for (int64_t j = 0; j < kernel; ++j) {
        sum += w[static_cast<size_t>(c * kernel + j)] * window[static_cast<size_t>((i + j * dilation) * channels + c)];
      }
      out[static_cast<size_t>(i * channels + c)] = silu(sum) + (res.empty() ? 0.0 : res[static_cast<size_t>(i * channels + c)]);
    }
  }
  return out;
}

std::vector<double> rows_of(const std::vector<double>& all, int64_t first, int64_t count, int64_t channels) {
  return std::vector<double>(all.begin() + first * channels, all.begin() + (first + count) * channels);
}

TEST(CausalConv1dDilated, RaggedBatchMatchesTheFormulaAndKeepsTheLastRows) {
  const int64_t channels = 280, kernel = 4, dilation = 3, history = (kernel - 1) * dilation, num_slots = 7;
  for (bool write : {true, false}) {
    Random rng(write ? 41 : 42);
    // (q_len, ctx, slot): fresh prefill over a NaN slot, continuation, decode, continuations shorter than
    // the 9-row history (the state shifts), a fresh sequence shorter than the history, q_len 0, no slot.
    Ragged batch;
    batch.add(20, 0, 3);
    batch.add(7, 5, 0);
    batch.add(1, 30, 4);
    batch.add(4, 2, 1);
    batch.add(2, 0, 2);
    batch.add(0, 6, 5);
    batch.add(5, 11, -1);
    const int64_t tokens = batch.cu_q.back();
    const OwnedTensor x_wide = testing::random_tensor(DType::kF32, {tokens, channels + 6}, rng);
    const Tensor x = x_wide->slice(1, 2, 2 + channels);
    const OwnedTensor res_wide = testing::random_tensor(DType::kF32, {tokens, channels + 4}, rng);
    const Tensor res = res_wide->slice(1, 4, 4 + channels);
    const OwnedTensor weight = testing::random_tensor(DType::kF32, {channels, kernel}, rng, -0.6f, 0.6f);
    const OwnedTensor state = testing::random_tensor(DType::kF32, {num_slots, history, channels}, rng);
    testing::poison(state->select(0, 3));  // a fresh sequence must not read its slot
    const std::vector<double> state_before = testing::to_doubles(*state);
    OwnedTensor out(DType::kF32, {tokens, channels});
    testing::poison(*out);
    kernels::CausalConv1dParams params;
    params.dilation = static_cast<int>(dilation);
    params.residual = res;
    params.write_state = write;
    kernels::causal_conv1d(x, *weight, *state, batch.cu(), batch.lens(), batch.slot_tensor(), *out, params);

    const std::vector<double> xv = testing::to_doubles(x), rv = testing::to_doubles(res), wv = testing::to_doubles(*weight);
    const std::vector<double> got = testing::to_doubles(*out), state_after = testing::to_doubles(*state);
    const int64_t slot_size = history * channels;
    for (size_t s = 0; s < batch.slots.size(); ++s) {
      const int64_t first = batch.cu_q[s], q_len = batch.cu_q[s + 1] - first, ctx = batch.kv_lens[s] - q_len;
      const int32_t slot = batch.slots[s];
      const bool fresh = ctx == 0 || slot < 0;
      const std::vector<double> hist =
          fresh ? std::vector<double>(static_cast<size_t>(slot_size), 0.0)
                : std::vector<double>(state_before.begin() + slot * slot_size, state_before.begin() + (slot + 1) * slot_size);
      const std::vector<double> xs = rows_of(xv, first, q_len, channels);
      if (q_len > 0) {
        EXPECT_TRUE(testing::close_rel_l2(rows_of(got, first, q_len, channels),
                                          reference(hist, xs, rows_of(rv, first, q_len, channels), wv, channels,
                                                    kernel, dilation),
                                          1e-6))
            << "sequence " << s;
      }
      if (slot < 0) continue;
      std::vector<double> window = hist;
      window.insert(window.end(), xs.begin(), xs.end());
      const std::vector<double> kept(window.end() - slot_size, window.end());
      const std::vector<double> now(state_after.begin() + slot * slot_size, state_after.begin() + (slot + 1) * slot_size);
      if (write && q_len > 0) {
        EXPECT_EQ(now, kept) << "slot of sequence " << s;
      } else if (!fresh || !write) {
        // Read-only steps and q_len 0 leave the slot as it was (bit for bit, NaN included).
        const std::vector<double> was(state_before.begin() + slot * slot_size, state_before.begin() + (slot + 1) * slot_size);
        for (size_t i = 0; i < was.size(); ++i) {
          EXPECT_TRUE(now[i] == was[i] || (std::isnan(now[i]) && std::isnan(was[i]))) << "slot " << slot;
        }
      }
    }
    // Slot 6 belongs to nobody.
    EXPECT_EQ(std::vector<double>(state_after.begin() + 6 * slot_size, state_after.end()),
              std::vector<double>(state_before.begin() + 6 * slot_size, state_before.end()));
  }
}

TEST(CausalConv1dDilated, ConsecutiveCallsMatchOneCall) {
  Random rng(43);
  const int64_t channels = 24, kernel = 4, dilation = 3, history = (kernel - 1) * dilation, tokens = 40;
  const OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, channels}, rng);
  const OwnedTensor res = testing::random_tensor(DType::kF32, {tokens, channels}, rng);
  const OwnedTensor weight = testing::random_tensor(DType::kF32, {channels, kernel}, rng, -0.6f, 0.6f);
  kernels::CausalConv1dParams params;
  params.dilation = static_cast<int>(dilation);
  OwnedTensor whole(DType::kF32, {tokens, channels});
  {
    OwnedTensor state(DType::kF32, {1, history, channels});
    Ragged batch;
    batch.add(static_cast<int32_t>(tokens), 0, 0);
    params.residual = *res;
    kernels::causal_conv1d(*x, *weight, *state, batch.cu(), batch.lens(), batch.slot_tensor(), *whole, params);
  }
  OwnedTensor pieces(DType::kF32, {tokens, channels});
  OwnedTensor state(DType::kF32, {1, history, channels});
  int32_t done = 0;
  for (int32_t chunk : {2, 1, 1, 5, 9, 1, 1, 1, 19}) {
    Ragged batch;
    batch.add(chunk, done, 0);
    params.residual = res->slice(0, done, done + chunk);
    kernels::causal_conv1d(x->slice(0, done, done + chunk), *weight, *state, batch.cu(), batch.lens(),
                           batch.slot_tensor(), pieces->slice(0, done, done + chunk), params);
    done += chunk;
  }
  ASSERT_EQ(done, tokens);
  EXPECT_EQ(testing::to_doubles(*pieces), testing::to_doubles(*whole));
}

TEST(CausalConv1dDilated, Bf16RoundsAfterTheConvTheActivationAndTheAdd) {
  Random rng(44);
  const int64_t channels = 16, kernel = 2, dilation = 2, tokens = 6;
  const OwnedTensor x = testing::random_tensor(DType::kBF16, {tokens, channels}, rng, -3.0f, 3.0f);
  const OwnedTensor res = testing::random_tensor(DType::kBF16, {tokens, channels}, rng, -3.0f, 3.0f);
  const OwnedTensor weight = testing::random_tensor(DType::kBF16, {channels, kernel}, rng);
  OwnedTensor state(DType::kBF16, {1, (kernel - 1) * dilation, channels});
  OwnedTensor out(DType::kBF16, {tokens, channels});
  Ragged batch;
  batch.add(static_cast<int32_t>(tokens), 0, 0);
  kernels::CausalConv1dParams params;
  params.dilation = static_cast<int>(dilation);
  params.residual = *res;
  kernels::causal_conv1d(*x, *weight, *state, batch.cu(), batch.lens(), batch.slot_tensor(), *out, params);
  const std::vector<double> xv = testing::to_doubles(*x), rv = testing::to_doubles(*res), wv = testing::to_doubles(*weight);
  const auto bf = [](double v) { return static_cast<double>(round_to_bf16(static_cast<float>(v))); };
  std::vector<double> expected;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      const double previous = t >= dilation ? xv[static_cast<size_t>((t - dilation) * channels + c)] : 0.0;
      const double conv = bf(wv[static_cast<size_t>(c * kernel)] * previous + wv[static_cast<size_t>(c * kernel + 1)] * xv[static_cast<size_t>(t * channels + c)]);
      expected.push_back(bf(rv[static_cast<size_t>(t * channels + c)] + bf(silu(conv))));
    }
  }
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, 1e-4));
}

}  // namespace
}  // namespace metrale
