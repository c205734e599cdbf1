// CUDA kv_cache_write and paged_attention against their CPU twins, on the same bf16 inputs.
//
// Every batch is ragged and paged: block tables are shuffled (a sequence's blocks are neither
// contiguous nor ordered), every cache slot that no sequence owns holds NaN (a kernel that reads
// past a sequence's keys, or a table entry it should not, poisons its output), outputs are NaN
// before the call, and the spare table column holds garbage. Shapes cover both CUDA kernels: the
// split-KV kernel (decode, short verify blocks, with and without splitting) and the tensor-core
// prefill kernel (single and mixed sequences, decode rows inside prefill steps), head_dim 64, 128
// and 256, GQA groups 1 to 32, block sizes 8 to 128, sliding windows, strided q and out views, host
// bounds that are exact, loose or absent, and a workspace of exactly paged_attention_workspace_bytes
// followed by guard bytes.
#include "kernels/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace metrale {
namespace {

using testing::to_device;

constexpr uint16_t kBf16NaN = 0x7fc0;
constexpr double kAttentionTolerance = 1e-2;  // bf16 q/K/V/P/out, fp32 softmax and accumulation
constexpr double kRowTolerance = 3e-2;        // one (token, head) row of head_dim values (typical: 2e-3)

// Fast seeded bf16 values in [lo, hi), never zero: caches hold millions of them.
class Bf16Source {
 public:
  explicit Bf16Source(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint16_t next(float lo, float hi) {
    for (;;) {
      state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
      const float unit = static_cast<float>(state_ >> 40) * (1.0f / 16777216.0f);
      const uint16_t bits = f32_to_bf16_bits(lo + (hi - lo) * unit);
      if ((bits & 0x7fffu) != 0) return bits;
    }
  }
  void fill(std::vector<uint16_t>& values, float lo, float hi) {
    for (auto& v : values) v = next(lo, hi);
  }
  uint64_t below(uint64_t n) {
    state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
    return (state_ >> 33) % n;
  }

 private:
  uint64_t state_;
};

// A device copy of host bytes, with a contiguous view.
std::vector<uint16_t> download_bf16(const Tensor& device_contiguous) {
  std::vector<uint16_t> host(static_cast<size_t>(device_contiguous.numel()));
  copy_tensor(Tensor(host.data(), DType::kBF16, device_contiguous.shape()), device_contiguous);
  return host;
}

struct Geometry {
  int64_t heads, kv_heads, head_dim, block_size;
};

struct SeqSpec {
  int64_t cached;  // keys already in the cache before this step
  int64_t q_len;   // query rows of this step (their keys are in the cache too)
  int64_t kv_len() const { return cached + q_len; }
};

// The host side of one step: paged bf16 caches (NaN in every slot no sequence owns), metadata and q.
struct HostBatch {
  Geometry g;
  std::vector<SeqSpec> seqs;
  int64_t tokens = 0, num_blocks = 0, max_blocks = 0, max_q = 0, max_kv = 0;
  std::vector<uint16_t> k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim] bf16
  std::vector<int32_t> cu_q, kv_lens, block_tables;
  std::vector<uint16_t> q;  // [tokens, heads, head_dim] bf16, contiguous

  int64_t num_seqs() const { return static_cast<int64_t>(seqs.size()); }
  Shape cache_shape() const { return {num_blocks, g.block_size, g.kv_heads, g.head_dim}; }
  Tensor k_tensor() { return Tensor(k_cache.data(), DType::kBF16, cache_shape()); }
  Tensor v_tensor() { return Tensor(v_cache.data(), DType::kBF16, cache_shape()); }
  Tensor q_tensor() { return Tensor(q.data(), DType::kBF16, {tokens, g.heads, g.head_dim}); }
  Tensor cu_tensor() { return Tensor(cu_q.data(), DType::kI32, {num_seqs() + 1}); }
  Tensor lens_tensor() { return Tensor(kv_lens.data(), DType::kI32, {num_seqs()}); }
  Tensor tables_tensor() { return Tensor(block_tables.data(), DType::kI32, {num_seqs(), max_blocks}); }
};

HostBatch make_batch(const Geometry& g, const std::vector<SeqSpec>& seqs, uint64_t seed) {
  Bf16Source source(seed);
  HostBatch b;
  b.g = g;
  b.seqs = seqs;
  int64_t used_blocks = 0;
  for (const auto& s : seqs) {
    const int64_t blocks = (s.kv_len() + g.block_size - 1) / g.block_size;
    used_blocks += blocks;
    b.max_blocks = std::max(b.max_blocks, blocks);
    b.tokens += s.q_len;
    b.max_q = std::max(b.max_q, s.q_len);
    b.max_kv = std::max(b.max_kv, s.kv_len());
  }
  b.max_blocks += 1;               // a spare column no sequence uses: garbage the kernels must not read
  b.num_blocks = used_blocks + 3;  // and a few blocks nobody owns (NaN)
  std::vector<int32_t> free_blocks(static_cast<size_t>(b.num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), std::mt19937_64(seed));
  b.block_tables.assign(static_cast<size_t>(b.num_seqs() * b.max_blocks), -12345);
  const size_t row = static_cast<size_t>(g.kv_heads * g.head_dim);
  b.k_cache.assign(static_cast<size_t>(b.num_blocks * g.block_size) * row, kBf16NaN);
  b.v_cache.assign(b.k_cache.size(), kBf16NaN);
  size_t next_free = 0;
  b.cu_q = {0};
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t kv = seqs[s].kv_len();
    int32_t* table = b.block_tables.data() + s * static_cast<size_t>(b.max_blocks);
    for (int64_t i = 0; i < (kv + g.block_size - 1) / g.block_size; ++i) table[i] = free_blocks.at(next_free++);
    for (int64_t p = 0; p < kv; ++p) {
      const size_t slot = static_cast<size_t>(table[p / g.block_size] * g.block_size + p % g.block_size);
      for (size_t e = 0; e < row; ++e) {
        b.k_cache[slot * row + e] = source.next(-1.5f, 1.5f);
        b.v_cache[slot * row + e] = source.next(-1.0f, 1.0f);
      }
    }
    b.cu_q.push_back(b.cu_q.back() + static_cast<int32_t>(seqs[s].q_len));
    b.kv_lens.push_back(static_cast<int32_t>(kv));
  }
  b.q.resize(static_cast<size_t>(b.tokens * g.heads * g.head_dim));
  source.fill(b.q, -1.5f, 1.5f);
  return b;
}

// How a run presents q, out, bounds and workspace to the kernels.
struct RunOptions {
  int window = 0;
  bool give_bounds = true;
  int64_t extra_q_bound = 0;  // loose bounds, as a CUDA graph captured for a larger shape would pass
  int64_t extra_kv_bound = 0;
  int64_t q_pad_elems = 0;    // q is a view with rows of heads * head_dim + pad elements (pad 4: unaligned)
  int64_t out_pad_heads = 0;  // out is the middle heads of a wider [T, heads + 2 pad, D] buffer
  bool workspace = true;
};

// Runs the CUDA op and the CPU twin on the same bf16 inputs; checks every output element, the
// output padding and the workspace guard.
void check_batch(HostBatch& b, const RunOptions& options, const std::string& label) {
  SCOPED_TRACE(label);
  const Geometry& g = b.g;
  const int64_t T = b.tokens, H = g.heads, D = g.head_dim;
  kernels::AttentionParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(D));
  params.window = options.window;
  if (options.give_bounds) {
    params.max_q_len = b.max_q + options.extra_q_bound;
    params.max_kv_len = b.max_kv + options.extra_kv_bound;
  }

  // CPU reference: fp32 arithmetic on the same bf16 values.
  std::vector<float> expected(static_cast<size_t>(T * H * D));
  kernels::cpu::paged_attention(b.q_tensor(), b.k_tensor(), b.v_tensor(), b.cu_tensor(), b.lens_tensor(),
                                b.tables_tensor(), Tensor(expected.data(), DType::kF32, {T, H, D}), params);

  const OwnedTensor k_cache = to_device(b.k_tensor()), v_cache = to_device(b.v_tensor());
  const OwnedTensor cu_q = to_device(b.cu_tensor()), kv_lens = to_device(b.lens_tensor());
  const OwnedTensor tables = to_device(b.tables_tensor());
  // q: a view into a buffer with padded rows.
  const int64_t q_row = H * D + options.q_pad_elems;
  std::vector<uint16_t> q_host(static_cast<size_t>(T * q_row + 8), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(b.q.begin() + t * H * D, H * D, q_host.begin() + t * q_row);
  }
  const OwnedTensor q_buffer = to_device(Tensor(q_host.data(), DType::kBF16, {static_cast<int64_t>(q_host.size())}));
  const Tensor q(q_buffer->data(), DType::kBF16, {T, H, D}, {q_row, D, 1}, Device::cuda());
  // out: the middle heads of a NaN-filled wider buffer.
  const int64_t out_heads = H + 2 * options.out_pad_heads;
  std::vector<uint16_t> out_host(static_cast<size_t>(T * out_heads * D), kBf16NaN);
  const OwnedTensor out_buffer = to_device(Tensor(out_host.data(), DType::kBF16, {T, out_heads, D}));
  const Tensor out = out_buffer->slice(1, options.out_pad_heads, options.out_pad_heads + H);
  // Workspace: exactly the advertised bytes, then guard bytes.
  constexpr size_t kGuard = 4096;
  const size_t workspace_bytes = kernels::paged_attention_workspace_bytes(b.num_seqs(), T, H, D, params.max_kv_len);
  std::vector<uint8_t> guard_host(workspace_bytes + kGuard, 0xA5);
  const OwnedTensor workspace_buffer =
      to_device(Tensor(guard_host.data(), DType::kU8, {static_cast<int64_t>(guard_host.size())}));
  if (options.workspace && workspace_bytes > 0) {
    params.workspace =
        Tensor(workspace_buffer->data(), DType::kU8, {static_cast<int64_t>(workspace_bytes)}, Device::cuda());
  }

  kernels::paged_attention(q, *k_cache, *v_cache, *cu_q, *kv_lens, *tables, out, params);
  synchronize(Device::cuda());

  const std::vector<uint16_t> got = download_bf16(*out_buffer);
  std::vector<double> actual, reference;
  actual.reserve(expected.size());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < out_heads * D; ++c) {
      const uint16_t bits = got[static_cast<size_t>(t * out_heads * D + c)];
      const int64_t h = c / D - options.out_pad_heads;
      if (h < 0 || h >= H) {
        ASSERT_EQ(bits, kBf16NaN) << "padding head written at token " << t;
        continue;
      }
      actual.push_back(bf16_bits_to_f32(bits));
      reference.push_back(expected[static_cast<size_t>((t * H + h) * D + c % D)]);
    }
  }
  EXPECT_TRUE(testing::close_rel_l2(actual, reference, kAttentionTolerance));
  // Per (token, head) row as well, so that an error confined to one row (a lost split, a wrong
  // sequence boundary) cannot hide in the batch norm.
  double worst = 0.0;
  int64_t worst_row = -1;
  for (int64_t row = 0; row < T * H && static_cast<size_t>((row + 1) * D) <= actual.size(); ++row) {
    const std::span<const double> a(actual.data() + row * D, static_cast<size_t>(D));
    const std::span<const double> r(reference.data() + row * D, static_cast<size_t>(D));
    const double error = testing::relative_l2(a, r);
    if (!(error <= worst)) {
      worst = error;
      worst_row = row;
    }
  }
  EXPECT_LE(worst, kRowTolerance) << "token " << worst_row / H << " head " << worst_row % H;

  std::vector<uint8_t> guard_after(guard_host.size());
  copy_tensor(Tensor(guard_after.data(), DType::kU8, {static_cast<int64_t>(guard_after.size())}), *workspace_buffer);
  for (size_t i = workspace_bytes; i < guard_after.size(); ++i) {
    ASSERT_EQ(guard_after[i], 0xA5) << "workspace of " << workspace_bytes << " bytes overrun at byte " << i;
  }
}

std::string describe(const Geometry& g, const std::vector<SeqSpec>& seqs) {
  std::string text = "heads " + std::to_string(g.heads) + "/" + std::to_string(g.kv_heads) + " d " +
                     std::to_string(g.head_dim) + " bs " + std::to_string(g.block_size) + " seqs";
  for (const auto& s : seqs) text += " (" + std::to_string(s.cached) + "+" + std::to_string(s.q_len) + ")";
  return text;
}

void check(const Geometry& g, const std::vector<SeqSpec>& seqs, uint64_t seed, const RunOptions& options = {}) {
  HostBatch b = make_batch(g, seqs, seed);
  check_batch(b, options, describe(g, seqs) + " window " + std::to_string(options.window));
}

std::vector<SeqSpec> decode_batch(std::vector<int64_t> contexts) {
  std::vector<SeqSpec> seqs;
  for (const int64_t kv : contexts) seqs.push_back({kv - 1, 1});
  return seqs;
}

// ---- decode (every q_len 1): the split-KV kernel ----

TEST(CudaPagedAttention, DecodeSingleSequenceQwen3Shape) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Geometry g{32, 8, 128, 16};  // Qwen3-8B
  uint64_t seed = 100;
  for (const int64_t context : {1, 15, 16, 17, 1000, 5000, 8192}) check(g, decode_batch({context}), ++seed);
}

TEST(CudaPagedAttention, DecodeBatchesAcrossGroupsDimsAndBlockSizes) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check({16, 2, 256, 32}, decode_batch({5000, 17, 1000}), 201);  // G 8, Qwen3-Next head_dim
  check({4, 4, 64, 16}, decode_batch({1, 15, 16, 17, 33, 64, 65, 100, 200, 300, 411, 512, 513, 700, 999, 1000, 1100}),
        202);  // G 1
  std::vector<int64_t> contexts;
  Bf16Source source(203);
  for (int i = 0; i < 17; ++i) contexts.push_back(1 + static_cast<int64_t>(source.below(1500)));
  check({16, 4, 128, 32}, decode_batch(contexts), 204);           // G 4, block 32
  check({32, 2, 128, 16}, decode_batch({3000, 2, 777}), 205);     // G 16
  check({64, 2, 64, 16}, decode_batch({1200, 5}), 206);           // G 32: two 16-row chunks
  check({6, 2, 64, 8}, decode_batch({300, 40, 5}), 207);          // G 3, block 8
  check({8, 2, 128, 128}, decode_batch({129, 1000, 4000}), 208);  // block 128
}

TEST(CudaPagedAttention, DecodeBoundsAndWorkspaceVariants) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Geometry g{32, 8, 128, 16};
  RunOptions no_bounds;
  no_bounds.give_bounds = false;  // bounds derived from the shapes (T, table width)
  check(g, decode_batch({4000, 3}), 301, no_bounds);
  RunOptions loose;
  loose.extra_q_bound = 0;  // decode stays decode
  loose.extra_kv_bound = 20000;
  check(g, decode_batch({4000, 3, 100}), 302, loose);
  RunOptions no_workspace;
  no_workspace.workspace = false;  // one split per chunk
  check(g, decode_batch({6000}), 303, no_workspace);
}

// Split decode merges its partials in the last split CTA of each chunk (arrival counters the kernel
// resets) or in a separate merge kernel: both agree with the CPU twin, agree bit for bit with each
// other, and the in-kernel merge gives the same bits on every launch and on every graph replay (a
// counter left non-zero would merge early or never).
TEST(CudaPagedAttention, SplitMergeInKernelMatchesTheMergeKernel) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  struct Restore {
    bool saved = kernels::cuda::split_merge_in_kernel();
    ~Restore() { kernels::cuda::set_split_merge_in_kernel(saved); }
  } restore;
  const Geometry g{128, 4, 128, 16};  // G 32: two 16-row chunks per KV head
  // 4 sequences x 4 KV heads x 2 chunks on 132 SMs: 9 splits of the 5000-key bound, past the
  // in-kernel merge's threshold of 8.
  const std::vector<SeqSpec> seqs = decode_batch({5000, 3, 1500, 777});
  for (const bool in_kernel : {true, false}) {
    kernels::cuda::set_split_merge_in_kernel(in_kernel);
    check(g, seqs, 310, {});
  }
  HostBatch b = make_batch(g, seqs, 311);
  kernels::AttentionParams params;
  params.scale = 1.0f / std::sqrt(128.0f);
  params.max_q_len = b.max_q;
  params.max_kv_len = b.max_kv;
  const size_t workspace_bytes =
      kernels::paged_attention_workspace_bytes(b.num_seqs(), b.tokens, g.heads, g.head_dim, params.max_kv_len);
  ASSERT_GT(workspace_bytes, 0u);
  const OwnedTensor workspace(DType::kU8, {static_cast<int64_t>(workspace_bytes)}, Device::cuda());
  params.workspace = *workspace;
  const OwnedTensor q = to_device(b.q_tensor()), k_cache = to_device(b.k_tensor()), v_cache = to_device(b.v_tensor());
  const OwnedTensor cu_q = to_device(b.cu_tensor()), kv_lens = to_device(b.lens_tensor());
  const OwnedTensor tables = to_device(b.tables_tensor());
  const OwnedTensor out(DType::kBF16, {b.tokens, g.heads, g.head_dim}, Device::cuda());
  // Every launch starts from a NaN output: a launch whose merge never ran cannot show the last one's bits.
  const std::vector<uint16_t> nan_host(static_cast<size_t>(out->numel()), kBf16NaN);
  const auto poison = [&] {
    copy_tensor(*out, Tensor(const_cast<uint16_t*>(nan_host.data()), DType::kBF16, out->shape()));
  };
  const auto run = [&] {
    poison();
    kernels::paged_attention(*q, *k_cache, *v_cache, *cu_q, *kv_lens, *tables, *out, params);
  };
  const auto result = [&] { return download_bf16(*out); };
  kernels::cuda::set_split_merge_in_kernel(false);
  run();
  const std::vector<uint16_t> merged_by_kernel = result();
  kernels::cuda::set_split_merge_in_kernel(true);
  for (int i = 0; i < 4; ++i) {
    run();
    ASSERT_EQ(result(), merged_by_kernel) << "launch " << i;
  }
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  CudaGraph graph;
  graph.begin_capture(stream);
  kernels::paged_attention(*q, *k_cache, *v_cache, *cu_q, *kv_lens, *tables, *out, params);
  graph.end_capture(stream);
  for (int i = 0; i < 4; ++i) {
    poison();
    graph.launch(stream);
    ASSERT_EQ(result(), merged_by_kernel) << "graph replay " << i;
  }
}

TEST(CudaPagedAttention, WorkspaceBytesSufficeForEverySplitPlan) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  // Batch sizes around the split thresholds (on 132 SMs: 264 CTAs; 263 single-head sequences split
  // in two come closest to the bound), one KV head and eight.
  uint64_t seed = 400;
  for (const int64_t seqs : {1, 2, 3, 7, 33, 131, 263}) {
    for (const Geometry g : {Geometry{4, 1, 64, 16}, Geometry{16, 8, 128, 16}}) {
      if (g.kv_heads == 8 && seqs > 33) continue;  // past 33 x 8 CTAs nothing splits; keep the caches small
      std::vector<int64_t> contexts = {seqs == 1 ? 16384 : 3000};
      contexts.resize(static_cast<size_t>(seqs), 600);
      check(g, decode_batch(contexts), ++seed);
    }
  }
}

// ---- prefill, extend and mixed steps: the tensor-core kernel (short blocks: split-KV) ----

TEST(CudaPagedAttention, PrefillSingleSequence) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Geometry g{8, 2, 128, 16};
  uint64_t seed = 500;
  for (const int64_t cached : {0, 100}) {
    for (const int64_t q_len : {1, 2, 7, 31, 64, 65, 127, 128, 129, 300}) check(g, {{cached, q_len}}, ++seed);
  }
}

TEST(CudaPagedAttention, MixedStepsAcrossHeadDims) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<SeqSpec> mixed = {{0, 300}, {517, 1}, {33, 64}, {0, 1}, {1000, 77}, {5, 129}, {2000, 1}, {7, 0}};
  check({8, 2, 64, 16}, mixed, 601);
  check({8, 2, 128, 32}, mixed, 602);
  check({8, 2, 256, 16}, mixed, 603);
  check({12, 12, 128, 16}, mixed, 604);  // no GQA
  check({6, 2, 64, 8}, mixed, 605);      // G 3
}

TEST(CudaPagedAttention, GenericHeadDimMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  // Head sizes without a tensor-core kernel (tiny test models): decode, prefill and windows.
  const std::vector<SeqSpec> mixed = {{0, 40}, {130, 1}, {17, 9}, {0, 1}};
  check({4, 2, 16, 16}, mixed, 701);
  check({4, 1, 32, 16}, mixed, 702);
  check({6, 3, 96, 8}, mixed, 703);
  RunOptions windowed;
  windowed.window = 8;
  check({4, 2, 16, 16}, mixed, 704, windowed);
}

// f32 q, caches and out (f32 runs): the CUDA-core kernel at every head size, fp32 throughout, so it
// must agree with the CPU twin up to summation order. The caches are the batch's bf16 values widened
// (NaN where no sequence owns a slot); the KV-cache write into f32 caches is checked bit for bit.
void check_f32(const Geometry& g, const std::vector<SeqSpec>& seqs, uint64_t seed, int window = 0) {
  HostBatch b = make_batch(g, seqs, seed);
  SCOPED_TRACE(describe(g, seqs) + " f32 window " + std::to_string(window));
  const auto widen = [](const std::vector<uint16_t>& bits) {
    std::vector<float> values(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) values[i] = bf16_bits_to_f32(bits[i]);
    return values;
  };
  std::vector<float> k = widen(b.k_cache), v = widen(b.v_cache), q = widen(b.q);
  const int64_t T = b.tokens, H = g.heads, D = g.head_dim;
  const Tensor k_host(k.data(), DType::kF32, b.cache_shape()), v_host(v.data(), DType::kF32, b.cache_shape());
  const Tensor q_host(q.data(), DType::kF32, {T, H, D});
  kernels::AttentionParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(D));
  params.window = window;
  params.max_q_len = b.max_q;
  params.max_kv_len = b.max_kv;
  std::vector<float> expected(static_cast<size_t>(T * H * D));
  kernels::cpu::paged_attention(q_host, k_host, v_host, b.cu_tensor(), b.lens_tensor(), b.tables_tensor(),
                                Tensor(expected.data(), DType::kF32, {T, H, D}), params);
  const OwnedTensor k_cache = to_device(k_host), v_cache = to_device(v_host), q_device = to_device(q_host);
  const OwnedTensor cu_q = to_device(b.cu_tensor()), kv_lens = to_device(b.lens_tensor());
  const OwnedTensor tables = to_device(b.tables_tensor());
  OwnedTensor out(DType::kF32, {T, H, D}, Device::cuda());
  kernels::paged_attention(*q_device, *k_cache, *v_cache, *cu_q, *kv_lens, *tables, *out, params);
  synchronize(Device::cuda());
  std::vector<float> got(expected.size());
  copy_tensor(Tensor(got.data(), DType::kF32, {T, H, D}), *out);
  const std::vector<double> actual(got.begin(), got.end()), reference(expected.begin(), expected.end());
  EXPECT_TRUE(testing::close_rel_l2(actual, reference, 1e-5));
}

TEST(CudaPagedAttention, F32MatchesCpuTightly) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<SeqSpec> mixed = {{0, 40}, {130, 1}, {17, 9}, {0, 1}};
  check_f32({4, 2, 16, 16}, mixed, 1201);
  check_f32({4, 1, 32, 16}, mixed, 1202);
  check_f32({8, 2, 64, 16}, mixed, 1203);
  check_f32({4, 2, 128, 16}, mixed, 1204);
  check_f32({4, 2, 256, 8}, {{0, 20}, {300, 1}}, 1205);
  check_f32({4, 2, 16, 16}, mixed, 1206, 8);
}

TEST(CudaKvCacheWrite, F32CachesHoldTheValuesExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const int64_t tokens = 5, kv_heads = 2, head_dim = 16, slots = 32;
  std::vector<float> k(static_cast<size_t>(tokens * kv_heads * head_dim)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 0.1f * static_cast<float>(i) + 1e-7f;  // not representable in bf16
    v[i] = -0.3f * static_cast<float>(i) + 3e-7f;
  }
  std::vector<int32_t> slot_mapping = {7, -1, 0, 31, 12};
  const OwnedTensor k_device = to_device(Tensor(k.data(), DType::kF32, {tokens, kv_heads, head_dim}));
  const OwnedTensor v_device = to_device(Tensor(v.data(), DType::kF32, {tokens, kv_heads, head_dim}));
  const OwnedTensor slot_device = to_device(Tensor(slot_mapping.data(), DType::kI32, {tokens}));
  std::vector<float> zeros(static_cast<size_t>(slots * kv_heads * head_dim), 0.0f);
  const Shape cache_shape{slots / 8, 8, kv_heads, head_dim};
  const OwnedTensor k_cache = to_device(Tensor(zeros.data(), DType::kF32, cache_shape));
  const OwnedTensor v_cache = to_device(Tensor(zeros.data(), DType::kF32, cache_shape));
  kernels::kv_cache_write(*k_device, *v_device, *slot_device, *k_cache, *v_cache);
  std::vector<float> k_got(zeros.size()), v_got(zeros.size());
  copy_tensor(Tensor(k_got.data(), DType::kF32, cache_shape), *k_cache);
  copy_tensor(Tensor(v_got.data(), DType::kF32, cache_shape), *v_cache);
  const size_t row = static_cast<size_t>(kv_heads * head_dim);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t slot = slot_mapping[static_cast<size_t>(t)];
    if (slot < 0) continue;
    for (size_t e = 0; e < row; ++e) {
      ASSERT_EQ(k_got[static_cast<size_t>(slot) * row + e], k[static_cast<size_t>(t) * row + e]) << "token " << t;
      ASSERT_EQ(v_got[static_cast<size_t>(slot) * row + e], v[static_cast<size_t>(t) * row + e]) << "token " << t;
    }
  }
  EXPECT_EQ(k_got[row], 0.0f);  // slot 1: nobody writes it (the -1 row is skipped)
}

TEST(CudaPagedAttention, LongPrefillQwen3Shape) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check({32, 8, 128, 16}, {{0, 1500}, {600, 400}}, 701);
  check({16, 2, 256, 16}, {{0, 700}, {50, 300}}, 702);
}

TEST(CudaPagedAttention, SpeculativeVerifyBlocks) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check({32, 8, 128, 16}, {{3000, 4}, {100, 2}, {1, 3}}, 801);  // 16 packed rows: split-KV with causal rows
  check({16, 2, 128, 16}, {{5000, 2}, {64, 2}}, 802);           // G 8, 2 rows per sequence
  check({32, 8, 128, 16}, {{4000, 8}, {30, 5}}, 803);           // 32 packed rows, few tiles: split-KV, 2 chunks
}

TEST(CudaPagedAttention, SlidingWindows) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Geometry g{8, 2, 128, 16};
  uint64_t seed = 900;
  for (const int window : {1, 16, 100, 1000}) {
    RunOptions options;
    options.window = window;
    check(g, {{0, 300}, {517, 1}, {33, 64}, {1000, 77}, {0, 1}}, ++seed, options);
    check(g, decode_batch({3000, 50, 999}), ++seed, options);
    check({16, 2, 256, 32}, {{2000, 3}, {10, 40}}, ++seed, options);
  }
}

TEST(CudaPagedAttention, StridedViewsAndLooseBounds) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Geometry g{8, 2, 64, 16};
  const std::vector<SeqSpec> mixed = {{0, 100}, {33, 7}, {200, 1}};
  RunOptions fused;  // q a slice of a fused projection: 16-byte aligned rows
  fused.q_pad_elems = 4 * 64;
  fused.out_pad_heads = 1;
  check(g, mixed, 1001, fused);
  RunOptions unaligned;  // rows not a multiple of 8 elements: the scalar paths
  unaligned.q_pad_elems = 4;
  check(g, mixed, 1002, unaligned);
  check(g, decode_batch({900, 3}), 1003, unaligned);
  RunOptions loose;  // bounds as a graph captured for a bigger step would pass them
  loose.extra_q_bound = 200;
  loose.extra_kv_bound = 5000;
  check(g, mixed, 1004, loose);
  RunOptions none;
  none.give_bounds = false;
  check(g, mixed, 1005, none);
}

TEST(CudaPagedAttention, RejectsUnsupportedShapes) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  // Head sizes other than 64/128/256 take a generic kernel (see GenericHeadDimMatchesCpu); above 256
  // none exists.
  HostBatch b = make_batch({4, 2, 258, 16}, {{3, 2}}, 1100);
  const OwnedTensor k_cache = to_device(b.k_tensor()), v_cache = to_device(b.v_tensor());
  const OwnedTensor cu_q = to_device(b.cu_tensor()), kv_lens = to_device(b.lens_tensor());
  const OwnedTensor tables = to_device(b.tables_tensor());
  const OwnedTensor q = to_device(b.q_tensor());
  OwnedTensor out(DType::kBF16, {b.tokens, 4, 258}, Device::cuda());
  try {
    kernels::paged_attention(*q, *k_cache, *v_cache, *cu_q, *kv_lens, *tables, *out, {});
    FAIL() << "head_dim 258 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
  }
}

// ---- kv_cache_write ----

// Writes through CUDA and through the CPU twin into identical caches and compares every byte.
void check_cache_write(DType input_dtype, int64_t token_pad_elems, bool fused_slice, uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_name(input_dtype)) + " pad " + std::to_string(token_pad_elems) +
               (fused_slice ? " fused" : ""));
  const int64_t kv_heads = 4, head_dim = 128, block_size = 16, num_blocks = 9, tokens = 37;
  Bf16Source source(seed);
  std::vector<uint16_t> cache_init(static_cast<size_t>(num_blocks * block_size * kv_heads * head_dim));
  source.fill(cache_init, -2.0f, 2.0f);
  // Slots: distinct, shuffled, with some -1 (padding rows that must be skipped).
  std::vector<int32_t> slots(static_cast<size_t>(num_blocks * block_size));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(seed));
  slots.resize(static_cast<size_t>(tokens));
  for (const size_t i : {0u, 5u, 36u}) slots[i] = -1;
  // k and v: [T, kv_heads, head_dim] views, either slices of a fused [T, 2 + 2 kv_heads, D] buffer
  // or rows padded by token_pad_elems.
  const int64_t row = fused_slice ? (2 + 2 * kv_heads) * head_dim : kv_heads * head_dim + token_pad_elems;
  const size_t elem = dtype_size(input_dtype);
  std::vector<uint8_t> kv_host(static_cast<size_t>(tokens * row) * elem * (fused_slice ? 1 : 2));
  for (size_t i = 0; i < kv_host.size() / elem; ++i) {
    const float value = bf16_bits_to_f32(source.next(-1.0f, 1.0f)) * (input_dtype == DType::kF32 ? 1.2345f : 1.0f);
    testing::store_element(input_dtype, kv_host.data(), static_cast<int64_t>(i), value);
  }
  const Shape strides{row, head_dim, 1};
  const int64_t k_offset = fused_slice ? 2 * head_dim : 0;
  const int64_t v_offset = fused_slice ? (2 + kv_heads) * head_dim : tokens * row;
  const auto view = [&](void* base, int64_t offset, Device device) {
    return Tensor(static_cast<uint8_t*>(base) + offset * static_cast<int64_t>(elem), input_dtype,
                  {tokens, kv_heads, head_dim}, strides, device);
  };
  const OwnedTensor kv_device = to_device(Tensor(kv_host.data(), DType::kU8, {static_cast<int64_t>(kv_host.size())}));
  const Shape cache_shape{num_blocks, block_size, kv_heads, head_dim};
  std::vector<uint16_t> k_cpu = cache_init, v_cpu = cache_init;
  const OwnedTensor k_cache = to_device(Tensor(cache_init.data(), DType::kBF16, cache_shape));
  const OwnedTensor v_cache = to_device(Tensor(cache_init.data(), DType::kBF16, cache_shape));
  const OwnedTensor slot_device = to_device(Tensor(slots.data(), DType::kI32, {tokens}));

  kernels::kv_cache_write(view(kv_device->data(), k_offset, Device::cuda()),
                          view(kv_device->data(), v_offset, Device::cuda()), *slot_device, *k_cache, *v_cache);
  kernels::kv_cache_write(view(kv_host.data(), k_offset, Device::cpu()), view(kv_host.data(), v_offset, Device::cpu()),
                          Tensor(slots.data(), DType::kI32, {tokens}), Tensor(k_cpu.data(), DType::kBF16, cache_shape),
                          Tensor(v_cpu.data(), DType::kBF16, cache_shape));
  synchronize(Device::cuda());
  const std::vector<uint16_t> k_got = download_bf16(*k_cache), v_got = download_bf16(*v_cache);
  size_t written = 0;
  for (size_t i = 0; i < k_got.size(); ++i) {
    ASSERT_EQ(k_got[i], k_cpu[i]) << "k cache element " << i;
    ASSERT_EQ(v_got[i], v_cpu[i]) << "v cache element " << i;
    written += k_got[i] != cache_init[i];
  }
  EXPECT_GT(written, 0u);  // the comparison is not vacuous
}

TEST(CudaKvCacheWrite, MatchesCpuBitExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check_cache_write(DType::kBF16, 0, false, 1201);  // contiguous: 16-byte vectors
  check_cache_write(DType::kBF16, 0, true, 1202);   // slices of a fused qkv projection: vectors
  check_cache_write(DType::kBF16, 4, false, 1203);  // rows not 16-byte aligned: scalar path
  check_cache_write(DType::kF32, 0, false, 1204);   // f32 inputs rounded to bf16 like the CPU
}

TEST(CudaKvCacheWrite, EmptyBatchIsANoOp) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  OwnedTensor cache(DType::kBF16, {2, 16, 2, 64}, Device::cuda());
  OwnedTensor k(DType::kBF16, {0, 2, 64}, Device::cuda());
  OwnedTensor slots(DType::kI32, {0}, Device::cuda());
  EXPECT_NO_THROW(kernels::kv_cache_write(*k, *k, *slots, *cache, *cache));
}

}  // namespace
}  // namespace metrale
