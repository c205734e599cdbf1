// The Kimi Delta Attention kernels on the CPU (kda_gates, kda_recurrent, kda_chunked, the sigmoid
// form of gated_rms_norm and the once-rounded causal_conv1d) against direct double-precision
// formulas (glm_deepseek.md §2.5), and against each other: chunked vs recurrent, ragged batches vs
// each sequence alone, one long call vs consecutive calls continuing from the state slot, final
// states included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/causal_conv1d.h"
#include "kernels/gated_rms_norm.h"
#include "kernels/kda.h"
#include "kernels/kernel_helpers.h"
#include "kernels/ragged_batch.h"

namespace metrale {
namespace {

using testing::RaggedBatch;
using testing::Random;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The inputs of one KDA call, f32 (the CPU activation dtype), with q, k, v as column slices of one
// conv output [T, 3 * H * d] as the model passes them.
struct KdaInputs {
  int64_t tokens, heads, dk, dv;
  OwnedTensor conv, f, b, A_log, dt_bias;
  Tensor q, k, v;
  KdaInputs(Random& rng, int64_t t, int64_t h, int64_t d_k, int64_t d_v, float gate_lo, float gate_hi)
      : tokens(t), heads(h), dk(d_k), dv(d_v),
        conv(testing::random_tensor(DType::kF32, {t, h * (2 * d_k + d_v)}, rng)),
        f(testing::random_tensor(DType::kF32, {t, h * d_k}, rng, gate_lo, gate_hi)),
        b(testing::random_tensor(DType::kF32, {t, h}, rng, -3.0f, 3.0f)),
        A_log(testing::random_tensor(DType::kF32, {h}, rng, -0.5f, 1.0f)),
        dt_bias(testing::random_tensor(DType::kF32, {h * d_k}, rng, -1.0f, 1.0f)) {
    q = testing::split_heads(conv->slice(1, 0, h * d_k), h, d_k);
    k = testing::split_heads(conv->slice(1, h * d_k, 2 * h * d_k), h, d_k);
    v = testing::split_heads(conv->slice(1, 2 * h * d_k, h * (2 * d_k + d_v)), h, d_v);
  }
};

struct GateValues {
  std::vector<double> g, beta;  // [T, H, dk], [T, H]
};

GateValues reference_gates(const KdaInputs& in, const kernels::KdaParams& params) {
  const std::vector<double> f = testing::to_doubles(*in.f), b = testing::to_doubles(*in.b);
  const std::vector<double> A_log = testing::to_doubles(*in.A_log), bias = testing::to_doubles(*in.dt_bias);
  GateValues gates;
  gates.g.resize(static_cast<size_t>(in.tokens * in.heads * in.dk));
  gates.beta.resize(static_cast<size_t>(in.tokens * in.heads));
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int64_t h = 0; h < in.heads; ++h) {
      const double rate = std::exp(A_log[static_cast<size_t>(h)]);
      for (int64_t d = 0; d < in.dk; ++d) {
        const size_t i = static_cast<size_t>((t * in.heads + h) * in.dk + d);
        const double phi = f[i] + bias[static_cast<size_t>(h * in.dk + d)];
        gates.g[i] = params.has_lower_bound ? params.lower_bound * sigmoid(rate * phi)
                                            : -rate * (phi > 20.0 ? phi : std::log1p(std::exp(phi)));
      }
      gates.beta[static_cast<size_t>(t * in.heads + h)] = sigmoid(b[static_cast<size_t>(t * in.heads + h)]);
    }
  }
  return gates;
}

struct KdaResult {
  std::vector<double> out;                  // [T, H, dv]
  std::vector<std::vector<double>> states;  // per sequence [H, dk, dv]
};

// The recurrence of §2.5 in double for every sequence of the batch, each starting from its slot in
// `slots_before` (or zero when it has no cached tokens or no slot).
KdaResult reference_kda(const KdaInputs& in, RaggedBatch& batch, const std::vector<double>& slots_before,
                        const kernels::KdaParams& params) {
  const GateValues gates = reference_gates(in, params);
  const std::vector<double> q = testing::to_doubles(in.q), k = testing::to_doubles(in.k), v = testing::to_doubles(in.v);
  const int64_t H = in.heads, dk = in.dk, dv = in.dv, state_size = H * dk * dv;
  KdaResult result;
  result.out.assign(static_cast<size_t>(in.tokens * H * dv), 0.0);
  for (int64_t s = 0; s < batch.size(); ++s) {
    std::vector<double> S(static_cast<size_t>(state_size), 0.0);
    const int32_t slot = batch.slots[static_cast<size_t>(s)];
    if (batch.ctx(s) > 0 && slot >= 0) {
      std::copy_n(slots_before.begin() + slot * state_size, state_size, S.begin());
    }
    for (int64_t t = batch.cu_q[static_cast<size_t>(s)]; t < batch.cu_q[static_cast<size_t>(s) + 1]; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> qh(static_cast<size_t>(dk)), kh(static_cast<size_t>(dk));
        double qq = 0.0, kk = 0.0;
        for (int64_t d = 0; d < dk; ++d) {
          qh[static_cast<size_t>(d)] = q[static_cast<size_t>((t * H + h) * dk + d)];
          kh[static_cast<size_t>(d)] = k[static_cast<size_t>((t * H + h) * dk + d)];
          qq += qh[static_cast<size_t>(d)] * qh[static_cast<size_t>(d)];
          kk += kh[static_cast<size_t>(d)] * kh[static_cast<size_t>(d)];
        }
        for (int64_t d = 0; d < dk; ++d) {
          qh[static_cast<size_t>(d)] *= params.scale / std::sqrt(qq + 1e-6);
          kh[static_cast<size_t>(d)] /= std::sqrt(kk + 1e-6);
        }
        double* Sh = S.data() + h * dk * dv;
        for (int64_t d = 0; d < dk; ++d) {
          const double decay = std::exp(gates.g[static_cast<size_t>((t * H + h) * dk + d)]);
          for (int64_t c = 0; c < dv; ++c) Sh[d * dv + c] *= decay;
        }
        const double beta = gates.beta[static_cast<size_t>(t * H + h)];
        for (int64_t c = 0; c < dv; ++c) {
          double memory = 0.0;
          for (int64_t d = 0; d < dk; ++d) memory += Sh[d * dv + c] * kh[static_cast<size_t>(d)];
          const double delta = beta * (v[static_cast<size_t>((t * H + h) * dv + c)] - memory);
          double o = 0.0;
          for (int64_t d = 0; d < dk; ++d) {
            Sh[d * dv + c] += kh[static_cast<size_t>(d)] * delta;
            o += Sh[d * dv + c] * qh[static_cast<size_t>(d)];
          }
          result.out[static_cast<size_t>((t * H + h) * dv + c)] = o;
        }
      }
    }
    result.states.push_back(S);
  }
  return result;
}

std::vector<double> slot_values(const std::vector<double>& all, int64_t slot, int64_t size) {
  return {all.begin() + slot * size, all.begin() + (slot + 1) * size};
}

using KdaOp = void (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const kernels::KdaParams&);

void run(KdaOp op, const KdaInputs& in, RaggedBatch& batch, const Tensor& state, const Tensor& out,
         const kernels::KdaParams& params) {
  op(in.q, in.k, in.v, *in.f, *in.b, *in.A_log, *in.dt_bias, state, batch.cu(), batch.lens(), batch.state_slots(), out,
     params);
}

kernels::KdaParams params_for(int64_t dk, bool lower_bound) {
  kernels::KdaParams params;
  params.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  params.has_lower_bound = lower_bound;
  params.lower_bound = -5.0f;
  return params;
}

// (q_len, ctx, slot) over 5 slots: a fresh multi-chunk prefill whose slot holds NaN, a continuation
// across a chunk boundary, a decode row, a fresh prefill without a slot, a short continuation.
RaggedBatch mixed_batch() {
  RaggedBatch batch;
  batch.add(150, 0, 3);
  batch.add(70, 40, 0);
  batch.add(1, 17, 4);
  batch.add(9, 0, -1);
  batch.add(5, 3, 1);
  return batch;
}

TEST(KdaGates, BothFormsMatchDirectFormula) {
  Random rng(21);
  const KdaInputs in(rng, 37, 3, 16, 8, -4.0f, 4.0f);
  for (const bool lower_bound : {true, false}) {
    const kernels::KdaParams params = params_for(in.dk, lower_bound);
    OwnedTensor g(DType::kF32, {in.tokens, in.heads, in.dk}), beta(DType::kF32, {in.tokens, in.heads});
    testing::poison(*g);
    testing::poison(*beta);
    kernels::kda_gates(*in.f, *in.b, *in.A_log, *in.dt_bias, *g, *beta, params);
    const GateValues expected = reference_gates(in, params);
    EXPECT_TRUE(testing::close_rel_l2(*g, expected.g, testing::kF32Tolerance)) << "lower bound " << lower_bound;
    EXPECT_TRUE(testing::close_rel_l2(*beta, expected.beta, testing::kF32Tolerance));
    for (const double value : testing::to_doubles(*g)) {
      EXPECT_LT(value, 0.0);
      if (lower_bound) {
        EXPECT_GT(value, -5.0);
      }
    }
  }
}

TEST(KdaGates, BetaIsRoundedToTheActivationDtype) {
  Random rng(22);
  const int64_t tokens = 9, heads = 4, dk = 8;
  const OwnedTensor f = testing::random_tensor(DType::kBF16, {tokens, heads * dk}, rng);
  const OwnedTensor b = testing::random_tensor(DType::kBF16, {tokens, heads}, rng, -4.0f, 4.0f);
  const OwnedTensor A_log = testing::random_tensor(DType::kF32, {heads}, rng);
  const OwnedTensor dt_bias = testing::random_tensor(DType::kF32, {heads * dk}, rng);
  OwnedTensor g(DType::kF32, {tokens, heads, dk}), beta(DType::kF32, {tokens, heads});
  kernels::kda_gates(*f, *b, *A_log, *dt_bias, *g, *beta, params_for(dk, true));
  const std::vector<double> logits = testing::to_doubles(*b), got = testing::to_doubles(*beta);
  for (size_t i = 0; i < logits.size(); ++i) {
    const float exact = static_cast<float>(sigmoid(logits[i]));
    EXPECT_EQ(static_cast<float>(got[i]), bf16_bits_to_f32(f32_to_bf16_bits(exact))) << i;
  }
}

// Both forms against the double recurrence on a ragged batch, final states in their slots; the slot
// of a sequence without state (-1) and the untouched slot 2 keep their bytes.
TEST(KdaCore, BothFormsMatchDirectRecurrenceOnRaggedBatch) {
  for (const bool lower_bound : {true, false}) {
    Random rng(lower_bound ? 23 : 24);
    RaggedBatch batch = mixed_batch();
    const KdaInputs in(rng, batch.tokens(), 3, 32, 16, -3.0f, 2.0f);
    const kernels::KdaParams params = params_for(in.dk, lower_bound);
    const int64_t num_slots = 5, state_size = in.heads * in.dk * in.dv;
    OwnedTensor initial(DType::kF32, {num_slots, in.heads, in.dk, in.dv});
    testing::fill_random(*initial, rng, -0.5f, 0.5f);
    testing::poison(initial->select(0, 3));  // fresh sequence: must not be read
    const std::vector<double> before = testing::to_doubles(*initial);
    const KdaResult expected = reference_kda(in, batch, before, params);
    for (const KdaOp op : {KdaOp(&kernels::kda_recurrent), KdaOp(&kernels::kda_chunked)}) {
      const bool chunked = op == KdaOp(&kernels::kda_chunked);
      OwnedTensor state(DType::kF32, initial->shape());
      testing::fill(*state, std::vector<float>(before.begin(), before.end()));
      OwnedTensor out(DType::kF32, {in.tokens, in.heads, in.dv});
      testing::poison(*out);
      run(op, in, batch, *state, *out, params);
      const double tolerance = chunked ? 2e-5 : 1e-5;
      EXPECT_TRUE(testing::close_rel_l2(*out, expected.out, tolerance)) << "chunked " << chunked << " lb " << lower_bound;
      const std::vector<double> after = testing::to_doubles(*state);
      for (int64_t s = 0; s < batch.size(); ++s) {
        const int32_t slot = batch.slots[static_cast<size_t>(s)];
        if (slot < 0) continue;
        EXPECT_TRUE(testing::close_rel_l2(slot_values(after, slot, state_size), expected.states[static_cast<size_t>(s)],
                                          tolerance))
            << "state of sequence " << s << " chunked " << chunked;
      }
      EXPECT_EQ(slot_values(after, 2, state_size), slot_values(before, 2, state_size));
    }
  }
}

// Decays far beyond fp32's range inside one chunk (softplus gate, g ~ -60 per row): the chunked
// form must stay finite and equal to the recurrence (every such term is exactly zero there).
TEST(KdaCore, ChunkedIsStableUnderStrongDecay) {
  Random rng(25);
  RaggedBatch batch;
  batch.add(130, 0, 0);
  KdaInputs in(rng, batch.tokens(), 2, 16, 8, 30.0f, 60.0f);
  testing::fill_random(*in.A_log, rng, 0.0f, 0.1f);
  const kernels::KdaParams params = params_for(in.dk, false);
  OwnedTensor state_a(DType::kF32, {1, in.heads, in.dk, in.dv}), state_b(DType::kF32, {1, in.heads, in.dk, in.dv});
  OwnedTensor out_a(DType::kF32, {in.tokens, in.heads, in.dv}), out_b(DType::kF32, {in.tokens, in.heads, in.dv});
  run(&kernels::kda_recurrent, in, batch, *state_a, *out_a, params);
  run(&kernels::kda_chunked, in, batch, *state_b, *out_b, params);
  const std::vector<double> expected = testing::to_doubles(*out_a);
  EXPECT_TRUE(testing::close_rel_l2(*out_b, expected, 1e-5));
  EXPECT_TRUE(testing::close_rel_l2(*state_b, testing::to_doubles(*state_a), 1e-5));
}

// Each sequence alone (its own call) gives the same rows and state as inside the batch.
TEST(KdaCore, BatchedEqualsAlone) {
  Random rng(26);
  RaggedBatch batch = mixed_batch();
  const KdaInputs in(rng, batch.tokens(), 2, 16, 16, -2.0f, 2.0f);
  const kernels::KdaParams params = params_for(in.dk, true);
  const int64_t state_size = in.heads * in.dk * in.dv;
  OwnedTensor initial(DType::kF32, {5, in.heads, in.dk, in.dv});
  testing::fill_random(*initial, rng, -0.5f, 0.5f);
  const std::vector<double> before = testing::to_doubles(*initial);
  for (const KdaOp op : {KdaOp(&kernels::kda_recurrent), KdaOp(&kernels::kda_chunked)}) {
    OwnedTensor state(DType::kF32, initial->shape());
    testing::fill(*state, std::vector<float>(before.begin(), before.end()));
    OwnedTensor out(DType::kF32, {in.tokens, in.heads, in.dv});
    run(op, in, batch, *state, *out, params);
    const std::vector<double> all = testing::to_doubles(*out), states = testing::to_doubles(*state);
    for (int64_t s = 0; s < batch.size(); ++s) {
      const int64_t begin = batch.cu_q[static_cast<size_t>(s)], end = batch.cu_q[static_cast<size_t>(s) + 1];
      RaggedBatch alone;
      alone.add(static_cast<int32_t>(end - begin), static_cast<int32_t>(batch.ctx(s)), 0);
      const int32_t slot = batch.slots[static_cast<size_t>(s)];
      OwnedTensor one_state(DType::kF32, {1, in.heads, in.dk, in.dv});
      testing::fill(*one_state, std::vector<float>(before.begin() + std::max(slot, 0) * state_size,
                                                   before.begin() + (std::max(slot, 0) + 1) * state_size));
      OwnedTensor one_out(DType::kF32, {end - begin, in.heads, in.dv});
      op(in.q.slice(0, begin, end), in.k.slice(0, begin, end), in.v.slice(0, begin, end), in.f->slice(0, begin, end),
         in.b->slice(0, begin, end), *in.A_log, *in.dt_bias, *one_state, alone.cu(), alone.lens(),
         alone.state_slots(), *one_out, params);
      const std::vector<double> expected(all.begin() + begin * in.heads * in.dv, all.begin() + end * in.heads * in.dv);
      EXPECT_EQ(testing::to_doubles(*one_out), expected) << "sequence " << s;
      if (slot >= 0) {
        EXPECT_EQ(testing::to_doubles(*one_state), slot_values(states, slot, state_size));
      }
    }
  }
}

// One call over 200 rows equals calls of 64 + 100 + 1 + 35 rows continuing from the slot, for both
// forms and across them (chunked prefill, then recurrent decode).
TEST(KdaCore, ContinuedEqualsWhole) {
  Random rng(27);
  const int64_t total = 200;
  const KdaInputs in(rng, total, 2, 16, 8, -2.0f, 2.0f);
  const kernels::KdaParams params = params_for(in.dk, true);
  RaggedBatch whole;
  whole.add(static_cast<int32_t>(total), 0, 0);
  OwnedTensor whole_state(DType::kF32, {1, in.heads, in.dk, in.dv});
  OwnedTensor whole_out(DType::kF32, {total, in.heads, in.dv});
  run(&kernels::kda_recurrent, in, whole, *whole_state, *whole_out, params);
  const std::vector<double> expected = testing::to_doubles(*whole_out);
  const std::vector<int32_t> pieces = {64, 100, 1, 35};
  for (const bool mix_forms : {false, true}) {
    OwnedTensor state(DType::kF32, {1, in.heads, in.dk, in.dv});
    testing::poison(*state);
    OwnedTensor out(DType::kF32, {total, in.heads, in.dv});
    int32_t at = 0;
    for (const int32_t piece : pieces) {
      RaggedBatch step;
      step.add(piece, at, 0);
      const KdaOp op = (!mix_forms || piece > 1) ? KdaOp(&kernels::kda_chunked) : KdaOp(&kernels::kda_recurrent);
      op(in.q.slice(0, at, at + piece), in.k.slice(0, at, at + piece), in.v.slice(0, at, at + piece),
         in.f->slice(0, at, at + piece), in.b->slice(0, at, at + piece), *in.A_log, *in.dt_bias, *state, step.cu(),
         step.lens(), step.state_slots(), out->slice(0, at, at + piece), params);
      at += piece;
    }
    EXPECT_TRUE(testing::close_rel_l2(*out, expected, 2e-5)) << "mixed forms " << mix_forms;
    EXPECT_TRUE(testing::close_rel_l2(*state, testing::to_doubles(*whole_state), 2e-5));
  }
}

// Verify: row_states hold the state after every row, write_state = false leaves the slot as it was,
// and committing an accepted row's state equals running only the accepted rows.
TEST(KdaCore, RecurrentRowStatesAndReadOnlySlots) {
  Random rng(28);
  RaggedBatch batch;
  batch.add(4, 10, 1);
  batch.add(3, 5, 0);
  const KdaInputs in(rng, batch.tokens(), 2, 16, 8, -2.0f, 2.0f);
  kernels::KdaParams params = params_for(in.dk, true);
  const int64_t state_size = in.heads * in.dk * in.dv;
  OwnedTensor state(DType::kF32, {2, in.heads, in.dk, in.dv});
  testing::fill_random(*state, rng, -0.5f, 0.5f);
  const std::vector<double> before = testing::to_doubles(*state);
  OwnedTensor rows(DType::kF32, {in.tokens, in.heads, in.dk, in.dv});
  testing::poison(*rows);
  OwnedTensor out(DType::kF32, {in.tokens, in.heads, in.dv});
  params.row_states = *rows;
  params.write_state = false;
  run(&kernels::kda_recurrent, in, batch, *state, *out, params);
  EXPECT_EQ(testing::to_doubles(*state), before);
  const std::vector<double> row_values = testing::to_doubles(*rows);
  // Sequence 0 accepts 2 of its 4 rows: its row-1 state equals a call over those 2 rows alone.
  RaggedBatch accepted;
  accepted.add(2, 10, 1);
  OwnedTensor fresh_state(DType::kF32, state->shape());
  testing::fill(*fresh_state, std::vector<float>(before.begin(), before.end()));
  OwnedTensor fresh_out(DType::kF32, {2, in.heads, in.dv});
  kernels::KdaParams plain = params_for(in.dk, true);
  kernels::kda_recurrent(in.q.slice(0, 0, 2), in.k.slice(0, 0, 2), in.v.slice(0, 0, 2), in.f->slice(0, 0, 2),
                         in.b->slice(0, 0, 2), *in.A_log, *in.dt_bias, *fresh_state, accepted.cu(), accepted.lens(),
                         accepted.state_slots(), *fresh_out, plain);
  EXPECT_EQ(slot_values(row_values, 1, state_size), slot_values(testing::to_doubles(*fresh_state), 1, state_size));
  const KdaResult expected = reference_kda(in, batch, before, plain);
  EXPECT_TRUE(testing::close_rel_l2(*out, expected.out, 1e-5));
  EXPECT_TRUE(testing::close_rel_l2(slot_values(row_values, 3, state_size), expected.states[0], 1e-5));
  EXPECT_TRUE(testing::close_rel_l2(slot_values(row_values, 6, state_size), expected.states[1], 1e-5));
}

TEST(KdaOutputNorm, SigmoidGatedRmsNormMatchesFormula) {
  Random rng(29);
  const int64_t tokens = 6, heads = 3, width = 40;
  const float eps = 1e-5f;
  const OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, heads, width}, rng, -2.0f, 2.0f);
  const OwnedTensor zrow = testing::random_tensor(DType::kF32, {tokens, heads * width + 5}, rng, -4.0f, 4.0f);
  const Tensor z = testing::split_heads(zrow->slice(1, 5, 5 + heads * width), heads, width);
  const OwnedTensor weight = testing::random_tensor(DType::kF32, {width}, rng, 0.5f, 1.5f);
  OwnedTensor out(DType::kF32, {tokens, heads, width});
  testing::poison(*out);
  kernels::gated_rms_norm(*x, z, *weight, *out, eps, kernels::GatedNormGate::kSigmoid);
  const std::vector<double> xs = testing::to_doubles(*x), zs = testing::to_doubles(z), w = testing::to_doubles(*weight);
  std::vector<double> expected(xs.size());
  for (int64_t row = 0; row < tokens * heads; ++row) {
    double sum = 0.0;
    for (int64_t i = 0; i < width; ++i) sum += xs[static_cast<size_t>(row * width + i)] * xs[static_cast<size_t>(row * width + i)];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
    for (int64_t i = 0; i < width; ++i) {
      const size_t at = static_cast<size_t>(row * width + i);
      expected[at] = w[static_cast<size_t>(i)] * xs[at] * inv * sigmoid(zs[at]);
    }
  }
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
}

// KDA's conv (fp32 weights): with round_conv false a bf16 output is rounded once, after the SiLU.
TEST(KdaConv, Fp32ConvRoundsOnceAfterSilu) {
  Random rng(30);
  const int64_t channels = 24, kernel = 4, tokens = 5;
  const OwnedTensor x = testing::random_tensor(DType::kBF16, {tokens, channels}, rng, -2.0f, 2.0f);
  const OwnedTensor weight = testing::random_tensor(DType::kF32, {channels, kernel}, rng);
  OwnedTensor state(DType::kBF16, {1, kernel - 1, channels});
  OwnedTensor out(DType::kBF16, {tokens, channels});
  RaggedBatch batch;
  batch.add(static_cast<int32_t>(tokens), 0, 0);
  kernels::CausalConv1dParams params;
  params.round_conv = false;
  kernels::causal_conv1d(*x, *weight, *state, batch.cu(), batch.lens(), batch.state_slots(), *out, params);
  const std::vector<double> xs = testing::to_doubles(*x), w = testing::to_doubles(*weight), got = testing::to_doubles(*out);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < kernel; ++j) {
        const int64_t src = t - (kernel - 1) + j;
        if (src >= 0) sum += static_cast<float>(w[static_cast<size_t>(c * kernel + j)] * xs[static_cast<size_t>(src * channels + c)]);
      }
      const float silu = sum / (1.0f + std::exp(-sum));
      EXPECT_EQ(static_cast<float>(got[static_cast<size_t>(t * channels + c)]), bf16_bits_to_f32(f32_to_bf16_bits(silu)))
          << t << "," << c;
    }
  }
}

}  // namespace
}  // namespace metrale
