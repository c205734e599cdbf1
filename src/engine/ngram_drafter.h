// NgramDrafter: prompt lookup. The longest suffix of the sequence (ngram_max down to ngram_min
// tokens) that occurred earlier in its prompt + output proposes the tokens that followed its latest
// earlier occurrence (Sequence::ngram_index, engine/ngram_index.h: O(ngram_max) per proposal).
#pragma once

#include "engine/drafter.h"
#include "engine/speculator.h"

namespace metrale {

class NgramDrafter final : public Drafter {
 public:
  explicit NgramDrafter(const SpeculativeConfig& config) : config_(config) {}
  double propose(Sequence& sequence, int32_t limit) override;

 private:
  SpeculativeConfig config_;
};

}  // namespace metrale
