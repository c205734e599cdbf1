// The Gated DeltaNet kernels on the CPU (causal_conv1d, gdn_gates, gated_delta_rule_{chunked,recurrent},
// gated_rms_norm) and gated attention's sigmoid_gate against direct double-precision formulas (qwen.md §3.1,
// §6.2-§6.6), and against each other: chunked vs recurrent, ragged batches vs each sequence alone, one long call vs
// consecutive calls that continue from the state slot.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"
#include "kernels/gated_rms_norm.h"
#include "kernels/kernel_helpers.h"
#include "kernels/sigmoid_gate.h"

namespace metrale {
namespace {

using testing::Random;

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double silu(double x) {
  return x * sigmoid(x);
}

// ---------------------------------------------------------------------------------------------
// Ragged-batch metadata owned by a test.

struct RaggedBatch {
  std::vector<int32_t> cu_q{0}, kv_lens, slots;
  Tensor cu() { return Tensor(cu_q.data(), DType::kI32, {static_cast<int64_t>(cu_q.size())}); }
  Tensor lens() { return Tensor(kv_lens.data(), DType::kI32, {static_cast<int64_t>(kv_lens.size())}); }
  Tensor state_slots() { return Tensor(slots.data(), DType::kI32, {static_cast<int64_t>(slots.size())}); }
  int64_t tokens() const { return cu_q.back(); }
  int64_t q_len(size_t s) const { return cu_q[s + 1] - cu_q[s]; }
  int64_t ctx(size_t s) const { return kv_lens[s] - q_len(s); }
  void add(int32_t q_len, int32_t ctx, int32_t slot) {
    cu_q.push_back(cu_q.back() + q_len);
    kv_lens.push_back(ctx + q_len);
    slots.push_back(slot);
  }
};

// ---------------------------------------------------------------------------------------------
// causal_conv1d

// out[t, c] = act(sum_j w[c, j] * window[t + j][c]) with window = (zero or given history of K-1 rows) ++ x.
std::vector<double> reference_conv(const std::vector<double>& history, const std::vector<double>& x,
                                   const std::vector<double>& w, int64_t channels, int64_t kernel, bool act) {
  std::vector<double> window = history;
  window.insert(window.end(), x.begin(), x.end());
  const int64_t rows = static_cast<int64_t>(x.size()) / channels;
  std::vector<double> out(x.size());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < channels; ++c) {
      double sum = 0.0;
      for (int64_t j = 0; j < kernel; ++j)
        sum += w[static_cast<size_t>(c * kernel + j)] * window[static_cast<size_t>((t + j) * channels + c)];
      out[static_cast<size_t>(t * channels + c)] = act ? silu(sum) : sum;
    }
  return out;
}

TEST(CausalConv1d, RaggedBatchMatchesDirectFormulaAndKeepsLastInputs) {
  Random rng(11);
  const int64_t channels = 300, kernel = 4, history = kernel - 1, num_slots = 5;  // 300: two channel blocks
  // (q_len, ctx, slot): a fresh prefill whose slot holds NaN, a continuation, a decode row, a continuation
  // shorter than K-1 (the state shifts by one row), and a fresh sequence shorter than K-1 (zero padding kept).
  RaggedBatch batch;
  batch.add(9, 0, 3);
  batch.add(6, 5, 0);
  batch.add(1, 17, 4);
  batch.add(1, 2, 1);
  batch.add(2, 0, 2);
  const int64_t tokens = batch.tokens();
  // x is a column slice of a wider projection (strided rows).
  const OwnedTensor projection = testing::random_tensor(DType::kF32, {tokens, channels + 7}, rng);
  const Tensor x = projection->slice(1, 3, 3 + channels);
  const OwnedTensor weight = testing::random_tensor(DType::kBF16, {channels, 1, kernel}, rng, -0.7f, 0.7f);
  OwnedTensor state(DType::kF32, {num_slots, history, channels});
  testing::fill_random(*state, rng);
  for (const int64_t fresh_slot : {3, 2}) testing::poison(state->select(0, fresh_slot));
  const std::vector<double> state_before = testing::to_doubles(*state);
  const std::vector<double> w = testing::to_doubles(*weight);
  const std::vector<double> xs = testing::to_doubles(x);

  for (const bool act : {true, false}) {
    OwnedTensor slots_state(DType::kF32, state->shape());
    testing::fill(*slots_state, std::vector<float>(state_before.begin(), state_before.end()));
    OwnedTensor out(DType::kF32, {tokens, channels});
    testing::poison(*out);
    kernels::causal_conv1d(x, *weight, *slots_state, batch.cu(), batch.lens(), batch.state_slots(), *out, {act, 0});
    const std::vector<double> got = testing::to_doubles(*out);
    const std::vector<double> got_state = testing::to_doubles(*slots_state);
    for (size_t s = 0; s < batch.slots.size(); ++s) {
      const size_t slot_elems = static_cast<size_t>(history * channels);
      const size_t slot_begin = static_cast<size_t>(batch.slots[s]) * slot_elems;
      std::vector<double> hist(slot_elems, 0.0);
      if (batch.ctx(s) > 0)
        hist.assign(state_before.begin() + static_cast<ptrdiff_t>(slot_begin),
                    state_before.begin() + static_cast<ptrdiff_t>(slot_begin + slot_elems));
      const auto row0 = static_cast<size_t>(batch.cu_q[s] * channels);
      const auto row1 = static_cast<size_t>(batch.cu_q[s + 1] * channels);
      const std::vector<double> xseq(xs.begin() + static_cast<ptrdiff_t>(row0),
                                     xs.begin() + static_cast<ptrdiff_t>(row1));
      const std::vector<double> expected = reference_conv(hist, xseq, w, channels, kernel, act);
      const std::vector<double> actual(got.begin() + static_cast<ptrdiff_t>(row0),
                                       got.begin() + static_cast<ptrdiff_t>(row1));
      EXPECT_TRUE(testing::close_rel_l2(actual, expected, testing::kF32Tolerance)) << "sequence " << s;
      // The slot now holds the last K-1 rows of hist ++ x.
      std::vector<double> window = hist;
      window.insert(window.end(), xseq.begin(), xseq.end());
      const std::vector<double> expected_state(window.end() - static_cast<ptrdiff_t>(slot_elems), window.end());
      const std::vector<double> actual_state(got_state.begin() + static_cast<ptrdiff_t>(slot_begin),
                                             got_state.begin() + static_cast<ptrdiff_t>(slot_begin + slot_elems));
      EXPECT_EQ(actual_state, expected_state) << "state of sequence " << s;
    }
  }
}

TEST(CausalConv1d, TokenByTokenEqualsOneCall) {
  Random rng(12);
  const int64_t channels = 40, kernel = 4, tokens = 11;
  const OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, channels}, rng);
  const OwnedTensor weight = testing::random_tensor(DType::kF32, {channels, kernel}, rng);
  OwnedTensor whole_state(DType::kF32, {1, kernel - 1, channels}), step_state(DType::kF32, {1, kernel - 1, channels});
  testing::poison(*whole_state);
  testing::poison(*step_state);
  OwnedTensor whole(DType::kF32, {tokens, channels}), steps(DType::kF32, {tokens, channels});
  RaggedBatch one;
  one.add(static_cast<int32_t>(tokens), 0, 0);
  kernels::causal_conv1d(*x, *weight, *whole_state, one.cu(), one.lens(), one.state_slots(), *whole, {});
  for (int32_t t = 0; t < tokens; ++t) {
    RaggedBatch step;
    step.add(1, t, 0);
    kernels::causal_conv1d(x->slice(0, t, t + 1), *weight, *step_state, step.cu(), step.lens(), step.state_slots(),
                           steps->slice(0, t, t + 1), {});
  }
  EXPECT_EQ(testing::to_doubles(*steps), testing::to_doubles(*whole));
  EXPECT_EQ(testing::to_doubles(*step_state), testing::to_doubles(*whole_state));
}

// ---------------------------------------------------------------------------------------------
// gdn_gates and gated_rms_norm

TEST(GdnGates, MatchDirectFormula) {
  Random rng(13);
  const int64_t tokens = 9, heads = 6;
  const OwnedTensor ab = testing::random_tensor(DType::kF32, {tokens, 2 * heads + 1}, rng, -4.0f, 4.0f);
  const Tensor b = ab->slice(1, 0, heads), a = ab->slice(1, heads, 2 * heads);
  // One value past softplus' linear threshold (x > 20 returns x).
  testing::fill(a.slice(0, 0, 1).slice(1, 0, 1), std::vector<float>{25.0f});
  const OwnedTensor a_log = testing::random_tensor(DType::kBF16, {heads}, rng, -1.0f, 2.0f);
  const OwnedTensor dt_bias = testing::random_tensor(DType::kBF16, {heads}, rng, -1.0f, 1.0f);
  OwnedTensor g(DType::kF32, {tokens, heads}), beta(DType::kF32, {tokens, heads});
  testing::poison(*g);
  testing::poison(*beta);
  kernels::gdn_gates(a, b, *a_log, *dt_bias, *g, *beta);
  const auto as = testing::to_doubles(a), bs = testing::to_doubles(b), al = testing::to_doubles(*a_log),
             dt = testing::to_doubles(*dt_bias);
  std::vector<double> want_g(as.size()), want_beta(as.size());
  for (size_t i = 0; i < as.size(); ++i) {
    const size_t h = i % static_cast<size_t>(heads);
    const double x = as[i] + dt[h];
    want_g[i] = -std::exp(al[h]) * (x > 20.0 ? x : std::log1p(std::exp(x)));
    want_beta[i] = sigmoid(bs[i]);
  }
  EXPECT_TRUE(testing::close_rel_l2(*g, want_g, testing::kF32Tolerance));
  EXPECT_TRUE(testing::close_rel_l2(*beta, want_beta, testing::kF32Tolerance));
  for (const double value : testing::to_doubles(*g)) EXPECT_LE(value, 0.0);
}

TEST(GatedRmsNorm, MatchesDirectFormulaInPlace) {
  Random rng(14);
  const int64_t tokens = 5, heads = 3, width = 20;
  OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, heads, width}, rng, -2.0f, 2.0f);
  const OwnedTensor zproj = testing::random_tensor(DType::kF32, {tokens, heads * width + 4}, rng, -3.0f, 3.0f);
  const Tensor z(zproj->slice(1, 4, 4 + heads * width).data(), DType::kF32, {tokens, heads, width},
                 {zproj->stride(0), width, 1}, Device::cpu());
  const OwnedTensor weight = testing::random_tensor(DType::kBF16, {width}, rng, 0.5f, 1.5f);
  const auto xs = testing::to_doubles(*x), zs = testing::to_doubles(z), ws = testing::to_doubles(*weight);
  const float eps = 1e-6f;
  std::vector<double> want(xs.size());
  for (size_t row = 0; row < xs.size() / static_cast<size_t>(width); ++row) {
    double sum = 0.0;
    for (int64_t i = 0; i < width; ++i)
      sum += xs[row * static_cast<size_t>(width) + static_cast<size_t>(i)] *
             xs[row * static_cast<size_t>(width) + static_cast<size_t>(i)];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
    for (int64_t i = 0; i < width; ++i) {
      const size_t at = row * static_cast<size_t>(width) + static_cast<size_t>(i);
      want[at] = ws[static_cast<size_t>(i)] * xs[at] * inv * silu(zs[at]);
    }
  }
  kernels::gated_rms_norm(*x, z, *weight, *x, eps);
  EXPECT_TRUE(testing::close_rel_l2(*x, want, testing::kF32Tolerance));
}

// Gated attention's output gate: the gate is the strided second half of each head of q_proj's output.
TEST(SigmoidGate, MatchesDirectFormulaWithAStridedGate) {
  Random rng(15);
  const int64_t tokens = 4, heads = 3, width = 8;
  const OwnedTensor projection = testing::random_tensor(DType::kF32, {tokens, 2 * heads * width + 5}, rng, -4.0f, 4.0f);
  const Tensor gate(projection->slice(1, width, 2 * heads * width).data(), DType::kF32, {tokens, heads, width},
                    {projection->stride(0), 2 * width, 1}, Device::cpu());
  OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, heads, width}, rng);
  const auto xs = testing::to_doubles(*x), gs = testing::to_doubles(gate);
  std::vector<double> want(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) want[i] = xs[i] * sigmoid(gs[i]);
  kernels::sigmoid_gate(*x, gate, *x);
  EXPECT_TRUE(testing::close_rel_l2(*x, want, testing::kF32Tolerance));
}

// ---------------------------------------------------------------------------------------------
// The delta rule

// One delta-rule call's inputs as views: q, k, v [T, heads, dim] and the gates [T, Hv].
struct DeltaView {
  int64_t hk = 0, hv = 0, dk = 0, dv = 0;
  Tensor q, k, v, g, beta;
  // Rows [begin, end) of the same inputs.
  DeltaView rows(int64_t begin, int64_t end) const {
    DeltaView part = *this;
    part.q = q.slice(0, begin, end);
    part.k = k.slice(0, begin, end);
    part.v = v.slice(0, begin, end);
    part.g = g.slice(0, begin, end);
    part.beta = beta.slice(0, begin, end);
    return part;
  }
};

// Random inputs: q, k, v are column slices of one projection output [T, conv_dim + pad] (as the GDN
// mixer passes them); decays in (-1.5, -0.005) so that states neither vanish nor explode.
struct DeltaInputs {
  OwnedTensor qkv, g, beta;
  DeltaView view;

  DeltaInputs(int64_t tokens, int64_t hk, int64_t hv, int64_t dk, int64_t dv, Random& rng) {
    qkv = testing::random_tensor(DType::kF32, {tokens, 2 * hk * dk + hv * dv + 3}, rng);
    g = testing::random_tensor(DType::kF32, {tokens, hv}, rng, -1.5f, -0.005f);
    beta = testing::random_tensor(DType::kF32, {tokens, hv}, rng, 0.05f, 0.95f);
    const int64_t row = qkv->stride(0);
    char* base = static_cast<char*>(qkv->data());
    view = {hk,
            hv,
            dk,
            dv,
            Tensor(base, DType::kF32, {tokens, hk, dk}, {row, dk, 1}, Device::cpu()),
            Tensor(base + hk * dk * 4, DType::kF32, {tokens, hk, dk}, {row, dk, 1}, Device::cpu()),
            Tensor(base + 2 * hk * dk * 4, DType::kF32, {tokens, hv, dv}, {row, dv, 1}, Device::cpu()),
            *g,
            *beta};
  }
};

// Direct formula (qwen.md §6.5) in double for rows [r0, r1) of one sequence from `initial` [Hv, dk, dv];
// returns outputs [rows, Hv, dv] and leaves the final state in `state` (and each row's in `row_states`).
std::vector<double> reference_delta(const DeltaView& in, int64_t r0, int64_t r1, std::vector<double>& state,
                                    float scale, std::vector<double>* row_states = nullptr) {
  const auto qs = testing::to_doubles(in.q), ks = testing::to_doubles(in.k), vs = testing::to_doubles(in.v);
  const auto gs = testing::to_doubles(in.g), bs = testing::to_doubles(in.beta);
  const int64_t hv = in.hv, dk = in.dk, dv = in.dv, ratio = in.hv / in.hk;
  std::vector<double> out(static_cast<size_t>((r1 - r0) * hv * dv));
  const auto l2 = [&](const std::vector<double>& src, int64_t t, int64_t head) {
    std::vector<double> x(static_cast<size_t>(dk));
    double sum = 0.0;
    for (int64_t a = 0; a < dk; ++a) {
      x[static_cast<size_t>(a)] = src[static_cast<size_t>((t * in.hk + head) * dk + a)];
      sum += x[static_cast<size_t>(a)] * x[static_cast<size_t>(a)];
    }
    for (auto& value : x) value /= std::sqrt(sum + 1e-6);
    return x;
  };
  for (int64_t t = r0; t < r1; ++t) {
    for (int64_t h = 0; h < hv; ++h) {
      std::vector<double> qn = l2(qs, t, h / ratio);
      const std::vector<double> kn = l2(ks, t, h / ratio);
      for (auto& value : qn) value *= scale;
      double* S = state.data() + h * dk * dv;
      const double decay = std::exp(gs[static_cast<size_t>(t * hv + h)]), bt = bs[static_cast<size_t>(t * hv + h)];
      for (int64_t i = 0; i < dk * dv; ++i) S[i] *= decay;
      for (int64_t c = 0; c < dv; ++c) {
        double m = 0.0;
        for (int64_t a = 0; a < dk; ++a) m += S[a * dv + c] * kn[static_cast<size_t>(a)];
        const double delta = (vs[static_cast<size_t>((t * hv + h) * dv + c)] - m) * bt;
        for (int64_t a = 0; a < dk; ++a) S[a * dv + c] += kn[static_cast<size_t>(a)] * delta;
      }
      for (int64_t c = 0; c < dv; ++c) {
        double o = 0.0;
        for (int64_t a = 0; a < dk; ++a) o += S[a * dv + c] * qn[static_cast<size_t>(a)];
        out[static_cast<size_t>(((t - r0) * hv + h) * dv + c)] = o;
      }
    }
    if (row_states != nullptr) {
      row_states->insert(row_states->end(), state.begin(), state.end());
    }
  }
  return out;
}

enum class Form { kChunked, kRecurrent };

void run_delta(Form form, const DeltaView& in, RaggedBatch& batch, const Tensor& state, const Tensor& out, float scale,
               const Tensor& row_states = Tensor(), bool write_state = true) {
  kernels::GatedDeltaRuleParams params;
  params.scale = scale;
  params.row_states = row_states;
  params.write_state = write_state;
  if (form == Form::kChunked) {
    kernels::gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, state, batch.cu(), batch.lens(),
                                      batch.state_slots(), out, params);
  } else {
    kernels::gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, state, batch.cu(), batch.lens(),
                                        batch.state_slots(), out, params);
  }
}

std::vector<double> slot_values(const Tensor& state, int64_t slot) {
  return testing::to_doubles(state.select(0, slot));
}

class DeltaRuleForms : public ::testing::TestWithParam<Form> {};

// A ragged batch of fresh and continuing sequences (slot order scrambled, a fresh sequence's slot full of
// NaN) against the direct formula, outputs and final states; dk != dv and Hv = 2 Hk catch transposes and
// the key-head mapping. 150 rows cross two chunk boundaries.
TEST_P(DeltaRuleForms, RaggedBatchMatchesDirectFormula) {
  Random rng(21);
  const int64_t hk = 2, hv = 4, dk = 16, dv = 8, num_slots = 5;
  RaggedBatch batch;
  batch.add(150, 0, 3);
  batch.add(1, 9, 0);
  batch.add(70, 33, 4);
  batch.add(5, 0, 1);
  const DeltaInputs inputs(batch.tokens(), hk, hv, dk, dv, rng);
  const DeltaView& in = inputs.view;
  OwnedTensor state = testing::random_tensor(DType::kF32, {num_slots, hv, dk, dv}, rng, -0.5f, 0.5f);
  for (const int64_t fresh_slot : {3, 1}) testing::poison(state->select(0, fresh_slot));
  std::vector<std::vector<double>> initial;
  for (int64_t slot = 0; slot < num_slots; ++slot) initial.push_back(slot_values(*state, slot));
  OwnedTensor out(DType::kF32, {batch.tokens(), hv, dv});
  testing::poison(*out);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  run_delta(GetParam(), in, batch, *state, *out, scale);
  const std::vector<double> got = testing::to_doubles(*out);
  for (size_t s = 0; s < batch.slots.size(); ++s) {
    std::vector<double> S = batch.ctx(s) > 0 ? initial[static_cast<size_t>(batch.slots[s])]
                                             : std::vector<double>(static_cast<size_t>(hv * dk * dv), 0.0);
    const std::vector<double> expected = reference_delta(in, batch.cu_q[s], batch.cu_q[s + 1], S, scale);
    const auto begin = static_cast<ptrdiff_t>(batch.cu_q[s] * hv * dv);
    const std::vector<double> actual(got.begin() + begin,
                                     got.begin() + begin + static_cast<ptrdiff_t>(expected.size()));
    EXPECT_TRUE(testing::close_rel_l2(actual, expected, 1e-5)) << "outputs of sequence " << s;
    EXPECT_TRUE(testing::close_rel_l2(slot_values(*state, batch.slots[s]), S, 1e-5)) << "state of sequence " << s;
  }
  EXPECT_EQ(slot_values(*state, 2), initial[2]) << "a slot no sequence uses is untouched";
}

// Each sequence of a ragged batch gives exactly what it gives alone.
TEST_P(DeltaRuleForms, BatchedEqualsAlone) {
  Random rng(22);
  const int64_t hk = 1, hv = 2, dk = 32, dv = 32;
  RaggedBatch batch;
  batch.add(67, 0, 1);
  batch.add(3, 12, 0);
  batch.add(130, 0, 2);
  const DeltaInputs inputs(batch.tokens(), hk, hv, dk, dv, rng);
  const DeltaView& in = inputs.view;
  const OwnedTensor initial = testing::random_tensor(DType::kF32, {3, hv, dk, dv}, rng, -0.5f, 0.5f);
  OwnedTensor state(DType::kF32, initial->shape());
  copy_tensor(*state, *initial);
  OwnedTensor out(DType::kF32, {batch.tokens(), hv, dv});
  run_delta(GetParam(), in, batch, *state, *out, 0.3f);
  for (size_t s = 0; s < batch.slots.size(); ++s) {
    RaggedBatch alone;
    alone.add(static_cast<int32_t>(batch.q_len(s)), static_cast<int32_t>(batch.ctx(s)), 0);
    OwnedTensor alone_state(DType::kF32, {1, hv, dk, dv});
    copy_tensor(*alone_state, initial->slice(0, batch.slots[s], batch.slots[s] + 1));
    OwnedTensor alone_out(DType::kF32, {batch.q_len(s), hv, dv});
    run_delta(GetParam(), in.rows(batch.cu_q[s], batch.cu_q[s + 1]), alone, *alone_state, *alone_out, 0.3f);
    EXPECT_EQ(testing::to_doubles(*alone_out), testing::to_doubles(out->slice(0, batch.cu_q[s], batch.cu_q[s + 1])))
        << "sequence " << s;
    EXPECT_EQ(testing::to_doubles(*alone_state), slot_values(*state, batch.slots[s])) << "sequence " << s;
  }
}

// One call over 200 rows equals consecutive calls of 40, 1, 64 and 95 rows that continue from the slot.
TEST_P(DeltaRuleForms, ContinuingFromTheSlotEqualsOneCall) {
  Random rng(23);
  const int64_t hk = 2, hv = 2, dk = 64, dv = 64, tokens = 200;
  const DeltaInputs inputs(tokens, hk, hv, dk, dv, rng);
  const DeltaView& in = inputs.view;
  const float scale = 0.125f;
  OwnedTensor whole_state(DType::kF32, {1, hv, dk, dv});
  testing::poison(*whole_state);
  OwnedTensor whole(DType::kF32, {tokens, hv, dv});
  RaggedBatch one;
  one.add(static_cast<int32_t>(tokens), 0, 0);
  run_delta(GetParam(), in, one, *whole_state, *whole, scale);

  OwnedTensor parts_state(DType::kF32, {2, hv, dk, dv});
  testing::poison(*parts_state);
  OwnedTensor parts(DType::kF32, {tokens, hv, dv});
  int32_t done = 0;
  for (const int32_t len : {40, 1, 64, 95}) {
    RaggedBatch part;
    part.add(len, done, 1);
    run_delta(GetParam(), in.rows(done, done + len), part, *parts_state, parts->slice(0, done, done + len), scale);
    done += len;
  }
  EXPECT_TRUE(testing::close_rel_l2(*parts, testing::to_doubles(*whole), 1e-5));
  EXPECT_TRUE(testing::close_rel_l2(parts_state->select(0, 1), slot_values(*whole_state, 0), 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Forms, DeltaRuleForms, ::testing::Values(Form::kChunked, Form::kRecurrent),
                         [](const auto& param_info) {
                           return param_info.param == Form::kChunked ? "Chunked" : "Recurrent";
                         });

// The two forms compute the same thing (qwen.md §6.6: ~1e-7 relative in fp32), at the production head size.
TEST(DeltaRule, ChunkedAgreesWithRecurrent) {
  Random rng(24);
  const int64_t hk = 1, hv = 2, dk = 128, dv = 128;
  RaggedBatch batch;
  batch.add(129, 0, 0);
  batch.add(64, 20, 1);
  const DeltaInputs inputs(batch.tokens(), hk, hv, dk, dv, rng);
  const DeltaView& in = inputs.view;
  const OwnedTensor initial = testing::random_tensor(DType::kF32, {2, hv, dk, dv}, rng, -0.5f, 0.5f);
  OwnedTensor chunked_state(DType::kF32, initial->shape()), recurrent_state(DType::kF32, initial->shape());
  copy_tensor(*chunked_state, *initial);
  copy_tensor(*recurrent_state, *initial);
  OwnedTensor chunked(DType::kF32, {batch.tokens(), hv, dv}), recurrent(DType::kF32, {batch.tokens(), hv, dv});
  const float scale = 1.0f / std::sqrt(128.0f);
  run_delta(Form::kChunked, in, batch, *chunked_state, *chunked, scale);
  run_delta(Form::kRecurrent, in, batch, *recurrent_state, *recurrent, scale);
  EXPECT_TRUE(testing::close_rel_l2(*chunked, testing::to_doubles(*recurrent), 1e-5));
  EXPECT_TRUE(testing::close_rel_l2(*chunked_state, testing::to_doubles(*recurrent_state), 1e-5));
}

// Speculative verify: row t of row_states holds the state after token t; the slot the state after the last.
TEST(DeltaRule, RecurrentRowStatesHoldTheStateAfterEveryRow) {
  Random rng(25);
  const int64_t hk = 1, hv = 2, dk = 8, dv = 4;
  RaggedBatch batch;
  batch.add(3, 5, 1);
  batch.add(4, 0, 0);
  const DeltaInputs inputs(batch.tokens(), hk, hv, dk, dv, rng);
  const DeltaView& in = inputs.view;
  OwnedTensor state = testing::random_tensor(DType::kF32, {2, hv, dk, dv}, rng, -0.5f, 0.5f);
  const std::vector<double> initial = slot_values(*state, 1);
  OwnedTensor out(DType::kF32, {batch.tokens(), hv, dv});
  OwnedTensor row_states(DType::kF32, {batch.tokens(), hv, dk, dv});
  testing::poison(*row_states);
  run_delta(Form::kRecurrent, in, batch, *state, *out, 0.5f, *row_states);
  std::vector<double> expected_rows;
  std::vector<double> S = initial;
  reference_delta(in, 0, 3, S, 0.5f, &expected_rows);
  std::vector<double> S0(initial.size(), 0.0);
  reference_delta(in, 3, 7, S0, 0.5f, &expected_rows);
  EXPECT_TRUE(testing::close_rel_l2(*row_states, expected_rows, 1e-5));
  EXPECT_TRUE(testing::close_rel_l2(slot_values(*state, 1), S, 1e-5));
  EXPECT_TRUE(testing::close_rel_l2(slot_values(*state, 0), S0, 1e-5));
}

// Speculative verify reads the slots without writing them; its commit runs the rejected rows of a
// sequence as a part without a slot (-1): from zero state, nothing kept.
TEST(DeltaRule, RecurrentReadOnlySlotsAndSlotlessParts) {
  Random rng(26);
  const int64_t hk = 1, hv = 2, dk = 8, dv = 4;
  RaggedBatch batch;
  batch.add(3, 5, 1);
  batch.add(2, 2, -1);
  const DeltaInputs inputs(batch.tokens(), hk, hv, dk, dv, rng);
  const DeltaView& in = inputs.view;
  OwnedTensor state = testing::random_tensor(DType::kF32, {2, hv, dk, dv}, rng, -0.5f, 0.5f);
  const std::vector<double> before = testing::to_doubles(*state);
  OwnedTensor out(DType::kF32, {batch.tokens(), hv, dv});
  run_delta(Form::kRecurrent, in, batch, *state, *out, 0.5f, Tensor(), /*write_state=*/false);
  EXPECT_EQ(testing::to_doubles(*state), before) << "read-only slots changed";
  std::vector<double> S = slot_values(*state, 1);
  std::vector<double> expected_rows;
  reference_delta(in, 0, 3, S, 0.5f, &expected_rows);
  // The outputs (not the states) of the same rows, written again by a writing call: equal.
  OwnedTensor again(DType::kF32, {batch.tokens(), hv, dv});
  run_delta(Form::kRecurrent, in, batch, *state, *again, 0.5f);
  EXPECT_EQ(testing::to_doubles(*again), testing::to_doubles(*out));
  EXPECT_TRUE(testing::close_rel_l2(slot_values(*state, 1), S, 1e-5)) << "slot 1 advanced over its rows";
  EXPECT_EQ(slot_values(*state, 0), std::vector<double>(before.begin(), before.begin() + hv * dk * dv))
      << "slot 0 belongs to no sequence (the slotless part writes nowhere)";
}

TEST(DeltaRule, WorkspaceIsZeroOnTheCpu) {
  EXPECT_EQ(kernels::gated_delta_rule_workspace_bytes(Device::cpu(), 1024, 4, 32, 128, 128), 0u);
}

}  // namespace
}  // namespace metrale
