#include "engine/runner.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "engine/runner_internal.h"
#include "kernels/moe.h"
#include "runtime/stream.h"

namespace metrale {

Runner::Runner(Model& model, const RunnerLimits& limits)
    : model_(model),
      limits_(limits),
      workspace_(model.device(), 16u << 20, /*growable=*/true),
      host_(std::make_unique<HostStep>()),
      commit_workspace_(model.device(), 1u << 20, /*growable=*/true) {
  const int64_t tokens = max_step_rows();
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
  if (limits_.max_drafts > 0) allocate_speculative_buffers();
}

Runner::~Runner() = default;

void Runner::lower_max_num_seqs(int64_t max_num_seqs) {
  METRALE_CHECK(max_num_seqs > 0 && max_num_seqs <= limits_.max_num_seqs, "max_num_seqs {} is not below the limit {}",
                max_num_seqs, limits_.max_num_seqs);
  limits_.max_num_seqs = max_num_seqs;  // buffers stay sized for the old limit
}

void Runner::build_host_step(const SchedulePlan& plan, int64_t padded_seqs, int64_t rows_per_seq, StepResult& result) {
  HostStep& h = *host_;
  const int64_t block_size = limits_.block_size;
  const int64_t real_seqs = static_cast<int64_t>(plan.chunks.size());
  const int64_t num_seqs = std::max(real_seqs, padded_seqs);
  METRALE_CHECK(num_seqs <= limits_.max_num_seqs, "step of {} sequences exceeds the limit {}", num_seqs,
                limits_.max_num_seqs);
  int64_t step_blocks = 1;
  for (const auto& chunk : plan.chunks) {
    step_blocks = std::max<int64_t>(step_blocks, cache_->block_table(chunk.sequence->id).size());
    // Fixed layout: padding rows count in the sequence's length (their blocks read as block 0).
    if (rows_per_seq > 0)
      step_blocks = std::max(step_blocks, (chunk.sequence->num_computed + rows_per_seq + block_size - 1) / block_size);
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
    const int64_t seq_rows = rows_per_seq > 0 ? rows_per_seq : chunk.num_rows();
    METRALE_CHECK(seq_rows >= chunk.num_rows(), "sequence {}: {} rows in a layout of {}", sequence.id, chunk.num_rows(),
                  seq_rows);
    METRALE_CHECK(t + seq_rows <= max_step_rows(), "step exceeds the token limit");
    std::copy(table.begin(), table.end(), tables + s * h.block_stride);
    const int64_t first_row = t;
    for (int64_t p = begin; p < end; ++p, ++t) {
      token_ids[t] = p < known_end ? sequence.tokens[static_cast<size_t>(p)]
                                   : sequence.draft_tokens[static_cast<size_t>(p - known_end)];
      positions[t] = static_cast<int32_t>(p);
      slots[t] = cache_slot_of(table, p, block_size);
    }
    // Fixed layout: padding rows after the sequence's own (a known position, no KV write); the
    // sequence's length counts them so that its real rows keep their positions.
    for (int64_t p = end; p < begin + seq_rows; ++p, ++t) {
      token_ids[t] = 0;
      positions[t] = static_cast<int32_t>(begin);
      slots[t] = -1;
    }
    cu_q[s + 1] = static_cast<int32_t>(t);
    kv_lens[s] = static_cast<int32_t>(begin + seq_rows);
    if (h.has_state_slots) {
      int32_t slot = cache_->state_slot(sequence.id);
      if (slot < 0) {
        METRALE_CHECK(scratch_slots, "sequence {} has no state slot", sequence.id);
        slot = cache_->padding_state_slot();
      }
      state_slots[s] = slot;
    }
    h.max_q_len = std::max(h.max_q_len, seq_rows);
    h.max_kv_len = std::max(h.max_kv_len, begin + seq_rows);

    // Rows whose logits the engine needs: every prompt position when scoring, and the last known
    // row and every draft row when the chunk yields tokens.
    LogitRowUse use{chunk, r, 0, 0};
    int64_t first_wanted = end;
    if (sequence.request.return_prompt_logits && begin < sequence.num_prompt) first_wanted = begin;
    if (chunk.samples) first_wanted = std::min(first_wanted, known_end - 1);
    const int64_t last_wanted = chunk.samples ? end : std::min(end, sequence.num_prompt);
    if (rows_per_seq > 0) {
      // Fixed layout: every row is a logits row; the chunk's wanted ones are its known and draft rows.
      METRALE_CHECK(chunk.samples && chunk.num_new == 1, "sequence {}: a fixed-layout row set must decode",
                    sequence.id);
      use.first_row = r;
      use.first_position = begin;
      use.num_rows = end - begin;
      for (int64_t i = 0; i < seq_rows; ++i) rows[r++] = static_cast<int32_t>(first_row + i);
    } else if (first_wanted < last_wanted) {
      use.first_position = first_wanted;
      use.num_rows = last_wanted - first_wanted;
      for (int64_t p = first_wanted; p < last_wanted; ++p) rows[r++] = static_cast<int32_t>(first_row + p - begin);
    }
    use.first_batch_row = first_row;
    result.uses.push_back(use);
  }
  // Padding sequences of a graph batch: rows_per_seq tokens at position 0 that write nothing
  // (slot -1) and read keys of block 0; their logits are computed and ignored. Recurrent layers see
  // a sequence starting from zero state, which writes its final state into the padding slot.
  const int64_t padding_rows = std::max<int64_t>(rows_per_seq, 1);
  for (int64_t s = real_seqs; s < num_seqs; ++s) {
    for (int64_t i = 0; i < padding_rows; ++i, ++t) {
      token_ids[t] = 0;
      positions[t] = 0;
      slots[t] = -1;
      rows[r++] = static_cast<int32_t>(t);
    }
    cu_q[s + 1] = static_cast<int32_t>(t);
    kv_lens[s] = static_cast<int32_t>(padding_rows);
    if (h.has_state_slots) state_slots[s] = cache_->padding_state_slot();
    h.max_q_len = std::max(h.max_q_len, padding_rows);
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
  model_.forward(batch, model_caches(), logits, workspace_);
}

StepResult Runner::execute(const SchedulePlan& plan) {
  METRALE_CHECK(!plan.empty(), "empty step");
  METRALE_CHECK(cache_ != nullptr, "runner has no cache");
  join_commit();
  StepResult result;
  const Device device = model_.device();
  const int64_t vocab = model_.config().vocab_size;
  const int64_t seqs = static_cast<int64_t>(plan.chunks.size());
  METRALE_CHECK(!commit_pending_, "a step ran before the last verify step's commit");
  const bool verify = plan.num_draft_rows > 0;
  last_fixed_ = FixedShape();
  if (verify) {
    // Verify steps where every sequence decodes: the fixed layout (and its graphs).
    const auto [padded, k] = fixed_verify_shape(plan);
    if (padded > 0) {
      execute_fixed_verify(plan, padded, k, result);
      return result;
    }
  }
  // Decode graphs write the final hidden states too when the engine drafts with MTP.
  const bool all_decode = !verify && (!keep_hidden_ || limits_.mtp) &&
                          std::all_of(plan.chunks.begin(), plan.chunks.end(),
                                      [](const ScheduledChunk& c) { return c.decodes() && c.num_drafts == 0; });
  // The smallest captured graph that holds this decode batch.
  const auto graph = all_decode ? graphs_.lower_bound(seqs) : graphs_.end();
#if METRALE_WITH_CUDA
  if (graph != graphs_.end()) {
    const int64_t padded = graph->first;
    build_host_step(plan, padded, 1, result);
    upload(/*fixed_block_stride=*/true);
    graph->second->graph.launch(static_cast<cudaStream_t>(current_stream(device)));
    result.logits = logits_.tensor.slice(0, 0, padded);
    result.used_graph = true;
    last_hidden_ = keep_hidden_ ? hidden_.tensor.slice(0, 0, padded) : Tensor();
    // MTP: the decode graph wrote every row's hidden state; the fixed-layout chain can follow.
    if (limits_.mtp) remember_fixed(plan, padded, 0, true);
    return result;
  }
#else
  (void)graph;
#endif
  build_host_step(plan, 0, 0, result);
  ForwardBatch batch = upload(/*fixed_block_stride=*/false);
  const int64_t rows = host_->num_rows;
  attach_speculative_outputs(batch, verify);
  // An eager decode step whose hidden states land in the fixed buffer can feed the MTP chain too.
  const bool decode_only = std::all_of(plan.chunks.begin(), plan.chunks.end(),
                                       [](const ScheduledChunk& c) { return c.decodes() && c.num_drafts == 0; });
  if (limits_.mtp && !verify && keep_hidden_ && decode_only && batch.hidden_out.data() == hidden_.tensor.data()) {
    remember_fixed(plan, seqs, 0, false);
  }
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

size_t Runner::plan_workspace() {
  const Device device = model_.device();
  if (device.is_cpu()) return 0;
  // A scratch cache big enough for the profile batch: the largest step the scheduler can build.
  // No sequence is longer than max_model_len, so neither is a profile sequence.
  const int64_t seqs = std::min(limits_.max_num_seqs, max_step_rows());
  const int64_t tokens = std::min(max_step_rows(), seqs * limits_.max_model_len);
  const int64_t per_seq = (tokens + seqs - 1) / seqs;
  // No state slots of its own: profile sequences share the padding slot (see build_host_step).
  CacheConfig scratch_config;
  scratch_config.block_size = static_cast<int32_t>(limits_.block_size);
  scratch_config.num_blocks = static_cast<int32_t>(seqs * ((per_seq + limits_.block_size - 1) / limits_.block_size));
  scratch_config.activation_dtype = DType::kBF16;
  std::vector<CacheSpec> specs = model_.cache_specs();
  if (limits_.mtp) {
    const auto mtp = model_.mtp_cache_specs();
    specs.insert(specs.end(), mtp.begin(), mtp.end());
  }
  CacheManager scratch(specs, scratch_config, device);
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
  build_host_step(plan, 0, 0, result);
  host_->max_kv_len = limits_.max_model_len;  // size attention scratch for the longest context
  const ForwardBatch batch = upload(false);
  workspace_.reserve(workspace_.capacity_bytes(), /*growable=*/true);
  run_forward(batch, logits_.tensor.slice(0, 0, host_->num_rows));
  synchronize(device);
  size_t needed = workspace_.high_water_bytes();
  // Decode graphs pad to their batch size with the longest context bound: profile the largest one too.
  if (limits_.max_num_seqs > 0) {
    SchedulePlan empty;
    build_host_step(empty, limits_.max_num_seqs, 1, result);
    const ForwardBatch decode = upload(true);
    run_forward(decode, logits_.tensor.slice(0, 0, host_->num_rows));
    synchronize(device);
    needed = std::max(needed, workspace_.high_water_bytes());
  }
  // Speculative steps in the fixed layout: the largest verify, its commit and the MTP chain.
  if (limits_.max_drafts > 0) needed = std::max(needed, profile_fixed_steps());
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
    build_host_step(empty, size, 1, result);
    ForwardBatch batch = upload(true);
    if (limits_.mtp) batch.hidden_out = hidden_.tensor.slice(0, 0, size);
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
  if (limits_.max_drafts > 0) capture_verify_graphs(batch_sizes);
  warm_up_mtp_keys();
  METRALE_LOG_INFO("captured {} decode graphs and {} verify graph sets", graphs_.size(), verify_graphs_.size());
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
