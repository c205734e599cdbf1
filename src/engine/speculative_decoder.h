// SpeculativeDecoder: the one owner of speculative decoding's state in the engine. It holds the
// drafter (NgramDrafter or MtpDrafter, engine/drafter.h), the SpeculationController, the verify
// step awaiting its commit and (through the MTP drafter) the MTP chain in flight and the stash.
// The Engine calls it at fixed points of every step:
//
//   prepare()      before the schedule: drafts for the decoding sequences, as many as the
//                  controller allows; decides whether the drafter runs after the step;
//   track()        after the forward: a verify step's batch stays pending until its commit;
//   commit()       after acceptance: the verify's commit of the kept rows, and the drafter's
//                  fixed-layout work launched beside it when it can be;
//   record_verify() during the bookkeeping, per verified sequence;
//   finish_step()  after the bookkeeping: the drafter's work, the controller's cost record;
//   abandon()      when the step failed anywhere: nothing stays pending (no commit, no chain, no
//                  probe or acceptance half-recorded), so the next step starts clean.
//
// A verify step (engine/speculator.h has the scheme) must be committed before any other step or
// MTP step runs; track() and commit() enforce it.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/drafter.h"
#include "engine/fault_injection.h"
#include "engine/mtp_drafter.h"
#include "engine/speculator.h"
#include "engine/step_sampler.h"

namespace metrale {

// Validates the speculative config against the model: speculation is turned off (with a warning)
// when the model's recurrent layers cannot verify drafts, and method mtp needs an MTP head.
void configure_speculation(SpeculativeConfig& config, const Model& model);

struct SpeculativeLimits {
  int64_t max_model_len = 0;
  int64_t max_num_batched_tokens = 0;
  int64_t max_num_seqs = 0;
};

class SpeculativeDecoder {
 public:
  SpeculativeDecoder(const SpeculativeConfig& config, const SpeculativeLimits& limits, const Model& model,
                     Runner& runner, CacheManager& cache, FaultInjector& faults, MtpDrafter::SequenceLookup lookup);

  const SpeculativeConfig& config() const { return config_; }
  const SpeculationController& controller() const { return controller_; }

  // Before the schedule: gives each decoding sequence of `running` its drafts for this step.
  // `num_waiting` sequences may join the step's schedule (they decode next).
  void prepare(std::span<Sequence* const> running, size_t num_waiting);
  // Whether this step's verify should run in the ragged layout (SchedulePlan::ragged_verify): each
  // sequence with its own drafts and no padding rows.
  bool ragged_verify() const { return ragged_verify_; }
  // After the forward. A verify step's commit is now pending.
  void track(const StepResult& result);
  // After acceptance: commits the pending verify's kept rows and launches the drafter's work for
  // the step when it can run on the device beside the commit.
  void commit(const StepResult& result, const StepTokens& tokens, int64_t num_running);
  // During the bookkeeping: `sequence` verified `drafted` drafts and kept `accepted`.
  void record_verify(Sequence& sequence, int64_t drafted, int64_t accepted);
  // After the bookkeeping: the drafter's work for the step, and the step's cost for the controller
  // (`started`: before prepare(); `scheduled`: when the schedule was ready).
  void finish_step(const SchedulePlan& plan, const StepResult& result, const StepTokens& tokens, int64_t num_running,
                   std::chrono::steady_clock::time_point started, std::chrono::steady_clock::time_point scheduled);
  // The step failed: drops the pending verify, the drafter's work in flight and the step's
  // half-made records. The runner must have waited for the device first (Runner::abandon).
  void abandon();
  // Whether nothing is pending (no verify awaiting its commit, no drafter work in flight).
  bool idle() const { return !pending_verify_ && !launched_; }

  // Tests: the next `steps` steps run plain with the drafter off, whatever the controller chooses.
  void force_plain_steps(int64_t steps) { forced_plain_steps_ = steps; }
  // Tests: the next `steps` steps verify in the ragged layout, decoding sequence i of a step keeping
  // at most i % (num_drafts + 1) of its drafts (none included), whatever the controller chooses.
  void force_ragged_steps(int64_t steps) { forced_ragged_steps_ = steps; }
  // Tests: the MTP drafter has no stashed rows waiting for their keys (true without MTP).
  bool mtp_stash_empty() const { return mtp_ == nullptr || mtp_->stash_empty(); }

 private:
  DraftStep draft_step(const StepResult& result, const StepTokens& tokens, int64_t num_running) const;

  SpeculativeConfig config_;
  SpeculativeLimits limits_;
  const Model& model_;
  Runner& runner_;
  FaultInjector& faults_;
  SpeculationController controller_;
  std::unique_ptr<Drafter> drafter_;
  MtpDrafter* mtp_ = nullptr;  // drafter_ when it drafts with MTP
  // The verify step whose commit is pending: its batch and fixed shape.
  struct PendingVerify {
    ForwardBatch batch;
    FixedStep fixed;
  };
  std::optional<PendingVerify> pending_verify_;
  bool launched_ = false;         // the drafter launched this step's work (end_step collects it)
  bool ragged_verify_ = false;    // prepare() chose the ragged layout for this step's verify
  double untimed_seconds_ = 0.0;  // this step's one-off work left out of its measured cost
  int64_t forced_plain_steps_ = 0;
  int64_t forced_ragged_steps_ = 0;
};

}  // namespace metrale
