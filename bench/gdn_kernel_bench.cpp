// The Gated DeltaNet kernels alone, on one layer of the Qwen3.5 / Qwen3-Next shape (32 value heads,
// 16 key heads, dk = dv = 128, conv kernel 4, bf16 activations, fp32 state): the recurrent decode
// at batch 1 to 128, the chunked prefill of 8K and 32K tokens as one sequence and as several, and
// the bandwidth-bound pieces (conv1d, gates, gated RMSNorm). tools/device/gdn_bench.sh runs it next
// to flash-linear-attention on the same shapes.
//
// Timing as triton.testing.do_bench: every repetition is preceded by a 256 MB memset that flushes
// the L2, and is bracketed by its own pair of CUDA events; the median is reported. All repetitions
// are queued before the first synchronisation, so the launch gaps are hidden behind the flushes.
// Usage: metrale_gdn_bench [--reps N] [--json FILE] [--only "CASE NAME"]
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

#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"
#include "kernels/gated_rms_norm.h"
#include "kernels/random_fill.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace metrale {
namespace {

constexpr int64_t kKeyHeads = 16, kValueHeads = 32, kHeadDim = 128, kConvKernel = 4;
constexpr int64_t kKeyDim = kKeyHeads * kHeadDim, kValueDim = kValueHeads * kHeadDim;
constexpr int64_t kConvDim = 2 * kKeyDim + kValueDim;
constexpr size_t kFlushBytes = size_t{256} << 20;

struct Result {
  std::string name;
  double ms;
  double bytes;  // minimum device-memory traffic, for the achieved bandwidth (0: not counted)
};

class Bench {
 public:
  Bench(int reps, std::string only)
      : reps_(reps), only_(std::move(only)), flush_(DType::kU8, {static_cast<int64_t>(kFlushBytes)}, Device::cuda()) {
    stream_ = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  }

  // Median milliseconds of `fn` over the repetitions, each after an L2 flush.
  double time(const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();  // warm-up: attributes, first-launch costs
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
    for (int i = 0; i < reps_; ++i) ms.push_back(stops[static_cast<size_t>(i)]->elapsed_ms_since(*starts[static_cast<size_t>(i)]));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

  void add(const std::string& name, double bytes, const std::function<void()>& fn) {
    if (!only_.empty() && name != only_) return;
    const double ms = time(fn);
    results_.push_back({name, ms, bytes});
    std::printf("%-34s %10.1f us", name.c_str(), ms * 1e3);
    if (bytes > 0) std::printf("   %7.0f GB/s", bytes / (ms * 1e-3) / 1e9);
    std::printf("\n");
    std::fflush(stdout);
  }

  const std::vector<Result>& results() const { return results_; }

 private:
  int reps_;
  std::string only_;  // run only the case of this name (for profilers), when not empty
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

// Sequences of the given lengths, each with `ctx` cached tokens, in slots 0..S-1.
struct Batch {
  OwnedTensor cu_q, kv_lens, slots;
  int64_t tokens = 0, num_seqs = 0, max_q = 0;
};

Batch make_batch(const std::vector<int64_t>& q_lens, int64_t ctx) {
  std::vector<int32_t> cu{0}, lens, slots;
  Batch b;
  for (size_t s = 0; s < q_lens.size(); ++s) {
    b.tokens += q_lens[s];
    b.max_q = std::max(b.max_q, q_lens[s]);
    cu.push_back(static_cast<int32_t>(b.tokens));
    lens.push_back(static_cast<int32_t>(ctx + q_lens[s]));
    slots.push_back(static_cast<int32_t>(s));
  }
  b.num_seqs = static_cast<int64_t>(q_lens.size());
  b.cu_q = int_device(cu);
  b.kv_lens = int_device(lens);
  b.slots = int_device(slots);
  return b;
}

Tensor heads_view(const Tensor& rows, int64_t column, int64_t heads, int64_t dim) {
  return Tensor(static_cast<char*>(rows.data()) + column * static_cast<int64_t>(rows.element_size()), rows.dtype(),
                {rows.size(0), heads, dim}, {rows.stride(0), dim, 1}, rows.device());
}

// One layer's GDN inputs for a batch: the conv output (q | k | v columns), gates, state slots.
struct LayerInputs {
  OwnedTensor conv_out, g, beta, state;
  Tensor q, k, v;
  LayerInputs(int64_t tokens, int64_t num_seqs, uint64_t seed)
      : conv_out(random_device(DType::kBF16, {tokens, kConvDim}, seed)),
        g(DType::kF32, {tokens, kValueHeads}, Device::cuda()),
        beta(DType::kF32, {tokens, kValueHeads}, Device::cuda()),
        state(random_device(DType::kF32, {num_seqs, kValueHeads, kHeadDim, kHeadDim}, seed + 1, 0.0f, 0.05f)) {
    q = heads_view(*conv_out, 0, kKeyHeads, kHeadDim);
    k = heads_view(*conv_out, kKeyDim, kKeyHeads, kHeadDim);
    v = heads_view(*conv_out, 2 * kKeyDim, kValueHeads, kHeadDim);
    const OwnedTensor ab = random_device(DType::kBF16, {tokens, 2 * kValueHeads}, seed + 2);
    const OwnedTensor A_log = random_device(DType::kF32, {kValueHeads}, seed + 3, 0.0f, 0.5f);
    const OwnedTensor dt_bias = random_device(DType::kF32, {kValueHeads}, seed + 4, 0.0f, 0.5f);
    kernels::gdn_gates(ab->slice(1, 0, kValueHeads), ab->slice(1, kValueHeads, 2 * kValueHeads), *A_log, *dt_bias, *g,
                       *beta);
  }
};

void bench_decode(Bench& bench, int64_t batch) {
  const Batch b = make_batch(std::vector<int64_t>(static_cast<size_t>(batch), 1), 1000);
  LayerInputs in(b.tokens, b.num_seqs, 100 + static_cast<uint64_t>(batch));
  const OwnedTensor out(DType::kBF16, {b.tokens, kValueHeads, kHeadDim}, Device::cuda());
  kernels::GatedDeltaRuleParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  params.max_q_len = 1;
  const double state_bytes = 2.0 * static_cast<double>(in.state->nbytes());
  bench.add("recurrent decode b" + std::to_string(batch), state_bytes, [&] {
    kernels::gated_delta_rule_recurrent(in.q, in.k, in.v, *in.g, *in.beta, *in.state, *b.cu_q, *b.kv_lens, *b.slots,
                                        *out, params);
  });
}

void bench_prefill(Bench& bench, const std::string& name, const std::vector<int64_t>& q_lens) {
  const Batch b = make_batch(q_lens, 0);
  LayerInputs in(b.tokens, b.num_seqs, 200 + static_cast<uint64_t>(b.tokens));
  const OwnedTensor out(DType::kBF16, {b.tokens, kValueHeads, kHeadDim}, Device::cuda());
  const size_t ws_bytes = kernels::gated_delta_rule_workspace_bytes(Device::cuda(), b.tokens, b.num_seqs, kValueHeads,
                                                                    kHeadDim, kHeadDim);
  const OwnedTensor workspace(DType::kU8, {static_cast<int64_t>(ws_bytes)}, Device::cuda());
  kernels::GatedDeltaRuleParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  params.max_q_len = b.max_q;
  params.workspace = *workspace;
  // q, k, v in, out written: the floor without intermediates.
  const double bytes = static_cast<double>(b.tokens) * (kConvDim + kValueDim) * 2.0;
  bench.add("chunked prefill " + name, bytes, [&] {
    kernels::gated_delta_rule_chunked(in.q, in.k, in.v, *in.g, *in.beta, *in.state, *b.cu_q, *b.kv_lens, *b.slots,
                                      *out, params);
  });
  if (q_lens.size() == 1) {
    const OwnedTensor conv_in = random_device(DType::kBF16, {b.tokens, kConvDim}, 7);
    const OwnedTensor weight = random_device(DType::kBF16, {kConvDim, kConvKernel}, 8, 0.0f, 0.3f);
    const OwnedTensor conv_state(DType::kBF16, {b.num_seqs, kConvKernel - 1, kConvDim}, Device::cuda());
    kernels::CausalConv1dParams conv_params;
    conv_params.max_q_len = b.max_q;
    bench.add("conv1d prefill " + name, 2.0 * static_cast<double>(conv_in->nbytes()), [&] {
      kernels::causal_conv1d(*conv_in, *weight, *conv_state, *b.cu_q, *b.kv_lens, *b.slots, *in.conv_out,
                             conv_params);
    });
    const OwnedTensor z = random_device(DType::kBF16, {b.tokens, kValueHeads, kHeadDim}, 9);
    const OwnedTensor norm_weight = random_device(DType::kBF16, {kHeadDim}, 10, 1.0f, 0.1f);
    bench.add("gated rms norm " + name, 3.0 * static_cast<double>(z->nbytes()),
              [&] { kernels::gated_rms_norm(*out, *z, *norm_weight, *out, 1e-6f); });
  }
}

void bench_conv_decode(Bench& bench, int64_t batch) {
  const Batch b = make_batch(std::vector<int64_t>(static_cast<size_t>(batch), 1), 1000);
  const OwnedTensor conv_in = random_device(DType::kBF16, {b.tokens, kConvDim}, 11);
  const OwnedTensor conv_out(DType::kBF16, {b.tokens, kConvDim}, Device::cuda());
  const OwnedTensor weight = random_device(DType::kBF16, {kConvDim, kConvKernel}, 12, 0.0f, 0.3f);
  const OwnedTensor conv_state = random_device(DType::kBF16, {batch, kConvKernel - 1, kConvDim}, 13);
  kernels::CausalConv1dParams params;
  params.max_q_len = 1;
  bench.add("conv1d decode b" + std::to_string(batch), 2.0 * static_cast<double>(conv_state->nbytes()), [&] {
    kernels::causal_conv1d(*conv_in, *weight, *conv_state, *b.cu_q, *b.kv_lens, *b.slots, *conv_out, params);
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
    std::fprintf(stderr, "metrale_gdn_bench: no GPU\n");
    return 1;
  }
  Bench bench(reps, only);
  for (const int64_t batch : {1, 8, 32, 128}) bench_decode(bench, batch);
  bench_prefill(bench, "8K", {8192});
  bench_prefill(bench, "32K", {32768});
  bench_prefill(bench, "8K as 4x2K", {2048, 2048, 2048, 2048});
  bench_prefill(bench, "32K as 8x4K", std::vector<int64_t>(8, 4096));
  bench_prefill(bench, "8K mixed 16 seqs", {1024, 17, 900, 64, 1500, 333, 700, 120, 1000, 65, 400, 600, 250, 99, 500, 420});
  bench_conv_decode(bench, 1);
  bench_conv_decode(bench, 128);
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
    std::fprintf(stderr, "metrale_gdn_bench: %s\n", e.what());
    return 1;
  }
}
