#include "engine/runner.h"

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "engine/runner_internal.h"
#include "kernels/moe.h"
#include "runtime/stream.h"

namespace metrale {

std::vector<CacheSpec> engine_cache_specs(const Model& model, bool mtp) {
  std::vector<CacheSpec> specs = model.cache_specs();
  if (mtp) {
    const std::vector<CacheSpec> heads = model.mtp_cache_specs();
    specs.insert(specs.end(), heads.begin(), heads.end());
  }
  return specs;
}

namespace {

BatchLimits batch_limits(const RunnerLimits& limits) {
  BatchLimits batch;
  batch.max_rows = std::max(limits.max_num_tokens, limits.max_num_seqs);
  batch.max_seqs = limits.max_num_seqs;
  batch.max_stride = max_blocks_per_seq(limits);
  batch.block_size = limits.block_size;
  batch.max_drafts = limits.max_drafts;
  return batch;
}


}  // namespace

Runner::Runner(Model& model, const RunnerLimits& limits)
    : model_(model),
      limits_(limits),
      workspace_(model.device(), 16u << 20, /*growable=*/true),
      builder_(batch_limits(limits), model.device()),
      commit_workspace_(model.device(), 1u << 20, /*growable=*/true) {
  if (model_.capabilities().needs_prestage) {
    builder_.set_step_inputs(model_.step_input_specs(), [this](const PrestageRows& rows, std::span<const Tensor> inputs) {
      model_.prestage(rows, inputs);
    });
  }
  const Device device = model_.device();
  if (device.is_cuda()) {
    const int64_t logit_rows = std::max(limits_.max_num_seqs, limits_.max_logit_rows);
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

ForwardBatch Runner::build_step(const SchedulePlan& plan, int64_t padded_seqs, int64_t rows_per_seq,
                                StepResult& result, int64_t max_kv_len) {
  const int64_t block_size = limits_.block_size;
  const int64_t real_seqs = static_cast<int64_t>(plan.chunks.size());
  const int64_t num_seqs = std::max(real_seqs, padded_seqs);
  METRALE_CHECK(num_seqs <= limits_.max_num_seqs, "step of {} sequences exceeds the limit {}", num_seqs,
                limits_.max_num_seqs);
  const bool state_slots = cache_->has_recurrent_state();
  // Sequences of a scratch cache (the workspace profile) have no slot of their own: they write the
  // padding slot, whose contents nobody reads.
  const bool scratch_slots = cache_->config().num_state_slots == 0;
  groups_.clear();
  result.uses.clear();
  int64_t row = 0, logit_row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
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
    METRALE_CHECK(row + seq_rows <= max_step_rows(), "step exceeds the token limit");
    RowGroup group;
    group.first_position = begin;
    group.rows = seq_rows;  // fixed layout: padding rows after the sequence's own
    group.real_rows = chunk.num_rows();
    const std::span<const int32_t> tokens(sequence.tokens);
    group.tokens = tokens.subspan(static_cast<size_t>(begin), static_cast<size_t>(chunk.num_new));
    group.drafts = std::span<const int32_t>(sequence.draft_tokens).first(static_cast<size_t>(chunk.num_drafts));
    group.block_table = table;
    group.history = tokens.first(static_cast<size_t>(begin));
    if (state_slots) {
      group.state_slot = cache_->state_slot(sequence.id);
      if (group.state_slot < 0) {
        METRALE_CHECK(scratch_slots, "sequence {} has no state slot", sequence.id);
        group.state_slot = cache_->padding_state_slot();
      }
    }
    // Rows whose logits the engine needs: every prompt position when scoring, and the last known
    // row and every draft row when the chunk yields tokens.
    LogitRowUse use{chunk, logit_row, 0, 0};
    int64_t first_wanted = end;
    if (sequence.request.return_prompt_logits && begin < sequence.num_prompt) first_wanted = begin;
    if (chunk.samples) first_wanted = std::min(first_wanted, known_end - 1);
    const int64_t last_wanted = chunk.samples ? end : std::min(end, sequence.num_prompt);
    if (rows_per_seq > 0) {
      // Fixed layout: every row is a logits row; the chunk's wanted ones are its known and draft rows.
      METRALE_CHECK(chunk.samples && chunk.num_new == 1, "sequence {}: a fixed-layout row set must decode",
                    sequence.id);
      group.logits_end = seq_rows;
      use.first_position = begin;
      use.num_rows = end - begin;
    } else if (first_wanted < last_wanted) {
      group.logits_begin = first_wanted - begin;
      group.logits_end = last_wanted - begin;
      use.first_position = first_wanted;
      use.num_rows = last_wanted - first_wanted;
    }
    use.first_batch_row = row;
    result.uses.push_back(use);
    row += group.rows;
    logit_row += group.logits_end - group.logits_begin;
    groups_.push_back(group);
  }
  // Padding sequences of a graph batch: rows_per_seq tokens at position 0 that write nothing
  // (slot -1) and read keys of block 0; their logits are computed and ignored. Recurrent layers see
  // a sequence starting from zero state, which writes its final state into the padding slot.
  RowGroup padding;
  padding.rows = std::max<int64_t>(rows_per_seq, 1);
  padding.logits_end = padding.rows;
  if (state_slots) padding.state_slot = cache_->padding_state_slot();
  for (int64_t s = real_seqs; s < num_seqs; ++s) groups_.push_back(padding);

  BatchBuilder::StepOptions options;
  options.stride = padded_seqs > 0 ? max_blocks_per_seq(limits_) : 0;
  options.max_kv_len = padded_seqs > 0 ? limits_.max_model_len : max_kv_len;  // graphs plan for any context
  options.state_slots = state_slots;
  options.prestage = true;
  const BatchBuilder::Built built = builder_.build_step(groups_, options);
  ForwardBatch batch = built.batch;
  batch.step_inputs = built.step_inputs;
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
  const bool verify = plan.num_draft_rows > 0;
  const bool first_step = std::exchange(first_step_, false);
  calibrate_mtp_ = first_step;
  if (verify && !first_step) {
    // Verify steps where every sequence decodes: the fixed layout (and its graphs).
    const auto [padded, k] = fixed_verify_shape(plan);
    if (padded > 0) {
      execute_fixed_verify(plan, padded, k, result);
      return result;
    }
  }
  const bool decode_only = std::all_of(plan.chunks.begin(), plan.chunks.end(),
                                       [](const ScheduledChunk& c) { return c.decodes() && c.num_drafts == 0; });
  // Decode graphs write the final hidden states too when the engine drafts with MTP.
  const bool all_decode = !verify && (!keep_hidden_ || limits_.mtp) && decode_only;
  // The smallest captured graph that holds this decode batch.
  const auto graph = all_decode && !first_step ? graphs_.lower_bound(seqs) : graphs_.end();
#if METRALE_WITH_CUDA
  if (graph != graphs_.end()) {
    const int64_t padded = graph->first;
    build_step(plan, padded, 1, result);
    graph->second->graph.launch(static_cast<cudaStream_t>(current_stream(device)));
    result.logits = logits_.tensor.slice(0, 0, padded);
    result.used_graph = true;
    result.hidden = keep_hidden_ ? hidden_.tensor.slice(0, 0, padded) : Tensor();
    // MTP: the decode graph wrote every row's hidden state; the fixed-layout chain can follow.
    if (limits_.mtp) result.fixed = fixed_step(plan, padded, 0, true);
    return result;
  }
#else
  (void)graph;
#endif
  ForwardBatch batch = build_step(plan, 0, 0, result);
  batch.calibrate_kv_scales = first_step;
  const auto rows = static_cast<int64_t>(batch.host_logit_rows.size());
  attach_speculative_outputs(batch, verify, /*fixed=*/false, result);
  // An eager decode step whose hidden states land in the fixed buffer can feed the MTP chain too.
  if (limits_.mtp && !verify && keep_hidden_ && decode_only && batch.hidden_out.data() == hidden_.tensor.data()) {
    result.fixed = fixed_step(plan, seqs, 0, false);
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
  if (verify) result.verify = batch;
  return result;
}

void Runner::abandon() {
  join_commit();
  synchronize(model_.device());
}

size_t Runner::plan_workspace() {
  const Device device = model_.device();
  if (device.is_cpu()) return 0;
  // A scratch cache big enough for the profile batch: the largest step the scheduler can build.
  // No sequence is longer than max_model_len, so neither is a profile sequence.
  const int64_t seqs = std::min(limits_.max_num_seqs, max_step_rows());
  const int64_t tokens = std::min(max_step_rows(), seqs * limits_.max_model_len);
  const int64_t per_seq = (tokens + seqs - 1) / seqs;
  // No state slots of its own: profile sequences share the padding slot (see build_step).
  CacheConfig scratch_config;
  scratch_config.block_size = static_cast<int32_t>(limits_.block_size);
  scratch_config.num_blocks = static_cast<int32_t>(seqs * ((per_seq + limits_.block_size - 1) / limits_.block_size));
  scratch_config.activation_dtype = model_.activation_dtype();
  CacheManager scratch(engine_cache_specs(model_, limits_.mtp), scratch_config, device);
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
  // Attention scratch sized for the longest context.
  const ForwardBatch batch = build_step(plan, 0, 0, result, /*max_kv_len=*/limits_.max_model_len);
  workspace_.reserve(workspace_.capacity_bytes(), /*growable=*/true);
  run_forward(batch, logits_.tensor.slice(0, 0, static_cast<int64_t>(batch.host_logit_rows.size())));
  synchronize(device);
  size_t needed = workspace_.high_water_bytes();
  // Decode graphs pad to their batch size with the longest context bound: profile the largest one too.
  if (limits_.max_num_seqs > 0) {
    SchedulePlan empty;
    const ForwardBatch decode = build_step(empty, limits_.max_num_seqs, 1, result);
    run_forward(decode, logits_.tensor.slice(0, 0, static_cast<int64_t>(decode.host_logit_rows.size())));
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
    ForwardBatch batch = build_step(empty, size, 1, result);
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
