// CUDA Gated DeltaNet kernels against their CPU twins on the same inputs: causal_conv1d (prefill
// and decode-shaped batches, vectorised and element-wise paths), gdn_gates, gated_rms_norm, and the
// gated delta rule in both forms (tensor-core chunked path, its row-by-row fallback, recurrent
// decode / verify with row_states).
//
// Every batch is ragged: sequences with and without cached tokens (a fresh sequence must start from
// zeros whatever its slot holds), prompts shorter than a chunk, exactly a chunk, and across chunk
// boundaries, q_len 0, and more state slots than sequences, shuffled (slots nobody owns must come
// back bit for bit). q, k, v are column slices of one conv output, as the model passes them.
// Outputs start as NaN. Final states are compared on every test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"
#include "kernels/gated_rms_norm.h"
#include "kernels/kernel_helpers.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using testing::Random;
using testing::to_device;
using testing::to_host;

constexpr double kOutputTolerance = 1e-2;  // bf16 outputs (and bf16 operands of the output products)
constexpr double kStateTolerance = 1e-3;   // fp32 state

struct SeqSpec {
  int64_t ctx;    // cached tokens before this step
  int64_t q_len;  // rows of this step
};

// Host metadata of a ragged batch; slots are distinct and shuffled, with spare slots nobody owns.
struct Batch {
  std::vector<int32_t> cu_q{0}, kv_lens, slots;
  std::vector<bool> owned;
  int64_t tokens = 0, num_slots = 0, max_q = 0;
  int64_t num_seqs() const { return static_cast<int64_t>(kv_lens.size()); }
};

// Speculative commit and verify layouts: sequences without a slot (-1, rows computed from zero
// state and never kept) and steps that read the slots without writing them.
struct SlotUse {
  int64_t no_slot_every = 0;  // > 0: every n-th sequence (n - 1, 2n - 1, ...) has slot -1
  bool write_state = true;
};

void apply_slot_use(Batch& b, const SlotUse& use) {
  for (int64_t s = 0; s < b.num_seqs(); ++s) {
    const bool no_slot = use.no_slot_every > 0 && s % use.no_slot_every == use.no_slot_every - 1;
    if (no_slot || !use.write_state) b.owned[static_cast<size_t>(b.slots[static_cast<size_t>(s)])] = false;
    if (no_slot) b.slots[static_cast<size_t>(s)] = -1;
  }
}

Batch make_batch(const std::vector<SeqSpec>& specs, int64_t spare_slots, uint64_t seed) {
  Batch b;
  b.num_slots = static_cast<int64_t>(specs.size()) + spare_slots;
  std::vector<int32_t> order(static_cast<size_t>(b.num_slots));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  b.owned.assign(static_cast<size_t>(b.num_slots), false);
  for (size_t s = 0; s < specs.size(); ++s) {
    b.tokens += specs[s].q_len;
    b.max_q = std::max(b.max_q, specs[s].q_len);
    b.cu_q.push_back(static_cast<int32_t>(b.tokens));
    b.kv_lens.push_back(static_cast<int32_t>(specs[s].ctx + specs[s].q_len));
    b.slots.push_back(order[s]);
    b.owned[static_cast<size_t>(order[s])] = true;
  }
  return b;
}

OwnedTensor int_tensor(const std::vector<int32_t>& values) {
  OwnedTensor t(DType::kI32, {static_cast<int64_t>(values.size())});
  if (!values.empty()) std::memcpy(t->data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// Device copies of a batch's metadata.
struct DeviceBatch {
  OwnedTensor cu_q, kv_lens, slots;
  explicit DeviceBatch(const Batch& b)
      : cu_q(to_device(*int_tensor(b.cu_q))),
        kv_lens(to_device(*int_tensor(b.kv_lens))),
        slots(to_device(*int_tensor(b.slots))) {}
};

// Values of slot `slot` of a [slots, ...] tensor.
std::vector<double> slot_values(const Tensor& t, int64_t slot) {
  return testing::to_doubles(t.select(0, slot));
}

// Owned slots match within `tolerance` (relative L2 over all of them); the others are unchanged.
void expect_states(const Tensor& got, const Tensor& expected, const Tensor& before, const Batch& b, double tolerance) {
  std::vector<double> got_owned, expected_owned;
  for (int64_t slot = 0; slot < b.num_slots; ++slot) {
    if (b.owned[static_cast<size_t>(slot)]) {
      const std::vector<double> g = slot_values(got, slot), e = slot_values(expected, slot);
      got_owned.insert(got_owned.end(), g.begin(), g.end());
      expected_owned.insert(expected_owned.end(), e.begin(), e.end());
    } else {
      EXPECT_EQ(testing::element_bytes(got.select(0, slot)), testing::element_bytes(before.select(0, slot)))
          << "slot " << slot << " belongs to no sequence and must stay untouched";
    }
  }
  // (Steps that only read the slots own none.)
  if (!expected_owned.empty()) {
    EXPECT_TRUE(testing::close_rel_l2(got_owned, expected_owned, tolerance)) << "final states";
  }
}

// ---- causal_conv1d ----

struct ConvCase {
  std::vector<SeqSpec> seqs;
  int64_t channels;
  int64_t column_offset;  // x is a column slice of a wider row (odd offsets: element-wise path)
  bool silu = true;
  SlotUse slot_use = {};
};

void check_conv(const ConvCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "channels " << c.channels << " offset " << c.column_offset << " seqs "
                                    << c.seqs.size());
  constexpr int64_t kKernel = 4;
  Random rng(seed);
  Batch b = make_batch(c.seqs, 3, seed);
  apply_slot_use(b, c.slot_use);
  const int64_t width = c.channels + c.column_offset + 8;
  const OwnedTensor x_wide = testing::random_tensor(DType::kBF16, {b.tokens, width}, rng);
  const Tensor x = x_wide->slice(1, c.column_offset, c.column_offset + c.channels);
  const OwnedTensor weight = testing::random_tensor(DType::kF32, {c.channels, kKernel}, rng, -0.6f, 0.6f);
  const OwnedTensor state = testing::random_tensor(DType::kBF16, {b.num_slots, kKernel - 1, c.channels}, rng);
  OwnedTensor out_cpu(DType::kBF16, {b.tokens, c.channels});
  testing::poison(*out_cpu);
  const OwnedTensor state_cpu = to_host(*to_device(*state));  // a copy

  const OwnedTensor x_dev = to_device(*x_wide), weight_dev = to_device(*weight), state_dev = to_device(*state);
  const OwnedTensor out_dev = to_device(*out_cpu);  // NaN
  const DeviceBatch meta(b);
  kernels::CausalConv1dParams params;
  params.silu = c.silu;
  params.max_q_len = b.max_q;
  params.write_state = c.slot_use.write_state;
  kernels::causal_conv1d(x_dev->slice(1, c.column_offset, c.column_offset + c.channels), *weight_dev, *state_dev,
                         *meta.cu_q, *meta.kv_lens, *meta.slots, *out_dev, params);
  const OwnedTensor cu = int_tensor(b.cu_q), lens = int_tensor(b.kv_lens), slots = int_tensor(b.slots);
  kernels::causal_conv1d(x, *weight, *state_cpu, *cu, *lens, *slots, *out_cpu, params);

  EXPECT_TRUE(testing::close_rel_l2(*to_host(*out_dev), testing::to_doubles(*out_cpu), 1e-2)) << "conv output";
  // New conv states are copies of inputs: exact.
  EXPECT_EQ(testing::element_bytes(*to_host(*state_dev)), testing::element_bytes(*state_cpu)) << "conv states";
  // Slots of sequences without a slot, and every slot when states are only read, stay as they were.
  for (int64_t slot = 0; slot < b.num_slots; ++slot) {
    if (b.owned[static_cast<size_t>(slot)]) continue;
    EXPECT_EQ(testing::element_bytes(to_host(*state_dev)->select(0, slot)),
              testing::element_bytes(state->select(0, slot)))
        << "conv slot " << slot;
  }
}

TEST(CudaGdnConv, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<SeqSpec> mixed = {{0, 37}, {5, 1}, {3, 2}, {0, 1}, {10, 130}, {6, 0}, {0, 2}, {2, 70}};
  check_conv({mixed, 1024, 0}, 11);
  check_conv({mixed, 1024, 8, false}, 12);
  check_conv({mixed, 100, 3}, 13);  // channels % 8 != 0 and unaligned rows: one channel per thread
  std::vector<SeqSpec> decode;
  for (int i = 0; i < 64; ++i) decode.push_back({i % 7 == 0 ? 0 : 3 + i, 1});
  check_conv({decode, 2048, 0}, 14);
  // Speculative verify (slots read, not written) and commit (rejected rows without a slot).
  check_conv({mixed, 1024, 0, true, {0, false}}, 15);
  check_conv({mixed, 1024, 0, true, {2, true}}, 16);
  check_conv({decode, 2048, 0, true, {3, true}}, 17);
  // max_q 1 takes the one-launch decode kernel: also with a sequence without a row and unaligned rows.
  decode.push_back({4, 0});
  check_conv({decode, 2048, 0}, 18);
  check_conv({decode, 100, 3}, 19);
  check_conv({decode, 1024, 0, true, {0, false}}, 20);
}

// ---- gdn_gates ----

TEST(CudaGdnGates, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(21);
  const int64_t tokens = 77, heads = 32;
  const OwnedTensor ab = testing::random_tensor(DType::kBF16, {tokens, 2 * heads + 5}, rng, -8.0f, 24.0f);
  const OwnedTensor A_log = testing::random_tensor(DType::kF32, {heads}, rng, -1.0f, 1.5f);
  const OwnedTensor dt_bias = testing::random_tensor(DType::kBF16, {heads}, rng, -1.0f, 1.0f);
  const Tensor a = ab->slice(1, 0, heads), b = ab->slice(1, heads + 5, 2 * heads + 5);
  OwnedTensor g_ref(DType::kF32, {tokens, heads}), beta_ref(DType::kF32, {tokens, heads});
  kernels::gdn_gates(a, b, *A_log, *dt_bias, *g_ref, *beta_ref);

  const OwnedTensor ab_dev = to_device(*ab), A_log_dev = to_device(*A_log), dt_bias_dev = to_device(*dt_bias);
  OwnedTensor nan(DType::kF32, {tokens, heads});
  testing::poison(*nan);
  const OwnedTensor g_dev = to_device(*nan), beta_dev = to_device(*nan);
  kernels::gdn_gates(ab_dev->slice(1, 0, heads), ab_dev->slice(1, heads + 5, 2 * heads + 5), *A_log_dev, *dt_bias_dev,
                     *g_dev, *beta_dev);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*g_dev), testing::to_doubles(*g_ref), 1e-5)) << "g";
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*beta_dev), testing::to_doubles(*beta_ref), 1e-3)) << "beta";
}

// ---- gated_rms_norm ----

void check_gated_norm(int64_t tokens, int64_t heads, int64_t width, bool in_place, uint64_t seed,
                      kernels::GatedNormGate gate = kernels::GatedNormGate::kSilu) {
  SCOPED_TRACE(::testing::Message() << "width " << width << " in place " << in_place << " gate "
                                    << static_cast<int>(gate));
  Random rng(seed);
  // x [T, Hv, D] contiguous; z a column slice of a projection row [T, 2 * Hv * D + 8].
  const OwnedTensor x = testing::random_tensor(DType::kBF16, {tokens, heads, width}, rng, -2.0f, 2.0f);
  const OwnedTensor zrow = testing::random_tensor(DType::kBF16, {tokens, 2 * heads * width + 8}, rng, -3.0f, 3.0f);
  const OwnedTensor weight = testing::random_tensor(DType::kBF16, {width}, rng, 0.5f, 1.5f);
  auto z_view = [&](const Tensor& rows) {
    return Tensor(static_cast<char*>(rows.data()) + heads * width * 2, DType::kBF16, {tokens, heads, width},
                  {rows.stride(0), width, 1}, rows.device());
  };
  OwnedTensor out_cpu(DType::kF32, {tokens, heads, width});
  kernels::gated_rms_norm(*x, z_view(*zrow), *weight, *out_cpu, 1e-6f, gate);

  const OwnedTensor x_dev = to_device(*x), zrow_dev = to_device(*zrow), weight_dev = to_device(*weight);
  OwnedTensor nan(DType::kBF16, {tokens, heads, width});
  testing::poison(*nan);
  const OwnedTensor out_dev = to_device(*nan);
  const Tensor& target = in_place ? *x_dev : *out_dev;
  kernels::gated_rms_norm(*x_dev, z_view(*zrow_dev), *weight_dev, target, 1e-6f, gate);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(target), testing::to_doubles(*out_cpu), kOutputTolerance));
}

TEST(CudaGdnGatedRmsNorm, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check_gated_norm(33, 8, 128, false, 31);
  check_gated_norm(33, 8, 128, true, 32);
  check_gated_norm(9, 4, 50, false, 33);  // element-wise path
  check_gated_norm(5, 3, 256, false, 34);
  // qwen4_exp's sigmoid gate with the GDN norm's roundings.
  check_gated_norm(33, 8, 128, false, 35, kernels::GatedNormGate::kSigmoidRounded);
  check_gated_norm(9, 4, 50, true, 36, kernels::GatedNormGate::kSigmoidRounded);
}

// ---- gated delta rule ----

struct DeltaCase {
  std::vector<SeqSpec> seqs;
  int64_t k_heads, v_heads, dk, dv;
  bool chunked;
  bool row_states = false;
  bool l2norm = true;
  SlotUse slot_use = {};
};

struct DeltaInputs {
  Batch b;
  OwnedTensor qkv;      // [T, 2 Hk dk + Hv dv] bf16: q | k | v columns, as the conv output
  OwnedTensor g, beta;  // [T, Hv] f32
  OwnedTensor state;    // [slots, Hv, dk, dv] f32
};

Tensor qkv_part(const Tensor& qkv, int64_t begin, int64_t heads, int64_t dim) {
  const auto element = static_cast<int64_t>(qkv.element_size());
  return Tensor(static_cast<char*>(qkv.data()) + begin * element, qkv.dtype(), {qkv.size(0), heads, dim},
                {qkv.stride(0), dim, 1}, qkv.device());
}

void check_delta_rule(const DeltaCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << (c.chunked ? "chunked" : "recurrent") << " Hk " << c.k_heads << " Hv "
                                    << c.v_heads << " dk " << c.dk << " dv " << c.dv << " seqs " << c.seqs.size()
                                    << " l2norm " << c.l2norm);
  Random rng(seed);
  Batch b = make_batch(c.seqs, 2, seed);
  apply_slot_use(b, c.slot_use);
  const int64_t key_dim = c.k_heads * c.dk, width = 2 * key_dim + c.v_heads * c.dv;
  const float qk_range = c.l2norm ? 1.0f : 0.08f;
  OwnedTensor qkv(DType::kBF16, {b.tokens, width});
  {
    std::vector<float> values(static_cast<size_t>(b.tokens * width));
    for (int64_t t = 0; t < b.tokens; ++t) {
      for (int64_t i = 0; i < width; ++i) {
        const float range = i < 2 * key_dim ? qk_range : 1.0f;
        values[static_cast<size_t>(t * width + i)] = rng.nonzero(-range, range);
      }
    }
    testing::fill(*qkv, values);
  }
  const OwnedTensor g = testing::random_tensor(DType::kF32, {b.tokens, c.v_heads}, rng, -1.2f, -0.005f);
  const OwnedTensor beta = testing::random_tensor(DType::kF32, {b.tokens, c.v_heads}, rng, 0.05f, 1.0f);
  const OwnedTensor state = testing::random_tensor(DType::kF32, {b.num_slots, c.v_heads, c.dk, c.dv}, rng, -0.5f, 0.5f);

  kernels::GatedDeltaRuleParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(c.dk));
  params.qk_l2norm = c.l2norm;
  params.max_q_len = b.max_q;
  params.write_state = c.slot_use.write_state;

  // CPU twin: f32 output (the fp32 reference), same bf16 inputs.
  const OwnedTensor state_cpu = to_host(*to_device(*state));
  OwnedTensor out_cpu(DType::kF32, {b.tokens, c.v_heads, c.dv});
  OwnedTensor rows_cpu;
  const OwnedTensor cu = int_tensor(b.cu_q), lens = int_tensor(b.kv_lens), slots = int_tensor(b.slots);
  const Tensor q = qkv_part(*qkv, 0, c.k_heads, c.dk), k = qkv_part(*qkv, key_dim, c.k_heads, c.dk),
               v = qkv_part(*qkv, 2 * key_dim, c.v_heads, c.dv);
  kernels::GatedDeltaRuleParams cpu_params = params;
  if (c.row_states) {
    rows_cpu = OwnedTensor(DType::kF32, {b.tokens, c.v_heads, c.dk, c.dv});
    cpu_params.row_states = *rows_cpu;
  }
  if (c.chunked) {
    kernels::gated_delta_rule_chunked(q, k, v, *g, *beta, *state_cpu, *cu, *lens, *slots, *out_cpu, cpu_params);
  } else {
    kernels::gated_delta_rule_recurrent(q, k, v, *g, *beta, *state_cpu, *cu, *lens, *slots, *out_cpu, cpu_params);
  }

  const OwnedTensor qkv_dev = to_device(*qkv), g_dev = to_device(*g), beta_dev = to_device(*beta);
  const OwnedTensor state_dev = to_device(*state);
  OwnedTensor nan(DType::kBF16, {b.tokens, c.v_heads, c.dv});
  testing::poison(*nan);
  const OwnedTensor out_dev = to_device(*nan);
  const DeviceBatch meta(b);
  OwnedTensor workspace, rows_dev;
  if (c.chunked) {
    const size_t bytes =
        kernels::gated_delta_rule_workspace_bytes(Device::cuda(), b.tokens, b.num_seqs(), c.v_heads, c.dk, c.dv);
    workspace = OwnedTensor(DType::kU8, {static_cast<int64_t>(std::max<size_t>(bytes, 1))}, Device::cuda());
    params.workspace = *workspace;
  }
  if (c.row_states) {
    OwnedTensor rows_nan(DType::kF32, {b.tokens, c.v_heads, c.dk, c.dv});
    testing::poison(*rows_nan);
    rows_dev = to_device(*rows_nan);
    params.row_states = *rows_dev;
  }
  const Tensor qd = qkv_part(*qkv_dev, 0, c.k_heads, c.dk), kd = qkv_part(*qkv_dev, key_dim, c.k_heads, c.dk),
               vd = qkv_part(*qkv_dev, 2 * key_dim, c.v_heads, c.dv);
  if (c.chunked) {
    kernels::gated_delta_rule_chunked(qd, kd, vd, *g_dev, *beta_dev, *state_dev, *meta.cu_q, *meta.kv_lens, *meta.slots,
                                      *out_dev, params);
  } else {
    kernels::gated_delta_rule_recurrent(qd, kd, vd, *g_dev, *beta_dev, *state_dev, *meta.cu_q, *meta.kv_lens,
                                        *meta.slots, *out_dev, params);
  }
  if (b.tokens > 0) {
    const std::vector<double> got = testing::to_doubles(*to_host(*out_dev)), want = testing::to_doubles(*out_cpu);
    EXPECT_TRUE(testing::close_rel_l2(got, want, kOutputTolerance)) << "output";
    std::printf("[ info ] %s Hk %lld Hv %lld dk %lld dv %lld: output relative L2 %.2e, final state %.2e\n",
                c.chunked ? "chunked" : "recurrent", static_cast<long long>(c.k_heads),
                static_cast<long long>(c.v_heads), static_cast<long long>(c.dk), static_cast<long long>(c.dv),
                testing::relative_l2(got, want),
                testing::relative_l2(testing::to_doubles(*to_host(*state_dev)), testing::to_doubles(*state_cpu)));
  }
  expect_states(*to_host(*state_dev), *state_cpu, *state, b, kStateTolerance);
  if (c.row_states) {
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*rows_dev), testing::to_doubles(*rows_cpu), kStateTolerance))
        << "row states";
  }
}

const std::vector<SeqSpec> kPrefillMix = {{0, 200}, {50, 64}, {0, 1}, {7, 129}, {0, 63}, {3, 0}, {0, 0}, {20, 65}};

TEST(CudaGdnDeltaRule, ChunkedMatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check_delta_rule({kPrefillMix, 4, 8, 128, 128, true}, 41);                       // two value heads per key head
  check_delta_rule({kPrefillMix, 4, 4, 128, 64, true}, 42);                        // one; dv 64
  check_delta_rule({{{0, 130}, {9, 17}}, 2, 8, 128, 96, true}, 43);                // four; dv 96
  check_delta_rule({{{5, 1000}}, 16, 32, 128, 128, true}, 44);                     // Qwen3.5 shape, 16 chunks
  check_delta_rule({{{0, 90}, {4, 33}}, 2, 4, 128, 128, true, false, false}, 45);  // no l2 norm
}

TEST(CudaGdnDeltaRule, ChunkedFallbackMatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check_delta_rule({kPrefillMix, 2, 4, 64, 64, true}, 51);  // dk 64: the row-by-row kernel
}

TEST(CudaGdnDeltaRule, RecurrentMatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  std::vector<SeqSpec> decode;
  for (int i = 0; i < 9; ++i) decode.push_back({i == 4 ? 0 : 10 + i, 1});
  check_delta_rule({decode, 4, 8, 128, 128, false}, 61);                                   // 32-column tiles
  check_delta_rule({{{12, 1}, {0, 1}}, 4, 8, 128, 128, false}, 62);                        // 16-column tiles
  check_delta_rule({{{12, 3}, {0, 4}, {5, 1}, {2, 0}}, 4, 8, 128, 128, false, true}, 63);  // verify rows
  check_delta_rule({decode, 2, 4, 64, 64, false, true}, 64);
  check_delta_rule({{{0, 40}}, 2, 4, 128, 128, false}, 65);  // a prompt through the recurrent form
  // Speculative verify (slots read, not written) and commit (rejected parts without a slot).
  const std::vector<SeqSpec> verify = {{12, 4}, {0, 4}, {5, 4}, {9, 4}, {3, 4}};
  check_delta_rule({verify, 4, 8, 128, 128, false, false, true, {0, false}}, 66);
  const std::vector<SeqSpec> commit = {{12, 2}, {0, 2}, {5, 4}, {0, 0}, {3, 1}, {0, 3}};
  check_delta_rule({commit, 4, 8, 128, 128, false, false, true, {2, true}}, 67);
  check_delta_rule({commit, 2, 4, 64, 64, false, false, true, {2, true}}, 68);
}

// The chunked and recurrent CUDA kernels agree with each other on the same prompt.
TEST(CudaGdnDeltaRule, ChunkedAndRecurrentAgree) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(71);
  const Batch b = make_batch({{0, 150}, {8, 70}}, 0, 71);
  const int64_t hk = 2, hv = 4, d = 128, width = 2 * hk * d + hv * d;
  const OwnedTensor qkv = to_device(*testing::random_tensor(DType::kBF16, {b.tokens, width}, rng));
  const OwnedTensor g = to_device(*testing::random_tensor(DType::kF32, {b.tokens, hv}, rng, -0.8f, -0.01f));
  const OwnedTensor beta = to_device(*testing::random_tensor(DType::kF32, {b.tokens, hv}, rng, 0.1f, 1.0f));
  const OwnedTensor state0 = testing::random_tensor(DType::kF32, {b.num_slots, hv, d, d}, rng, -0.5f, 0.5f);
  const OwnedTensor state_a = to_device(*state0), state_b = to_device(*state0);
  const OwnedTensor out_a(DType::kBF16, {b.tokens, hv, d}, Device::cuda()),
      out_b(DType::kBF16, {b.tokens, hv, d}, Device::cuda());
  const DeviceBatch meta(b);
  const OwnedTensor workspace(
      DType::kU8,
      {static_cast<int64_t>(kernels::gated_delta_rule_workspace_bytes(Device::cuda(), b.tokens, 2, hv, d, d))},
      Device::cuda());
  kernels::GatedDeltaRuleParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(d));
  params.workspace = *workspace;
  const Tensor q = qkv_part(*qkv, 0, hk, d), k = qkv_part(*qkv, hk * d, hk, d), v = qkv_part(*qkv, 2 * hk * d, hv, d);
  kernels::gated_delta_rule_chunked(q, k, v, *g, *beta, *state_a, *meta.cu_q, *meta.kv_lens, *meta.slots, *out_a,
                                    params);
  kernels::gated_delta_rule_recurrent(q, k, v, *g, *beta, *state_b, *meta.cu_q, *meta.kv_lens, *meta.slots, *out_b,
                                      params);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*out_a), testing::to_doubles(*to_host(*out_b)), kOutputTolerance));
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*state_a), testing::to_doubles(*to_host(*state_b)), kStateTolerance));
}

// Decode and prefill steps replay inside a CUDA graph with the same results as eager calls.
TEST(CudaGdnDeltaRule, ReplaysInsideCudaGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(81);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  for (const bool chunked : {false, true}) {
    SCOPED_TRACE(::testing::Message() << (chunked ? "chunked" : "recurrent"));
    const Batch b = chunked ? make_batch({{0, 70}, {3, 5}}, 1, 81) : make_batch({{4, 1}, {0, 1}, {9, 1}}, 1, 82);
    const int64_t hk = 2, hv = 4, d = 128, width = 2 * hk * d + hv * d;
    const OwnedTensor qkv = to_device(*testing::random_tensor(DType::kBF16, {b.tokens, width}, rng));
    const OwnedTensor g = to_device(*testing::random_tensor(DType::kF32, {b.tokens, hv}, rng, -0.8f, -0.01f));
    const OwnedTensor beta = to_device(*testing::random_tensor(DType::kF32, {b.tokens, hv}, rng, 0.1f, 1.0f));
    const OwnedTensor state0 = testing::random_tensor(DType::kF32, {b.num_slots, hv, d, d}, rng, -0.5f, 0.5f);
    const OwnedTensor state = to_device(*state0);
    const OwnedTensor out(DType::kBF16, {b.tokens, hv, d}, Device::cuda());
    const DeviceBatch meta(b);
    const OwnedTensor workspace(DType::kU8,
                                {static_cast<int64_t>(kernels::gated_delta_rule_workspace_bytes(
                                    Device::cuda(), b.tokens, b.num_seqs(), hv, d, d))},
                                Device::cuda());
    kernels::GatedDeltaRuleParams params;
    params.scale = 1.0f / std::sqrt(static_cast<float>(d));
    params.workspace = *workspace;
    const Tensor q = qkv_part(*qkv, 0, hk, d), k = qkv_part(*qkv, hk * d, hk, d), v = qkv_part(*qkv, 2 * hk * d, hv, d);
    auto step = [&] {
      if (chunked) {
        kernels::gated_delta_rule_chunked(q, k, v, *g, *beta, *state, *meta.cu_q, *meta.kv_lens, *meta.slots, *out,
                                          params);
      } else {
        kernels::gated_delta_rule_recurrent(q, k, v, *g, *beta, *state, *meta.cu_q, *meta.kv_lens, *meta.slots, *out,
                                            params);
      }
    };
    step();  // eager
    const OwnedTensor eager_out = to_host(*out), eager_state = to_host(*state);
    copy_tensor(*state, *state0);
    CudaGraph graph;
    graph.begin_capture(stream);
    step();
    graph.end_capture(stream);
    copy_tensor(*state, *state0);
    graph.launch(stream);
    EXPECT_EQ(testing::element_bytes(*to_host(*out)), testing::element_bytes(*eager_out));
    EXPECT_EQ(testing::element_bytes(*to_host(*state)), testing::element_bytes(*eager_state));
  }
}

}  // namespace
}  // namespace metrale
