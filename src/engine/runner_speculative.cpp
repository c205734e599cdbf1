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

DType activation_dtype_of(Device device) {
  return device.is_cpu() ? DType::kF32 : DType::kBF16;
}

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

// Device arrays of the fixed-layout commit and MTP steps of one shape (S sequences, k drafts,
// T = S (1 + k) rows), views into Runner::fixed_ints_ (host staging: the same offsets in
// Runner::fixed_host_). One upload per step fills them.
struct Runner::FixedArrays {
  int64_t seqs = 0, k = 0, rows = 0, stride = 0;
  // Commit (VerifyCommit's 2S parts): [2S+1], [2S], [2S].
  size_t cu_parts = 0, part_kv_lens = 0, part_slots = 0;
  // MTP catch-up over every verify row: tokens, positions, slots [T]; cu_q [S+1]; kv_lens and the
  // drafting row of each sequence [S].
  size_t tokens0 = 0, positions0 = 0, slots0 = 0, cu0 = 0, kv_lens0 = 0, draft_rows0 = 0;
  // Chained steps j = 1..n-1 (n <= max_drafts), one row per sequence: positions, slots, kv_lens
  // [(max_drafts - 1) S] each.
  size_t positions = 0, slots = 0, kv_lens = 0;
  // Shared by the chained steps: cu_q [S+1] = 0..S, logits rows [S] = 0..S-1; block tables [S, stride].
  size_t cu1 = 0, rows1 = 0, block_tables = 0;
  size_t commit_ints = 0;  // the commit's arrays are [0, commit_ints)
  size_t total = 0;        // ints

  Tensor view(const OwnedTensor& buffer, size_t offset, int64_t count) const {
    return Tensor(static_cast<int32_t*>(buffer.tensor.data()) + offset, DType::kI32, {count}, buffer.tensor.device());
  }
};

Runner::FixedArrays Runner::fixed_arrays(int64_t seqs, int64_t k) const {
  FixedArrays a;
  a.seqs = seqs;
  a.k = k;
  a.rows = seqs * (1 + k);
  a.stride = max_blocks_per_seq(limits_);
  size_t at = 0;
  const auto take = [&](int64_t count) {
    const size_t offset = at;
    at += static_cast<size_t>((count + 63) / 64 * 64);  // 256-byte aligned sections
    return offset;
  };
  a.cu_parts = take(2 * seqs + 1);
  a.part_kv_lens = take(2 * seqs);
  a.part_slots = take(2 * seqs);
  a.commit_ints = at;
  a.tokens0 = take(a.rows);
  a.positions0 = take(a.rows);
  a.slots0 = take(a.rows);
  a.cu0 = take(seqs + 1);
  a.kv_lens0 = take(seqs);
  a.draft_rows0 = take(seqs);
  const int64_t chain = std::max<int64_t>(limits_.max_drafts - 1, 1);  // chained steps at most
  a.positions = take(chain * seqs);
  a.slots = take(chain * seqs);
  a.kv_lens = take(chain * seqs);
  a.cu1 = take(seqs + 1);
  a.rows1 = take(seqs);
  a.block_tables = take(seqs * a.stride);
  a.total = at;
  return a;
}

void Runner::allocate_speculative_buffers() {
  const Device device = model_.device();
#if METRALE_WITH_CUDA
  if (device.is_cuda() && limits_.mtp) commit_stream_ = std::make_unique<CommitStream>();
#endif
  const int64_t tokens = max_step_rows();
  const int64_t seqs = limits_.max_num_seqs, k = limits_.max_drafts;
  const int64_t rows = seqs * (1 + k);
  const int64_t hidden = model_.config().hidden_size, vocab = model_.config().vocab_size;
  const DType act = activation_dtype_of(device);
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
  const FixedArrays largest = fixed_arrays(seqs, k);
  fixed_ints_ = OwnedTensor(DType::kI32, {static_cast<int64_t>(largest.total)}, device);
  fixed_host_ = PinnedBuffer(largest.total * sizeof(int32_t));
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
    mtp_key_ints_ = OwnedTensor(DType::kI32, {4 * tokens}, device);
  }
}

std::pair<int64_t, int64_t> Runner::fixed_verify_shape(const SchedulePlan& plan) const {
  if (limits_.max_drafts <= 0 || greedy_tokens_.tensor.empty()) return {0, 0};
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
  build_host_step(plan, use_graph ? padded_seqs : 0, 1 + k, result);
  ForwardBatch batch = upload(/*fixed_block_stride=*/use_graph);
  const int64_t rows = host_->num_tokens;
  attach_speculative_outputs(batch, /*verify=*/true, /*fixed=*/true);
  if (limits_.mtp) {  // the MTP chain reads the verify's hidden states in place
    batch.hidden_out = hidden_.tensor.slice(0, 0, rows);
    last_hidden_ = batch.hidden_out;
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
  remember_fixed(plan, use_graph ? padded_seqs : seqs, k, use_graph);
  last_verify_ = batch;
  commit_pending_ = true;
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

void Runner::remember_fixed(const SchedulePlan& plan, int64_t padded_seqs, int64_t k, bool graph) {
  last_fixed_ = {padded_seqs, k, static_cast<int64_t>(plan.chunks.size()), graph};
  fixed_seq_ids_.clear();
  fixed_first_positions_.clear();
  for (const ScheduledChunk& chunk : plan.chunks) {
    fixed_seq_ids_.push_back(chunk.sequence->id);
    fixed_first_positions_.push_back(chunk.sequence->num_computed);
  }
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

void Runner::attach_speculative_outputs(ForwardBatch& batch, bool verify, bool fixed) {
  const Device device = model_.device();
  last_hidden_ = Tensor();
  if (keep_hidden_) {
    last_hidden_ = grown(hidden_, activation_dtype_of(device), {batch.num_tokens, model_.config().hidden_size}, device);
    batch.hidden_out = last_hidden_;
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

void Runner::commit_verified(std::span<const int32_t> kept_rows, bool mtp_follows) {
  METRALE_CHECK(commit_pending_, "commit_verified without a verify step");
  commit_pending_ = false;
  if (!last_fixed_.graph) {
    // Eager: the model builds the exact commit rows from the host counts.
    std::vector<int32_t> kept(kept_rows.begin(), kept_rows.end());
    kept.resize(static_cast<size_t>(last_verify_.num_seqs), 1);  // padding sequences of the layout keep one row
    workspace_.reset();
    model_.commit_verified(last_verify_, kept, model_caches(), workspace_);
    last_verify_ = ForwardBatch();
    return;
  }
  stage_fixed_commit(kept_rows);
#if METRALE_WITH_CUDA
  const auto stream = static_cast<cudaStream_t>(current_stream(model_.device()));
  const CudaGraph& graph = verify_graphs_.at({last_fixed_.seqs, last_fixed_.k})->commit;
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
  last_verify_ = ForwardBatch();
}

void Runner::join_commit() {
  if (!commit_in_flight_) return;
  commit_in_flight_ = false;
#if METRALE_WITH_CUDA
  commit_stream_->done.wait_in(static_cast<cudaStream_t>(current_stream(model_.device())));
#endif
}

void Runner::stage_fixed_commit(std::span<const int32_t> kept_rows) {
  // The commit's parts (VerifyCommit) over the padded layout, in fixed buffers.
  const int64_t seqs = last_fixed_.seqs, k = last_fixed_.k, per_seq = 1 + k;
  const FixedArrays a = fixed_arrays(seqs, k);
  auto* host = static_cast<int32_t*>(fixed_host_.data());
  int32_t* cu_parts = host + a.cu_parts;
  int32_t* kv_lens = host + a.part_kv_lens;
  int32_t* slots = host + a.part_slots;
  const int32_t* verify_kv_lens = last_verify_.host_kv_lens.data();
  const int32_t* verify_slots = last_verify_.host_state_slots.data();
  cu_parts[0] = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int32_t kept = s < static_cast<int64_t>(kept_rows.size()) ? kept_rows[static_cast<size_t>(s)] : 1;
    METRALE_CHECK(kept >= 1 && kept <= per_seq, "commit: sequence {} keeps {} of {} rows", s, kept, per_seq);
    cu_parts[2 * s + 1] = static_cast<int32_t>(s * per_seq + kept);
    cu_parts[2 * s + 2] = static_cast<int32_t>((s + 1) * per_seq);
    kv_lens[2 * s] = verify_kv_lens[s] - static_cast<int32_t>(per_seq) + kept;
    kv_lens[2 * s + 1] = static_cast<int32_t>(per_seq) - kept;
    slots[2 * s] = verify_slots != nullptr ? verify_slots[s] : 0;
    slots[2 * s + 1] = -1;
  }
  copy_bytes_async(fixed_ints_.tensor.data(), model_.device(), host, Device::cpu(), a.commit_ints * sizeof(int32_t));
}

void Runner::run_fixed_commit(int64_t seqs, int64_t k) {
  const FixedArrays a = fixed_arrays(seqs, k);
  VerifyCommit kept;
  kept.max_rows = 1 + k;
  kept.cu_parts = a.view(fixed_ints_, a.cu_parts, 2 * seqs + 1);
  kept.kv_lens = a.view(fixed_ints_, a.part_kv_lens, 2 * seqs);
  kept.slots = a.view(fixed_ints_, a.part_slots, 2 * seqs);
  commit_workspace_.reset();
  model_.commit_kept_rows(last_verify_, kept, model_caches(), commit_workspace_);
}

void Runner::launch_mtp_fixed(std::span<const MtpFixedRow> rows, int64_t drafts) {
  METRALE_CHECK(!commit_pending_, "an MTP step ran before the last verify step's commit");
  METRALE_CHECK(limits_.mtp && last_fixed_.seqs > 0, "launch_mtp_fixed without a fixed-layout verify step");
  METRALE_CHECK(pending_mtp_.drafts == 0, "an MTP chain is still in flight");
  METRALE_CHECK(static_cast<int64_t>(rows.size()) == last_fixed_.real_seqs, "MTP rows for {} of {} sequences",
                rows.size(), last_fixed_.real_seqs);
  const Device device = model_.device();
  const int64_t seqs = last_fixed_.seqs, k = last_fixed_.k;
  drafts = std::clamp<int64_t>(drafts, 1, limits_.max_drafts);
#if METRALE_WITH_CUDA
  const CudaGraph* graph = nullptr;
  const auto graphs = verify_graphs_.find({seqs, k});
  if (last_fixed_.graph && graphs != verify_graphs_.end()) {
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
  stage_fixed_mtp(rows, drafts);
#if METRALE_WITH_CUDA
  if (graph != nullptr) {
    graph->launch(static_cast<cudaStream_t>(current_stream(device)));
  } else {
    run_fixed_mtp(seqs, k, drafts);
  }
#else
  run_fixed_mtp(seqs, k, drafts);
#endif
  mtp_plan_ = {};
  last_fixed_ = FixedShape();
  pending_mtp_.seqs = seqs;
  pending_mtp_.drafts = drafts;
  pending_mtp_.chain_positions.clear();
  for (const MtpFixedRow& row : rows) pending_mtp_.chain_positions.push_back(row.drafting ? row.chain_positions : -1);
  copy_bytes_async(mtp_drafts_host_.data(), Device::cpu(), mtp_drafts_.tensor.data(), device,
                   static_cast<size_t>(drafts * seqs) * sizeof(int32_t));
  join_commit();  // queued after the chain: it ran beside the commit
}

std::vector<std::vector<int32_t>> Runner::collect_mtp_fixed() {
  METRALE_CHECK(pending_mtp_.drafts > 0, "no MTP chain in flight");
  const Device device = model_.device();
  if (device.is_cuda()) synchronize(device);
  const auto* all = static_cast<const int32_t*>(mtp_drafts_host_.data());
  std::vector<std::vector<int32_t>> out(pending_mtp_.chain_positions.size());
  for (size_t s = 0; s < out.size(); ++s) {
    for (int64_t j = 0; j <= pending_mtp_.chain_positions[s]; ++j)
      out[s].push_back(std::max(all[static_cast<size_t>(j * pending_mtp_.seqs) + s], 0));  // -1: no valid logit
  }
  pending_mtp_ = PendingMtp();
  return out;
}

void Runner::stage_fixed_mtp(std::span<const MtpFixedRow> rows, int64_t drafts) {
  const int64_t seqs = last_fixed_.seqs, k = last_fixed_.k, per_seq = 1 + k;
  const bool use_graph = last_fixed_.graph;
  const FixedArrays a = fixed_arrays(seqs, k);
  const int64_t block_size = limits_.block_size;
  // Block tables keep the graphs' fixed stride; eager steps bound the attention by the longest context.
  const int64_t stride = a.stride;
  int64_t longest = 1 + k;  // padding rows: per_seq keys
  auto* host = static_cast<int32_t*>(fixed_host_.data());
  std::vector<std::span<const int32_t>> tables(static_cast<size_t>(seqs));
  for (int64_t s = 0; s < static_cast<int64_t>(rows.size()); ++s) {
    const MtpFixedRow& row = rows[static_cast<size_t>(s)];
    if (!row.drafting) continue;
    tables[static_cast<size_t>(s)] = cache_->block_table(fixed_seq_ids_[static_cast<size_t>(s)]);
  }
  mtp_drafting_.assign(static_cast<size_t>(seqs), 0);
  for (size_t s = 0; s < rows.size(); ++s) mtp_drafting_[s] = rows[s].drafting ? 1 : 0;
  int32_t* tokens0 = host + a.tokens0;
  int32_t* positions0 = host + a.positions0;
  int32_t* slots0 = host + a.slots0;
  int32_t* cu0 = host + a.cu0;
  int32_t* kv_lens0 = host + a.kv_lens0;
  int32_t* draft_rows0 = host + a.draft_rows0;
  int32_t* positions = host + a.positions;
  int32_t* slots = host + a.slots;
  int32_t* kv_lens = host + a.kv_lens;
  int32_t* cu1 = host + a.cu1;
  int32_t* rows1 = host + a.rows1;
  int32_t* block_tables = host + a.block_tables;
  std::fill(block_tables, block_tables + seqs * stride, 0);
  cu0[0] = 0;
  cu1[0] = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const bool real = s < last_fixed_.real_seqs;
    const MtpFixedRow* row = real && !rows.empty() ? &rows[static_cast<size_t>(s)] : nullptr;
    const bool drafting = row != nullptr && row->drafting;
    const int64_t first = s * per_seq;
    cu0[s + 1] = static_cast<int32_t>(first + per_seq);
    cu1[s + 1] = static_cast<int32_t>(s + 1);
    rows1[s] = static_cast<int32_t>(s);
    if (!drafting) {
      // Finished or padding: rows at position 0 that write nothing.
      for (int64_t i = 0; i < per_seq; ++i) {
        tokens0[first + i] = 0;
        positions0[first + i] = 0;
        slots0[first + i] = -1;
      }
      kv_lens0[s] = static_cast<int32_t>(per_seq);
      draft_rows0[s] = static_cast<int32_t>(first);
      for (int64_t j = 1; j < drafts; ++j) {
        const int64_t at = (j - 1) * seqs + s;
        positions[at] = 0;
        slots[at] = -1;
        kv_lens[at] = 1;
      }
      continue;
    }
    const auto table = tables[static_cast<size_t>(s)];
    std::copy(table.begin(), table.end(), block_tables + s * stride);
    // The verify row of the sequence's known token sat at position t.
    const int64_t t = fixed_first_positions_[static_cast<size_t>(s)];
    const int64_t accepted = row->accepted;
    METRALE_CHECK(accepted >= 0 && accepted <= k && static_cast<int64_t>(row->next_tokens.size()) == accepted + 1,
                  "MTP row {}: {} accepted with {} next tokens", s, accepted, row->next_tokens.size());
    // Catch-up: rows 0..a at positions t..t+a with the tokens that followed them; rows past a are
    // padding (their keys are not written).
    for (int64_t i = 0; i < per_seq; ++i) {
      const bool kept = i <= accepted;
      tokens0[first + i] = kept ? row->next_tokens[static_cast<size_t>(i)] : 0;
      positions0[first + i] = static_cast<int32_t>(kept ? t + i : t);
      slots0[first + i] = kept ? cache_slot_of(table, t + i, block_size) : -1;
    }
    kv_lens0[s] = static_cast<int32_t>(t + per_seq);
    draft_rows0[s] = static_cast<int32_t>(first + accepted);
    longest = std::max(longest, t + per_seq);
    // Chained draft j sits at position t + a + j; without a reserved block it writes nothing and
    // its draft is dropped.
    for (int64_t j = 1; j < drafts; ++j) {
      const int64_t at = (j - 1) * seqs + s;
      const int64_t position = t + accepted + j;
      const bool room = j <= row->chain_positions;
      positions[at] = static_cast<int32_t>(room ? position : t + accepted);
      slots[at] = room ? cache_slot_of(table, position, block_size) : -1;
      kv_lens[at] = static_cast<int32_t>((room ? position : t + accepted) + 1);
      longest = std::max<int64_t>(longest, kv_lens[at]);
    }
  }
  copy_bytes_async(static_cast<int32_t*>(fixed_ints_.tensor.data()) + a.commit_ints, model_.device(),
                   host + a.commit_ints, Device::cpu(), (a.total - a.commit_ints) * sizeof(int32_t));
  mtp_plan_ = use_graph ? MtpPlan{} : MtpPlan{longest};
}

void Runner::run_fixed_mtp(int64_t seqs, int64_t k, int64_t drafts) {
  const FixedArrays a = fixed_arrays(seqs, k);
  const Device device = model_.device();
  const DType act = activation_dtype_of(device);
  const int64_t hidden = model_.config().hidden_size, vocab = model_.config().vocab_size;
  const int64_t layers = std::max<int64_t>(model_.num_mtp_layers(), 1);
  const int64_t stride = a.stride;
  const int64_t max_kv_len = mtp_plan_.max_kv_len > 0 ? mtp_plan_.max_kv_len : limits_.max_model_len;
  const Tensor block_tables = a.view(fixed_ints_, a.block_tables, seqs * stride).reshape({seqs, stride});
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
      if (s < static_cast<int64_t>(mtp_drafting_.size()) && mtp_drafting_[static_cast<size_t>(s)] != 0) {
        sample(s, s + 1);
      } else {
        const int32_t zero = 0;
        copy_bytes(static_cast<int32_t*>(mtp_drafts_.tensor.data()) + j * seqs + s, device, &zero, Device::cpu(),
                   sizeof(zero));
      }
    }
  };
  const auto host_span = [&](size_t offset, int64_t count) {
    return std::span<const int32_t>(static_cast<const int32_t*>(fixed_host_.data()) + offset,
                                    static_cast<size_t>(count));
  };
  // Catch-up over every verify row: x_{t+1} with h_t of the verify (the hidden states in place).
  ForwardBatch b0;
  b0.num_tokens = a.rows;
  b0.num_seqs = seqs;
  b0.block_size = limits_.block_size;
  b0.max_q_len = 1 + k;
  b0.max_kv_len = max_kv_len;
  b0.token_ids = a.view(fixed_ints_, a.tokens0, a.rows);
  b0.positions = a.view(fixed_ints_, a.positions0, a.rows);
  b0.slot_mapping = a.view(fixed_ints_, a.slots0, a.rows);
  b0.cu_q = a.view(fixed_ints_, a.cu0, seqs + 1);
  b0.kv_lens = a.view(fixed_ints_, a.kv_lens0, seqs);
  b0.block_tables = block_tables;
  b0.logit_rows = a.view(fixed_ints_, a.draft_rows0, seqs);
  b0.host_cu_q = host_span(a.cu0, seqs + 1);
  b0.host_kv_lens = host_span(a.kv_lens0, seqs);
  b0.host_logit_rows = host_span(a.draft_rows0, seqs);
  b0.hidden_out = mtp_fixed_hidden_[0].tensor.slice(0, 0, a.rows);
  const Tensor verify_hidden = Tensor(hidden_.tensor.data(), act, {a.rows, hidden}, device);
  workspace_.reset();
  model_.mtp_forward(b0, model_caches(), verify_hidden, logits, workspace_, 0);
  greedy(0);
  // Chained drafts: one row per sequence with the previous draft and the previous o_t.
  Tensor previous = mtp_fixed_hidden_[1].tensor.slice(0, 0, seqs);
  kernels::gather_rows(b0.hidden_out, b0.logit_rows, previous);
  for (int64_t j = 1; j < drafts; ++j) {
    const Tensor out = mtp_fixed_hidden_[j % 2 == 1 ? 2 : 1].tensor.slice(0, 0, seqs);
    ForwardBatch b;
    b.num_tokens = seqs;
    b.num_seqs = seqs;
    b.block_size = limits_.block_size;
    b.max_q_len = 1;
    b.max_kv_len = max_kv_len;
    b.token_ids = mtp_drafts_.tensor.slice(0, (j - 1) * seqs, j * seqs);
    const size_t at = static_cast<size_t>((j - 1) * seqs);
    b.positions = a.view(fixed_ints_, a.positions + at, seqs);
    b.slot_mapping = a.view(fixed_ints_, a.slots + at, seqs);
    b.kv_lens = a.view(fixed_ints_, a.kv_lens + at, seqs);
    b.cu_q = a.view(fixed_ints_, a.cu1, seqs + 1);
    b.block_tables = block_tables;
    b.logit_rows = a.view(fixed_ints_, a.rows1, seqs);
    b.host_cu_q = host_span(a.cu1, seqs + 1);
    b.host_kv_lens = host_span(a.kv_lens + at, seqs);
    b.host_logit_rows = host_span(a.rows1, seqs);
    b.hidden_out = out;
    workspace_.reset();
    model_.mtp_forward(b, model_caches(), previous, logits, workspace_, j % layers);
    greedy(j);
    previous = out;
  }
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
                  "MTP rows of sequence {}: {} rows to position {} with {} blocks", seq.seq_id, count, end,
                  table.size());
    METRALE_CHECK(t + count <= max_step_rows(), "MTP step exceeds the token limit");
    std::copy(table.begin(), table.end(), tables + s * h.block_stride);
    for (int64_t i = 0; i < count; ++i, ++t) {
      const int64_t p = seq.first_position + i;
      token_ids[t] = seq.next_tokens[static_cast<size_t>(i)];
      positions[t] = static_cast<int32_t>(p);
      slots[t] = cache_slot_of(table, p, block_size);
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
  METRALE_CHECK(!commit_pending_, "an MTP step ran before the last verify step's commit");
  METRALE_CHECK(static_cast<int64_t>(rows.size()) <= padded, "{} MTP key rows padded to {}", rows.size(), padded);
  const Device device = model_.device();
  const int64_t block_size = limits_.block_size;
  // [4, padded] i32: token ids x_{t+1}, positions t, cache slots (-1: none), rows of hidden_source.
  std::vector<int32_t> ints(static_cast<size_t>(4 * padded), 0);
  std::fill(ints.begin() + 2 * padded, ints.begin() + 3 * padded, -1);
  for (size_t i = 0; i < rows.size(); ++i) {
    const MtpKeyRow& row = rows[i];
    const auto table = cache_->block_table(row.seq_id);
    METRALE_CHECK(static_cast<int64_t>(table.size()) * block_size > row.position,
                  "MTP keys of sequence {} at position {} with {} blocks", row.seq_id, row.position, table.size());
    const auto at = static_cast<int64_t>(i);
    ints[static_cast<size_t>(at)] = row.next_token;
    ints[static_cast<size_t>(padded + at)] = static_cast<int32_t>(row.position);
    ints[static_cast<size_t>(2 * padded + at)] = cache_slot_of(table, row.position, block_size);
    ints[static_cast<size_t>(3 * padded + at)] = static_cast<int32_t>(row.hidden_row);
  }
  const Tensor all = grown(mtp_key_ints_, DType::kI32, {4 * padded}, device);
  copy_bytes(all.data(), device, ints.data(), Device::cpu(), ints.size() * sizeof(int32_t));
  ForwardBatch batch;
  batch.num_tokens = padded;
  batch.block_size = block_size;
  batch.token_ids = all.slice(0, 0, padded);
  batch.positions = all.slice(0, padded, 2 * padded);
  batch.slot_mapping = all.slice(0, 2 * padded, 3 * padded);
  const Tensor hidden_in =
      grown(mtp_hidden_in_, activation_dtype_of(device), {padded, model_.config().hidden_size}, device);
  kernels::gather_rows(hidden_source, all.slice(0, 3 * padded, 4 * padded), hidden_in);
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

void Runner::stash_hidden_rows(int64_t first, int64_t count, int64_t at) {
  METRALE_CHECK(!last_hidden_.empty() && first >= 0 && first + count <= last_hidden_.size(0),
                "stash rows [{}, {}) of the last step's hidden states {}", first, first + count,
                last_hidden_.describe());
  METRALE_CHECK(at >= 0 && at + count <= mtp_stash_rows(), "stash rows [{}, {}) of {}", at, at + count,
                mtp_stash_rows());
  if (count == 0) return;
  const Tensor source = last_hidden_.slice(0, first, first + count);
  const Tensor target = mtp_stash_.tensor.slice(0, at, at + count);
  copy_bytes_async(target.data(), model_.device(), source.data(), model_.device(), source.nbytes());
}

size_t Runner::profile_fixed_steps() {
  const Device device = model_.device();
  const int64_t capacity = max_step_rows();
  const int64_t k = limits_.max_drafts;
  const int64_t seqs = std::min(limits_.max_num_seqs, capacity / (1 + k));
  if (seqs <= 0) return 0;
  prepare_fixed_shape(seqs, k);
  run_fixed_verify(last_verify_, seqs * (1 + k), {});
  stage_fixed_commit({});
  run_fixed_commit(seqs, k);
  if (limits_.mtp) {
    stage_fixed_mtp({}, k);
    run_fixed_mtp(seqs, k, k);
  }
  synchronize(device);
  // The largest commit sized its workspace: fixed from here on (its graphs keep the addresses).
  commit_workspace_.reserve(commit_workspace_.high_water_bytes() + (1u << 20), /*growable=*/false);
  last_fixed_ = FixedShape();
  last_verify_ = ForwardBatch();
  mtp_plan_ = {};
  return workspace_.high_water_bytes();
}

void Runner::prepare_fixed_shape(int64_t seqs, int64_t k) {
  // A step of padding sequences only (position 0, slot -1, the padding state slot).
  SchedulePlan empty;
  StepResult result;
  build_host_step(empty, seqs, 1 + k, result);
  ForwardBatch batch = upload(/*fixed_block_stride=*/true);
  batch.max_kv_len = limits_.max_model_len;
  attach_speculative_outputs(batch, /*verify=*/true, /*fixed=*/true);
  if (limits_.mtp) batch.hidden_out = hidden_.tensor.slice(0, 0, seqs * (1 + k));
  last_verify_ = batch;
  last_fixed_ = {seqs, k, 0, true};
  fixed_seq_ids_.clear();
  fixed_first_positions_.clear();
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
      prepare_fixed_shape(size, 0);
      for (const int64_t drafts : captured_draft_counts(limits_.max_drafts)) {
        stage_fixed_mtp({}, drafts);
        capture_graph(graphs->mtp[drafts], device, [&] { run_fixed_mtp(size, 0, drafts); });
      }
      verify_graphs_.emplace(std::make_pair(size, int64_t{0}), std::move(graphs));
    }
  }
  for (const int64_t k : captured_draft_counts(limits_.max_drafts)) {
    for (const int64_t size : batch_sizes) {
      if (size > limits_.max_num_seqs || size * (1 + k) > capacity || verify_graphs_.count({size, k})) continue;
      auto graphs = std::make_unique<VerifyGraphs>();
      prepare_fixed_shape(size, k);
      const ForwardBatch batch = last_verify_;
      capture_graph(graphs->verify, device, [&] { run_fixed_verify(batch, size * (1 + k), {}); });
      stage_fixed_commit({});
      capture_graph(graphs->commit, device, [&] { run_fixed_commit(size, k); });
      if (limits_.mtp) {
        for (const int64_t drafts : captured_draft_counts(limits_.max_drafts)) {
          stage_fixed_mtp({}, drafts);
          capture_graph(graphs->mtp[drafts], device, [&] { run_fixed_mtp(size, k, drafts); });
        }
      }
      verify_graphs_.emplace(std::make_pair(size, k), std::move(graphs));
    }
  }
  synchronize(device);
  last_fixed_ = FixedShape();
  last_verify_ = ForwardBatch();
  mtp_plan_ = {};
#else
  (void)batch_sizes;
#endif
}

}  // namespace metrale
