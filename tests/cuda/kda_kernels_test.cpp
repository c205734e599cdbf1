// CUDA KDA kernels against their CPU twins on the same inputs (glm_deepseek.md §2.5): kda_gates,
// kda_recurrent (decode and verify, row_states, read-only slots, slot -1) and kda_chunked (the
// tensor-core path with the factored and the exact diagonal blocks, its row-by-row fallback), with
// ragged batches of fresh and continued sequences across chunk boundaries. The CPU twin reads the
// very same bf16 tensors (so beta is rounded the same way) and writes f32. Outputs start as NaN;
// final states are compared, and slots nobody owns must come back bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/kda.h"
#include "kernels/kernel_helpers.h"
#include "kernels/ragged_batch.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using testing::RaggedBatch;
using testing::Random;
using testing::to_device;
using testing::to_host;

constexpr double kOutputTolerance = 1e-2;  // bf16 outputs and bf16 operands of the output products
constexpr double kStateTolerance = 1e-3;   // fp32 state through hi/lo products

// The inputs of one call in one dtype: q, k, v as column slices of one conv output, f, b.
struct Inputs {
  int64_t tokens, heads, dk, dv;
  OwnedTensor conv, f, b, A_log, dt_bias;
  Inputs(Random& rng, DType dtype, int64_t t, int64_t h, int64_t d_k, int64_t d_v, float gate_lo, float gate_hi)
      : tokens(t), heads(h), dk(d_k), dv(d_v),
        conv(testing::random_tensor(dtype, {t, h * (2 * d_k + d_v)}, rng, -1.0f, 1.0f)),
        f(testing::random_tensor(dtype, {t, h * d_k}, rng, gate_lo, gate_hi)),
        b(testing::random_tensor(dtype, {t, h}, rng, -3.0f, 3.0f)),
        A_log(testing::random_tensor(DType::kF32, {h}, rng, -0.5f, 1.0f)),
        dt_bias(testing::random_tensor(DType::kF32, {h * d_k}, rng, -1.0f, 1.0f)) {}
};

// Views of one copy (host or device) of the inputs.
struct Views {
  OwnedTensor conv, f, b, A_log, dt_bias;
  Tensor q, k, v;
  Views(const Inputs& in, bool device)
      : conv(device ? to_device(*in.conv) : copy_of(*in.conv)), f(device ? to_device(*in.f) : copy_of(*in.f)),
        b(device ? to_device(*in.b) : copy_of(*in.b)), A_log(device ? to_device(*in.A_log) : copy_of(*in.A_log)),
        dt_bias(device ? to_device(*in.dt_bias) : copy_of(*in.dt_bias)) {
    const int64_t H = in.heads, dk = in.dk, dv = in.dv;
    q = testing::split_heads(conv->slice(1, 0, H * dk), H, dk);
    k = testing::split_heads(conv->slice(1, H * dk, 2 * H * dk), H, dk);
    v = testing::split_heads(conv->slice(1, 2 * H * dk, H * (2 * dk + dv)), H, dv);
  }
  static OwnedTensor copy_of(const Tensor& t) {
    OwnedTensor c(t.dtype(), t.shape());
    copy_tensor(*c, t);
    return c;
  }
};

kernels::KdaParams params_for(int64_t dk, bool lower_bound, float bound = -5.0f) {
  kernels::KdaParams p;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  p.has_lower_bound = lower_bound;
  p.lower_bound = bound;
  return p;
}

struct Metadata {
  OwnedTensor cu, lens, slots;
  explicit Metadata(RaggedBatch& b) : cu(to_device(b.cu())), lens(to_device(b.lens())), slots(to_device(b.state_slots())) {}
};

using KdaOp = void (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const kernels::KdaParams&);

// Runs `op` on the CPU (f32 out) and on the GPU (out in the input dtype) from the same initial
// state; compares outputs, the owned slots' final states, and the bytes of the other slots.
void compare(KdaOp op, const Inputs& in, RaggedBatch batch, int64_t num_slots, const kernels::KdaParams& params,
             Random& rng, double out_tolerance = kOutputTolerance, double state_tolerance = kStateTolerance) {
  OwnedTensor initial(DType::kF32, {num_slots, in.heads, in.dk, in.dv});
  testing::fill_random(*initial, rng, -0.5f, 0.5f);
  std::vector<bool> owned(static_cast<size_t>(num_slots), false);
  for (int64_t s = 0; s < batch.size(); ++s) {
    const int32_t slot = batch.slots[static_cast<size_t>(s)];
    if (slot >= 0 && params.write_state) owned[static_cast<size_t>(slot)] = true;
    if (slot >= 0 && batch.ctx(s) == 0) testing::poison(initial->select(0, slot));  // must not be read
  }
  const Views host(in, false), dev(in, true);
  OwnedTensor cpu_state(DType::kF32, initial->shape());
  copy_tensor(*cpu_state, *initial);
  OwnedTensor gpu_state = to_device(*initial);
  OwnedTensor cpu_out(DType::kF32, {in.tokens, in.heads, in.dv});
  OwnedTensor gpu_out_host(in.conv->dtype(), {in.tokens, in.heads, in.dv});
  testing::poison(*gpu_out_host);
  OwnedTensor gpu_out = to_device(*gpu_out_host);
  kernels::KdaParams cpu_params = params, gpu_params = params;
  OwnedTensor cpu_rows, gpu_rows, workspace;
  if (!params.row_states.empty()) {
    cpu_rows = OwnedTensor(DType::kF32, {in.tokens, in.heads, in.dk, in.dv});
    gpu_rows = OwnedTensor(DType::kF32, {in.tokens, in.heads, in.dk, in.dv}, Device::cuda());
    cpu_params.row_states = *cpu_rows;
    gpu_params.row_states = *gpu_rows;
  }
  const size_t ws = kernels::kda_workspace_bytes(Device::cuda(), in.tokens, batch.size(), in.heads, in.dk, in.dv);
  workspace = OwnedTensor(DType::kU8, {static_cast<int64_t>(std::max<size_t>(ws, 256))}, Device::cuda());
  gpu_params.workspace = *workspace;
  op(host.q, host.k, host.v, *host.f, *host.b, *host.A_log, *host.dt_bias, *cpu_state, batch.cu(), batch.lens(),
     batch.state_slots(), *cpu_out, cpu_params);
  const Metadata meta(batch);
  op(dev.q, dev.k, dev.v, *dev.f, *dev.b, *dev.A_log, *dev.dt_bias, *gpu_state, *meta.cu, *meta.lens, *meta.slots,
     *gpu_out, gpu_params);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*gpu_out), testing::to_doubles(*cpu_out), out_tolerance)) << "outputs";
  const OwnedTensor got_state = to_host(*gpu_state);
  std::vector<double> got_owned, want_owned;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    if (owned[static_cast<size_t>(slot)]) {
      const std::vector<double> g = testing::to_doubles(got_state->select(0, slot));
      const std::vector<double> e = testing::to_doubles(cpu_state->select(0, slot));
      got_owned.insert(got_owned.end(), g.begin(), g.end());
      want_owned.insert(want_owned.end(), e.begin(), e.end());
    } else {
      EXPECT_EQ(testing::element_bytes(got_state->select(0, slot)), testing::element_bytes(initial->select(0, slot)))
          << "slot " << slot << " must stay untouched";
    }
  }
  if (!want_owned.empty()) {
    EXPECT_TRUE(testing::close_rel_l2(got_owned, want_owned, state_tolerance)) << "states";
  }
  if (!params.row_states.empty()) {
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*gpu_rows), testing::to_doubles(*cpu_rows), state_tolerance))
        << "row states";
  }
}

// Fresh multi-chunk prefills (one exactly a chunk), continuations across chunk boundaries, a short
// prompt, a sequence without a slot.
RaggedBatch prefill_batch() {
  RaggedBatch b;
  b.add(200, 0, 4);
  b.add(64, 0, 1);
  b.add(90, 50, 6);
  b.add(7, 0, 2);
  b.add(130, 9, -1);
  b.add(1, 33, 0);
  return b;
}

TEST(CudaKda, GatesMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(301);
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    for (const bool lower_bound : {true, false}) {
      const Inputs in(rng, dtype, 37, 3, 64, 16, -4.0f, 4.0f);
      const kernels::KdaParams params = params_for(in.dk, lower_bound);
      OwnedTensor g_cpu(DType::kF32, {in.tokens, in.heads, in.dk}), beta_cpu(DType::kF32, {in.tokens, in.heads});
      kernels::kda_gates(*in.f, *in.b, *in.A_log, *in.dt_bias, *g_cpu, *beta_cpu, params);
      const Views dev(in, true);
      OwnedTensor g_gpu(DType::kF32, g_cpu->shape(), Device::cuda()), beta_gpu(DType::kF32, beta_cpu->shape(), Device::cuda());
      kernels::kda_gates(*dev.f, *dev.b, *dev.A_log, *dev.dt_bias, *g_gpu, *beta_gpu, params);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*g_gpu), testing::to_doubles(*g_cpu), 1e-6));
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*beta_gpu), testing::to_doubles(*beta_cpu), 1e-6));
    }
  }
}

TEST(CudaKda, RecurrentDecodeMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(302);
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    for (const int64_t dk : {128, 64, 32}) {
      RaggedBatch batch;  // decode rows, one fresh, one without a slot
      for (int32_t s = 0; s < 9; ++s) batch.add(1, s == 3 ? 0 : 5 + s, s == 5 ? -1 : s);
      const Inputs in(rng, dtype, batch.tokens(), 4, dk, 128, -2.0f, 2.0f);
      compare(&kernels::kda_recurrent, in, batch, 11, params_for(dk, true), rng);
    }
  }
}

TEST(CudaKda, RecurrentVerifyKeepsRowStatesAndSlots) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(303);
  RaggedBatch batch;
  batch.add(4, 20, 2);
  batch.add(3, 7, 0);
  batch.add(5, 0, 1);
  const Inputs in(rng, DType::kBF16, batch.tokens(), 3, 128, 64, -2.0f, 2.0f);
  kernels::KdaParams params = params_for(128, false);
  OwnedTensor marker(DType::kF32, {1});
  params.row_states = *marker;  // any non-empty tensor: compare() allocates the real ones
  params.write_state = false;
  compare(&kernels::kda_recurrent, in, batch, 4, params, rng);
}

TEST(CudaKda, ChunkedTensorCoresMatchCpuBoundedGate) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(304);
  for (const int64_t dv : {128, 64, 256}) {  // clusters of 2 column tiles, one tile alone, two clusters
    const RaggedBatch batch = prefill_batch();
    const Inputs in(rng, DType::kBF16, batch.tokens(), 3, 128, dv, -3.0f, 3.0f);
    compare(&kernels::kda_chunked, in, batch, 8, params_for(128, true), rng);
  }
}

// The softplus gate and a bound below -5 take the exact element-wise diagonal blocks; strong decays
// (g down to about -60 per row) must stay finite.
TEST(CudaKda, ChunkedTensorCoresMatchCpuOtherGates) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(305);
  {
    const RaggedBatch batch = prefill_batch();
    const Inputs in(rng, DType::kBF16, batch.tokens(), 2, 128, 128, -3.0f, 3.0f);
    compare(&kernels::kda_chunked, in, batch, 8, params_for(128, false), rng);
  }
  {
    const RaggedBatch batch = prefill_batch();
    const Inputs in(rng, DType::kBF16, batch.tokens(), 2, 128, 64, -3.0f, 3.0f);
    compare(&kernels::kda_chunked, in, batch, 8, params_for(128, true, -12.0f), rng);
  }
  {
    RaggedBatch batch;
    batch.add(150, 0, 0);
    batch.add(70, 20, 1);
    const Inputs in(rng, DType::kBF16, batch.tokens(), 2, 128, 64, 20.0f, 60.0f);
    compare(&kernels::kda_chunked, in, batch, 2, params_for(128, false), rng);
  }
}

// Shapes off the tensor-core path (f32 activations, dk 64) run the recurrent kernel row by row.
TEST(CudaKda, ChunkedFallbackMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(306);
  const RaggedBatch batch = prefill_batch();
  const Inputs f32(rng, DType::kF32, batch.tokens(), 2, 128, 64, -2.0f, 2.0f);
  compare(&kernels::kda_chunked, f32, batch, 8, params_for(128, true), rng, 1e-4, 1e-4);
  const Inputs small(rng, DType::kBF16, batch.tokens(), 2, 64, 32, -2.0f, 2.0f);
  compare(&kernels::kda_chunked, small, batch, 8, params_for(64, true), rng);
}

// Consecutive chunked calls (prefill in pieces) then recurrent decode equal one whole call.
TEST(CudaKda, ContinuedCallsEqualWholeOnGpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(307);
  const int64_t total = 300;
  const Inputs in(rng, DType::kBF16, total, 2, 128, 128, -2.0f, 2.0f);
  const Views dev(in, true);
  const kernels::KdaParams base = params_for(128, true);
  const size_t ws = kernels::kda_workspace_bytes(Device::cuda(), total, 1, in.heads, 128, 128);
  OwnedTensor workspace(DType::kU8, {static_cast<int64_t>(ws)}, Device::cuda());
  kernels::KdaParams params = base;
  params.workspace = *workspace;
  auto run = [&](const Tensor& state, const Tensor& out, int32_t at, int32_t len, bool recurrent) {
    RaggedBatch step;
    step.add(len, at, 0);
    const Metadata meta(step);
    const auto rows = [&](const Tensor& t) { return t.slice(0, at, at + len); };
    (recurrent ? kernels::kda_recurrent : kernels::kda_chunked)(
        rows(dev.q), rows(dev.k), rows(dev.v), rows(*dev.f), rows(*dev.b), *dev.A_log, *dev.dt_bias, state, *meta.cu,
        *meta.lens, *meta.slots, rows(out), params);
  };
  OwnedTensor whole_state(DType::kF32, {1, in.heads, 128, 128}, Device::cuda());
  OwnedTensor whole_out(DType::kBF16, {total, in.heads, 128}, Device::cuda());
  run(*whole_state, *whole_out, 0, static_cast<int32_t>(total), false);
  OwnedTensor state(DType::kF32, {1, in.heads, 128, 128}, Device::cuda());
  OwnedTensor out(DType::kBF16, {total, in.heads, 128}, Device::cuda());
  int32_t at = 0;
  for (const int32_t piece : {100, 64, 1, 1, 130, 4}) {
    run(*state, *out, at, piece, piece == 1);
    at += piece;
  }
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*out), testing::to_doubles(*to_host(*whole_out)), kOutputTolerance));
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*state), testing::to_doubles(*to_host(*whole_state)), kStateTolerance));
}

}  // namespace
}  // namespace metrale
