#include "model/blocks/ple.h"

#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/causal_conv1d.h"
#include "kernels/elementwise.h"
#include "kernels/linear.h"
#include "kernels/ple_gate.h"
#include "kernels/ple_gather.h"
#include "kernels/ple_ngram.h"
#include "kernels/random_fill.h"
#include "runtime/thread_pool.h"

namespace metrale {
namespace {

constexpr size_t kKeptAlignment = 256;

size_t aligned(size_t bytes) { return (bytes + kKeptAlignment - 1) / kKeptAlignment * kKeptAlignment; }

// A stored int64 buffer of the checkpoint, compared with the value §7.2 gives.
void check_buffer(Weights& weights, const std::string& key, const std::vector<int64_t>& expected) {
  if (weights.is_random()) return;
  const std::string name = weights.prefix() + key;
  if (!weights.store().has(name)) return;  // not stored: the computed value is the one transformers uses
  const Tensor view = weights.store().get(name);
  const std::string file = weights.store().file_of(name).path().string();
  if (view.dtype() != DType::kI64 || view.ndim() != 1 || view.size(0) != static_cast<int64_t>(expected.size())) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' is {} {}, expected i64 [{}]", file, name, dtype_name(view.dtype()),
          view.shape().to_string(), expected.size());
  }
  std::vector<int64_t> stored(expected.size());
  std::memcpy(stored.data(), view.data(), stored.size() * sizeof(int64_t));
  for (size_t i = 0; i < expected.size(); ++i) {
    if (stored[i] != expected[i]) {
      raise(ErrorCode::kBadFormat,
            "{}: tensor '{}' entry {} is {}, but the config gives {} (qwen.md §7.2: seed, ngram_size, "
            "ngram_vocab_size_base, vocab_size or the PLE layer order differ from the checkpoint's)",
            file, name, i, stored[i], expected[i]);
    }
  }
}

}  // namespace

PleTable::PleTable(Weights& weights, const std::string& key, int64_t padded_rows, int64_t head_dim,
                   int64_t split_parts)
    : rows_(padded_rows), head_dim_(head_dim) {
  if (weights.is_random()) {
    // Benchmarks: a host table of the configured size (the GPU reads only the staged rows).
    owned_ = OwnedTensor(DType::kBF16, {padded_rows, head_dim}, Device::cpu());
    kernels::random_fill(*owned_, {0x504c45u, 0.0f, 0.02f});
    shards_.push_back(*owned_);
    chunk_rows_ = padded_rows;
    return;
  }
  const WeightStore& store = weights.store();
  const std::string whole = weights.prefix() + key + "weight";
  const auto check_view = [&](const std::string& name, int64_t rows) {
    const Tensor view = store.get(name);
    if (view.ndim() != 2 || view.size(0) != rows || view.size(1) != head_dim) {
      raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected [{}, {}]", store.file_of(name).path().string(),
            name, view.shape().to_string(), rows, head_dim);
    }
    if (!is_floating(view.dtype()) || view.dtype() == DType::kF8E4M3) {
      raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}; the PLE table must be bf16, f16 or f32",
            store.file_of(name).path().string(), name, dtype_name(view.dtype()));
    }
    if (!shards_.empty() && view.dtype() != shards_.front().dtype()) {
      raise(ErrorCode::kBadFormat, "{}: tensor '{}' has dtype {}, the first PLE shard {}",
            store.file_of(name).path().string(), name, dtype_name(view.dtype()), dtype_name(shards_.front().dtype()));
    }
    shards_.push_back(view);
  };
  if (store.has(whole)) {
    check_view(whole, padded_rows);
    chunk_rows_ = padded_rows;
    return;
  }
  // torch.chunk(split_parts): chunks of ceil(rows / parts) rows, the last shorter; fewer chunks than
  // parts when they run out first.
  if (split_parts < 1) {
    raise(ErrorCode::kBadFormat, "{}: split_ngram_parts must be positive, got {}", weights.source_name(), split_parts);
  }
  chunk_rows_ = (padded_rows + split_parts - 1) / split_parts;
  const int64_t shards = (padded_rows + chunk_rows_ - 1) / chunk_rows_;
  for (int64_t s = 0; s < shards; ++s) {
    const std::string name = weights.prefix() + key + "shard_" + std::to_string(s) + ".weight";
    if (!store.has(name)) {
      raise(ErrorCode::kNotFound, "{}: checkpoint has neither '{}' nor the PLE row shard '{}' ({} shards of {} rows)",
            store.dir().string(), whole, name, shards, chunk_rows_);
    }
    check_view(name, std::min(chunk_rows_, padded_rows - s * chunk_rows_));
  }
  const std::string extra = weights.prefix() + key + "shard_" + std::to_string(shards) + ".weight";
  if (store.has(extra)) {
    raise(ErrorCode::kBadFormat, "{}: '{}' is one PLE shard too many for {} rows in {} parts", store.dir().string(),
          extra, padded_rows, split_parts);
  }
}

void PleTable::gather(const std::vector<int64_t>& ids, int64_t heads, const Tensor& out) const {
  const auto tokens = static_cast<int64_t>(ids.size()) / heads;
  METRALE_CHECK(out.ndim() == 2 && out.size(0) == tokens && out.size(1) == heads * head_dim_ && out.stride(1) == 1,
                "PLE gather: out {} for {} tokens x {} heads of {}", out.describe(), tokens, heads, head_dim_);
  if (tokens == 0) return;
  if (shards_.size() == 1) {
    const Tensor id_tensor(const_cast<int64_t*>(ids.data()), DType::kI64, {tokens, heads});
    kernels::ple_gather(shards_.front(), id_tensor, out);
    return;
  }
  const DType table_dtype = shards_.front().dtype();
  const size_t row_bytes = static_cast<size_t>(head_dim_) * dtype_size(table_dtype);
  for (const int64_t id : ids) {
    if (id < 0 || id >= rows_) {
      raise(ErrorCode::kInvalidArgument, "PLE gather: row id {} is outside the table's {} rows", id, rows_);
    }
  }
  // Items are (token, head) rows; the worker pool overlaps the page faults of a mapped table.
  cpu_pool().parallel_for(tokens * heads, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(head_dim_));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads, id = ids[static_cast<size_t>(item)];
      const Tensor& shard = shards_[static_cast<size_t>(id / chunk_rows_)];
      const char* src = static_cast<const char*>(shard.data()) + (id % chunk_rows_) * static_cast<int64_t>(row_bytes);
      char* dst = static_cast<char*>(out.data()) +
                  (t * out.stride(0) + h * head_dim_) * static_cast<int64_t>(out.element_size());
      if (table_dtype == out.dtype()) {
        std::memcpy(dst, src, row_bytes);
      } else {
        convert_to_f32(table_dtype, src, row.data(), row.size());
        convert_from_f32(out.dtype(), row.data(), dst, row.size());
      }
    }
  });
}

PleBlock::PleBlock(const PleConfig& config, Weights& weights, const std::string& prefix)
    : config_(config), row_dtype_(weights.compute_dtype()) {
  const int64_t nh = config.num_heads(), width = config.streams * config.hidden_size;
  if (config.ngram_size < 2 || config.ngram_size > kernels::kMaxPleNgram || config.heads_per_ngram < 1) {
    raise(ErrorCode::kBadFormat, "{}: PLE needs 2 <= ngram_size <= {} and heads_per_ngram >= 1, got {} and {}",
          weights.source_name(), kernels::kMaxPleNgram, config.ngram_size, config.heads_per_ngram);
  }
  if (config.embed_dim <= 0 || config.embed_dim % nh != 0) {
    raise(ErrorCode::kBadFormat, "{}: ple_embed_dim {} must be a positive multiple of ngram_heads {}",
          weights.source_name(), config.embed_dim, nh);
  }
  if (config.conv_kernel < 2 || config.vocab_size_base < 2 || config.pad_multiple < 1) {
    raise(ErrorCode::kBadFormat,
          "{}: PLE needs ple_conv_kernel_size >= 2, ngram_vocab_size_base >= 2 and "
          "make_ngram_vocab_size_divisible_by >= 1, got {}, {}, {}",
          weights.source_name(), config.conv_kernel, config.vocab_size_base, config.pad_multiple);
  }
  multipliers_ = kernels::ple_layer_multipliers(config.vocab_size, static_cast<int>(config.ngram_size),
                                                config.layer_index, config.seed);
  const kernels::PleHeadTable geometry =
      kernels::ple_head_table(config.vocab_size_base, nh, config.layer_index, config.pad_multiple);
  head_sizes_ = geometry.sizes;
  head_offsets_ = geometry.offsets;
  const std::string embedding = prefix + "ple_embedding.";
  check_buffer(weights, embedding + "layer_multipliers", multipliers_);
  check_buffer(weights, embedding + "ngram_heads_vocab_sizes", head_sizes_);
  check_buffer(weights, embedding + "ngram_heads_offsets", head_offsets_);
  table_ = PleTable(weights, embedding + "ngram_embedding.", geometry.padded_rows, config.head_dim(),
                    config.split_parts);
  key_proj_ = weights.get(prefix + "key_proj.weight", {width, config.embed_dim});
  value_proj_ = weights.get(prefix + "value_proj.weight", {config.hidden_size, config.embed_dim});
  norm_key_ = weights.get(prefix + "norm_key.weight", {width});
  norm_query_ = weights.get(prefix + "norm_query.weight", {width});
  norm_conv_ = weights.get(prefix + "norm_conv.weight", {width});
  conv_weight_ =
      weights.get(prefix + "conv1d.weight", {width, 1, config.conv_kernel}).reshape({width, config.conv_kernel});
}

CacheSpec PleBlock::cache_spec() const {
  const int64_t history = (config_.conv_kernel - 1) * config_.ngram_size;
  return {{CacheTensorSpec::per_slot("ple_conv", {history, config_.streams * config_.hidden_size})}};
}

std::vector<StepInputSpec> PleBlock::step_input_specs() const {
  return {{"ple_rows", row_dtype_, config_.embed_dim}};
}

std::vector<int64_t> PleBlock::ngram_ids(const PrestageRows& rows) const {
  const int64_t seqs = rows.num_seqs, tokens = rows.num_tokens, nh = config_.num_heads();
  const int64_t context = config_.ngram_size - 1;
  // Per sequence: the last n_max - 1 ids of its history, EOS-padded on the left (transformers'
  // id state after a first call shorter than n_max - 1), as ple_ngram_ids' history slots.
  std::vector<int64_t> history(static_cast<size_t>(std::max<int64_t>(seqs, 1) * context), config_.eos_token_id);
  std::vector<int32_t> kv_lens(static_cast<size_t>(seqs)), slots(static_cast<size_t>(seqs));
  for (int64_t s = 0; s < seqs; ++s) {
    const std::span<const int32_t> past =
        static_cast<size_t>(s) < rows.history.size() ? rows.history[static_cast<size_t>(s)] : std::span<const int32_t>();
    const auto n = static_cast<int64_t>(past.size());
    for (int64_t j = 0; j < std::min(n, context); ++j) {
      history[static_cast<size_t>(s * context + context - 1 - j)] = past[static_cast<size_t>(n - 1 - j)];
    }
    const int64_t q_len = rows.cu_q[static_cast<size_t>(s + 1)] - rows.cu_q[static_cast<size_t>(s)];
    kv_lens[static_cast<size_t>(s)] = static_cast<int32_t>(n + q_len);
    slots[static_cast<size_t>(s)] = static_cast<int32_t>(s);
  }
  std::vector<int64_t> ids(static_cast<size_t>(tokens * nh));
  if (tokens == 0) return ids;
  const auto i32 = [](std::span<const int32_t> v) {
    return Tensor(const_cast<int32_t*>(v.data()), DType::kI32, {static_cast<int64_t>(v.size())});
  };
  const auto i64 = [](const std::vector<int64_t>& v, Shape shape) {
    return Tensor(const_cast<int64_t*>(v.data()), DType::kI64, std::move(shape));
  };
  kernels::PleNgramParams params;
  params.eos_token_id = config_.eos_token_id;
  params.ngram_size = static_cast<int>(config_.ngram_size);
  params.heads_per_ngram = static_cast<int>(config_.heads_per_ngram);
  params.write_history = false;
  kernels::ple_ngram_ids(i32(rows.token_ids.first(static_cast<size_t>(tokens))),
                         i64(history, {std::max<int64_t>(seqs, 1), context}), i32(rows.cu_q.first(static_cast<size_t>(seqs + 1))),
                         i32(kv_lens), i32(slots), i64(multipliers_, {config_.ngram_size}),
                         i64(head_sizes_, {nh}), i64(head_offsets_, {nh}), i64(ids, {tokens, nh}), params);
  return ids;
}

void PleBlock::prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const {
  METRALE_CHECK(host_inputs.size() == 1, "PLE layer: {} step inputs, expected its rows", host_inputs.size());
  table_.gather(ngram_ids(rows), config_.num_heads(), host_inputs[0]);
}

size_t PleBlock::verify_scratch_bytes(int64_t num_tokens, int64_t /*num_seqs*/, DType activation) const {
  return aligned(static_cast<size_t>(num_tokens * config_.streams * config_.hidden_size) * dtype_size(activation));
}

void PleBlock::forward(const StepContext& step, const BlockCache& cache, const Tensor& streams) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, width = config_.streams * config_.hidden_size;
  METRALE_CHECK(cache.tensors.size() == 1, "PLE layer: {} cache tensors, expected its conv state", cache.tensors.size());
  METRALE_CHECK(step.step_inputs.size() == 1 && step.step_inputs[0].ndim() == 2 &&
                    step.step_inputs[0].size(0) == tokens && step.step_inputs[0].size(1) == config_.embed_dim,
                "PLE layer: step inputs {} for {} rows of {}",
                step.step_inputs.empty() ? std::string("(none)") : step.step_inputs[0].describe(), tokens,
                config_.embed_dim);
  METRALE_CHECK(streams.ndim() == 2 && streams.size(1) == width, "PLE layer: streams {} for width {}",
                streams.describe(), width);
  if (tokens == 0) return;
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  Tensor rows = step.step_inputs[0];  // [T, E] the gathered table rows
  if (rows.dtype() != act) {
    const Tensor converted = ws.alloc(act, {tokens, config_.embed_dim});
    kernels::convert(rows, converted);
    rows = converted;
  }
  const Tensor key = ws.alloc(act, {tokens, width});
  const Tensor value = ws.alloc(act, {tokens, config_.hidden_size});
  kernels::linear(rows, key_proj_, key);
  kernels::linear(rows, value_proj_, value);
  const Tensor gated = ws.alloc(act, {tokens, width});  // [T, N*H] G
  // [T, N*H] G^, the conv input: kept for the commit on verify steps.
  const Tensor gated_normed =
      batch.verify ? Tensor(step.verify_scratch.data(), act, {tokens, width}, step.verify_scratch.device())
                   : ws.alloc(act, {tokens, width});
  if (batch.verify) {
    METRALE_CHECK(step.verify_scratch.nbytes() >= verify_scratch_bytes(tokens, batch.num_seqs, act),
                  "PLE layer: verify scratch {}", step.verify_scratch.describe());
  }
  kernels::ple_gate(key, value, streams, norm_key_, norm_query_, norm_conv_, gated, gated_normed,
                    {static_cast<int>(config_.streams), static_cast<float>(config_.rms_norm_eps)});
  const Tensor ple = ws.alloc(act, {tokens, width});  // [T, N*H] D(G + C)
  kernels::CausalConv1dParams conv;
  conv.silu = true;
  conv.max_q_len = batch.max_q_len;
  conv.write_state = !batch.verify;
  conv.dilation = static_cast<int>(config_.ngram_size);
  conv.residual = gated;
  kernels::causal_conv1d(gated_normed, conv_weight_, cache.tensors[kConv], batch.cu_q, batch.kv_lens,
                         batch.state_slots, ple, conv);
  kernels::add_inplace(streams, ple);
}

void PleBlock::commit(const StepContext& step, const BlockCache& cache, const VerifyCommit& kept) {
  const int64_t tokens = step.batch.num_tokens, width = config_.streams * config_.hidden_size;
  if (tokens == 0) return;
  const DType act = step.activation_dtype;
  const Tensor gated_normed(step.verify_scratch.data(), act, {tokens, width}, step.verify_scratch.device());
  // The conv window advances over each sequence's kept rows exactly as the verify forward read them.
  const Tensor out = step.workspace.alloc(act, {tokens, width});
  kernels::CausalConv1dParams conv;
  conv.silu = true;
  conv.max_q_len = kept.max_rows;
  conv.dilation = static_cast<int>(config_.ngram_size);
  kernels::causal_conv1d(gated_normed, conv_weight_, cache.tensors[kConv], kept.cu_parts, kept.kv_lens, kept.slots, out,
                         conv);
}

}  // namespace metrale
