#include "engine/mtp_drafter.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "runtime/buffer.h"

namespace metrale {

MtpDrafter::MtpDrafter(const SpeculativeConfig& config, Context context)
    : config_(config), context_(std::move(context)) {}

double MtpDrafter::propose(Sequence& sequence, int32_t /*limit*/) {
  // The head drafted after the last step; drafts of an older state (e.g. made before a preemption)
  // are dropped.
  if (sequence.draft_base != sequence.num_tokens()) {
    sequence.draft_tokens.clear();
    sequence.draft_probs.clear();
  }
  return 0.0;
}

int32_t MtpDrafter::chain_length(int64_t num_running) const {
  return std::max(1, context_.controller.planned_drafts(num_running));
}

void MtpDrafter::launch(const DraftStep& step) {
  flush_stash();  // the head attends to every earlier position
  const int32_t wanted = chain_length(step.num_running);
  const std::vector<LogitRowUse>& uses = step.result.uses;
  std::vector<MtpFixedRow> rows(uses.size());
  for (size_t u = 0; u < uses.size(); ++u) {
    Sequence& sequence = *uses[u].chunk.sequence;
    MtpFixedRow& row = rows[u];
    // Before this step's bookkeeping: the verify's known token sits at t = num_computed, rows
    // t..t+a are kept and row t + i's next token is the i-th emitted one. A sequence that finishes
    // in the bookkeeping drafts for nothing (its drafts are dropped).
    const int64_t t = sequence.num_computed, a = step.accepted[u];
    if (static_cast<int64_t>(step.emitted[u].size()) != a + 1) continue;
    row.drafting = true;
    row.accepted = static_cast<int32_t>(a);
    for (const SampledToken& token : step.emitted[u]) row.next_tokens.push_back(token.token);
    // Chained draft j writes its MTP keys at t + a + j: room for as many as fit.
    for (int64_t j = 1; j < wanted; ++j) {
      const int64_t position = t + a + j;
      if (position + 1 > context_.max_model_len || !context_.cache.reserve(sequence.id, position + 1)) break;
      row.chain_positions = j;
    }
    advance(sequence, t, t + a + 1);
  }
  chain_ = context_.runner.launch_mtp_fixed(step.result.fixed, rows, wanted);
  context_.faults.hit(FaultSite::kMtp);
}

void MtpDrafter::end_step(const DraftStep& step, bool launched) {
  if (launched) {
    collect(step);
  } else if (active_) {
    run_head(step);
  } else {
    write_keys(step);
  }
}

void MtpDrafter::abandon() {
  // Whatever the chain computed is gone with the step (the runner waited for it); stashed rows of
  // earlier steps stay valid and are written when the stash is next flushed.
  chain_ = MtpChain();
  active_ = false;
}

void MtpDrafter::collect(const DraftStep& step) {
  const std::vector<std::vector<int32_t>> drafts = context_.runner.collect_mtp_fixed(chain_);
  chain_ = MtpChain();
  for (size_t u = 0; u < step.result.uses.size(); ++u) {
    Sequence& sequence = *step.result.uses[u].chunk.sequence;
    sequence.draft_tokens.clear();
    sequence.draft_probs.clear();
    if (drafts[u].empty() || sequence.finished() || !decodes_next(sequence)) continue;
    sequence.draft_tokens = drafts[u];
    sequence.draft_base = sequence.num_tokens();
  }
}

void MtpDrafter::run_head(const DraftStep& step) {
  const int64_t num_layers = std::max<int64_t>(context_.model.num_mtp_layers(), 1);
  const StepResult& result = step.result;
  flush_stash();  // the head attends to every earlier position
  // Catch-up: every kept row of this step gets its MTP keys (row t with h_t and x_{t+1}). The last
  // row of a decoding sequence runs the whole head and drafts the token after its new one; the
  // other rows (prompts, accepted drafts) only write their keys.
  std::vector<MtpKeyRow> key_rows;
  std::vector<MtpRows> rows;
  std::vector<Sequence*> drafting;
  for (size_t u = 0; u < result.uses.size(); ++u) {
    const LogitRowUse& use = result.uses[u];
    Sequence& sequence = *use.chunk.sequence;
    const int64_t count = step.kept_rows[u];
    if (sequence.finished() || count <= 0) continue;
    const int64_t first_position = sequence.num_computed - count;
    const bool drafts = decodes_next(sequence);
    append_key_rows(use, count, drafts ? count - 1 : count, key_rows);
    if (drafts) {
      MtpRows seq_rows;
      seq_rows.seq_id = sequence.id;
      seq_rows.first_position = sequence.num_computed - 1;
      seq_rows.next_tokens = {sequence.tokens[static_cast<size_t>(sequence.num_computed)]};
      seq_rows.first_hidden_row = use.first_batch_row + count - 1;
      seq_rows.wants_logits = true;
      rows.push_back(std::move(seq_rows));
      drafting.push_back(&sequence);
    }
    advance(sequence, first_position, sequence.num_computed);
  }
  if (!key_rows.empty()) context_.runner.run_mtp_keys(key_rows, result.hidden);
  if (drafting.empty()) return;
  Tensor hidden;
  const Tensor logits = context_.runner.run_mtp(rows, result.hidden, 0, hidden);
  context_.faults.hit(FaultSite::kMtp);
  for (Sequence* sequence : drafting) {
    sequence->draft_tokens.clear();
    sequence->draft_probs.clear();
    sequence->draft_base = sequence->num_tokens();
  }
  take_drafts(logits, drafting);
  // Chained drafts: row t + j with the draft before it and the o_t of the previous MTP step; draft
  // j + 1 of a sequence continues from its o_t row of the step that drafted j (one row each).
  const int32_t wanted = chain_length(step.num_running);
  std::vector<Sequence*> active = drafting;
  std::vector<int64_t> hidden_row(drafting.size());
  for (size_t d = 0; d < drafting.size(); ++d) hidden_row[d] = static_cast<int64_t>(d);
  for (int32_t j = 1; j < wanted && !active.empty(); ++j) {
    std::vector<MtpRows> chain;
    std::vector<Sequence*> next_active;
    std::vector<int64_t> next_hidden_row;
    for (size_t d = 0; d < active.size(); ++d) {
      Sequence& sequence = *active[d];
      const int64_t position = sequence.num_computed - 1 + j;
      // Room for this row's MTP keys (the verify step reserves the same blocks anyway).
      if (position + 1 > context_.max_model_len || !context_.cache.reserve(sequence.id, position + 1)) continue;
      MtpRows row;
      row.seq_id = sequence.id;
      row.first_position = position;
      row.next_tokens = {sequence.draft_tokens.back()};
      row.first_hidden_row = hidden_row[d];
      row.wants_logits = true;
      chain.push_back(std::move(row));
      next_active.push_back(&sequence);
      next_hidden_row.push_back(static_cast<int64_t>(next_active.size()) - 1);
    }
    if (chain.empty()) break;
    Tensor next_hidden;
    const Tensor chain_logits = context_.runner.run_mtp(chain, hidden, j % num_layers, next_hidden);
    take_drafts(chain_logits, next_active);
    hidden = next_hidden;
    active = std::move(next_active);
    hidden_row = std::move(next_hidden_row);
  }
}

void MtpDrafter::take_drafts(const Tensor& logits, std::span<Sequence* const> sequences) {
  const int64_t vocab = context_.model.config().vocab_size;
  const bool replay = config_.replay_accept_rate >= 0.0;
  const bool argmax_only = std::all_of(sequences.begin(), sequences.end(), [&](const Sequence* sequence) {
    return sequence->request.sampling.is_greedy() || replay;
  });
  if (argmax_only && logits.device().is_cuda()) {
    // Greedy drafts: the argmax on the device (a few bytes per row come back, not the rows).
    const std::vector<int32_t> best = context_.runner.argmax_rows(logits);
    // A row without a valid logit (-1) drafts token 0: a draft's value only affects acceptance.
    for (size_t d = 0; d < sequences.size(); ++d) sequences[d]->draft_tokens.push_back(std::max(best[d], 0));
    return;
  }
  std::vector<float> host(static_cast<size_t>(logits.numel()));
  copy_bytes(host.data(), Device::cpu(), logits.data(), logits.device(), host.size() * sizeof(float));
  for (size_t d = 0; d < sequences.size(); ++d) {
    Sequence& sequence = *sequences[d];
    const SamplingParams& params = sequence.request.sampling;
    const std::span<float> row(host.data() + static_cast<int64_t>(d) * vocab, static_cast<size_t>(vocab));
    if (params.is_greedy() || replay) {
      // Argmax, lowest id on ties; NaN never wins (a draft's value only affects acceptance).
      int32_t best = 0;
      for (int64_t v = 1; v < vocab; ++v)
        if (row[static_cast<size_t>(v)] > row[static_cast<size_t>(best)]) best = static_cast<int32_t>(v);
      sequence.draft_tokens.push_back(best);
      continue;
    }
    // Sampling: draw the draft from the head's distribution under the request's parameters and
    // keep that distribution (q) for rejection sampling.
    std::vector<int32_t> history(sequence.output().begin(), sequence.output().end());
    history.insert(history.end(), sequence.draft_tokens.begin(), sequence.draft_tokens.end());
    for (float& x : row) {
      if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
    }
    const size_t offset = sequence.draft_probs.size();
    sequence.draft_probs.resize(offset + static_cast<size_t>(vocab));
    const std::span<float> q(sequence.draft_probs.data() + offset, static_cast<size_t>(vocab));
    target_distribution(sampler_, row, params, sequence.prompt(), history, q);
    const auto draw = static_cast<uint64_t>(sequence.num_output() + static_cast<int64_t>(sequence.draft_tokens.size()) + 1);
    const double target = static_cast<double>(stream_uniform(sequence.seed, kDraftStream, draw));
    double running = 0.0;
    int32_t chosen = -1;
    for (int64_t v = 0; v < vocab; ++v) {
      if (q[static_cast<size_t>(v)] <= 0.0f) continue;
      running += q[static_cast<size_t>(v)];
      chosen = static_cast<int32_t>(v);
      if (running > target) break;
    }
    sequence.draft_tokens.push_back(std::max(chosen, 0));
  }
}

void MtpDrafter::append_key_rows(const LogitRowUse& use, int64_t kept, int64_t count, std::vector<MtpKeyRow>& rows) {
  const Sequence& sequence = *use.chunk.sequence;
  const int64_t first_position = sequence.num_computed - kept;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t position = first_position + i;
    rows.push_back(
        {sequence.id, position, sequence.tokens[static_cast<size_t>(position + 1)], use.first_batch_row + i});
  }
}

void MtpDrafter::advance(Sequence& sequence, int64_t first_position, int64_t end) {
  sequence.mtp_missed += std::max<int64_t>(0, first_position - sequence.mtp_computed);
  sequence.mtp_computed = end;
}

void MtpDrafter::write_keys(const DraftStep& step) {
  const StepResult& result = step.result;
  Runner& runner = context_.runner;
  std::vector<MtpKeyRow> rows;
  // A decode step without drafts: sequence u's hidden state sits in row u (both layouts).
  bool decode_step = true;
  for (size_t u = 0; u < result.uses.size(); ++u) {
    const LogitRowUse& use = result.uses[u];
    Sequence& sequence = *use.chunk.sequence;
    decode_step = decode_step && use.chunk.decodes() && use.chunk.num_drafts == 0 &&
                  use.first_batch_row == static_cast<int64_t>(u);
    const int64_t count = step.kept_rows[u];
    if (sequence.finished() || count <= 0) continue;
    append_key_rows(use, count, count, rows);
    advance(sequence, sequence.num_computed - count, sequence.num_computed);
  }
  if (rows.empty()) return;
  const auto step_rows = static_cast<int64_t>(result.uses.size());
  if (!decode_step || step_rows > runner.mtp_stash_rows()) {
    runner.run_mtp_keys(rows, result.hidden);
    return;
  }
  if (stash_used_ + step_rows > runner.mtp_stash_rows()) flush_stash();
  runner.stash_hidden_rows(result.hidden, 0, step_rows, stash_used_);
  for (MtpKeyRow& row : rows) {
    row.hidden_row += stash_used_;
    stash_rows_.push_back(row);
  }
  stash_used_ += step_rows;
}

void MtpDrafter::flush_stash() {
  if (stash_rows_.empty()) return;
  // A sequence that finished, or was preempted and has not recomputed the position, lost its blocks
  // there, and one swapped out has none on the device: its rows are dropped (a missing MTP key costs
  // draft quality only; verification keeps the output exact).
  std::vector<MtpKeyRow> rows;
  rows.reserve(stash_rows_.size());
  for (const MtpKeyRow& row : stash_rows_) {
    const Sequence* sequence = context_.lookup(row.seq_id);
    if (sequence == nullptr || sequence->finished() || row.position >= sequence->num_computed) continue;
    // Swapped out to the host tier since: its blocks are not on the device to write into.
    if (!context_.cache.has_sequence(row.seq_id)) continue;
    rows.push_back(row);
  }
  stash_rows_.clear();
  stash_used_ = 0;
  if (!rows.empty()) context_.runner.run_mtp_keys(rows, context_.runner.mtp_stash());
}

}  // namespace metrale
