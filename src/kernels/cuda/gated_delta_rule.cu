// Gated DeltaNet core on the GPU (qwen.md §6.3-§6.6): the gates, the recurrent form (decode,
// speculative verify, and the fallback for shapes the tensor-core path does not take) and the
// chunked form (gated_delta_rule_chunked.cuh). Batch metadata is read on the device only, so every
// launch can be captured in a CUDA graph; grids are sized from tensor shapes.
//
// Recurrent kernel: one CTA of 128 threads per (sequence, value head, tile of 16 or 32 state
// columns), the tile [dk, tile] fp32 in registers (each thread 4 columns of dk / row-groups rows),
// rows of the sequence in order. Per token: S' = exp(g) S; m = S'^T k, p = S'^T q (one reduction
// for both); delta = beta (v - m); o = p + delta (k . q) (= S_new^T q); S = S' + k delta^T. Decode
// moves the state once in and once out (bandwidth bound at large batch); at batch 1 the 16-column
// tiles put 256 CTAs on the GPU so that the 4 MB of one layer's state stream in parallel.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gated_delta_rule_chunked.cuh"
#include "kernels/gated_delta_rule.h"

namespace metrale::kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;

enum class ParamType : int { kF32, kBF16, kF16 };

ParamType param_type_of(const Tensor& t, const char* what) {
  switch (t.dtype()) {
    case DType::kF32: return ParamType::kF32;
    case DType::kBF16: return ParamType::kBF16;
    case DType::kF16: return ParamType::kF16;
    default:
      raise_message(ErrorCode::kUnsupported,
                    std::string(what) + ": dtype " + std::string(dtype_name(t.dtype())) + " is not supported on CUDA");
  }
}

__device__ __forceinline__ float load_param(const void* p, ParamType type, int i) {
  switch (type) {
    case ParamType::kBF16: return __bfloat162float(static_cast<const bf16*>(p)[i]);
    case ParamType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// ---- gates ----

struct GatesArgs {
  const void* a;  // [T, Hv] activations, rows strided
  const void* b;
  int64_t a_row, b_row;
  const void* A_log;  // [Hv]
  const void* dt_bias;
  ParamType A_log_type, dt_bias_type;
  float* g;  // [T, Hv] f32
  float* beta;
  int64_t count;
  int heads;
};

template <typename T>
__global__ void __launch_bounds__(256) gates_kernel(GatesArgs p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= p.count) return;
  const int64_t t = i / p.heads;
  const int h = static_cast<int>(i % p.heads);
  const float a = to_f32(static_cast<const T*>(p.a)[t * p.a_row + h]);
  const float b = to_f32(static_cast<const T*>(p.b)[t * p.b_row + h]);
  const float x = a + load_param(p.dt_bias, p.dt_bias_type, h);
  const float softplus = x > 20.0f ? x : log1pf(expf(x));
  p.g[i] = -expf(load_param(p.A_log, p.A_log_type, h)) * softplus;
  p.beta[i] = to_f32(from_f32<T>(1.0f / (1.0f + expf(-b))));  // sigmoid in the activation dtype
}

// ---- recurrent form ----

struct RecurrentArgs {
  const void* q;  // [T, Hk, dk]
  const void* k;
  const void* v;  // [T, Hv, dv]
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  const float* g;  // [T, Hv]
  const float* beta;
  float* state;  // [slots, Hv, dk, dv]
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* slots;
  void* out;  // [T, Hv, dv]
  int64_t out_row, out_head;
  float* row_states;  // [T, Hv, dk, dv] or null
  bool write_state;   // false: the slot is only read
  int k_heads, v_heads, dv;
  float scale;
  bool l2norm;
};

constexpr int kRecurrentThreads = 128;

template <typename T, int kDk, int kTile>
__global__ void __launch_bounds__(kRecurrentThreads) recurrent_kernel(RecurrentArgs a) {
  constexpr int kColGroups = kTile / 4;                     // float4 columns
  constexpr int kRowGroups = kRecurrentThreads / kColGroups;  // threads along dk
  constexpr int kRows = kDk / kRowGroups;                   // dk rows per thread: rg + kRowGroups * j
  constexpr int kWarps = kRecurrentThreads / 32;
  static_assert(kDk % kRowGroups == 0, "dk must split over the row groups");
  __shared__ float kq_s[2][kDk];  // raw k, q of the current token
  __shared__ float sums_s[kWarps][3];
  __shared__ float partial_s[kWarps][kTile][2];

  // Column tiles vary fastest: the CTAs of one head, which together cover its contiguous state,
  // run side by side.
  const int v0 = blockIdx.x * kTile, h = blockIdx.y, s = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cg = tid % kColGroups, rg = tid / kColGroups;
  const int row_begin = a.cu_q[s], row_end = a.cu_q[s + 1];
  const bool fresh = a.kv_lens[s] == row_end - row_begin || a.slots[s] < 0;  // slot -1: no state
  const int hk = h / (a.v_heads / a.k_heads);
  const int64_t head_rows = (static_cast<int64_t>(a.slots[s]) * a.v_heads + h) * kDk;  // first state row
  const int col = v0 + 4 * cg;

  float4 st[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int r = rg + kRowGroups * j;
    // Streaming loads and stores: each state element is read once and written once per step.
    st[j] = fresh ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                  : __ldcs(reinterpret_cast<const float4*>(a.state + (head_rows + r) * a.dv + col));
  }

  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  for (int t = row_begin; t < row_end; ++t) {
    float kk = 0.0f, qq = 0.0f, kq = 0.0f;
    for (int i = tid; i < kDk; i += kRecurrentThreads) {
      const float kv = to_f32(k[t * a.k_row + hk * a.k_head + i]);
      const float qv = to_f32(q[t * a.q_row + hk * a.q_head + i]);
      kq_s[0][i] = kv;
      kq_s[1][i] = qv;
      kk += kv * kv;
      qq += qv * qv;
      kq += kv * qv;
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
    const int64_t gate = static_cast<int64_t>(t) * a.v_heads + h;
    const float decay = expf(a.g[gate]), beta = a.beta[gate];
    __syncthreads();
    kk = qq = kq = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      kk += sums_s[w][0];
      qq += sums_s[w][1];
      kq += sums_s[w][2];
    }
    const float rk = a.l2norm ? rsqrtf(kk + 1e-6f) : 1.0f;
    const float rq = (a.l2norm ? rsqrtf(qq + 1e-6f) : 1.0f) * a.scale;
    const float kq_normed = kq * rk * rq;

    float m[4] = {}, p[4] = {};
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = rg + kRowGroups * j;
      const float kr = kq_s[0][r] * rk, qr = kq_s[1][r] * rq;
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
      const int r = rg + kRowGroups * j;
      const float kr = kq_s[0][r] * rk;
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
      float* rows = a.row_states + (static_cast<int64_t>(t) * a.v_heads + h) * kDk * a.dv + col;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        *reinterpret_cast<float4*>(rows + static_cast<int64_t>(rg + kRowGroups * j) * a.dv) = st[j];
      }
    }
    __syncthreads();  // kq_s, sums_s and partial_s are rewritten by the next token
  }
  if (!a.write_state || a.slots[s] < 0) return;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    __stcs(reinterpret_cast<float4*>(a.state + (head_rows + rg + kRowGroups * j) * a.dv + col), st[j]);
  }
}

// ---- shared checks ----

struct DeltaRuleShape {
  int64_t tokens, k_heads, v_heads, dk, dv, num_seqs, num_slots;
};

DeltaRuleShape check_delta_rule(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens,
                                const Tensor& state_slots, const Tensor& out) {
  const std::string what(op);
  for (const Tensor* t : {&q, &k, &v, &g, &beta, &state, &cu_q, &kv_lens, &state_slots, &out}) {
    METRALE_EXPECT(t->device().is_cuda(), what + ": tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && out.ndim() == 3,
                 what + ": q " + q.describe() + " k " + k.describe() + " v " + v.describe() + " out " + out.describe());
  DeltaRuleShape d{};
  d.tokens = q.size(0);
  d.k_heads = q.size(1);
  d.dk = q.size(2);
  d.v_heads = v.size(1);
  d.dv = v.size(2);
  METRALE_EXPECT(k.size(0) == d.tokens && k.size(1) == d.k_heads && k.size(2) == d.dk && v.size(0) == d.tokens &&
                     q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                 what + ": q " + q.describe() + " k " + k.describe() + " v " + v.describe());
  METRALE_EXPECT(d.k_heads > 0 && d.v_heads % d.k_heads == 0, what + ": value heads must be a multiple of key heads");
  METRALE_EXPECT(q.dtype() == k.dtype() && q.dtype() == v.dtype() && q.dtype() == out.dtype(),
                 what + ": q, k, v and out must share a dtype");
  METRALE_EXPECT(out.size(0) == d.tokens && out.size(1) == d.v_heads && out.size(2) == d.dv && out.stride(2) == 1,
                 what + ": out " + out.describe());
  for (const Tensor* gate : {&g, &beta}) {
    METRALE_EXPECT(gate->dtype() == DType::kF32 && gate->is_contiguous() && gate->numel() == d.tokens * d.v_heads,
                   what + ": gates must be f32 [T, Hv], got " + gate->describe());
  }
  METRALE_EXPECT(state.dtype() == DType::kF32 && state.is_contiguous() && state.ndim() == 4 &&
                     state.size(1) == d.v_heads && state.size(2) == d.dk && state.size(3) == d.dv,
                 what + ": state " + state.describe() + " must be f32 [slots, Hv, dk, dv]");
  d.num_seqs = kv_lens.numel();
  d.num_slots = state.size(0);
  METRALE_EXPECT(cu_q.dtype() == DType::kI32 && kv_lens.dtype() == DType::kI32 && state_slots.dtype() == DType::kI32 &&
                     cu_q.numel() == d.num_seqs + 1 && state_slots.numel() == d.num_seqs,
                 what + ": cu_q " + cu_q.describe() + " kv_lens " + kv_lens.describe() + " state_slots " +
                     state_slots.describe());
  METRALE_EXPECT(d.num_seqs <= 65535 && d.v_heads <= 65535, what + ": batch too large");
  return d;
}

bool recurrent_supported(const DeltaRuleShape& d, DType dtype) {
  return (d.dk == 64 || d.dk == 128) && d.dv % 16 == 0 && (dtype == DType::kBF16 || dtype == DType::kF32);
}

template <typename T, int kDk, int kTile>
void launch_recurrent(const RecurrentArgs& args, const DeltaRuleShape& d, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(d.dv / kTile), static_cast<unsigned>(d.v_heads),
                  static_cast<unsigned>(d.num_seqs));
  recurrent_kernel<T, kDk, kTile><<<grid, kRecurrentThreads, 0, stream>>>(args);
}

template <typename T>
void launch_recurrent_for(const RecurrentArgs& args, const DeltaRuleShape& d, cudaStream_t stream) {
  // 32-column tiles unless that leaves fewer than ~2 CTAs per SM (batch-1 decode): then 16.
  const bool narrow = d.dv % 32 != 0 || d.num_seqs * d.v_heads * (d.dv / 32) < 256;
  if (d.dk == 128) {
    narrow ? launch_recurrent<T, 128, 16>(args, d, stream) : launch_recurrent<T, 128, 32>(args, d, stream);
  } else {
    narrow ? launch_recurrent<T, 64, 16>(args, d, stream) : launch_recurrent<T, 64, 32>(args, d, stream);
  }
}

void run_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                   const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& state_slots,
                   const Tensor& out, const GatedDeltaRuleParams& params, const DeltaRuleShape& d, const char* op) {
  if (!recurrent_supported(d, q.dtype())) {
    raise_message(ErrorCode::kUnsupported,
                  std::string(op) + ": CUDA supports dk 64 or 128, dv a multiple of 16 and bf16/f32 activations (dk " +
                      std::to_string(d.dk) + ", dv " + std::to_string(d.dv) + ", " + std::string(dtype_name(q.dtype())) +
                      ")");
  }
  RecurrentArgs args{};
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.q_row = q.stride(0);
  args.q_head = q.stride(1);
  args.k_row = k.stride(0);
  args.k_head = k.stride(1);
  args.v_row = v.stride(0);
  args.v_head = v.stride(1);
  args.g = g.data_as<const float>();
  args.beta = beta.data_as<const float>();
  args.state = state.data_as<float>();
  args.cu_q = cu_q.data_as<const int32_t>();
  args.kv_lens = kv_lens.data_as<const int32_t>();
  args.slots = state_slots.data_as<const int32_t>();
  args.out = out.data();
  args.out_row = out.stride(0);
  args.out_head = out.stride(1);
  args.row_states = params.row_states.empty() ? nullptr : params.row_states.data_as<float>();
  args.write_state = params.write_state;
  args.k_heads = static_cast<int>(d.k_heads);
  args.v_heads = static_cast<int>(d.v_heads);
  args.dv = static_cast<int>(d.dv);
  args.scale = params.scale;
  args.l2norm = params.qk_l2norm;
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

int64_t max_chunks(int64_t tokens, int64_t num_seqs) { return chunks::max_chunks(tokens, num_seqs, gdn::kChunk); }

size_t chunk_offsets_bytes(int64_t num_seqs) { return chunks::offsets_bytes(num_seqs); }

bool aligned16(const Tensor& t) {
  const auto element = static_cast<int64_t>(t.element_size());
  return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && (t.stride(0) * element) % 16 == 0 &&
         (t.stride(1) * element) % 16 == 0;
}

bool tensor_core_path(const DeltaRuleShape& d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out) {
  return q.dtype() == DType::kBF16 && d.dk == gdn::kKeyDim && d.dv % gdn::kTileV == 0 && aligned16(q) &&
         aligned16(k) && aligned16(v) && out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
         reinterpret_cast<uintptr_t>(out.data()) % 4 == 0;
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

void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
               const Tensor& beta) {
  for (const Tensor* t : {&a, &b, &A_log, &dt_bias, &g, &beta}) {
    METRALE_EXPECT(t->device().is_cuda(), "gdn_gates: tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(a.ndim() == 2 && b.ndim() == 2 && a.stride(1) == 1 && b.stride(1) == 1 && a.dtype() == b.dtype(),
                 "gdn_gates: a " + a.describe() + " b " + b.describe());
  const int64_t tokens = a.size(0), heads = a.size(1);
  METRALE_EXPECT(b.size(0) == tokens && b.size(1) == heads && A_log.numel() == heads && dt_bias.numel() == heads &&
                     A_log.is_contiguous() && dt_bias.is_contiguous(),
                 "gdn_gates: A_log " + A_log.describe() + " dt_bias " + dt_bias.describe());
  for (const Tensor* gate : {&g, &beta}) {
    METRALE_EXPECT(gate->dtype() == DType::kF32 && gate->is_contiguous() && gate->numel() == tokens * heads,
                   "gdn_gates: outputs must be f32 [T, Hv], got " + gate->describe());
  }
  GatesArgs p{};
  p.a = a.data();
  p.b = b.data();
  p.a_row = a.stride(0);
  p.b_row = b.stride(0);
  p.A_log = A_log.data();
  p.dt_bias = dt_bias.data();
  p.A_log_type = param_type_of(A_log, "gdn_gates");
  p.dt_bias_type = param_type_of(dt_bias, "gdn_gates");
  p.g = g.data_as<float>();
  p.beta = beta.data_as<float>();
  p.count = tokens * heads;
  p.heads = static_cast<int>(heads);
  if (p.count == 0) return;
  const auto grid = static_cast<unsigned>((p.count + 255) / 256);
  const cudaStream_t stream = stream_of(g);
  METRALE_DISPATCH_FLOAT(a.dtype(), "gdn_gates", [&] { gates_kernel<scalar_t><<<grid, 256, 0, stream>>>(p); });
  METRALE_CHECK_LAUNCH("gdn_gates");
}

void gated_delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens,
                                const Tensor& state_slots, const Tensor& out, const GatedDeltaRuleParams& params) {
  const DeltaRuleShape d = check_delta_rule("gated_delta_rule_recurrent", q, k, v, g, beta, state, cu_q, kv_lens,
                                            state_slots, out);
  if (!params.row_states.empty()) {
    const Tensor& rows = params.row_states;
    METRALE_EXPECT(rows.device().is_cuda() && rows.dtype() == DType::kF32 && rows.is_contiguous() &&
                       rows.numel() == d.tokens * d.v_heads * d.dk * d.dv,
                   "gated_delta_rule_recurrent: row_states " + rows.describe() + " must be f32 [T, Hv, dk, dv]");
  }
  run_recurrent(q, k, v, g, beta, state, cu_q, kv_lens, state_slots, out, params, d, "gated_delta_rule_recurrent");
}

void gated_delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                              const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& state_slots,
                              const Tensor& out, const GatedDeltaRuleParams& params) {
  const char* op = "gated_delta_rule_chunked";
  const DeltaRuleShape d = check_delta_rule(op, q, k, v, g, beta, state, cu_q, kv_lens, state_slots, out);
  if (!params.write_state) {
    raise_message(ErrorCode::kInvalidArgument, "gated_delta_rule_chunked always writes the final state");
  }
  if (!tensor_core_path(d, q, k, v, out)) {
    // Shapes outside the tensor-core path (dk != 128, small test models, unaligned rows): row by row.
    GatedDeltaRuleParams recurrent = params;
    recurrent.row_states = Tensor();
    run_recurrent(q, k, v, g, beta, state, cu_q, kv_lens, state_slots, out, recurrent, d, op);
    return;
  }
  if (d.num_seqs == 0) return;
  const size_t needed = gated_delta_rule_workspace_bytes(out.device(), d.tokens, d.num_seqs, d.v_heads, d.dk, d.dv);
  const Tensor& ws = params.workspace;
  METRALE_EXPECT(!ws.empty() && ws.device().is_cuda() && ws.nbytes() >= needed &&
                     reinterpret_cast<uintptr_t>(ws.data()) % 256 == 0,
                 std::string(op) + ": workspace " + ws.describe() + " below the " + std::to_string(needed) +
                     " bytes of gated_delta_rule_workspace_bytes (or not 256-byte aligned)");
  gdn::ChunkArgs args{};
  args.q = q.data_as<const bf16>();
  args.k = k.data_as<const bf16>();
  args.v = v.data_as<const bf16>();
  args.q_row = q.stride(0);
  args.q_head = q.stride(1);
  args.k_row = k.stride(0);
  args.k_head = k.stride(1);
  args.v_row = v.stride(0);
  args.v_head = v.stride(1);
  args.g = g.data_as<const float>();
  args.beta = beta.data_as<const float>();
  args.state = state.data_as<float>();
  args.cu_q = cu_q.data_as<const int32_t>();
  args.kv_lens = kv_lens.data_as<const int32_t>();
  args.slots = state_slots.data_as<const int32_t>();
  args.out = out.data_as<bf16>();
  args.out_row = out.stride(0);
  args.out_head = out.stride(1);
  args.chunk_offsets = ws.data_as<int32_t>();
  args.records =
      reinterpret_cast<gdn::ChunkRecord*>(static_cast<char*>(ws.data()) + chunk_offsets_bytes(d.num_seqs));
  args.num_seqs = static_cast<int>(d.num_seqs);
  args.k_heads = static_cast<int>(d.k_heads);
  args.v_heads = static_cast<int>(d.v_heads);
  args.dv = static_cast<int>(d.dv);
  args.scale = params.scale;
  args.l2norm = params.qk_l2norm;

  static std::mutex smem_mutex;
  static uint64_t prep_done = 0, scan_done = 0;
  allow_smem(reinterpret_cast<const void*>(gdn::chunk_prep_kernel), gdn::prep::kSmemBytes, prep_done, smem_mutex);
  allow_smem(reinterpret_cast<const void*>(gdn::chunk_scan_kernel), gdn::scan::kSmemBytes, scan_done, smem_mutex);

  const cudaStream_t stream = stream_of(out);
  chunks::offsets_kernel<gdn::kChunk><<<1, 1024, 0, stream>>>(args.cu_q, args.num_seqs, args.chunk_offsets);
  METRALE_CHECK_LAUNCH("gdn chunk_offsets");
  const int64_t chunks = max_chunks(d.tokens, d.num_seqs);
  if (chunks > 0) {
    METRALE_EXPECT(chunks <= 65535, std::string(op) + ": too many chunks for one call");
    gdn::chunk_prep_kernel<<<dim3(static_cast<unsigned>(d.k_heads), static_cast<unsigned>(chunks)), gdn::kPrepThreads,
                             gdn::prep::kSmemBytes, stream>>>(args);
    METRALE_CHECK_LAUNCH("gdn chunk_prep");
  }
  gdn::chunk_scan_kernel<<<dim3(static_cast<unsigned>(d.dv / gdn::kTileV), static_cast<unsigned>(d.v_heads),
                                static_cast<unsigned>(d.num_seqs)),
                           gdn::kScanThreads, gdn::scan::kSmemBytes, stream>>>(args);
  METRALE_CHECK_LAUNCH("gdn chunk_scan");
}

}  // namespace cuda

size_t gated_delta_rule_workspace_bytes(Device device, int64_t num_tokens, int64_t num_seqs, int64_t num_v_heads,
                                        int64_t key_head_dim, int64_t value_head_dim) {
  (void)key_head_dim;
  (void)value_head_dim;
  if (!device.is_cuda()) return 0;
  return cuda::chunk_offsets_bytes(num_seqs) + static_cast<size_t>(cuda::max_chunks(num_tokens, num_seqs)) *
                                                   static_cast<size_t>(num_v_heads) * sizeof(cuda::gdn::ChunkRecord);
}

}  // namespace metrale::kernels
