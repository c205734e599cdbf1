// The glm5_next kernels alone, on one layer of the GLM-5.3-Flash shape (glm_deepseek.md §2): KDA at
// 64 heads of 128 (recurrent decode at batch 1 to 128, chunked prefill of 8K and 32K tokens as one
// sequence and as several), the mHC map of one site (D = 4096, n = 4) for decode and prefill
// batches, and DSA (the pool selection and the sparse absorbed attention of 64 heads over the
// 512-wide latents, at 1K and 16K context, and the absorption matmuls). tools/device/glm5_bench.sh
// runs it next to flash-linear-attention's KDA on the same shapes.
//
// Timing as bench/gdn_kernel_bench.cpp: an L2 flush of 256 MB before every repetition, CUDA events
// around the call, the median. The byte counts are the fewest bytes each call must move (inputs
// once, outputs once), for the achieved bandwidth.
// Usage: metrale_glm5_bench [--reps N] [--json FILE] [--only "CASE NAME"]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dsa.h"
#include "kernels/mhc.h"
#include "kernels/kda.h"
#include "kernels/linear.h"
#include "kernels/random_fill.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace metrale {
namespace {

constexpr int64_t kHeads = 64, kHeadDim = 128, kP = kHeads * kHeadDim;  // KDA
constexpr int64_t kHidden = 4096, kStreams = 4;                          // mHC
constexpr int64_t kMlaHeads = 64, kLatent = 512, kNope = 256;            // DSA attention
constexpr int64_t kIndexHeads = 32, kIndexDim = 128, kPool = 16, kTopPools = 2048 / kPool, kBlock = 64;
constexpr size_t kFlushBytes = size_t{256} << 20;

struct Result {
  std::string name;
  double ms;
  double bytes;
};

class Bench {
 public:
  Bench(int reps, std::string only)
      : reps_(reps), only_(std::move(only)), flush_(DType::kU8, {static_cast<int64_t>(kFlushBytes)}, Device::cuda()) {
    stream_ = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  }
  bool wants(const std::string& name) const { return only_.empty() || name == only_; }
  double time(const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<std::unique_ptr<CudaEvent>> starts, stops;
    for (int i = 0; i < reps_; ++i) {
      METRALE_CUDA_CHECK(cudaMemsetAsync(flush_->data(), 0, kFlushBytes, stream_));
      starts.push_back(std::make_unique<CudaEvent>());
      stops.push_back(std::make_unique<CudaEvent>());
      starts.back()->record(stream_);
      fn();
      stops.back()->record(stream_);
    }
    stops.back()->synchronize();
    std::vector<double> ms;
    for (int i = 0; i < reps_; ++i) {
      ms.push_back(stops[static_cast<size_t>(i)]->elapsed_ms_since(*starts[static_cast<size_t>(i)]));
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
  void add(const std::string& name, double bytes, const std::function<void()>& fn) {
    if (!wants(name)) return;
    const double ms = time(fn);
    results_.push_back({name, ms, bytes});
    std::printf("%-40s %10.1f us", name.c_str(), ms * 1e3);
    if (bytes > 0) std::printf("   %7.0f GB/s", bytes / (ms * 1e-3) / 1e9);
    std::printf("\n");
    std::fflush(stdout);
  }
  const std::vector<Result>& results() const { return results_; }

 private:
  int reps_;
  std::string only_;
  OwnedTensor flush_;
  cudaStream_t stream_ = nullptr;
  std::vector<Result> results_;
};

OwnedTensor random_device(DType dtype, Shape shape, uint64_t seed, float mean = 0.0f, float stddev = 1.0f) {
  OwnedTensor t(dtype, shape, Device::cuda());
  kernels::RandomFillParams params;
  params.seed = seed;
  params.mean = mean;
  params.stddev = stddev;
  kernels::random_fill(*t, params);
  return t;
}

OwnedTensor int_device(const std::vector<int32_t>& values) {
  OwnedTensor host(DType::kI32, {static_cast<int64_t>(values.size())});
  std::memcpy(host->data(), values.data(), values.size() * sizeof(int32_t));
  OwnedTensor device(DType::kI32, host->shape(), Device::cuda());
  copy_tensor(*device, *host);
  return device;
}

OwnedTensor zeros_device(int64_t bytes) {
  OwnedTensor t(DType::kU8, {std::max<int64_t>(bytes, 256)}, Device::cuda());
  METRALE_CUDA_CHECK(cudaMemset(t->data(), 0, static_cast<size_t>(t->numel())));
  return t;
}

// Sequences of the given lengths, each with `ctx` cached tokens, slot s and blocks s * max_blocks...
struct Batch {
  OwnedTensor cu_q, kv_lens, slots, tables;
  int64_t tokens = 0, num_seqs = 0, max_q = 0, max_kv = 0, max_blocks = 0;
};

Batch make_batch(const std::vector<int64_t>& q_lens, int64_t ctx) {
  std::vector<int32_t> cu{0}, lens, slots;
  Batch b;
  for (size_t s = 0; s < q_lens.size(); ++s) {
    b.tokens += q_lens[s];
    b.max_q = std::max(b.max_q, q_lens[s]);
    b.max_kv = std::max(b.max_kv, ctx + q_lens[s]);
    cu.push_back(static_cast<int32_t>(b.tokens));
    lens.push_back(static_cast<int32_t>(ctx + q_lens[s]));
    slots.push_back(static_cast<int32_t>(s));
  }
  b.num_seqs = static_cast<int64_t>(q_lens.size());
  b.max_blocks = (b.max_kv + kBlock - 1) / kBlock;
  std::vector<int32_t> tables(static_cast<size_t>(b.num_seqs * b.max_blocks));
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  b.cu_q = int_device(cu);
  b.kv_lens = int_device(lens);
  b.slots = int_device(slots);
  b.tables = OwnedTensor(DType::kI32, {b.num_seqs, b.max_blocks}, Device::cuda());
  copy_tensor(*b.tables, Tensor(tables.data(), DType::kI32, {b.num_seqs, b.max_blocks}));
  return b;
}

Tensor heads_view(const Tensor& rows, int64_t column, int64_t heads, int64_t dim) {
  return Tensor(static_cast<char*>(rows.data()) + column * static_cast<int64_t>(rows.element_size()), rows.dtype(),
                {rows.size(0), heads, dim}, {rows.stride(0), dim, 1}, rows.device());
}

// ---- KDA ----

struct KdaInputs {
  OwnedTensor conv_out, f, b, A_log, dt_bias, state;
  Tensor q, k, v;
  KdaInputs(int64_t tokens, int64_t num_seqs, uint64_t seed)
      : conv_out(random_device(DType::kBF16, {tokens, 3 * kP}, seed)),
        f(random_device(DType::kBF16, {tokens, kP}, seed + 1, 0.0f, 0.5f)),
        b(random_device(DType::kBF16, {tokens, kHeads}, seed + 2)),
        A_log(random_device(DType::kF32, {kHeads}, seed + 3, 0.0f, 0.1f)),
        dt_bias(random_device(DType::kF32, {kP}, seed + 4, -4.0f, 1.0f)),
        state(random_device(DType::kF32, {num_seqs, kHeads, kHeadDim, kHeadDim}, seed + 5, 0.0f, 0.05f)) {
    q = heads_view(*conv_out, 0, kHeads, kHeadDim);
    k = heads_view(*conv_out, kP, kHeads, kHeadDim);
    v = heads_view(*conv_out, 2 * kP, kHeads, kHeadDim);
  }
};

kernels::KdaParams kda_params() {
  kernels::KdaParams p;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  return p;
}

void bench_kda_decode(Bench& bench, int64_t batch) {
  const std::string name = "kda recurrent decode b" + std::to_string(batch);
  if (!bench.wants(name)) return;
  const Batch b = make_batch(std::vector<int64_t>(static_cast<size_t>(batch), 1), 1000);
  KdaInputs in(b.tokens, b.num_seqs, 100 + static_cast<uint64_t>(batch));
  const OwnedTensor out(DType::kBF16, {b.tokens, kHeads, kHeadDim}, Device::cuda());
  kernels::KdaParams params = kda_params();
  params.max_q_len = 1;
  bench.add(name, 2.0 * static_cast<double>(in.state->nbytes()), [&] {
    kernels::kda_recurrent(in.q, in.k, in.v, *in.f, *in.b, *in.A_log, *in.dt_bias, *in.state, *b.cu_q, *b.kv_lens,
                           *b.slots, *out, params);
  });
}

void bench_kda_prefill(Bench& bench, const std::string& label, const std::vector<int64_t>& q_lens) {
  const std::string name = "kda chunked prefill " + label;
  if (!bench.wants(name)) return;
  const Batch b = make_batch(q_lens, 0);
  KdaInputs in(b.tokens, b.num_seqs, 200 + static_cast<uint64_t>(b.tokens));
  const OwnedTensor out(DType::kBF16, {b.tokens, kHeads, kHeadDim}, Device::cuda());
  const size_t ws = kernels::kda_workspace_bytes(Device::cuda(), b.tokens, b.num_seqs, kHeads, kHeadDim, kHeadDim);
  const OwnedTensor workspace(DType::kU8, {static_cast<int64_t>(ws)}, Device::cuda());
  kernels::KdaParams params = kda_params();
  params.max_q_len = b.max_q;
  params.workspace = *workspace;
  // q, k, v, f in and out written (2 bytes each), the final states written.
  const double bytes = static_cast<double>(b.tokens) * 5.0 * kP * 2.0 + static_cast<double>(in.state->nbytes());
  bench.add(name, bytes, [&] {
    kernels::kda_chunked(in.q, in.k, in.v, *in.f, *in.b, *in.A_log, *in.dt_bias, *in.state, *b.cu_q, *b.kv_lens,
                         *b.slots, *out, params);
  });
}

// ---- mHC ----

void bench_hc(Bench& bench, int64_t tokens) {
  const std::string pre_name = "mhc_pre T" + std::to_string(tokens), post_name = "mhc_post T" + std::to_string(tokens);
  if (!bench.wants(pre_name) && !bench.wants(post_name)) return;
  const int64_t mix = (2 + kStreams) * kStreams;
  const OwnedTensor X = random_device(DType::kBF16, {tokens, kStreams, kHidden}, 300);
  const OwnedTensor fn = random_device(DType::kBF16, {mix, kStreams * kHidden}, 301, 0.0f, 0.02f);
  const OwnedTensor base = random_device(DType::kBF16, {mix}, 302, 0.0f, 0.5f);
  const OwnedTensor scale = random_device(DType::kBF16, {3}, 303, 1.0f, 0.1f);
  const OwnedTensor post(DType::kF32, {tokens, kStreams}, Device::cuda());
  const OwnedTensor comb(DType::kF32, {tokens, kStreams, kStreams}, Device::cuda());
  const OwnedTensor h(DType::kBF16, {tokens, kHidden}, Device::cuda());
  const OwnedTensor ws =
      zeros_device(static_cast<int64_t>(kernels::mhc_pre_workspace_bytes(Device::cuda(), tokens, kStreams, kHidden)));
  kernels::MhcParams params;
  params.workspace = *ws;
  const double pre_bytes = static_cast<double>(X->nbytes() + fn->nbytes() + h->nbytes());
  bench.add(pre_name, pre_bytes, [&] { kernels::mhc_pre(*X, *fn, *base, *scale, *post, *comb, *h, params); });
  bench.add(post_name, 2.0 * static_cast<double>(X->nbytes()) + static_cast<double>(h->nbytes()),
            [&] { kernels::mhc_post(*X, *h, *post, *comb, *X); });
}

// ---- DSA ----

// One DSA layer's caches for a batch at `ctx` cached tokens, filled with random rows.
struct DsaLayer {
  OwnedTensor latent, pools;
  DsaLayer(const Batch& b, uint64_t seed)
      : latent(random_device(DType::kBF16, {b.num_seqs * b.max_blocks, kBlock, kLatent}, seed, 0.0f, 0.5f)),
        pools(random_device(DType::kBF16, {b.num_seqs * b.max_blocks, kBlock / kPool, kIndexDim}, seed + 1)) {}
};

void bench_dsa(Bench& bench, const std::string& label, int64_t rows_per_seq, int64_t seqs, int64_t ctx) {
  const Batch b = make_batch(std::vector<int64_t>(static_cast<size_t>(seqs), rows_per_seq), ctx);
  const DsaLayer layer(b, 400 + static_cast<uint64_t>(ctx));
  const OwnedTensor q_index = random_device(DType::kBF16, {b.tokens, kIndexHeads, kIndexDim}, 410);
  const OwnedTensor weights = random_device(DType::kBF16, {b.tokens, kIndexHeads}, 411);
  const OwnedTensor selected(DType::kI32, {b.tokens, kTopPools}, Device::cuda());
  kernels::DsaSelectParams sp;
  sp.kpool = kPool;
  sp.top_pools = kTopPools;
  sp.score_scale = 1.0f / std::sqrt(static_cast<float>(kIndexDim));
  sp.weight_scale = 1.0f / std::sqrt(static_cast<float>(kIndexHeads));
  sp.max_kv_len = b.max_kv;
  const OwnedTensor select_ws = zeros_device(
      static_cast<int64_t>(kernels::dsa_select_workspace_bytes(Device::cuda(), b.tokens, b.max_kv, kPool)));
  sp.workspace = *select_ws;
  const double pool_bytes = static_cast<double>(b.max_kv / kPool) * kIndexDim * 2.0 * static_cast<double>(seqs);
  bench.add("dsa select " + label, pool_bytes + static_cast<double>(q_index->nbytes()), [&] {
    kernels::dsa_select(*q_index, *weights, *layer.pools, *b.cu_q, *b.kv_lens, *b.tables, *selected, sp);
  });
  kernels::dsa_select(*q_index, *weights, *layer.pools, *b.cu_q, *b.kv_lens, *b.tables, *selected, sp);
  const OwnedTensor q = random_device(DType::kBF16, {b.tokens, kMlaHeads, kLatent}, 412, 0.0f, 0.1f);
  const OwnedTensor out(DType::kBF16, {b.tokens, kMlaHeads, kLatent}, Device::cuda());
  kernels::DsaAttentionParams ap;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(kNope));
  ap.kpool = kPool;
  ap.max_kv_len = b.max_kv;
  const int splits = kernels::dsa_attention_splits(Device::cuda(), b.tokens, kMlaHeads, kTopPools);
  const OwnedTensor attn_ws = zeros_device(static_cast<int64_t>(
      kernels::dsa_attention_workspace_bytes(Device::cuda(), b.tokens, kMlaHeads, kLatent, splits)));
  ap.workspace = *attn_ws;
  // Every query row reads its attended latents (at most index_topk + kp - 1 of them).
  const double attended = static_cast<double>(std::min<int64_t>(ctx + rows_per_seq, 2048 + kPool - 1));
  const double attn_bytes = static_cast<double>(b.tokens) * attended * kLatent * 2.0 + 2.0 * static_cast<double>(q->nbytes());
  bench.add("dsa attention " + label + " (" + std::to_string(splits) + " splits)", attn_bytes, [&] {
    kernels::dsa_attention(*q, *layer.latent, *selected, *b.cu_q, *b.kv_lens, *b.tables, *out, ap);
  });
  // The two absorptions of the step (weights [64, 512, 256] and [64, 256, 512], bf16).
  const OwnedTensor q_nope = random_device(DType::kBF16, {b.tokens, kMlaHeads, kNope}, 413);
  const OwnedTensor w_uk_t = random_device(DType::kBF16, {kMlaHeads, kLatent, kNope}, 414, 0.0f, 0.05f);
  const OwnedTensor w_uv = random_device(DType::kBF16, {kMlaHeads, kNope, kLatent}, 415, 0.0f, 0.05f);
  const OwnedTensor o_nope(DType::kBF16, {b.tokens, kMlaHeads, kNope}, Device::cuda());
  const double absorb_bytes = static_cast<double>(w_uk_t->nbytes() + w_uv->nbytes());
  bench.add("mla absorb q+o " + label, absorb_bytes, [&] {
    kernels::mla_absorb(*q_nope, *w_uk_t, *q);
    kernels::mla_absorb(*out, *w_uv, *o_nope);
  });
}

int run(int argc, char** argv) {
  int reps = 30;
  std::string json, only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = argv[++i];
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--json FILE] [--only \"CASE NAME\"]\n", argv[0]);
      return 2;
    }
  }
  if (!cuda_available()) {
    std::fprintf(stderr, "metrale_glm5_bench: no GPU\n");
    return 1;
  }
  kernels::linear_prepare(Device::cuda());
  Bench bench(reps, only);
  for (const int64_t batch : {1, 8, 32, 128}) bench_kda_decode(bench, batch);
  bench_kda_prefill(bench, "8K", {8192});
  bench_kda_prefill(bench, "32K", {32768});
  bench_kda_prefill(bench, "8K as 4x2K", {2048, 2048, 2048, 2048});
  bench_kda_prefill(bench, "8K mixed 16 seqs",
                    {1024, 17, 900, 64, 1500, 333, 700, 120, 1000, 65, 400, 600, 250, 99, 500, 420});
  for (const int64_t tokens : {1, 8, 32, 128, 8192}) bench_hc(bench, tokens);
  bench_dsa(bench, "decode b1 1K", 1, 1, 1024);
  bench_dsa(bench, "decode b1 16K", 1, 1, 16384);
  bench_dsa(bench, "decode b32 16K", 1, 32, 16384);
  bench_dsa(bench, "prefill 8K rows at 8K", 8192, 1, 8192);
  synchronize(Device::cuda());
  if (!json.empty()) {
    std::FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f, "{\"engine\": \"metrale\", \"results\": [");
    for (size_t i = 0; i < bench.results().size(); ++i) {
      const Result& r = bench.results()[i];
      std::fprintf(f, "%s{\"name\": \"%s\", \"us\": %.3f, \"bytes\": %.0f}", i ? ", " : "", r.name.c_str(), r.ms * 1e3,
                   r.bytes);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace metrale

int main(int argc, char** argv) {
  try {
    return metrale::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "metrale_glm5_bench: %s\n", e.what());
    return 1;
  }
}
