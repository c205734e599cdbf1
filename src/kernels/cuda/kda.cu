// KDA core on the GPU (glm_deepseek.md §2.5): the gates, the recurrent form (decode, speculative
// verify, and the fallback for shapes the tensor-core path does not take) and the chunked form
// (kda_chunked.cuh). Batch metadata is read on the device only, so every launch can be captured in a
// CUDA graph; grids are sized from tensor shapes.
//
// Recurrent kernel: one CTA of 128 threads per (sequence, head, tile of 16 or 32 state columns), the
// tile [dk, tile] fp32 in registers (each thread 4 columns of dk / row-groups rows), rows of the
// sequence in order. Per token the CTA computes the dk channel decays exp(g) from the gate
// projection, then S' = diag(exp(g)) S; m = S'^T k, p = S'^T q (one reduction for both);
// delta = beta (v - m); o = p + delta (k . q) (= S_new^T q); S = S' + k delta^T. Decode moves the
// state once in and once out: 8 MB per layer at 64 heads of 128, bandwidth bound (~2.5 us at
// 3.3 TB/s); at batch 1 the 16-column tiles put 512 CTAs on the GPU.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kda_chunked.cuh"
#include "kernels/kda.h"

namespace metrale::kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;

struct GateParams {
  const void* A_log;
  const void* dt_bias;
  WeightType A_log_type, dt_bias_type;
  bool has_lower_bound;
  float lower_bound;
};

__device__ __forceinline__ float gate_of(const GateParams& p, float f, int head, int64_t channel) {
  const float phi = f + load_weight(p.dt_bias, p.dt_bias_type, channel);
  return kda::forget_gate(phi, expf(load_weight(p.A_log, p.A_log_type, head)), p.has_lower_bound, p.lower_bound);
}

// ---- gates ----

template <typename T>
__global__ void __launch_bounds__(256) gates_kernel(const T* f, int64_t f_row, const T* b, int64_t b_row, GateParams p,
                                                    float* g, float* beta, int64_t count, int heads, int dk) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= count) return;
  const int64_t t = i / (static_cast<int64_t>(heads) * dk);
  const int within = static_cast<int>(i % (static_cast<int64_t>(heads) * dk));
  const int h = within / dk, d = within % dk;
  g[i] = gate_of(p, to_f32(f[t * f_row + within]), h, within);
  if (d == 0) {
    const float logit = to_f32(b[t * b_row + h]);
    beta[t * heads + h] = to_f32(from_f32<T>(1.0f / (1.0f + expf(-logit))));
  }
}

// ---- recurrent form ----

struct RecurrentArgs {
  const void* q;  // [T, H, dk]
  const void* k;
  const void* v;  // [T, H, dv]
  const void* f;  // [T, H * dk]
  const void* b;  // [T, H]
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, f_row, b_row;
  GateParams gates;
  float* state;  // [slots, H, dk, dv]
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* slots;
  void* out;  // [T, H, dv]
  int64_t out_row, out_head;
  float* row_states;  // [T, H, dk, dv] or null
  bool write_state;
  int heads, dv;
  float scale;
};

constexpr int kRecurrentThreads = 128;

template <typename T, int kDk, int kTile>
__global__ void __launch_bounds__(kRecurrentThreads) recurrent_kernel(RecurrentArgs a) {
  constexpr int kColGroups = kTile / 4;
  constexpr int kRowGroups = kRecurrentThreads / kColGroups;
  constexpr int kRows = kDk / kRowGroups;  // rows per thread: rg + kRowGroups * j
  constexpr int kWarps = kRecurrentThreads / 32;
  static_assert(kDk % kRowGroups == 0 && kDk <= kRecurrentThreads, "dk must split over the row groups");
  __shared__ float kq_s[2][kDk];
  __shared__ float decay_s[kDk];
  __shared__ float sums_s[kWarps][3];
  __shared__ float partial_s[kWarps][kTile][2];

  const int v0 = blockIdx.x * kTile, h = blockIdx.y, s = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cg = tid % kColGroups, rg = tid / kColGroups;
  const int row_begin = a.cu_q[s], row_end = a.cu_q[s + 1];
  const bool fresh = a.kv_lens[s] == row_end - row_begin || a.slots[s] < 0;
  const int64_t head_rows = (static_cast<int64_t>(a.slots[s]) * a.heads + h) * kDk;
  const int col = v0 + 4 * cg;

  float4 st[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int r = rg + kRowGroups * j;
    st[j] = fresh ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                  : __ldcs(reinterpret_cast<const float4*>(a.state + (head_rows + r) * a.dv + col));
  }
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* f = static_cast<const T*>(a.f);
  const T* b = static_cast<const T*>(a.b);
  for (int t = row_begin; t < row_end; ++t) {
    float kk = 0.0f, qq = 0.0f, kq = 0.0f;
    if (tid < kDk) {
      const float kv = to_f32(k[t * a.k_row + h * a.k_head + tid]);
      const float qv = to_f32(q[t * a.q_row + h * a.q_head + tid]);
      kq_s[0][tid] = kv;
      kq_s[1][tid] = qv;
      kk = kv * kv;
      qq = qv * qv;
      kq = kv * qv;
      const int64_t channel = static_cast<int64_t>(h) * kDk + tid;
      decay_s[tid] = expf(gate_of(a.gates, to_f32(f[t * a.f_row + channel]), h, channel));
    }
    kk = warp_sum(kk);
    qq = warp_sum(qq);
    kq = warp_sum(kq);
    if (lane == 0) {
      sums_s[warp][0] = kk;
      sums_s[warp][1] = qq;
      sums_s[warp][2] = kq;
    }
    const T* v_row = v + t * a.v_row + h * a.v_head + col;
    const float4 vv = make_float4(to_f32(v_row[0]), to_f32(v_row[1]), to_f32(v_row[2]), to_f32(v_row[3]));
    const float beta = to_f32(from_f32<T>(1.0f / (1.0f + expf(-to_f32(b[t * a.b_row + h])))));
    __syncthreads();
    kk = qq = kq = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      kk += sums_s[w][0];
      qq += sums_s[w][1];
      kq += sums_s[w][2];
    }
    const float rk = 1.0f / sqrtf(kk + 1e-6f);
    const float rq = a.scale / sqrtf(qq + 1e-6f);
    const float kq_normed = kq * rk * rq;

    float m[4] = {}, p[4] = {};
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = rg + kRowGroups * j;
      const float kr = kq_s[0][r] * rk, qr = kq_s[1][r] * rq, decay = decay_s[r];
      st[j].x *= decay;
      st[j].y *= decay;
      st[j].z *= decay;
      st[j].w *= decay;
      m[0] += st[j].x * kr;
      m[1] += st[j].y * kr;
      m[2] += st[j].z * kr;
      m[3] += st[j].w * kr;
      p[0] += st[j].x * qr;
      p[1] += st[j].y * qr;
      p[2] += st[j].z * qr;
      p[3] += st[j].w * qr;
    }
#pragma unroll
    for (int offset = kColGroups; offset < 32; offset <<= 1) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        m[e] += __shfl_xor_sync(0xffffffffu, m[e], offset);
        p[e] += __shfl_xor_sync(0xffffffffu, p[e], offset);
      }
    }
    if (lane < kColGroups) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        partial_s[warp][4 * cg + e][0] = m[e];
        partial_s[warp][4 * cg + e][1] = p[e];
      }
    }
    __syncthreads();
    float delta[4], o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float mt = 0.0f, pt = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        mt += partial_s[w][4 * cg + e][0];
        pt += partial_s[w][4 * cg + e][1];
      }
      const float ve = e == 0 ? vv.x : e == 1 ? vv.y : e == 2 ? vv.z : vv.w;
      delta[e] = (ve - mt) * beta;
      o[e] = pt + delta[e] * kq_normed;
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const float kr = kq_s[0][rg + kRowGroups * j] * rk;
      st[j].x += kr * delta[0];
      st[j].y += kr * delta[1];
      st[j].z += kr * delta[2];
      st[j].w += kr * delta[3];
    }
    if (rg == 0) {
      T* out = static_cast<T*>(a.out) + t * a.out_row + h * a.out_head + col;
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = from_f32<T>(o[e]);
    }
    if (a.row_states != nullptr) {
      float* rows = a.row_states + (static_cast<int64_t>(t) * a.heads + h) * kDk * a.dv + col;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        *reinterpret_cast<float4*>(rows + static_cast<int64_t>(rg + kRowGroups * j) * a.dv) = st[j];
      }
    }
    __syncthreads();  // kq_s, decay_s, sums_s and partial_s are rewritten by the next token
  }
  if (!a.write_state || a.slots[s] < 0) return;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    __stcs(reinterpret_cast<float4*>(a.state + (head_rows + rg + kRowGroups * j) * a.dv + col), st[j]);
  }
}

// ---- shared checks ----

struct KdaShape {
  int64_t tokens, heads, dk, dv, num_seqs, num_slots;
};

GateParams gate_params(const Tensor& A_log, const Tensor& dt_bias, const KdaParams& params, const char* op) {
  GateParams g{};
  g.A_log = A_log.data();
  g.dt_bias = dt_bias.data();
  g.A_log_type = weight_type_of(A_log, op);
  g.dt_bias_type = weight_type_of(dt_bias, op);
  g.has_lower_bound = params.has_lower_bound;
  g.lower_bound = params.lower_bound;
  return g;
}

void check_gate_inputs(const std::string& what, const Tensor& f, const Tensor& b, const Tensor& A_log,
                       const Tensor& dt_bias, int64_t tokens, int64_t heads, int64_t dk, const KdaParams& params) {
  METRALE_EXPECT(f.ndim() == 2 && f.size(0) == tokens && f.size(1) == heads * dk && f.stride(1) == 1,
                 what + ": f " + f.describe());
  METRALE_EXPECT(
      b.ndim() == 2 && b.size(0) == tokens && b.size(1) == heads && b.stride(1) == 1 && b.dtype() == f.dtype(),
      what + ": b " + b.describe());
  METRALE_EXPECT(A_log.numel() == heads && A_log.is_contiguous() && dt_bias.numel() == heads * dk &&
                     dt_bias.is_contiguous() && A_log.device().is_cuda() && dt_bias.device().is_cuda(),
                 what + ": A_log " + A_log.describe() + " dt_bias " + dt_bias.describe());
  METRALE_EXPECT(!params.has_lower_bound || params.lower_bound < 0.0f, what + ": the lower bound must be negative");
}

KdaShape check_kda(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                   const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out, const KdaParams& params) {
  const std::string what(op);
  for (const Tensor* t : {&q, &k, &v, &f, &b, &state, &cu_q, &kv_lens, &state_slots, &out}) {
    METRALE_EXPECT(t->device().is_cuda(), what + ": tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && out.ndim() == 3,
                 what + ": q " + q.describe() + " k " + k.describe() + " v " + v.describe() + " out " + out.describe());
  KdaShape d{};
  d.tokens = q.size(0);
  d.heads = q.size(1);
  d.dk = q.size(2);
  d.dv = v.size(2);
  METRALE_EXPECT(k.size(0) == d.tokens && k.size(1) == d.heads && k.size(2) == d.dk && v.size(0) == d.tokens &&
                     v.size(1) == d.heads && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                 what + ": q " + q.describe() + " k " + k.describe() + " v " + v.describe());
  for (const Tensor* t : {&k, &v, &f, &b, &out}) {
    METRALE_EXPECT(t->dtype() == q.dtype(), what + ": q, k, v, f, b and out must share a dtype");
  }
  METRALE_EXPECT(out.size(0) == d.tokens && out.size(1) == d.heads && out.size(2) == d.dv && out.stride(2) == 1,
                 what + ": out " + out.describe());
  check_gate_inputs(what, f, b, A_log, dt_bias, d.tokens, d.heads, d.dk, params);
  METRALE_EXPECT(state.dtype() == DType::kF32 && state.is_contiguous() && state.ndim() == 4 &&
                     state.size(1) == d.heads && state.size(2) == d.dk && state.size(3) == d.dv,
                 what + ": state " + state.describe() + " must be f32 [slots, H, dk, dv]");
  d.num_seqs = kv_lens.numel();
  d.num_slots = state.size(0);
  METRALE_EXPECT(
      cu_q.dtype() == DType::kI32 && kv_lens.dtype() == DType::kI32 && state_slots.dtype() == DType::kI32 &&
          cu_q.numel() == d.num_seqs + 1 && state_slots.numel() == d.num_seqs,
      what + ": cu_q " + cu_q.describe() + " kv_lens " + kv_lens.describe() + " state_slots " + state_slots.describe());
  METRALE_EXPECT(d.num_seqs <= 65535 && d.heads <= 65535, what + ": batch too large");
  return d;
}

bool recurrent_supported(const KdaShape& d, DType dtype) {
  return (d.dk == 32 || d.dk == 64 || d.dk == 128) && d.dv % 16 == 0 && (dtype == DType::kBF16 || dtype == DType::kF32);
}

template <typename T, int kDk, int kTile>
void launch_recurrent(const RecurrentArgs& args, const KdaShape& d, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(d.dv / kTile), static_cast<unsigned>(d.heads),
                  static_cast<unsigned>(d.num_seqs));
  recurrent_kernel<T, kDk, kTile><<<grid, kRecurrentThreads, 0, stream>>>(args);
}

template <typename T>
void launch_recurrent_for(const RecurrentArgs& args, const KdaShape& d, cudaStream_t stream) {
  // 32-column tiles unless that leaves fewer than ~2 CTAs per SM (batch-1 decode): then 16.
  const bool narrow = d.dv % 32 != 0 || d.num_seqs * d.heads * (d.dv / 32) < 256;
  if (d.dk == 128) {
    narrow ? launch_recurrent<T, 128, 16>(args, d, stream) : launch_recurrent<T, 128, 32>(args, d, stream);
  } else if (d.dk == 64) {
    narrow ? launch_recurrent<T, 64, 16>(args, d, stream) : launch_recurrent<T, 64, 32>(args, d, stream);
  } else {
    narrow ? launch_recurrent<T, 32, 16>(args, d, stream) : launch_recurrent<T, 32, 32>(args, d, stream);
  }
}

void run_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                   const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out, const KdaParams& params,
                   const KdaShape& d, const char* op) {
  if (!recurrent_supported(d, q.dtype())) {
    raise_message(
        ErrorCode::kUnsupported,
        std::string(op) + ": CUDA supports dk 32, 64 or 128, dv a multiple of 16 and bf16/f32 activations (dk " +
            std::to_string(d.dk) + ", dv " + std::to_string(d.dv) + ", " + std::string(dtype_name(q.dtype())) + ")");
  }
  RecurrentArgs args{};
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.f = f.data();
  args.b = b.data();
  args.q_row = q.stride(0);
  args.q_head = q.stride(1);
  args.k_row = k.stride(0);
  args.k_head = k.stride(1);
  args.v_row = v.stride(0);
  args.v_head = v.stride(1);
  args.f_row = f.stride(0);
  args.b_row = b.stride(0);
  args.gates = gate_params(A_log, dt_bias, params, op);
  args.state = state.data_as<float>();
  args.cu_q = cu_q.data_as<const int32_t>();
  args.kv_lens = kv_lens.data_as<const int32_t>();
  args.slots = state_slots.data_as<const int32_t>();
  args.out = out.data();
  args.out_row = out.stride(0);
  args.out_head = out.stride(1);
  args.row_states = params.row_states.empty() ? nullptr : params.row_states.data_as<float>();
  args.write_state = params.write_state;
  args.heads = static_cast<int>(d.heads);
  args.dv = static_cast<int>(d.dv);
  args.scale = params.scale;
  if (d.num_seqs == 0) return;
  const cudaStream_t stream = stream_of(out);
  if (q.dtype() == DType::kBF16) {
    launch_recurrent_for<bf16>(args, d, stream);
  } else {
    launch_recurrent_for<float>(args, d, stream);
  }
  METRALE_CHECK_LAUNCH(op);
}

// ---- chunked form ----

int64_t max_chunks(int64_t tokens, int64_t num_seqs) { return chunks::max_chunks(tokens, num_seqs, kda::kChunk); }

size_t chunk_offsets_bytes(int64_t num_seqs) { return chunks::offsets_bytes(num_seqs); }

bool rows_aligned16(const Tensor& t) {
  const auto element = static_cast<int64_t>(t.element_size());
  bool ok = reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && (t.stride(0) * element) % 16 == 0;
  if (t.ndim() == 3) ok = ok && (t.stride(1) * element) % 16 == 0;
  return ok;
}

bool tensor_core_path(const KdaShape& d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f,
                      const Tensor& out) {
  return q.dtype() == DType::kBF16 && d.dk == kda::kKeyDim && d.dv % kda::kTileV == 0 && rows_aligned16(q) &&
         rows_aligned16(k) && rows_aligned16(v) && rows_aligned16(f) && out.stride(0) % 2 == 0 &&
         out.stride(1) % 2 == 0 && reinterpret_cast<uintptr_t>(out.data()) % 4 == 0;
}

// Raises the kernel's dynamic shared-memory limit once per device (a host-side attribute, allowed
// during graph capture).
void allow_smem(const void* kernel, int bytes, uint64_t& done_devices, std::mutex& mutex) {
  int device = 0;
  METRALE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (done_devices & bit) != 0) return;
  METRALE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done_devices |= bit;
}

}  // namespace

void kda_gates(const Tensor& f, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
               const Tensor& beta, const KdaParams& params) {
  for (const Tensor* t : {&f, &b, &A_log, &dt_bias, &g, &beta}) {
    METRALE_EXPECT(t->device().is_cuda(), "kda_gates: tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(g.ndim() == 3 && g.dtype() == DType::kF32 && g.is_contiguous(),
                 "kda_gates: g " + g.describe() + " must be f32 [T, H, dk]");
  const int64_t tokens = g.size(0), heads = g.size(1), dk = g.size(2);
  check_gate_inputs("kda_gates", f, b, A_log, dt_bias, tokens, heads, dk, params);
  METRALE_EXPECT(beta.dtype() == DType::kF32 && beta.is_contiguous() && beta.numel() == tokens * heads,
                 "kda_gates: beta " + beta.describe() + " must be f32 [T, H]");
  const int64_t count = tokens * heads * dk;
  if (count == 0) return;
  const GateParams p = gate_params(A_log, dt_bias, params, "kda_gates");
  const auto grid = static_cast<unsigned>((count + 255) / 256);
  METRALE_DISPATCH_FLOAT(f.dtype(), "kda_gates", [&] {
    gates_kernel<scalar_t><<<grid, 256, 0, stream_of(g)>>>(
        f.data_as<const scalar_t>(), f.stride(0), b.data_as<const scalar_t>(), b.stride(0), p, g.data_as<float>(),
        beta.data_as<float>(), count, static_cast<int>(heads), static_cast<int>(dk));
  });
  METRALE_CHECK_LAUNCH("kda_gates");
}

void kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                   const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out, const KdaParams& params) {
  const char* op = "kda_recurrent";
  const KdaShape d = check_kda(op, q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens, state_slots, out, params);
  if (!params.row_states.empty()) {
    const Tensor& rows = params.row_states;
    METRALE_EXPECT(rows.device().is_cuda() && rows.dtype() == DType::kF32 && rows.is_contiguous() &&
                       rows.numel() == d.tokens * d.heads * d.dk * d.dv,
                   "kda_recurrent: row_states " + rows.describe() + " must be f32 [T, H, dk, dv]");
  }
  run_recurrent(q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens, state_slots, out, params, d, op);
}

void kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                 const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                 const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out, const KdaParams& params) {
  const char* op = "kda_chunked";
  const KdaShape d = check_kda(op, q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens, state_slots, out, params);
  if (!params.write_state) raise_message(ErrorCode::kInvalidArgument, "kda_chunked always writes the final state");
  if (!tensor_core_path(d, q, k, v, f, out)) {
    // Shapes outside the tensor-core path (dk != 128, f32 activations, small test models): row by row.
    KdaParams recurrent = params;
    recurrent.row_states = Tensor();
    run_recurrent(q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens, state_slots, out, recurrent, d, op);
    return;
  }
  if (d.num_seqs == 0) return;
  const size_t needed = kda_workspace_bytes(out.device(), d.tokens, d.num_seqs, d.heads, d.dk, d.dv);
  const Tensor& ws = params.workspace;
  METRALE_EXPECT(!ws.empty() && ws.device().is_cuda() && ws.nbytes() >= needed &&
                     reinterpret_cast<uintptr_t>(ws.data()) % 256 == 0,
                 std::string(op) + ": workspace " + ws.describe() + " below the " + std::to_string(needed) +
                     " bytes of kda_workspace_bytes (or not 256-byte aligned)");
  kda::ChunkArgs args{};
  args.q = q.data_as<const bf16>();
  args.k = k.data_as<const bf16>();
  args.v = v.data_as<const bf16>();
  args.f = f.data_as<const bf16>();
  args.b = b.data_as<const bf16>();
  args.q_row = q.stride(0);
  args.q_head = q.stride(1);
  args.k_row = k.stride(0);
  args.k_head = k.stride(1);
  args.v_row = v.stride(0);
  args.v_head = v.stride(1);
  args.f_row = f.stride(0);
  args.b_row = b.stride(0);
  args.A_log = A_log.data();
  args.dt_bias = dt_bias.data();
  args.A_log_type = weight_type_of(A_log, op);
  args.dt_bias_type = weight_type_of(dt_bias, op);
  args.state = state.data_as<float>();
  args.cu_q = cu_q.data_as<const int32_t>();
  args.kv_lens = kv_lens.data_as<const int32_t>();
  args.slots = state_slots.data_as<const int32_t>();
  args.out = out.data_as<bf16>();
  args.out_row = out.stride(0);
  args.out_head = out.stride(1);
  args.chunk_offsets = ws.data_as<int32_t>();
  args.records = reinterpret_cast<kda::ChunkRecord*>(static_cast<char*>(ws.data()) + chunk_offsets_bytes(d.num_seqs));
  args.num_seqs = static_cast<int>(d.num_seqs);
  args.heads = static_cast<int>(d.heads);
  args.dv = static_cast<int>(d.dv);
  args.scale = params.scale;
  args.has_lower_bound = params.has_lower_bound;
  args.lower_bound = params.lower_bound;
  // Inside a 16-row block |G_i - G_j| <= 16 |lambda|: the factored diagonal blocks stay below e^80.
  args.safe_diagonal = params.has_lower_bound && params.lower_bound >= -5.0f;

  static std::mutex smem_mutex;
  static uint64_t prep_done = 0, scan_done = 0;
  allow_smem(reinterpret_cast<const void*>(kda::prep_kernel), kda::prep::kSmemBytes, prep_done, smem_mutex);
  allow_smem(reinterpret_cast<const void*>(kda::scan_kernel), kda::scan::kSmemBytes, scan_done, smem_mutex);

  const cudaStream_t stream = stream_of(out);
  chunks::offsets_kernel<kda::kChunk><<<1, 1024, 0, stream>>>(args.cu_q, args.num_seqs, args.chunk_offsets);
  METRALE_CHECK_LAUNCH("kda offsets");
  const int64_t chunks = max_chunks(d.tokens, d.num_seqs);
  if (chunks > 0) {
    METRALE_EXPECT(chunks <= 65535, std::string(op) + ": too many chunks for one call");
    kda::prep_kernel<<<dim3(static_cast<unsigned>(d.heads), static_cast<unsigned>(chunks)), kda::kPrepThreads,
                       kda::prep::kSmemBytes, stream>>>(args);
    METRALE_CHECK_LAUNCH("kda prep");
  }
  const int64_t column_tiles = d.dv / kda::kTileV;
  kda::scan_kernel<<<dim3(static_cast<unsigned>(column_tiles), static_cast<unsigned>(d.heads),
                          static_cast<unsigned>(d.num_seqs)),
                     kda::kScanThreads, kda::scan::kSmemBytes, stream>>>(args);
  METRALE_CHECK_LAUNCH("kda scan");
}

}  // namespace cuda

size_t kda_workspace_bytes(Device device, int64_t num_tokens, int64_t num_seqs, int64_t num_heads, int64_t key_head_dim,
                           int64_t value_head_dim) {
  (void)key_head_dim;
  (void)value_head_dim;
  if (!device.is_cuda()) return 0;
  return cuda::chunk_offsets_bytes(num_seqs) + static_cast<size_t>(cuda::max_chunks(num_tokens, num_seqs)) *
                                                   static_cast<size_t>(num_heads) * sizeof(cuda::kda::ChunkRecord);
}

}  // namespace metrale::kernels
