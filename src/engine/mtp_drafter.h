// MtpDrafter: drafts with the checkpoint's multi-token-prediction head (Model::mtp_forward).
//
// After each step the head runs over every kept row of the step (catch-up: row t with h_t from the
// trunk's hidden states and x_{t+1}, which writes the MTP keys of those positions), the last row of
// each decoding sequence yields its first draft, and chained MTP steps (o_t fed back with the
// previous draft, layer j % layers) yield the rest. After a fixed-layout step of greedy requests
// (a verify, or a decode step) the whole head runs as one unit on the device (Runner::
// launch_mtp_fixed, one CUDA graph per shape): launched before the step's bookkeeping, beside the
// verify's commit, and collected after it.
//
// The head runs only when the next step is expected to verify drafts (begin_step). While it is
// off, positions still get the head's keys (Model::mtp_write_keys): decode steps park their hidden
// states in the runner's stash (Runner::mtp_stash), written in one batch when it fills or before
// the head runs; other steps write theirs at once. The head's view of a sequence thus stays whole
// whether it ran or not.
#pragma once

#include <functional>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/drafter.h"
#include "engine/fault_injection.h"
#include "engine/sampler.h"
#include "engine/speculator.h"

namespace metrale {

class MtpDrafter final : public Drafter {
 public:
  // The engine's sequence of an id (null once released), for stashed rows of earlier steps.
  using SequenceLookup = std::function<Sequence*(int64_t id)>;
  struct Context {
    const Model& model;
    Runner& runner;
    CacheManager& cache;
    const SpeculationController& controller;
    FaultInjector& faults;
    SequenceLookup lookup;
    int64_t max_model_len = 0;
  };
  MtpDrafter(const SpeculativeConfig& config, Context context);

  double propose(Sequence& sequence, int32_t limit) override;
  void begin_step(bool drafts_next) override { active_ = drafts_next; }
  bool runs_after_step() const override { return active_; }
  bool can_launch(const StepResult& result, bool greedy) const override {
    return active_ && greedy && !result.fixed.empty();
  }
  void launch(const DraftStep& step) override;
  void end_step(const DraftStep& step, bool launched) override;
  void abandon() override;

  // Tests: no stashed rows are waiting for their keys.
  bool stash_empty() const { return stash_rows_.empty(); }

 private:
  // Drafts the head chains after this step: what the controller plans for the next one (at least one).
  int32_t chain_length(int64_t num_running) const;
  // The fixed-layout chain's drafts, after the bookkeeping (drafts of sequences that finished are dropped).
  void collect(const DraftStep& step);
  // After the bookkeeping: catch-up over the step's kept rows, then the first and chained drafts.
  void run_head(const DraftStep& step);
  // Appends one draft to each of `sequences` from their rows of `logits` [R, V] (row d: sequence d).
  void take_drafts(const Tensor& logits, std::span<Sequence* const> sequences);
  // After a step that ran no head: the MTP keys of its kept rows (stashed for decode steps).
  void write_keys(const DraftStep& step);
  // Writes the keys of the stashed rows whose sequences still hold their positions; empties the stash.
  void flush_stash();
  // The first `count` of the `kept` rows `use` kept, as key rows (position t, x_{t+1}, h_t's row).
  static void append_key_rows(const LogitRowUse& use, int64_t kept, int64_t count, std::vector<MtpKeyRow>& rows);
  // The head has seen the sequence up to `end`; positions from mtp_computed to `first_position` it
  // never saw count as missed.
  static void advance(Sequence& sequence, int64_t first_position, int64_t end);

  SpeculativeConfig config_;
  Context context_;
  Sampler sampler_;  // sampled drafts' distributions (scratch only)
  bool active_ = false;
  MtpChain chain_;                        // launched until collected
  std::vector<MtpKeyRow> stash_rows_;     // rows waiting in Runner::mtp_stash() (hidden_row: stash row)
  int64_t stash_used_ = 0;                // stash rows taken (finished sequences' rows included)
};

}  // namespace metrale
