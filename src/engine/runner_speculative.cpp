// Runner: the speculative-decoding steps. Verify steps where every sequence decodes run in a fixed
// layout (1 + k rows per sequence, padded sequences up to a captured size) so that the verify, the
// commit of its kept rows and the MTP draft chain can each replay one CUDA graph; other verify steps
// (mixed with prefill chunks) run the ragged layout eagerly.
#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "engine/runner.h"
#include "engine/runner_internal.h"
#include "kernels/moe.h"
#include "kernels/sampling.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

// Grows `buffer` to hold at least `shape` (eager steps may allocate; the device is synchronised
// first so that no queued kernel still reads the old buffer) and returns a view of that shape.
// Buffers that graphs captured are allocated at full size up front and never grow here.
Tensor grown(OwnedTensor& buffer, DType dtype, Shape shape, Device device) {
  if (buffer.tensor.empty() || buffer.tensor.nbytes() < static_cast<size_t>(shape.numel()) * dtype_size(dtype)) {
    if (!device.is_cpu()) synchronize(device);
    int64_t elements = std::max<int64_t>(shape.numel(), 1);
    if (!buffer.tensor.empty())
      elements = std::max<int64_t>(elements, 2 * static_cast<int64_t>(buffer.tensor.nbytes() / dtype_size(dtype)));
    buffer = OwnedTensor(dtype, {elements}, device);
  }
  return Tensor(buffer.tensor.data(), dtype, shape, device);
}

// Draft counts whose verify graphs are captured: every k up to 4 and the largest; a step verifying
// k drafts pads its rows to the next captured count.
[[maybe_unused]] std::vector<int64_t> captured_draft_counts(int64_t max_drafts) {
  std::vector<int64_t> counts;
  for (int64_t k = 1; k <= std::min<int64_t>(max_drafts, 4); ++k) counts.push_back(k);
  if (max_drafts > 4) counts.push_back(max_drafts);
  return counts;
}

#if METRALE_WITH_CUDA
// Captures `body` (launches on `stream`) into `graph` after one eager warm-up run.
template <typename Body>
void capture_graph(CudaGraph& graph, Device device, Body&& body) {
  auto stream = static_cast<cudaStream_t>(current_stream(device));
  body();  // warm-up: libraries pick algorithms, lazy loads happen outside the capture
  synchronize(device);
  graph.begin_capture(stream);
  try {
    body();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);
    if (broken != nullptr) cudaGraphDestroy(broken);
    throw;
  }
  graph.end_capture(stream);
}
#endif

}  // namespace

void Runner::allocate_speculative_buffers() {
  const Device device = model_.device();
#if METRALE_WITH_CUDA
  if (device.is_cuda() && limits_.mtp) commit_stream_ = std::make_unique<CommitStream>();
#endif
  const int64_t tokens = max_step_rows();
  const int64_t seqs = limits_.max_num_seqs, k = limits_.max_drafts;
  const int64_t rows = seqs * (1 + k);
  const int64_t hidden = model_.config().hidden_size, vocab = model_.config().vocab_size;
  const DType act = model_.activation_dtype();
  // Greedy sampling of every verify row: constant parameters (temperature 0).
  greedy_temperature_ = OwnedTensor(DType::kF32, {rows}, device);
  greedy_top_k_ = OwnedTensor(DType::kI32, {rows}, device);
  greedy_top_p_ = OwnedTensor(DType::kF32, {rows}, device);
  greedy_min_p_ = OwnedTensor(DType::kF32, {rows}, device);
  greedy_seed_ = OwnedTensor(DType::kI64, {rows}, device);
  greedy_step_ = OwnedTensor(DType::kI64, {rows}, device);
  {
    const std::vector<float> zeros(static_cast<size_t>(rows), 0.0f), ones(static_cast<size_t>(rows), 1.0f);
    const std::vector<int64_t> zeros64(static_cast<size_t>(rows), 0);
    const size_t bytes = static_cast<size_t>(rows) * 4;
    copy_bytes(greedy_temperature_.tensor.data(), device, zeros.data(), Device::cpu(), bytes);
    copy_bytes(greedy_top_k_.tensor.data(), device, zeros.data(), Device::cpu(), bytes);  // int 0 == float 0 bits
    copy_bytes(greedy_top_p_.tensor.data(), device, ones.data(), Device::cpu(), bytes);
    copy_bytes(greedy_min_p_.tensor.data(), device, zeros.data(), Device::cpu(), bytes);
    copy_bytes(greedy_seed_.tensor.data(), device, zeros64.data(), Device::cpu(), 2 * bytes);
    copy_bytes(greedy_step_.tensor.data(), device, zeros64.data(), Device::cpu(), 2 * bytes);
  }
  greedy_tokens_ = OwnedTensor(DType::kI32, {rows}, device);
  greedy_logprobs_ = OwnedTensor(DType::kF32, {rows}, device);
  const size_t scratch = std::max<size_t>(model_.verify_scratch_bytes(rows, seqs), 1);
  fixed_verify_scratch_ = OwnedTensor(DType::kU8, {static_cast<int64_t>(scratch)}, device);
  builder_.reserve_fixed(seqs, k);
  greedy_host_ = PinnedBuffer(static_cast<size_t>(2 * rows) * sizeof(int32_t));
  if (limits_.mtp) {
    // Every step's hidden states at fixed addresses (decode and verify graphs write them).
    hidden_ = OwnedTensor(act, {tokens, hidden}, device);
    mtp_drafts_ = OwnedTensor(DType::kI32, {k * seqs}, device);
    mtp_drafts_host_ = PinnedBuffer(static_cast<size_t>(k * seqs) * sizeof(int32_t));
    mtp_draft_logprobs_ = OwnedTensor(DType::kF32, {seqs}, device);
    mtp_fixed_hidden_[0] = OwnedTensor(act, {rows, hidden}, device);
    mtp_fixed_hidden_[1] = OwnedTensor(act, {seqs, hidden}, device);
    mtp_fixed_hidden_[2] = OwnedTensor(act, {seqs, hidden}, device);
    mtp_fixed_logits_ = OwnedTensor(DType::kF32, {seqs, vocab}, device);
    // Sixteen decode steps of hidden states between two batched MTP key catch-ups while the head
    // is off; the batch then costs a few kernels over 16 x S rows instead of a head per step.
    constexpr int64_t kStashSteps = 16;
    mtp_stash_ = OwnedTensor(act, {kStashSteps * seqs, hidden}, device);
    // Eager MTP steps (run_mtp, run_mtp_keys: at most `tokens` rows each) gather into these, sized
    // up front so that no step allocates (and synchronises).
    mtp_hidden_in_ = OwnedTensor(act, {tokens, hidden}, device);
    builder_.reserve_key_rows(tokens);
  }
}

std::pair<int64_t, int64_t> Runner::fixed_verify_shape(const SchedulePlan& plan) const {
  if (limits_.max_drafts <= 0 || greedy_tokens_.tensor.empty() || plan.ragged_verify) return {0, 0};
  const auto seqs = static_cast<int64_t>(plan.chunks.size());
  int64_t k = 0, longest = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.decodes()) return {0, 0};
    k = std::max(k, chunk.num_drafts);
    longest = std::max(longest, chunk.sequence->num_computed);
  }
  if (k == 0 || k > limits_.max_drafts || seqs > limits_.max_num_seqs) return {0, 0};
  // The smallest captured shape that holds the step; eagerly the step's own shape.
  for (const auto& [shape, graphs] : verify_graphs_) {
    const auto [padded, drafts] = shape;
    if (padded >= seqs && drafts >= k && longest + 1 + drafts <= limits_.max_model_len) {
      // Prefer fewer rows: the map orders by sequences first, so look for the tightest k there.
      int64_t best_k = drafts;
      for (const auto& [other, unused] : verify_graphs_) {
        if (other.first == padded && other.second >= k && other.second < best_k) best_k = other.second;
      }
      return {padded, best_k};
    }
  }
  if (longest + 1 + k > limits_.max_model_len) return {0, 0};
  return {seqs, k};
}

void Runner::execute_fixed_verify(const SchedulePlan& plan, int64_t padded_seqs, int64_t k, StepResult& result) {
  const Device device = model_.device();
  const auto seqs = static_cast<int64_t>(plan.chunks.size());
  const auto graph = verify_graphs_.find({padded_seqs, k});
  const bool use_graph = graph != verify_graphs_.end();
  ForwardBatch batch = build_step(plan, use_graph ? padded_seqs : 0, 1 + k, result);
  const int64_t rows = batch.num_tokens;
  attach_speculative_outputs(batch, /*verify=*/true, /*fixed=*/true, result);
  if (limits_.mtp) {  // the MTP chain reads the verify's hidden states in place
    batch.hidden_out = hidden_.tensor.slice(0, 0, rows);
    result.hidden = batch.hidden_out;
  }
  if (device.is_cpu() && (logits_.tensor.empty() || logits_.tensor.size(0) < rows)) {
    logits_ = OwnedTensor(DType::kF32, {rows, model_.config().vocab_size}, device);
  }
#if METRALE_WITH_CUDA
  if (use_graph) {
    graph->second->verify.launch(static_cast<cudaStream_t>(current_stream(device)));
  } else {
    run_fixed_verify(batch, rows, result.uses);
  }
#else
  run_fixed_verify(batch, rows, result.uses);
#endif
  result.logits = logits_.tensor.slice(0, 0, rows);
  result.rows_per_seq = 1 + k;
  result.greedy_tokens = greedy_tokens_.tensor.slice(0, 0, rows);
  result.greedy_logprobs = greedy_logprobs_.tensor.slice(0, 0, rows);
  result.used_graph = use_graph;
  result.fixed = fixed_step(plan, use_graph ? padded_seqs : seqs, k, use_graph);
  result.verify = batch;
}

std::pair<std::span<const int32_t>, std::span<const float>> Runner::fetch_greedy_rows(const StepResult& result) {
  const int64_t rows = result.greedy_tokens.numel();
  METRALE_CHECK(rows > 0 && static_cast<size_t>(2 * rows) * sizeof(int32_t) <= greedy_host_.size(),
                "no greedy rows to fetch ({} rows)", rows);
  auto* tokens = static_cast<int32_t*>(greedy_host_.data());
  auto* logprobs = reinterpret_cast<float*>(tokens + rows);
  const Device device = result.greedy_tokens.device();
  copy_bytes_async(tokens, Device::cpu(), result.greedy_tokens.data(), device, static_cast<size_t>(rows) * 4);
  copy_bytes_async(logprobs, Device::cpu(), result.greedy_logprobs.data(), device, static_cast<size_t>(rows) * 4);
  if (device.is_cuda()) synchronize(device);
  return {{tokens, static_cast<size_t>(rows)}, {logprobs, static_cast<size_t>(rows)}};
}

void Runner::sample_greedy(const Tensor& logits) {
  const int64_t rows = logits.size(0);
  METRALE_CHECK(rows <= greedy_tokens_.tensor.numel(), "argmax of {} rows (at most {})", rows,
                greedy_tokens_.tensor.numel());
  if (rows == 0) return;
  const kernels::SamplingRowParams greedy{
      greedy_temperature_.tensor.slice(0, 0, rows), greedy_top_k_.tensor.slice(0, 0, rows),
      greedy_top_p_.tensor.slice(0, 0, rows),       greedy_min_p_.tensor.slice(0, 0, rows),
      greedy_seed_.tensor.slice(0, 0, rows),        greedy_step_.tensor.slice(0, 0, rows)};
  kernels::sample_tokens(logits, greedy, greedy_tokens_.tensor.slice(0, 0, rows),
                         greedy_logprobs_.tensor.slice(0, 0, rows));
}

std::vector<int32_t> Runner::argmax_rows(const Tensor& logits) {
  std::vector<int32_t> tokens(static_cast<size_t>(logits.size(0)));
  if (tokens.empty()) return tokens;
  sample_greedy(logits);
  copy_bytes(tokens.data(), Device::cpu(), greedy_tokens_.tensor.data(), logits.device(),
             tokens.size() * sizeof(int32_t));
  return tokens;
}

void Runner::greedy_rows(StepResult& result) {
  const int64_t rows = result.logits.size(0);
  sample_greedy(result.logits);
  result.greedy_tokens = greedy_tokens_.tensor.slice(0, 0, rows);
  result.greedy_logprobs = greedy_logprobs_.tensor.slice(0, 0, rows);
}

FixedStep Runner::fixed_step(const SchedulePlan& plan, int64_t padded_seqs, int64_t k, bool graph) {
  FixedStep step;
  step.seqs = padded_seqs;
  step.k = k;
  step.real_seqs = static_cast<int64_t>(plan.chunks.size());
  step.graph = graph;
  for (const ScheduledChunk& chunk : plan.chunks) {
    step.seq_ids.push_back(chunk.sequence->id);
    step.first_positions.push_back(chunk.sequence->num_computed);
  }
  return step;
}

void Runner::run_fixed_verify(const ForwardBatch& batch, int64_t rows, std::span<const LogitRowUse> uses) {
  run_forward(batch, logits_.tensor.slice(0, 0, rows));
  const auto sample = [&](int64_t begin, int64_t end) {
    const kernels::SamplingRowParams greedy{
        greedy_temperature_.tensor.slice(0, begin, end), greedy_top_k_.tensor.slice(0, begin, end),
        greedy_top_p_.tensor.slice(0, begin, end),       greedy_min_p_.tensor.slice(0, begin, end),
        greedy_seed_.tensor.slice(0, begin, end),        greedy_step_.tensor.slice(0, begin, end)};
    kernels::sample_tokens(logits_.tensor.slice(0, begin, end), greedy, greedy_tokens_.tensor.slice(0, begin, end),
                           greedy_logprobs_.tensor.slice(0, begin, end));
  };
  if (model_.device().is_cuda()) {
    // Every row at once (graph-safe): padding rows may read unwritten keys; the kernel marks rows
    // without a valid logit with token -1 and nobody reads theirs.
    sample(0, rows);
    return;
  }
  // The CPU sampler rejects non-finite rows: only the rows the sequences own.
  for (const LogitRowUse& use : uses) sample(use.first_row, use.first_row + use.num_rows);
}

void Runner::attach_speculative_outputs(ForwardBatch& batch, bool verify, bool fixed, StepResult& result) {
  const Device device = model_.device();
  if (keep_hidden_) {
    result.hidden = grown(hidden_, model_.activation_dtype(), {batch.num_tokens, model_.config().hidden_size}, device);
    batch.hidden_out = result.hidden;
  }
  if (!verify) return;
  batch.verify = true;
  const size_t bytes = model_.verify_scratch_bytes(batch.num_tokens, batch.num_seqs);
  if (fixed) {
    METRALE_CHECK(fixed_verify_scratch_.tensor.nbytes() >= bytes, "fixed verify scratch {} for {} bytes",
                  fixed_verify_scratch_.tensor.describe(), bytes);
    batch.verify_scratch = fixed_verify_scratch_.tensor;
  } else {
    batch.verify_scratch =
        grown(verify_scratch_, DType::kU8, {static_cast<int64_t>(std::max<size_t>(bytes, 1))}, device);
  }
}

void Runner::commit_verified(const ForwardBatch& verify, const FixedStep& fixed, std::span<const int32_t> kept_rows,
                             bool mtp_follows) {
  METRALE_CHECK(verify.verify, "commit_verified without a verify step");
  if (!fixed.graph) {
    // Eager: the model builds the exact commit rows from the host counts.
    std::vector<int32_t> kept(kept_rows.begin(), kept_rows.end());
    kept.resize(static_cast<size_t>(verify.num_seqs), 1);  // padding sequences of the layout keep one row
    workspace_.reset();
    model_.commit_verified(verify, kept, model_caches(), workspace_);
    return;
  }
  builder_.stage_commit(builder_.fixed_layout(fixed.seqs, fixed.k), verify, kept_rows);
#if METRALE_WITH_CUDA
  const auto stream = static_cast<cudaStream_t>(current_stream(model_.device()));
  const CudaGraph& graph = verify_graphs_.at({fixed.seqs, fixed.k})->commit;
  if (mtp_follows && commit_stream_ != nullptr) {
    // After the staged commit arrays, on its own stream; join_commit() follows the MTP chain.
    commit_stream_->inputs_ready.record(stream);
    commit_stream_->inputs_ready.wait_in(commit_stream_->stream.get());
    graph.launch(commit_stream_->stream.get());
    commit_stream_->done.record(commit_stream_->stream.get());
    commit_in_flight_ = true;
  } else {
    graph.launch(stream);
  }
#else
  (void)mtp_follows;
#endif
}

void Runner::join_commit() {
  if (!commit_in_flight_) return;
  commit_in_flight_ = false;
#if METRALE_WITH_CUDA
  commit_stream_->done.wait_in(static_cast<cudaStream_t>(current_stream(model_.device())));
#endif
}

void Runner::run_fixed_commit(const FixedLayout& layout, const ForwardBatch& verify) {
  const VerifyCommit kept = builder_.commit_view(layout);
  commit_workspace_.reset();
  model_.commit_kept_rows(verify, kept, model_caches(), commit_workspace_);
}

MtpChain Runner::launch_mtp_fixed(const FixedStep& step, std::span<const MtpFixedRow> rows, int64_t drafts) {
  METRALE_CHECK(limits_.mtp && !step.empty(), "launch_mtp_fixed without a fixed-layout step");
  METRALE_CHECK(static_cast<int64_t>(rows.size()) == step.real_seqs, "MTP rows for {} of {} sequences", rows.size(),
                step.real_seqs);
  const Device device = model_.device();
  const int64_t seqs = step.seqs;
  drafts = std::clamp<int64_t>(drafts, 1, limits_.max_drafts);
#if METRALE_WITH_CUDA
  const CudaGraph* graph = nullptr;
  const auto graphs = verify_graphs_.find({seqs, step.k});
  if (step.graph && !calibrate_mtp_ && graphs != verify_graphs_.end()) {
    // The smallest captured chain that makes enough drafts.
    const auto it = graphs->second->mtp.lower_bound(drafts);
    if (it != graphs->second->mtp.end()) {
      drafts = it->first;
      graph = &it->second;
    }
  }
#endif
  for (const MtpFixedRow& row : rows) {
    METRALE_CHECK(row.chain_positions < drafts, "MTP row with {} chained positions for {} drafts", row.chain_positions,
                  drafts);
  }
  const StagedMtp staged = stage_fixed_mtp(step, rows, drafts);
#if METRALE_WITH_CUDA
  if (graph != nullptr) {
    graph->launch(static_cast<cudaStream_t>(current_stream(device)));
  } else {
    run_fixed_mtp(staged);
  }
#else
  run_fixed_mtp(staged);
#endif
  MtpChain chain;
  chain.seqs = seqs;
  chain.drafts = drafts;
  for (const MtpFixedRow& row : rows) chain.chain_positions.push_back(row.drafting ? row.chain_positions : -1);
  copy_bytes_async(mtp_drafts_host_.data(), Device::cpu(), mtp_drafts_.tensor.data(), device,
                   static_cast<size_t>(drafts * seqs) * sizeof(int32_t));
  join_commit();  // queued after the chain: it ran beside the commit
  return chain;
}

std::vector<std::vector<int32_t>> Runner::collect_mtp_fixed(const MtpChain& chain) {
  METRALE_CHECK(!chain.empty(), "no MTP chain in flight");
  const Device device = model_.device();
  if (device.is_cuda()) synchronize(device);
  const auto* all = static_cast<const int32_t*>(mtp_drafts_host_.data());
  std::vector<std::vector<int32_t>> out(chain.chain_positions.size());
  for (size_t s = 0; s < out.size(); ++s) {
    for (int64_t j = 0; j <= chain.chain_positions[s]; ++j)
      out[s].push_back(std::max(all[static_cast<size_t>(j * chain.seqs) + s], 0));  // -1: no valid logit
  }
  return out;
}

Runner::StagedMtp Runner::stage_fixed_mtp(const FixedStep& step, std::span<const MtpFixedRow> rows, int64_t drafts) {
  const int64_t seqs = step.seqs, k = step.k, per_seq = 1 + k;
  StagedMtp staged;
  staged.layout = builder_.fixed_layout(seqs, k);
  staged.drafts = drafts;
  staged.drafting.assign(static_cast<size_t>(seqs), 0);
  groups_.assign(static_cast<size_t>(seqs), RowGroup());
  chain_groups_.assign(static_cast<size_t>(std::max<int64_t>(drafts - 1, 0) * seqs), RowGroup());
  // Finished or padding sequences: rows at position 0 that write nothing, their draft row first.
  for (RowGroup& group : groups_) {
    group.rows = per_seq;
    group.logits_end = 1;
  }
  for (RowGroup& group : chain_groups_) {
    group.rows = 1;
    group.logits_end = 1;
  }
  for (int64_t s = 0; s < static_cast<int64_t>(rows.size()) && s < step.real_seqs; ++s) {
    const MtpFixedRow& row = rows[static_cast<size_t>(s)];
    if (!row.drafting) continue;
    staged.drafting[static_cast<size_t>(s)] = 1;
    const auto table = cache_->block_table(step.seq_ids[static_cast<size_t>(s)]);
    // The verify row of the sequence's known token sat at position t.
    const int64_t t = step.first_positions[static_cast<size_t>(s)];
    const int64_t accepted = row.accepted;
    METRALE_CHECK(accepted >= 0 && accepted <= k && static_cast<int64_t>(row.next_tokens.size()) == accepted + 1,
                  "MTP row {}: {} accepted with {} next tokens", s, accepted, row.next_tokens.size());
    // Catch-up: rows 0..a at positions t..t+a with the tokens that followed them; rows past a are
    // padding (their keys are not written). Row a drafts.
    RowGroup& catch_up = groups_[static_cast<size_t>(s)];
    catch_up.first_position = t;
    catch_up.real_rows = accepted + 1;
    catch_up.tokens = row.next_tokens;
    catch_up.block_table = table;
    catch_up.logits_begin = accepted;
    catch_up.logits_end = accepted + 1;
    // Chained draft j sits at position t + a + j; without a reserved block it writes nothing (a
    // padding row at t + a) and its draft is dropped.
    for (int64_t j = 1; j < drafts; ++j) {
      RowGroup& chained = chain_groups_[static_cast<size_t>((j - 1) * seqs + s)];
      const bool room = j <= row.chain_positions;
      chained.first_position = t + accepted + (room ? j : 0);
      chained.real_rows = room ? 1 : 0;
      chained.block_table = table;
    }
  }
  // Block tables keep the graphs' fixed stride; eager steps bound the attention by the longest context.
  const int64_t longest = builder_.stage_mtp(staged.layout, groups_, chain_groups_);
  staged.max_kv_len = step.graph ? 0 : longest;
  return staged;
}

void Runner::run_fixed_mtp(const StagedMtp& staged) {
  const FixedLayout& a = staged.layout;
  const int64_t seqs = a.seqs, rows = seqs * (1 + a.k), drafts = staged.drafts;
  const Device device = model_.device();
  const DType act = model_.activation_dtype();
  const int64_t hidden = model_.config().hidden_size, vocab = model_.config().vocab_size;
  const int64_t layers = std::max<int64_t>(model_.num_mtp_layers(), 1);
  const int64_t max_kv_len = staged.max_kv_len > 0 ? staged.max_kv_len : limits_.max_model_len;
  const Tensor logits = Tensor(mtp_fixed_logits_.tensor.data(), DType::kF32, {seqs, vocab}, device);
  const auto greedy = [&](int64_t j) {
    const auto sample = [&](int64_t begin, int64_t end) {
      const kernels::SamplingRowParams params{
          greedy_temperature_.tensor.slice(0, begin, end), greedy_top_k_.tensor.slice(0, begin, end),
          greedy_top_p_.tensor.slice(0, begin, end),       greedy_min_p_.tensor.slice(0, begin, end),
          greedy_seed_.tensor.slice(0, begin, end),        greedy_step_.tensor.slice(0, begin, end)};
      kernels::sample_tokens(logits.slice(0, begin, end), params,
                             mtp_drafts_.tensor.slice(0, j * seqs + begin, j * seqs + end),
                             mtp_draft_logprobs_.tensor.slice(0, begin, end));
    };
    if (device.is_cuda()) {
      sample(0, seqs);  // graph-safe; rows of finished and padding sequences are ignored
      return;
    }
    // The CPU sampler rejects the non-finite rows finished and padding sequences may produce.
    for (int64_t s = 0; s < seqs; ++s) {
      if (s < static_cast<int64_t>(staged.drafting.size()) && staged.drafting[static_cast<size_t>(s)] != 0) {
        sample(s, s + 1);
      } else {
        const int32_t zero = 0;
        copy_bytes(static_cast<int32_t*>(mtp_drafts_.tensor.data()) + j * seqs + s, device, &zero, Device::cpu(),
                   sizeof(zero));
      }
    }
  };
  // Catch-up over every verify row: x_{t+1} with h_t of the verify (the hidden states in place).
  ForwardBatch b0 = builder_.mtp_view(a, 0, max_kv_len);
  b0.hidden_out = mtp_fixed_hidden_[0].tensor.slice(0, 0, rows);
  b0.calibrate_kv_scales = calibrate_mtp_;
  const Tensor verify_hidden = Tensor(hidden_.tensor.data(), act, {rows, hidden}, device);
  workspace_.reset();
  model_.mtp_forward(b0, model_caches(), verify_hidden, logits, workspace_, 0);
  greedy(0);
  // Chained drafts: one row per sequence with the previous draft and the previous o_t.
  Tensor previous = mtp_fixed_hidden_[1].tensor.slice(0, 0, seqs);
  kernels::gather_rows(b0.hidden_out, b0.logit_rows, previous);
  for (int64_t j = 1; j < drafts; ++j) {
    const Tensor out = mtp_fixed_hidden_[j % 2 == 1 ? 2 : 1].tensor.slice(0, 0, seqs);
    ForwardBatch b = builder_.mtp_view(a, j, max_kv_len);
    b.token_ids = mtp_drafts_.tensor.slice(0, (j - 1) * seqs, j * seqs);
    b.hidden_out = out;
    b.calibrate_kv_scales = calibrate_mtp_;
    workspace_.reset();
    model_.mtp_forward(b, model_caches(), previous, logits, workspace_, j % layers);
    greedy(j);
    previous = out;
  }
}

Tensor Runner::run_mtp(std::span<const MtpRows> rows, const Tensor& hidden_source, int64_t mtp_layer,
                       Tensor& out_hidden) {
  const Device device = model_.device();
  const int64_t hidden_size = model_.config().hidden_size;
  groups_.clear();
  for (const MtpRows& seq : rows) {
    const auto count = static_cast<int64_t>(seq.next_tokens.size());
    METRALE_CHECK(count > 0, "MTP rows of sequence {}: none", seq.seq_id);
    RowGroup group;
    group.first_position = seq.first_position;
    group.rows = group.real_rows = count;
    group.tokens = seq.next_tokens;
    group.block_table = cache_->block_table(seq.seq_id);
    group.hidden_row = seq.first_hidden_row;
    if (seq.wants_logits) {
      group.logits_begin = count - 1;
      group.logits_end = count;
    }
    groups_.push_back(group);
  }
  BatchBuilder::StepOptions options;
  options.hidden_rows = true;  // the MTP layers are attention only: no state slots
  const BatchBuilder::Built built = builder_.build_step(groups_, options);
  ForwardBatch batch = built.batch;
  batch.calibrate_kv_scales = calibrate_mtp_;
  const int64_t t = batch.num_tokens, r = built.shape.num_logit_rows;
  const DType act = model_.activation_dtype();
  const Tensor hidden_in = grown(mtp_hidden_in_, act, {t, hidden_size}, device);
  kernels::gather_rows(hidden_source, built.hidden_rows, hidden_in);
  mtp_flip_ ^= 1;
  out_hidden = grown(mtp_out_[mtp_flip_], act, {t, hidden_size}, device);
  batch.hidden_out = out_hidden;
  const Tensor logits = grown(mtp_logits_, DType::kF32, {r, model_.config().vocab_size}, device);
  workspace_.reset();
  model_.mtp_forward(batch, model_caches(), hidden_in, logits, workspace_, mtp_layer);
  return logits;
}

void Runner::run_mtp_keys(std::span<const MtpKeyRow> rows, const Tensor& hidden_source) {
  const int64_t most = max_step_rows();
  for (size_t begin = 0; begin < rows.size(); begin += static_cast<size_t>(most)) {
    const auto batch = rows.subspan(begin, std::min(rows.size() - begin, static_cast<size_t>(most)));
    run_mtp_key_batch(batch, mtp_key_batch_rows(static_cast<int64_t>(batch.size())), hidden_source);
  }
}

void Runner::run_mtp_key_batch(std::span<const MtpKeyRow> rows, int64_t padded, const Tensor& hidden_source) {
  METRALE_CHECK(static_cast<int64_t>(rows.size()) <= padded, "{} MTP key rows padded to {}", rows.size(), padded);
  const Device device = model_.device();
  groups_.clear();
  for (const MtpKeyRow& row : rows) {
    RowGroup group;
    group.first_position = row.position;
    group.rows = group.real_rows = 1;
    group.tokens = {&row.next_token, 1};
    group.block_table = cache_->block_table(row.seq_id);
    group.hidden_row = row.hidden_row;
    groups_.push_back(group);
  }
  if (static_cast<int64_t>(rows.size()) < padded) {
    RowGroup padding;  // position 0, cache slot -1, hidden row 0
    padding.rows = padded - static_cast<int64_t>(rows.size());
    groups_.push_back(padding);
  }
  const BatchBuilder::Built built = builder_.build_key_rows(groups_);
  const Tensor hidden_in =
      grown(mtp_hidden_in_, model_.activation_dtype(), {padded, model_.config().hidden_size}, device);
  kernels::gather_rows(hidden_source, built.hidden_rows, hidden_in);
  ForwardBatch batch = built.batch;
  batch.calibrate_kv_scales = calibrate_mtp_;
  workspace_.reset();
  model_.mtp_write_keys(batch, model_caches(), hidden_in, workspace_, 0);
}

int64_t Runner::mtp_key_batch_rows(int64_t count) const {
  const int64_t most = max_step_rows();
  int64_t rows = kMinMtpKeyRows;
  while (rows < count && rows < most) rows *= 2;
  return std::min(rows, most);
}

void Runner::warm_up_mtp_keys() {
  if (!limits_.mtp || cache_ == nullptr) return;
  const int64_t most = max_step_rows();
  const Tensor source = mtp_stash_.tensor.slice(0, 0, 1);  // padding rows gather row 0 and write nothing
  for (int64_t rows = kMinMtpKeyRows;; rows *= 2) {
    run_mtp_key_batch({}, std::min(rows, most), source);
    if (rows >= most) break;
  }
  synchronize(model_.device());
}

void Runner::stash_hidden_rows(const Tensor& hidden, int64_t first, int64_t count, int64_t at) {
  METRALE_CHECK(!hidden.empty() && first >= 0 && first + count <= hidden.size(0),
                "stash rows [{}, {}) of the step's hidden states {}", first, first + count, hidden.describe());
  METRALE_CHECK(at >= 0 && at + count <= mtp_stash_rows(), "stash rows [{}, {}) of {}", at, at + count,
                mtp_stash_rows());
  if (count == 0) return;
  const Tensor source = hidden.slice(0, first, first + count);
  const Tensor target = mtp_stash_.tensor.slice(0, at, at + count);
  copy_bytes_async(target.data(), model_.device(), source.data(), model_.device(), source.nbytes());
}

size_t Runner::profile_fixed_steps() {
  const Device device = model_.device();
  const int64_t capacity = max_step_rows();
  const int64_t k = limits_.max_drafts;
  const int64_t seqs = std::min(limits_.max_num_seqs, capacity / (1 + k));
  if (seqs <= 0) return 0;
  const FixedShapeStep shape = prepare_fixed_shape(seqs, k);
  run_fixed_verify(shape.batch, seqs * (1 + k), {});
  const FixedLayout layout = builder_.fixed_layout(seqs, k);
  builder_.stage_commit(layout, shape.batch, {});
  run_fixed_commit(layout, shape.batch);
  if (limits_.mtp) run_fixed_mtp(stage_fixed_mtp(shape.step, {}, k));
  synchronize(device);
  // The largest commit sized its workspace: fixed from here on (its graphs keep the addresses).
  commit_workspace_.reserve(commit_workspace_.high_water_bytes() + (1u << 20), /*growable=*/false);
  return workspace_.high_water_bytes();
}

Runner::FixedShapeStep Runner::prepare_fixed_shape(int64_t seqs, int64_t k) {
  // A step of padding sequences only (position 0, slot -1, the padding state slot).
  SchedulePlan empty;
  StepResult result;
  FixedShapeStep shape;
  shape.batch = build_step(empty, seqs, 1 + k, result);
  shape.batch.max_kv_len = limits_.max_model_len;
  attach_speculative_outputs(shape.batch, /*verify=*/true, /*fixed=*/true, result);
  if (limits_.mtp) shape.batch.hidden_out = hidden_.tensor.slice(0, 0, seqs * (1 + k));
  shape.step.seqs = seqs;
  shape.step.k = k;
  shape.step.graph = true;
  return shape;
}

void Runner::capture_verify_graphs(const std::vector<int64_t>& batch_sizes) {
#if METRALE_WITH_CUDA
  const Device device = model_.device();
  const int64_t capacity = max_step_rows();
  if (limits_.mtp) {
    // MTP after a plain decode step (k = 0): one catch-up row per sequence, then the chain.
    for (const int64_t size : batch_sizes) {
      if (size > limits_.max_num_seqs || verify_graphs_.count({size, 0})) continue;
      auto graphs = std::make_unique<VerifyGraphs>();
      const FixedShapeStep shape = prepare_fixed_shape(size, 0);
      for (const int64_t drafts : captured_draft_counts(limits_.max_drafts)) {
        const StagedMtp staged = stage_fixed_mtp(shape.step, {}, drafts);
        capture_graph(graphs->mtp[drafts], device, [&] { run_fixed_mtp(staged); });
      }
      verify_graphs_.emplace(std::make_pair(size, int64_t{0}), std::move(graphs));
    }
  }
  for (const int64_t k : captured_draft_counts(limits_.max_drafts)) {
    for (const int64_t size : batch_sizes) {
      if (size > limits_.max_num_seqs || size * (1 + k) > capacity || verify_graphs_.count({size, k})) continue;
      auto graphs = std::make_unique<VerifyGraphs>();
      const FixedShapeStep shape = prepare_fixed_shape(size, k);
      const ForwardBatch& batch = shape.batch;
      capture_graph(graphs->verify, device, [&] { run_fixed_verify(batch, size * (1 + k), {}); });
      const FixedLayout layout = builder_.fixed_layout(size, k);
      builder_.stage_commit(layout, batch, {});
      capture_graph(graphs->commit, device, [&] { run_fixed_commit(layout, batch); });
      if (limits_.mtp) {
        for (const int64_t drafts : captured_draft_counts(limits_.max_drafts)) {
          const StagedMtp staged = stage_fixed_mtp(shape.step, {}, drafts);
          capture_graph(graphs->mtp[drafts], device, [&] { run_fixed_mtp(staged); });
        }
      }
      verify_graphs_.emplace(std::make_pair(size, k), std::move(graphs));
    }
  }
  synchronize(device);
#else
  (void)batch_sizes;
#endif
}

}  // namespace metrale
