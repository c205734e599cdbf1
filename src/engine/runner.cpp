#include "engine/runner.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "kernels/moe.h"
#include "runtime/stream.h"
#if METRALE_WITH_CUDA
#include "runtime/cuda/cuda_graph.h"
#endif

namespace metrale {

// Host arrays of one step, each sized for the limits (pinned when a GPU is used).
struct Runner::HostStep {
  PinnedBuffer token_ids, positions, cu_q, kv_lens, block_tables, slot_mapping, logit_rows, state_slots;
  int64_t num_tokens = 0, num_seqs = 0, num_rows = 0;
  int64_t block_stride = 0;  // columns of the block table
  int64_t max_q_len = 0, max_kv_len = 0;
  bool has_state_slots = false;  // the model has recurrent layers

  static int32_t* ints(const PinnedBuffer& buffer) { return static_cast<int32_t*>(buffer.data()); }
};

struct Runner::Graph {
#if METRALE_WITH_CUDA
  CudaGraph graph;
#endif
  int64_t batch_size = 0;
};

namespace {

int64_t max_blocks_per_seq(const RunnerLimits& limits) {
  return (limits.max_model_len + limits.block_size - 1) / limits.block_size;
}

}  // namespace

Runner::Runner(Model& model, const RunnerLimits& limits)
    : model_(model), limits_(limits), workspace_(model.device(), 16u << 20, /*growable=*/true),
      host_(std::make_unique<HostStep>()) {
  const int64_t tokens = std::max(limits_.max_num_tokens, limits_.max_num_seqs);
  const int64_t seqs = limits_.max_num_seqs;
  const int64_t blocks = max_blocks_per_seq(limits_);
  const auto ints = [](int64_t count) { return PinnedBuffer(static_cast<size_t>(count) * sizeof(int32_t)); };
  host_->token_ids = ints(tokens);
  host_->positions = ints(tokens);
  host_->slot_mapping = ints(tokens);
  host_->logit_rows = ints(tokens);
  host_->cu_q = ints(seqs + 1);
  host_->kv_lens = ints(seqs);
  host_->block_tables = ints(seqs * blocks);
  host_->state_slots = ints(seqs);
  const Device device = model_.device();
  if (device.is_cuda()) {
    token_ids_ = OwnedTensor(DType::kI32, {tokens}, device);
    positions_ = OwnedTensor(DType::kI32, {tokens}, device);
    slot_mapping_ = OwnedTensor(DType::kI32, {tokens}, device);
    logit_rows_ = OwnedTensor(DType::kI32, {tokens}, device);
    cu_q_ = OwnedTensor(DType::kI32, {seqs + 1}, device);
    kv_lens_ = OwnedTensor(DType::kI32, {seqs}, device);
    block_tables_ = OwnedTensor(DType::kI32, {seqs * blocks}, device);
    state_slots_ = OwnedTensor(DType::kI32, {seqs}, device);
    const int64_t logit_rows = std::max(seqs, limits_.max_logit_rows);
    logits_ = OwnedTensor(DType::kF32, {logit_rows, model_.config().vocab_size}, device);
  }
}

Runner::~Runner() = default;

void Runner::lower_max_num_seqs(int64_t max_num_seqs) {
  METRALE_CHECK(max_num_seqs > 0 && max_num_seqs <= limits_.max_num_seqs, "max_num_seqs {} is not below the limit {}",
                max_num_seqs, limits_.max_num_seqs);
  limits_.max_num_seqs = max_num_seqs;  // buffers stay sized for the old limit
}

void Runner::build_host_step(const SchedulePlan& plan, int64_t padded_seqs, StepResult& result) {
  HostStep& h = *host_;
  const int64_t block_size = limits_.block_size;
  const int64_t real_seqs = static_cast<int64_t>(plan.chunks.size());
  const int64_t num_seqs = std::max(real_seqs, padded_seqs);
  METRALE_CHECK(num_seqs <= limits_.max_num_seqs, "step of {} sequences exceeds the limit {}", num_seqs,
                limits_.max_num_seqs);
  int64_t step_blocks = 1;
  for (const auto& chunk : plan.chunks) {
    step_blocks = std::max<int64_t>(step_blocks, cache_->block_table(chunk.sequence->id).size());
  }
  h.block_stride = padded_seqs > 0 ? max_blocks_per_seq(limits_) : step_blocks;
  int32_t* token_ids = HostStep::ints(h.token_ids);
  int32_t* positions = HostStep::ints(h.positions);
  int32_t* slots = HostStep::ints(h.slot_mapping);
  int32_t* rows = HostStep::ints(h.logit_rows);
  int32_t* cu_q = HostStep::ints(h.cu_q);
  int32_t* kv_lens = HostStep::ints(h.kv_lens);
  int32_t* tables = HostStep::ints(h.block_tables);
  int32_t* state_slots = HostStep::ints(h.state_slots);
  std::fill(tables, tables + num_seqs * h.block_stride, 0);
  h.has_state_slots = cache_->has_recurrent_state();
  // Sequences of a scratch cache (the workspace profile) have no slot of their own: they write the
  // padding slot, whose contents nobody reads.
  const bool scratch_slots = cache_->config().num_state_slots == 0;

  int64_t t = 0, r = 0;
  h.max_q_len = 0;
  h.max_kv_len = 0;
  cu_q[0] = 0;
  result.uses.clear();
  for (int64_t s = 0; s < real_seqs; ++s) {
    const ScheduledChunk& chunk = plan.chunks[static_cast<size_t>(s)];
    const Sequence& sequence = *chunk.sequence;
    const auto table = cache_->block_table(sequence.id);
    // Rows [begin, known_end) hold known tokens, [known_end, end) the drafts being verified.
    const int64_t begin = sequence.num_computed, known_end = begin + chunk.num_new, end = known_end + chunk.num_drafts;
    METRALE_CHECK(chunk.num_drafts == 0 || (chunk.samples && known_end == sequence.num_tokens() &&
                                            chunk.num_drafts <= static_cast<int64_t>(sequence.draft_tokens.size())),
                  "sequence {}: {} draft rows after {} of {} tokens", sequence.id, chunk.num_drafts, known_end,
                  sequence.num_tokens());
    METRALE_CHECK(static_cast<int64_t>(table.size()) * block_size >= end, "sequence {} has {} blocks for {} tokens",
                  sequence.id, table.size(), end);
    METRALE_CHECK(t + chunk.num_rows() <= std::max(limits_.max_num_tokens, limits_.max_num_seqs),
                  "step exceeds the token limit");
    std::copy(table.begin(), table.end(), tables + s * h.block_stride);
    const int64_t first_row = t;
    for (int64_t p = begin; p < end; ++p, ++t) {
      token_ids[t] = p < known_end ? sequence.tokens[static_cast<size_t>(p)]
                                   : sequence.draft_tokens[static_cast<size_t>(p - known_end)];
      positions[t] = static_cast<int32_t>(p);
      slots[t] = table[static_cast<size_t>(p / block_size)] * static_cast<int32_t>(block_size) +
                 static_cast<int32_t>(p % block_size);
    }
    cu_q[s + 1] = static_cast<int32_t>(t);
    kv_lens[s] = static_cast<int32_t>(end);
    if (h.has_state_slots) {
      int32_t slot = cache_->state_slot(sequence.id);
      if (slot < 0) {
        METRALE_CHECK(scratch_slots, "sequence {} has no state slot", sequence.id);
        slot = cache_->padding_state_slot();
      }
      state_slots[s] = slot;
    }
    h.max_q_len = std::max(h.max_q_len, chunk.num_rows());
    h.max_kv_len = std::max(h.max_kv_len, end);

    // Rows whose logits the engine needs: every prompt position when scoring, and the last known
    // row and every draft row when the chunk yields tokens.
    LogitRowUse use{chunk, r, 0, 0};
    int64_t first_wanted = end;
    if (sequence.request.return_prompt_logits && begin < sequence.num_prompt) first_wanted = begin;
    if (chunk.samples) first_wanted = std::min(first_wanted, known_end - 1);
    const int64_t last_wanted = chunk.samples ? end : std::min(end, sequence.num_prompt);
    if (first_wanted < last_wanted) {
      use.first_position = first_wanted;
      use.num_rows = last_wanted - first_wanted;
      for (int64_t p = first_wanted; p < last_wanted; ++p) rows[r++] = static_cast<int32_t>(first_row + p - begin);
    }
    use.first_batch_row = first_row;
    result.uses.push_back(use);
  }
  // Padding rows of a graph batch: one token at position 0 that writes nothing (slot -1) and reads
  // one key of block 0; their logits are computed and ignored. Recurrent layers see a sequence
  // starting from zero state, which writes its final state into the padding slot.
  for (int64_t s = real_seqs; s < num_seqs; ++s, ++t) {
    token_ids[t] = 0;
    positions[t] = 0;
    slots[t] = -1;
    cu_q[s + 1] = static_cast<int32_t>(t + 1);
    kv_lens[s] = 1;
    if (h.has_state_slots) state_slots[s] = cache_->padding_state_slot();
    rows[r++] = static_cast<int32_t>(t);
    h.max_q_len = std::max<int64_t>(h.max_q_len, 1);
  }
  h.num_tokens = t;
  h.num_seqs = num_seqs;
  h.num_rows = r;
  if (padded_seqs > 0) h.max_kv_len = limits_.max_model_len;  // graphs plan for any context
}

ForwardBatch Runner::upload(bool fixed_block_stride) {
  HostStep& h = *host_;
  ForwardBatch batch;
  batch.num_tokens = h.num_tokens;
  batch.num_seqs = h.num_seqs;
  batch.block_size = limits_.block_size;
  batch.max_q_len = h.max_q_len;
  batch.max_kv_len = h.max_kv_len;
  batch.host_cu_q = {HostStep::ints(h.cu_q), static_cast<size_t>(h.num_seqs + 1)};
  batch.host_kv_lens = {HostStep::ints(h.kv_lens), static_cast<size_t>(h.num_seqs)};
  batch.host_logit_rows = {HostStep::ints(h.logit_rows), static_cast<size_t>(h.num_rows)};
  const Device device = model_.device();
  const int64_t stride = fixed_block_stride ? max_blocks_per_seq(limits_) : h.block_stride;
  const auto place = [&](const PinnedBuffer& host, OwnedTensor& target, int64_t count, Shape shape) -> Tensor {
    METRALE_CHECK(static_cast<size_t>(count) * sizeof(int32_t) <= host.size(), "step input of {} ints exceeds its buffer",
                  count);
    if (device.is_cpu()) return Tensor(host.data(), DType::kI32, shape, Device::cpu());
    copy_bytes_async(target.tensor.data(), device, host.data(), Device::cpu(), static_cast<size_t>(count) * sizeof(int32_t));
    return Tensor(target.tensor.data(), DType::kI32, shape, device);
  };
  batch.token_ids = place(h.token_ids, token_ids_, h.num_tokens, {h.num_tokens});
  batch.positions = place(h.positions, positions_, h.num_tokens, {h.num_tokens});
  batch.slot_mapping = place(h.slot_mapping, slot_mapping_, h.num_tokens, {h.num_tokens});
  batch.logit_rows = place(h.logit_rows, logit_rows_, h.num_rows, {h.num_rows});
  batch.cu_q = place(h.cu_q, cu_q_, h.num_seqs + 1, {h.num_seqs + 1});
  batch.kv_lens = place(h.kv_lens, kv_lens_, h.num_seqs, {h.num_seqs});
  METRALE_CHECK(h.block_stride == stride, "block table stride {} != {}", h.block_stride, stride);
  batch.block_tables = place(h.block_tables, block_tables_, h.num_seqs * stride, {h.num_seqs, stride});
  if (h.has_state_slots) {
    batch.state_slots = place(h.state_slots, state_slots_, h.num_seqs, {h.num_seqs});
    batch.host_state_slots = {HostStep::ints(h.state_slots), static_cast<size_t>(h.num_seqs)};
  }
  return batch;
}

void Runner::run_forward(const ForwardBatch& batch, const Tensor& logits) {
  workspace_.reset();
  model_.forward(batch, cache_->layer_caches(), logits, workspace_);
}

StepResult Runner::execute(const SchedulePlan& plan) {
  METRALE_CHECK(!plan.empty(), "empty step");
  METRALE_CHECK(cache_ != nullptr, "runner has no cache");
  StepResult result;
  const Device device = model_.device();
  const int64_t vocab = model_.config().vocab_size;
  const int64_t seqs = static_cast<int64_t>(plan.chunks.size());
  METRALE_CHECK(!commit_pending_, "a step ran before the last verify step's commit");
  const bool verify = plan.num_draft_rows > 0;
  const bool all_decode = !verify && !keep_hidden_ &&
                          std::all_of(plan.chunks.begin(), plan.chunks.end(), [](const ScheduledChunk& c) {
                            return c.num_new == 1 && c.num_drafts == 0 && c.samples &&
                                   !c.sequence->request.return_prompt_logits;
                          });
  // The smallest captured graph that holds this decode batch.
  const auto graph = all_decode ? graphs_.lower_bound(seqs) : graphs_.end();
#if METRALE_WITH_CUDA
  if (graph != graphs_.end()) {
    const int64_t padded = graph->first;
    build_host_step(plan, padded, result);
    upload(/*fixed_block_stride=*/true);
    graph->second->graph.launch(static_cast<cudaStream_t>(current_stream(device)));
    result.logits = logits_.tensor.slice(0, 0, padded);
    result.used_graph = true;
    return result;
  }
#else
  (void)graph;
#endif
  build_host_step(plan, 0, result);
  ForwardBatch batch = upload(/*fixed_block_stride=*/false);
  const int64_t rows = host_->num_rows;
  attach_speculative_outputs(batch, verify);
  if (device.is_cpu()) {
    logits_ = OwnedTensor(DType::kF32, {rows, vocab}, device);
    run_forward(batch, logits_.tensor);
    result.logits = logits_.tensor;
  } else if (rows <= logits_.tensor.size(0)) {
    result.logits = logits_.tensor.slice(0, 0, rows);
    run_forward(batch, result.logits);
  } else {
    // Scoring many rows at once: a one-off buffer (eager steps may allocate).
    synchronize(device);
    score_logits_ = OwnedTensor(DType::kF32, {rows, vocab}, device);
    result.logits = score_logits_.tensor;
    run_forward(batch, result.logits);
  }
  if (verify) {
    last_verify_ = batch;
    commit_pending_ = true;
  }
  return result;
}

namespace {

DType activation_dtype_of(Device device) { return device.is_cpu() ? DType::kF32 : DType::kBF16; }

// Grows `buffer` to hold at least `shape` (eager steps may allocate; the device is synchronised
// first so that no queued kernel still reads the old buffer) and returns a view of that shape.
Tensor grown(OwnedTensor& buffer, DType dtype, Shape shape, Device device) {
  if (buffer.tensor.empty() || buffer.tensor.nbytes() < static_cast<size_t>(shape.numel()) * dtype_size(dtype)) {
    if (!device.is_cpu()) synchronize(device);
    int64_t elements = std::max<int64_t>(shape.numel(), 1);
    if (!buffer.tensor.empty()) elements = std::max<int64_t>(elements, 2 * static_cast<int64_t>(buffer.tensor.nbytes() / dtype_size(dtype)));
    buffer = OwnedTensor(dtype, {elements}, device);
  }
  return Tensor(buffer.tensor.data(), dtype, shape, device);
}

}  // namespace

void Runner::attach_speculative_outputs(ForwardBatch& batch, bool verify) {
  const Device device = model_.device();
  last_hidden_ = Tensor();
  if (keep_hidden_) {
    last_hidden_ = grown(hidden_, activation_dtype_of(device), {batch.num_tokens, model_.config().hidden_size}, device);
    batch.hidden_out = last_hidden_;
  }
  if (!verify) return;
  batch.verify = true;
  const size_t bytes = model_.verify_scratch_bytes(batch.num_tokens, batch.num_seqs);
  batch.verify_scratch = grown(verify_scratch_, DType::kU8, {static_cast<int64_t>(std::max<size_t>(bytes, 1))}, device);
  if (verify_seq_index_.tensor.empty()) {
    const int64_t seqs = limits_.max_num_seqs;
    std::vector<int32_t> index(static_cast<size_t>(seqs));
    for (int64_t s = 0; s < seqs; ++s) index[static_cast<size_t>(s)] = static_cast<int32_t>(s);
    verify_seq_index_ = OwnedTensor(DType::kI32, {seqs}, device);
    copy_bytes(verify_seq_index_.tensor.data(), device, index.data(), Device::cpu(), index.size() * sizeof(int32_t));
  }
  batch.verify_seq_index = verify_seq_index_.tensor.slice(0, 0, batch.num_seqs);
}

void Runner::commit_verified(std::span<const int32_t> kept_rows) {
  METRALE_CHECK(commit_pending_, "commit_verified without a verify step");
  commit_pending_ = false;
  workspace_.reset();
  model_.commit_verified(last_verify_, kept_rows, cache_->layer_caches(), workspace_);
  last_verify_ = ForwardBatch();
}

Tensor Runner::run_mtp(std::span<const MtpRows> rows, const Tensor& hidden_source, int64_t mtp_layer,
                       Tensor& out_hidden) {
  METRALE_CHECK(!commit_pending_, "an MTP step ran before the last verify step's commit");
  HostStep& h = *host_;
  const Device device = model_.device();
  const int64_t block_size = limits_.block_size;
  const int64_t hidden_size = model_.config().hidden_size;
  int64_t step_blocks = 1;
  for (const MtpRows& seq : rows) step_blocks = std::max<int64_t>(step_blocks, cache_->block_table(seq.seq_id).size());
  h.block_stride = step_blocks;
  int32_t* token_ids = HostStep::ints(h.token_ids);
  int32_t* positions = HostStep::ints(h.positions);
  int32_t* slots = HostStep::ints(h.slot_mapping);
  int32_t* logit_rows = HostStep::ints(h.logit_rows);
  int32_t* cu_q = HostStep::ints(h.cu_q);
  int32_t* kv_lens = HostStep::ints(h.kv_lens);
  int32_t* tables = HostStep::ints(h.block_tables);
  const int64_t num_seqs = static_cast<int64_t>(rows.size());
  METRALE_CHECK(num_seqs <= limits_.max_num_seqs, "MTP step of {} sequences", num_seqs);
  std::fill(tables, tables + num_seqs * h.block_stride, 0);
  std::vector<int32_t> gather;
  int64_t t = 0, r = 0;
  h.max_q_len = 0;
  h.max_kv_len = 0;
  cu_q[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const MtpRows& seq = rows[static_cast<size_t>(s)];
    const auto table = cache_->block_table(seq.seq_id);
    const auto count = static_cast<int64_t>(seq.next_tokens.size());
    const int64_t end = seq.first_position + count;
    METRALE_CHECK(count > 0 && static_cast<int64_t>(table.size()) * block_size >= end,
                  "MTP rows of sequence {}: {} rows to position {} with {} blocks", seq.seq_id, count, end, table.size());
    METRALE_CHECK(t + count <= std::max(limits_.max_num_tokens, limits_.max_num_seqs), "MTP step exceeds the token limit");
    std::copy(table.begin(), table.end(), tables + s * h.block_stride);
    for (int64_t i = 0; i < count; ++i, ++t) {
      const int64_t p = seq.first_position + i;
      token_ids[t] = seq.next_tokens[static_cast<size_t>(i)];
      positions[t] = static_cast<int32_t>(p);
      slots[t] = table[static_cast<size_t>(p / block_size)] * static_cast<int32_t>(block_size) +
                 static_cast<int32_t>(p % block_size);
      gather.push_back(static_cast<int32_t>(seq.first_hidden_row + i));
    }
    cu_q[s + 1] = static_cast<int32_t>(t);
    kv_lens[s] = static_cast<int32_t>(end);
    if (seq.wants_logits) logit_rows[r++] = static_cast<int32_t>(t - 1);
    h.max_q_len = std::max(h.max_q_len, count);
    h.max_kv_len = std::max(h.max_kv_len, end);
  }
  h.num_tokens = t;
  h.num_seqs = num_seqs;
  h.num_rows = r;
  h.has_state_slots = false;  // the MTP layers are attention only
  ForwardBatch batch = upload(/*fixed_block_stride=*/false);
  const DType act = activation_dtype_of(device);
  const Tensor index = grown(mtp_gather_, DType::kI32, {t}, device);
  copy_bytes(index.data(), device, gather.data(), Device::cpu(), gather.size() * sizeof(int32_t));
  const Tensor hidden_in = grown(mtp_hidden_in_, act, {t, hidden_size}, device);
  kernels::gather_rows(hidden_source, index, hidden_in);
  mtp_flip_ ^= 1;
  out_hidden = grown(mtp_out_[mtp_flip_], act, {t, hidden_size}, device);
  batch.hidden_out = out_hidden;
  const Tensor logits = grown(mtp_logits_, DType::kF32, {r, model_.config().vocab_size}, device);
  workspace_.reset();
  model_.mtp_forward(batch, cache_->layer_caches(), hidden_in, logits, workspace_, mtp_layer);
  return logits;
}

size_t Runner::plan_workspace() {
  const Device device = model_.device();
  if (device.is_cpu()) return 0;
  // A scratch cache big enough for the profile batch: the largest step the scheduler can build.
  // No sequence is longer than max_model_len, so neither is a profile sequence.
  const int64_t seqs = std::min(limits_.max_num_seqs, std::max(limits_.max_num_tokens, limits_.max_num_seqs));
  const int64_t tokens = std::min(std::max(limits_.max_num_tokens, limits_.max_num_seqs), seqs * limits_.max_model_len);
  const int64_t per_seq = (tokens + seqs - 1) / seqs;
  // No state slots of its own: profile sequences share the padding slot (see build_host_step).
  CacheConfig scratch_config;
  scratch_config.block_size = static_cast<int32_t>(limits_.block_size);
  scratch_config.num_blocks = static_cast<int32_t>(seqs * ((per_seq + limits_.block_size - 1) / limits_.block_size));
  scratch_config.kv_dtype = DType::kBF16;
  CacheManager scratch(model_.cache_specs(), scratch_config, device);
  CacheManager* real_cache = cache_;
  cache_ = &scratch;
  std::vector<std::unique_ptr<Sequence>> sequences;
  SchedulePlan plan;
  int64_t remaining = tokens;
  for (int64_t s = 0; s < seqs && remaining > 0; ++s) {
    auto sequence = std::make_unique<Sequence>();
    sequence->id = -1 - s;
    const int64_t count = std::min(per_seq, remaining);
    remaining -= count;
    sequence->tokens.assign(static_cast<size_t>(count), 0);
    sequence->num_prompt = count;
    METRALE_CHECK(scratch.reserve(sequence->id, count), "profile cache too small");
    plan.chunks.push_back({sequence.get(), count, true});
    sequences.push_back(std::move(sequence));
  }
  StepResult result;
  build_host_step(plan, 0, result);
  host_->max_kv_len = limits_.max_model_len;  // size attention scratch for the longest context
  const ForwardBatch batch = upload(false);
  workspace_.reserve(workspace_.capacity_bytes(), /*growable=*/true);
  run_forward(batch, logits_.tensor.slice(0, 0, host_->num_rows));
  synchronize(device);
  size_t needed = workspace_.high_water_bytes();
  // Decode graphs pad to their batch size with the longest context bound: profile the largest one too.
  if (limits_.max_num_seqs > 0) {
    SchedulePlan empty;
    build_host_step(empty, limits_.max_num_seqs, result);
    const ForwardBatch decode = upload(true);
    run_forward(decode, logits_.tensor.slice(0, 0, host_->num_rows));
    synchronize(device);
    needed = std::max(needed, workspace_.high_water_bytes());
  }
  cache_ = real_cache;
  // Headroom for allocations whose size depends on the batch in ways the two profiles miss.
  needed = needed + needed / 8 + (4u << 20);
  workspace_.reserve(needed, /*growable=*/false);
  METRALE_LOG_INFO("workspace: {} (profiled {} tokens in {} sequences)", format_bytes(needed), tokens, seqs);
  return needed;
}

void Runner::capture_decode_graphs(const std::vector<int64_t>& batch_sizes) {
#if METRALE_WITH_CUDA
  const Device device = model_.device();
  if (device.is_cpu()) return;
  auto stream = static_cast<cudaStream_t>(current_stream(device));
  for (const int64_t size : batch_sizes) {
    if (size > limits_.max_num_seqs || graphs_.count(size)) continue;
    SchedulePlan empty;
    StepResult result;
    build_host_step(empty, size, result);
    const ForwardBatch batch = upload(true);
    const Tensor logits = logits_.tensor.slice(0, 0, size);
    run_forward(batch, logits);  // warm-up outside capture: libraries pick algorithms, lazy loads happen
    synchronize(device);
    auto graph = std::make_unique<Graph>();
    graph->batch_size = size;
    graph->graph.begin_capture(stream);
    try {
      run_forward(batch, logits);
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream, &broken);
      if (broken != nullptr) cudaGraphDestroy(broken);
      throw;
    }
    graph->graph.end_capture(stream);
    graphs_.emplace(size, std::move(graph));
  }
  synchronize(device);
  METRALE_LOG_INFO("captured {} decode graphs", graphs_.size());
#else
  (void)batch_sizes;
#endif
}

std::vector<int64_t> Runner::graph_batch_sizes() const {
  std::vector<int64_t> sizes;
  for (const auto& [size, graph] : graphs_) sizes.push_back(size);
  return sizes;
}

}  // namespace metrale
