// Drafter: where a speculating sequence's drafts come from (engine/speculator.h has the scheme).
// The SpeculativeDecoder owns one and calls it around every step:
//   propose()   before the schedule, for each decoding sequence the controller lets draft;
//   begin_step() once the step's choice is made (whether the next step is expected to verify);
//   launch()    right after acceptance, when the drafter can queue its work for the step on the
//               device before the bookkeeping (the verify's commit then runs beside it);
//   end_step()  after the bookkeeping;
//   abandon()   when the step failed: whatever the drafter had in flight is dropped.
// Two implementations: NgramDrafter (prompt lookup, engine/ngram_drafter.h) and MtpDrafter (the
// model's multi-token-prediction head, engine/mtp_drafter.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/request.h"
#include "engine/runner.h"

namespace metrale {

// What a drafter sees of a step once its tokens are known.
struct DraftStep {
  const StepResult& result;
  std::span<const std::vector<SampledToken>> emitted;  // per LogitRowUse: the tokens the chunk emits
  std::span<const int64_t> accepted;                   // drafts each chunk kept
  std::span<const int64_t> kept_rows;                  // rows each sequence kept (known + accepted)
  int64_t num_running = 0;                             // running sequences (this step's finished ones included)
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // The drafts of a decoding sequence for this step, at most `limit`: sequence.draft_tokens (and
  // draft_probs for drafts sampled from a distribution), draft_base = num_tokens() when they are
  // fresh. Returns the seconds of one-off work the step's measured cost should leave out.
  virtual double propose(Sequence& sequence, int32_t limit) = 0;
  // The step's choice is made: `drafts_next` when the next step is expected to verify drafts.
  virtual void begin_step(bool /*drafts_next*/) {}
  // Whether the drafter runs after this step (its cost then joins the step's).
  virtual bool runs_after_step() const { return false; }
  // Whether launch() can queue this step's drafting before the bookkeeping: a fixed-layout step
  // whose requests take greedy drafts (`greedy`).
  virtual bool can_launch(const StepResult& /*result*/, bool /*greedy*/) const { return false; }
  virtual void launch(const DraftStep& /*step*/) {}
  // After the bookkeeping (`launched`: launch() ran for this step).
  virtual void end_step(const DraftStep& /*step*/, bool /*launched*/) {}
  virtual void abandon() {}
};

}  // namespace metrale
