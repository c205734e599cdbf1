// The qwen4_exp kernels alone (CUDA builds), on the released per-layer shapes (qwen.md §2.6:
// H 2560, N 4, 16 query / 2 KV heads of 256, QSA 4 index heads x 128, c 4, budget 2048; PLE 16
// heads x 160): QSA at decode batch 1 to 128 and 1K / 16K / 32K contexts (block keys of the step,
// scores, top-k, sparse attention; dense paged_attention over the same context for comparison), PLE
// ids, row gather from a device table and zero-copy from pinned host memory, gating and the dilated
// conv, and the hyper-connection pieces of one site.
//
// Timing as metrale_gdn_bench: each repetition follows a 256 MB memset that flushes the L2 and has its
// own pair of events; the median is printed with the achieved bandwidth over the minimum bytes.
// Usage: metrale_qwen4_bench [--reps N] [--only "CASE NAME"] [--host-rows N]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/causal_conv1d.h"
#include "kernels/hyper_connection.h"
#include "kernels/ple_gate.h"
#include "kernels/ple_gather.h"
#include "kernels/ple_ngram.h"
#include "kernels/qsa.h"
#include "kernels/random_fill.h"
#include "runtime/buffer.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace metrale {
namespace {

constexpr int64_t kHidden = 2560, kStreams = 4, kRank = 320;
constexpr int64_t kHeads = 16, kKvHeads = 2, kHeadDim = 256;
constexpr int64_t kIndexHeads = 4, kIndexDim = 128, kCompress = 4, kTopk = 512, kRotary = 64;
constexpr int64_t kPleHeads = 16, kPleWidth = 160, kNgram = 3, kPleKernel = 4;
constexpr int64_t kBlockSize = 64;
constexpr size_t kFlushBytes = size_t{256} << 20;

class Bench {
 public:
  Bench(int reps, std::string only)
      : reps_(reps), only_(std::move(only)), flush_(DType::kU8, {static_cast<int64_t>(kFlushBytes)}, Device::cuda()) {
    stream_ = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  }

  void add(const std::string& name, double bytes, const std::function<void()>& fn) {
    if (!only_.empty() && name != only_) return;
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
    for (int i = 0; i < reps_; ++i) ms.push_back(stops[static_cast<size_t>(i)]->elapsed_ms_since(*starts[static_cast<size_t>(i)]));
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    std::printf("%-44s %10.1f us", name.c_str(), median * 1e3);
    if (bytes > 0) std::printf("   %7.0f GB/s  (%.1f MB)", bytes / (median * 1e-3) / 1e9, bytes / 1e6);
    std::printf("\n");
    std::fflush(stdout);
  }

 private:
  int reps_;
  std::string only_;
  OwnedTensor flush_;
  cudaStream_t stream_ = nullptr;
};

OwnedTensor random_device(DType dtype, Shape shape, uint64_t seed, float stddev = 1.0f) {
  OwnedTensor t(dtype, shape, Device::cuda());
  kernels::RandomFillParams params;
  params.seed = seed;
  params.stddev = stddev;
  kernels::random_fill(*t, params);
  return t;
}

template <typename T>
OwnedTensor device_copy(const std::vector<T>& values, DType dtype, Shape shape) {
  OwnedTensor host(dtype, shape);
  std::memcpy(host->data(), values.data(), values.size() * sizeof(T));
  OwnedTensor device(dtype, shape, Device::cuda());
  copy_tensor(*device, *host);
  return device;
}

// `batch` decode rows, each with `ctx` cached tokens, in shuffled pages.
struct Decode {
  int64_t batch, ctx, table_width, num_blocks;
  OwnedTensor cu_q, kv_lens, tables, positions, slots;
  Decode(int64_t batch_, int64_t ctx_) : batch(batch_), ctx(ctx_) {
    table_width = (ctx + 1 + kBlockSize - 1) / kBlockSize;
    num_blocks = batch * table_width;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks));
    for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<int32_t>(i);
    std::shuffle(pool.begin(), pool.end(), std::mt19937_64(7));
    std::vector<int32_t> cu{0}, lens, pos, slot;
    for (int64_t s = 0; s < batch; ++s) {
      cu.push_back(static_cast<int32_t>(s + 1));
      lens.push_back(static_cast<int32_t>(ctx + 1));
      pos.push_back(static_cast<int32_t>(ctx));
      slot.push_back(pool[static_cast<size_t>(s * table_width + ctx / kBlockSize)] * static_cast<int32_t>(kBlockSize) +
                     static_cast<int32_t>(ctx % kBlockSize));
    }
    cu_q = device_copy(cu, DType::kI32, {batch + 1});
    kv_lens = device_copy(lens, DType::kI32, {batch});
    tables = device_copy(pool, DType::kI32, {batch, table_width});
    positions = device_copy(pos, DType::kI32, {batch});
    slots = device_copy(slot, DType::kI32, {batch});
  }
};

void bench_qsa(Bench& bench, int64_t batch, int64_t ctx) {
  const Decode d(batch, ctx);
  const std::string tag = " b" + std::to_string(batch) + " ctx" + std::to_string(ctx / 1024) + "K";
  const OwnedTensor index_cache = random_device(DType::kBF16, {d.num_blocks, kBlockSize, kIndexDim}, 1);
  const OwnedTensor block_keys = random_device(DType::kBF16, {d.num_blocks, kBlockSize / kCompress, kIndexDim}, 2);
  const OwnedTensor k_cache = random_device(DType::kBF16, {d.num_blocks, kBlockSize, kKvHeads, kHeadDim}, 3);
  const OwnedTensor v_cache = random_device(DType::kBF16, {d.num_blocks, kBlockSize, kKvHeads, kHeadDim}, 4);
  const OwnedTensor q_idx = random_device(DType::kBF16, {batch, kIndexHeads, kIndexDim}, 5);
  const OwnedTensor k_tok = random_device(DType::kBF16, {batch, kIndexDim}, 6);
  const OwnedTensor norm = random_device(DType::kBF16, {kIndexDim}, 7, 0.1f);
  std::vector<float> freq;
  for (int64_t i = 0; i < kRotary / 2; ++i) freq.push_back(static_cast<float>(std::pow(1e7, -2.0 * i / kRotary)));
  const OwnedTensor inv_freq = device_copy(freq, DType::kF32, {kRotary / 2});
  const int64_t nb = (ctx + 1) / kCompress;
  const OwnedTensor scores(DType::kF32, {batch, nb}, Device::cuda());
  const OwnedTensor selected(DType::kI32, {batch, kTopk}, Device::cuda());
  const OwnedTensor q = random_device(DType::kBF16, {batch, kHeads, kHeadDim}, 8);
  const OwnedTensor out(DType::kBF16, {batch, kHeads, kHeadDim}, Device::cuda());
  kernels::QsaParams params;
  params.compress_ratio = static_cast<int>(kCompress);
  params.block_topk = static_cast<int>(kTopk);
  params.rope.rotary_dim = static_cast<int>(kRotary);
  params.max_q_len = 1;
  params.max_kv_len = ctx + 1;
  const double key_bytes = static_cast<double>(batch * nb * kIndexDim * 2);
  bench.add("qsa prologue" + tag, 0, [&] {
    kernels::qsa_index_prologue(*q_idx, *k_tok, *norm, *d.positions, *inv_freq, *d.slots, *index_cache, params);
  });
  bench.add("qsa block keys (new)" + tag, 0, [&] {
    kernels::qsa_block_keys(*index_cache, *norm, *inv_freq, *d.cu_q, *d.kv_lens, *d.tables, *block_keys, params);
  });
  bench.add("qsa scores" + tag, key_bytes,
            [&] { kernels::qsa_scores(*q_idx, *block_keys, *d.cu_q, *d.kv_lens, *d.tables, *scores, params); });
  kernels::qsa_scores(*q_idx, *block_keys, *d.cu_q, *d.kv_lens, *d.tables, *scores, params);
  bench.add("qsa top-k" + tag, static_cast<double>(batch * nb * 4),
            [&] { kernels::qsa_topk(*scores, *d.cu_q, *d.kv_lens, *selected, params); });
  kernels::qsa_topk(*scores, *d.cu_q, *d.kv_lens, *selected, params);
  const OwnedTensor workspace(
      DType::kU8,
      {static_cast<int64_t>(std::max<size_t>(16, kernels::qsa_attention_workspace_bytes(batch, kHeads, kKvHeads, kHeadDim, kTopk, kCompress)))},
      Device::cuda());
  kernels::QsaAttentionParams attention;
  attention.scale = 1.0f / 16.0f;
  attention.compress_ratio = static_cast<int>(kCompress);
  attention.block_topk = static_cast<int>(kTopk);
  attention.max_q_len = 1;
  attention.max_kv_len = ctx + 1;
  attention.workspace = *workspace;
  const int64_t listed = std::min<int64_t>(ctx + 1, kTopk * kCompress + (ctx + 1) % kCompress);
  bench.add("qsa sparse attention" + tag, static_cast<double>(batch * kKvHeads * listed * kHeadDim * 4), [&] {
    kernels::qsa_attention(*q, *k_cache, *v_cache, *d.cu_q, *d.kv_lens, *d.tables, *selected, *out, attention);
  });
  const OwnedTensor dense_workspace(
      DType::kU8,
      {static_cast<int64_t>(std::max<size_t>(
          16, kernels::paged_attention_workspace_bytes(batch, batch, kHeads, kHeadDim, ctx + 1)))},
      Device::cuda());
  kernels::AttentionParams dense;
  dense.scale = 1.0f / 16.0f;
  dense.max_q_len = 1;
  dense.max_kv_len = ctx + 1;
  dense.workspace = *dense_workspace;
  bench.add("dense paged attention (reference)" + tag, static_cast<double>(batch * kKvHeads * (ctx + 1) * kHeadDim * 4),
            [&] { kernels::paged_attention(*q, *k_cache, *v_cache, *d.cu_q, *d.kv_lens, *d.tables, *out, dense); });
}

void bench_ple(Bench& bench, int64_t tokens, int64_t host_rows) {
  const std::string tag = " T" + std::to_string(tokens);
  // Ids.
  std::vector<int32_t> tok(static_cast<size_t>(tokens)), cu{0, static_cast<int32_t>(tokens)};
  std::mt19937_64 rng(3);
  for (auto& t : tok) t = static_cast<int32_t>(rng() % 248320);
  const kernels::PleHeadTable table = kernels::ple_head_table(20000000, kPleHeads, 0, 128);
  const OwnedTensor token_ids = device_copy(tok, DType::kI32, {tokens});
  const OwnedTensor cu_q = device_copy(cu, DType::kI32, {2});
  const OwnedTensor kv_lens = device_copy(std::vector<int32_t>{static_cast<int32_t>(tokens + 100)}, DType::kI32, {1});
  const OwnedTensor slots = device_copy(std::vector<int32_t>{0}, DType::kI32, {1});
  const OwnedTensor history = device_copy(std::vector<int64_t>{5, 6}, DType::kI64, {1, kNgram - 1});
  const OwnedTensor mult = device_copy(kernels::ple_layer_multipliers(248320, kNgram, 0, 1234), DType::kI64, {kNgram});
  const OwnedTensor sizes = device_copy(table.sizes, DType::kI64, {kPleHeads});
  const OwnedTensor offsets = device_copy(table.offsets, DType::kI64, {kPleHeads});
  const OwnedTensor ids(DType::kI64, {tokens, kPleHeads}, Device::cuda());
  kernels::PleNgramParams np;
  np.eos_token_id = 248044;
  np.ngram_size = static_cast<int>(kNgram);
  np.heads_per_ngram = static_cast<int>(kPleHeads / (kNgram - 1));
  np.write_history = false;
  bench.add("ple ids" + tag, 0, [&] {
    kernels::ple_ngram_ids(*token_ids, *history, *cu_q, *kv_lens, *slots, *mult, *sizes, *offsets, *ids, np);
  });
  // Gather rows of a table of `host_rows` rows (ids folded into it), device and pinned host.
  std::vector<int64_t> folded(static_cast<size_t>(tokens * kPleHeads));
  for (auto& id : folded) id = static_cast<int64_t>(rng() % static_cast<uint64_t>(host_rows));
  const OwnedTensor gather_ids = device_copy(folded, DType::kI64, {tokens, kPleHeads});
  const OwnedTensor embedding(DType::kBF16, {tokens, kPleHeads * kPleWidth}, Device::cuda());
  const double gather_bytes = static_cast<double>(tokens * kPleHeads * kPleWidth * 2 * 2);
  {
    const OwnedTensor device_table = random_device(DType::kBF16, {host_rows, kPleWidth}, 9);
    bench.add("ple gather, device table" + tag, gather_bytes,
              [&] { kernels::ple_gather(*device_table, *gather_ids, *embedding); });
  }
  PinnedBuffer pinned(static_cast<size_t>(host_rows * kPleWidth * 2));
  std::memset(pinned.data(), 0x3c, pinned.size());
  const Tensor host_table(pinned.data(), DType::kBF16, {host_rows, kPleWidth});
  bench.add("ple gather, zero-copy pinned host" + tag, gather_bytes,
            [&] { kernels::ple_gather(host_table, *gather_ids, *embedding); });
  // Gating and the dilated conv.
  const int64_t width = kStreams * kHidden;
  const OwnedTensor key = random_device(DType::kBF16, {tokens, width}, 10);
  const OwnedTensor value = random_device(DType::kBF16, {tokens, kHidden}, 11);
  const OwnedTensor residual = random_device(DType::kBF16, {tokens, width}, 12);
  const OwnedTensor w = random_device(DType::kBF16, {width}, 13, 0.1f);
  const OwnedTensor gated(DType::kBF16, {tokens, width}, Device::cuda()), normed(DType::kBF16, {tokens, width}, Device::cuda());
  kernels::PleGateParams gp;
  gp.num_streams = static_cast<int>(kStreams);
  bench.add("ple gate" + tag, static_cast<double>(tokens * (4 * width + kHidden) * 2),
            [&] { kernels::ple_gate(*key, *value, *residual, *w, *w, *w, *gated, *normed, gp); });
  const OwnedTensor conv_w = random_device(DType::kBF16, {width, kPleKernel}, 14, 0.3f);
  const OwnedTensor conv_state = random_device(DType::kBF16, {1, (kPleKernel - 1) * kNgram, width}, 15);
  const OwnedTensor conv_out(DType::kBF16, {tokens, width}, Device::cuda());
  kernels::CausalConv1dParams cp;
  cp.dilation = static_cast<int>(kNgram);
  cp.residual = *gated;
  cp.max_q_len = tokens;
  cp.write_state = false;
  bench.add("ple dilated conv + residual" + tag, static_cast<double>(tokens * 3 * width * 2), [&] {
    kernels::causal_conv1d(*normed, *conv_w, *conv_state, *cu_q, *kv_lens, *slots, *conv_out, cp);
  });
}

void bench_hc(Bench& bench, int64_t tokens) {
  const std::string tag = " T" + std::to_string(tokens);
  const int64_t width = kStreams * kHidden;
  const OwnedTensor residual = random_device(DType::kBF16, {tokens, width}, 20);
  const OwnedTensor u = random_device(DType::kBF16, {tokens, kHidden}, 21);
  const OwnedTensor beta = random_device(DType::kBF16, {tokens, kStreams}, 22);
  const OwnedTensor weight = random_device(DType::kBF16, {width}, 23, 0.1f);
  const OwnedTensor normed(DType::kBF16, {tokens, width}, Device::cuda());
  kernels::HcParams params;
  params.num_streams = static_cast<int>(kStreams);
  params.update = kernels::HcUpdate::kInject;
  bench.add("hc_norm (inject)" + tag, static_cast<double>(tokens * (3 * width + kHidden) * 2),
            [&] { kernels::hc_norm(*residual, *u, *beta, *weight, *normed, params); });
  const OwnedTensor projected = random_device(DType::kBF16, {tokens, kRank + kStreams}, 24);
  const OwnedTensor act(DType::kBF16, {tokens, kRank}, Device::cuda()), b(DType::kBF16, {tokens, kStreams}, Device::cuda());
  bench.add("hc_gates" + tag, static_cast<double>(tokens * 2 * (kRank + kStreams) * 2), [&] {
    kernels::hc_gates(projected->slice(1, 0, kRank), projected->slice(1, kRank, kRank + kStreams), *act, *b, params);
  });
  const OwnedTensor up = random_device(DType::kBF16, {tokens, width}, 25);
  const OwnedTensor x(DType::kBF16, {tokens, kHidden}, Device::cuda());
  bench.add("hc_mix" + tag, static_cast<double>(tokens * (2 * width + kHidden) * 2),
            [&] { kernels::hc_mix(*up, *normed, *x, params); });
}

int run(int argc, char** argv) {
  int reps = 50;
  int64_t host_rows = int64_t{1} << 24;  // 16M rows x 320 B = 5.4 GB
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--reps" && i + 1 < argc) {
      reps = std::stoi(argv[++i]);
    } else if (arg == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else if (arg == "--host-rows" && i + 1 < argc) {
      host_rows = std::stoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: metrale_qwen4_bench [--reps N] [--only NAME] [--host-rows N]\n");
      return 2;
    }
  }
  if (!cuda_available()) {
    std::fprintf(stderr, "metrale_qwen4_bench: no GPU\n");
    return 1;
  }
  Bench bench(reps, only);
  for (int64_t batch : {1, 8, 32, 128}) {
    for (int64_t ctx : {1024 - 1, 16 * 1024 - 1, 32 * 1024 - 1}) bench_qsa(bench, batch, ctx);
  }
  for (int64_t tokens : {1, 128, 8192}) bench_ple(bench, tokens, host_rows);
  for (int64_t tokens : {1, 128, 8192}) bench_hc(bench, tokens);
  return 0;
}

}  // namespace
}  // namespace metrale

int main(int argc, char** argv) {
  try {
    return metrale::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "metrale_qwen4_bench: %s\n", e.what());
    return 1;
  }
}
