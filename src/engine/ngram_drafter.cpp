#include "engine/ngram_drafter.h"

#include <chrono>

namespace metrale {

double NgramDrafter::propose(Sequence& sequence, int32_t limit) {
  double untimed = 0.0;
  // Tokens appended while this sequence drafted nothing are indexed apart and left out of the
  // step's measured cost: paid once, not by every step that drafts (a probe after a pause would
  // otherwise measure drafting as dear as the backlog).
  if (limit > 0 && sequence.ngram_index.pending(sequence.tokens) > 1 + config_.num_drafts) {
    const auto start = std::chrono::steady_clock::now();
    sequence.ngram_index.update(sequence.tokens, config_.ngram_min, config_.ngram_max);
    untimed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  sequence.draft_tokens = sequence.ngram_index.propose(sequence.tokens, config_.ngram_min, config_.ngram_max, limit);
  sequence.draft_probs.clear();
  sequence.draft_base = sequence.num_tokens();
  return untimed;
}

}  // namespace metrale
