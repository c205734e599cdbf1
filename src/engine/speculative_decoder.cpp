#include "engine/speculative_decoder.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "engine/ngram_drafter.h"

namespace metrale {
namespace {

// A verify's acceptance counts when the MTP head wrote the keys of all but 1 / kMtpMissedShare of
// the sequence's positions (it skips positions while drafting is off).
constexpr int64_t kMtpMissedShare = 8;

// Drafts worth verifying for a sequence: the j-th draft is kept while the chance that the chain
// reaches it stays above this.
constexpr double kMinDraftReach = 0.15;


}  // namespace

void configure_speculation(SpeculativeConfig& config, const Model& model) {
  config.validate();
  if (config.method == SpeculativeMethod::kNone) return;
  if (!model.capabilities().supports_verify) {
    // Without the verify contract a verify step would advance the recurrent state over rejected
    // drafts: speculation would change the output.
    METRALE_LOG_WARN("speculative decoding is off: model '{}' has recurrent layers that cannot verify drafts",
                     model.config().model_type);
    config.method = SpeculativeMethod::kNone;
    return;
  }
  if (config.method == SpeculativeMethod::kMtp && !model.has_mtp()) {
    raise(ErrorCode::kInvalidArgument, "--speculative-method mtp: model '{}' has no MTP head (mtp.* weights)",
          model.config().model_type);
  }
}

SpeculativeDecoder::SpeculativeDecoder(const SpeculativeConfig& config, const SpeculativeLimits& limits,
                                       const Model& model, Runner& runner, CacheManager& cache, FaultInjector& faults,
                                       MtpDrafter::SequenceLookup lookup)
    : config_(config),
      limits_(limits),
      model_(model),
      runner_(runner),
      faults_(faults),
      // Priors until measured: the MTP head of a trained checkpoint accepts most drafts; n-gram
      // lookup only where text repeats.
      controller_(config, config.method == SpeculativeMethod::kMtp ? 0.6 : 0.4,
                  [&model](int64_t rows) { return model.routed_weight_bytes(rows); }) {
  METRALE_CHECK(config_.method != SpeculativeMethod::kNone, "a speculative decoder without a method");
  if (config_.method == SpeculativeMethod::kMtp) {
    auto mtp = std::make_unique<MtpDrafter>(
        config_, MtpDrafter::Context{model, runner, cache, controller_, faults, std::move(lookup), limits.max_model_len});
    mtp_ = mtp.get();
    drafter_ = std::move(mtp);
  } else {
    drafter_ = std::make_unique<NgramDrafter>(config_);
  }
  METRALE_LOG_INFO("speculative decoding: {} with up to {} drafts{}", speculative_method_name(config_.method),
                   config_.num_drafts,
                   config_.replay_accept_rate >= 0.0 ? " (BENCHMARK MODE: acceptance replayed)" : "");
}

void SpeculativeDecoder::prepare(std::span<Sequence* const> running, size_t num_waiting) {
  METRALE_CHECK(idle(), "a step began while the last one's verify or drafts are still pending");
  const bool replay = config_.replay_accept_rate >= 0.0;
  // Decoding sequences, their expected acceptance and the drafts each could verify.
  std::vector<Sequence*> decoding;
  std::vector<double> acceptance;
  std::vector<int32_t> available;
  int64_t other_rows = 0;
  for (Sequence* sequence : running) {
    if (!decodes_next(*sequence)) {
      other_rows += std::min<int64_t>(sequence->num_tokens() - sequence->num_computed, limits_.max_num_batched_tokens);
      sequence->draft_tokens.clear();
      sequence->draft_probs.clear();
      continue;
    }
    // No drafts past max_tokens (the verify emits one token more than it accepts) or the context.
    int64_t limit = std::min<int64_t>(config_.num_drafts, sequence->request.max_tokens - sequence->num_output() - 1);
    limit = std::min<int64_t>(limit, limits_.max_model_len - sequence->num_tokens());
    const double a = controller_.acceptance(sequence->acceptance_ema);
    if (config_.adaptive && !replay) {
      // Drafts the chain is unlikely to reach cost rows in the ragged layout: keep those it reaches
      // with some chance, at least one (a sequence cut to none would never verify again and its
      // estimate could never recover).
      int64_t worth = 0;
      for (double reach = a; worth < limit && reach >= kMinDraftReach; reach *= a) ++worth;
      limit = std::min(limit, std::max<int64_t>(worth, 1));
    }
    decoding.push_back(sequence);
    acceptance.push_back(a);
    available.push_back(static_cast<int32_t>(std::max<int64_t>(limit, 0)));
  }
  SpeculationController::Choice choice = controller_.choose(acceptance, available, other_rows);
  if (forced_plain_steps_ > 0) {
    --forced_plain_steps_;
    choice = {0, true};
  }
  // Proposals up to the step's cap.
  for (size_t i = 0; i < decoding.size(); ++i) {
    Sequence& sequence = *decoding[i];
    const int32_t limit = std::min(choice.drafts, available[i]);
    untimed_seconds_ += drafter_->propose(sequence, limit);
    if (replay) {
      // Benchmark mode: rows matter, not what they hold; pad to the step's count.
      sequence.draft_tokens.resize(static_cast<size_t>(limit), sequence.tokens.back());
      sequence.draft_probs.clear();
      sequence.draft_base = sequence.num_tokens();
    }
    available[i] = std::min(limit, static_cast<int32_t>(sequence.draft_tokens.size()));
  }
  // With the proposals known, verify only what pays (e.g. not the drafts of a few sequences of a
  // large batch), in the fixed layout or, per sequence, in the ragged one; an exploration or probe
  // keeps its choice.
  SpeculationController::Layout layout = controller_.layout(choice, acceptance, available, other_rows);
  if (forced_ragged_steps_ > 0 && forced_plain_steps_ == 0 && other_rows == 0) {
    --forced_ragged_steps_;
    for (size_t i = 0; i < decoding.size(); ++i)
      layout.drafts[i] = std::min(available[i], static_cast<int32_t>(i % static_cast<size_t>(config_.num_drafts + 1)));
    layout.ragged = true;
  }
  ragged_verify_ = layout.ragged;
  for (size_t i = 0; i < decoding.size(); ++i) {
    Sequence& sequence = *decoding[i];
    const auto limit = static_cast<size_t>(layout.drafts[i]);
    if (sequence.draft_tokens.size() > limit) {
      sequence.draft_tokens.resize(limit);
      if (!sequence.draft_probs.empty())
        sequence.draft_probs.resize(limit * static_cast<size_t>(model_.config().vocab_size));
    }
  }
  // MTP: the head runs after this step (catch-up, and drafts for the next) when the next step is
  // expected to verify drafts. While it is off only its keys are written, decode steps' in
  // batches: the head's view of the sequence stays whole, so drafting can resume, and a probe
  // measures acceptance, as if it had never stopped. A step exploring plain runs no head: it
  // measures plain decoding. Prefill steps count the sequences about to decode: the waiting ones
  // are admitted by this step's schedule. A probe runs the head too: when it finds that drafting
  // pays, the next step probes again (see SpeculationController::record_step) and needs its drafts.
  const auto next_decoding = std::min<int64_t>(static_cast<int64_t>(running.size() + num_waiting), limits_.max_num_seqs);
  drafter_->begin_step(!(choice.explored && choice.drafts == 0) &&
                       (!config_.adaptive || choice.probe || controller_.planned_drafts(next_decoding) > 0));
  // MTP: every step's hidden states are kept, for the head or for the keys it would have written.
  runner_.set_keep_hidden(config_.method == SpeculativeMethod::kMtp);
}

void SpeculativeDecoder::track(const StepResult& result) {
  METRALE_CHECK(!pending_verify_, "a step ran before the last verify step's commit");
  if (result.verify.verify) pending_verify_ = PendingVerify{result.verify, result.fixed};
}

DraftStep SpeculativeDecoder::draft_step(const StepResult& result, const StepTokens& tokens,
                                         int64_t num_running) const {
  return DraftStep{result, tokens.emitted, tokens.accepted, tokens.kept_rows, num_running};
}

void SpeculativeDecoder::commit(const StepResult& result, const StepTokens& tokens, int64_t num_running) {
  // MTP after a fixed-layout greedy verify or a decode step: queued now (beside the verify's
  // commit), collected after the bookkeeping, which it overlaps.
  const bool verify = pending_verify_.has_value();
  const bool greedy = (!verify || tokens.from_greedy_rows) && tokens.all_greedy;
  const bool launch = drafter_->can_launch(result, greedy);
  if (verify) {
    const PendingVerify pending = std::move(*pending_verify_);
    pending_verify_.reset();  // whatever happens next, nothing of this verify stays pending
    const std::vector<int32_t> kept(tokens.kept_rows.begin(), tokens.kept_rows.end());
    runner_.commit_verified(pending.batch, pending.fixed, kept, /*mtp_follows=*/launch);
    faults_.hit(FaultSite::kCommit);
  }
  if (launch) {
    launched_ = true;
    drafter_->launch(draft_step(result, tokens, num_running));
  }
}

void SpeculativeDecoder::record_verify(Sequence& sequence, int64_t drafted, int64_t accepted) {
  // Drafts of an MTP head that missed much of the sequence say little about drafting that stays on.
  const bool fresh_drafter =
      config_.method != SpeculativeMethod::kMtp || sequence.mtp_missed * kMtpMissedShare <= sequence.num_computed;
  if (fresh_drafter) sequence.acceptance_ema = controller_.record_verify(sequence.acceptance_ema, drafted, accepted);
}

void SpeculativeDecoder::finish_step(const SchedulePlan& plan, const StepResult& result, const StepTokens& tokens,
                                     int64_t num_running, std::chrono::steady_clock::time_point started,
                                     std::chrono::steady_clock::time_point scheduled) {
  const bool launched = launched_;
  launched_ = false;
  drafter_->end_step(draft_step(result, tokens, num_running), launched);
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - started;
  SpeculativeStepRecord record;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (chunk.decodes()) {
      ++record.num_decoding;
      record.drafts = std::max(record.drafts, static_cast<int32_t>(chunk.num_drafts));
      record.draft_rows += chunk.num_drafts;
    } else {
      record.other_rows += chunk.num_rows();
    }
  }
  // The step's k is its longest draft run (what the choice decides); a fixed layout may pad it
  // to a captured shape's, whose cost is then this k's.
  record.drafter_ran = drafter_->runs_after_step();
  // A verify without a fixed layout ran ragged (mixed steps are costed apart, by their rows).
  record.ragged = plan.num_draft_rows > 0 && result.rows_per_seq == 0;
  record.seconds = std::max(seconds.count() - untimed_seconds_, 0.5 * seconds.count());
  untimed_seconds_ = 0.0;
  controller_.record_step(record);
  if (log_level() <= LogLevel::kDebug) {  // the drafted count is for the log only
    METRALE_LOG_DEBUG(
        "speculation: {} decoding ({} drafted) + {} rows, k {}{}, {:.3f} ms ({:.3f} to schedule), acceptance {:.2f}",
        record.num_decoding,
        std::count_if(plan.chunks.begin(), plan.chunks.end(), [](const ScheduledChunk& c) { return c.num_drafts > 0; }),
        record.other_rows, record.drafts, record.drafter_ran ? " + MTP head" : "", 1e3 * record.seconds,
        1e3 * std::chrono::duration<double>(scheduled - started).count(), controller_.global_acceptance());
  }
}

void SpeculativeDecoder::abandon() {
  pending_verify_.reset();
  launched_ = false;
  ragged_verify_ = false;
  untimed_seconds_ = 0.0;
  drafter_->abandon();
  controller_.abandon_step();
}

}  // namespace metrale
