// The cost side of the speculation controller (engine/speculator.h) for verify steps in the ragged
// layout, where each sequence verifies its own number of drafts and no row is padding.
//
// A ragged verify of n decoding sequences with D draft rows in all costs, relative to the plain step
// of the same sequences,
//
//   seconds / plain = 1 + b0 + b1 * D / n + b2 * (X(n + D) - X(n)) / X(inf)
//
// where X(rows) is the model's cost feature (Model::routed_weight_bytes: the bytes of weights the
// rows select, e.g. the distinct experts of MoE layers; 0 for a dense model). b0 is what the layout
// itself costs (an eager step next to a replayed graph), b1 the compute of a draft row, b2 the weight
// traffic of the experts the draft rows add. Dense models have X = 0 and b2 drops out. The fit is an
// exponentially weighted ridge regression that starts from, and is pulled toward, a prior built
// from the fixed-layout measurements (the controller's cells), so that a few ragged steps correct it
// rather than define it.
//
// Per-sequence drafts: with per-draft acceptance a_i, the j-th draft of sequence i adds a_i^j
// expected tokens, decreasing in j; for a given total D the best drafts are the D largest of those
// increments. allocate_drafts() searches D for the most expected tokens per second.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace metrale {

// The model's cost feature of a step of `rows` rows (bytes; see Model::routed_weight_bytes). Empty or
// constant: a dense model.
using StepCostFeature = std::function<double(int64_t rows)>;

// X(n + D) - X(n), normalised by the feature's saturation X(inf) (0 without a feature).
class CostFeatureScale {
 public:
  CostFeatureScale() = default;
  explicit CostFeatureScale(StepCostFeature feature);
  bool active() const { return saturation_ > 0.0; }
  // (X(rows + extra) - X(rows)) / X(inf), in [0, 1].
  double added(int64_t rows, int64_t extra) const;

 private:
  StepCostFeature feature_;
  double saturation_ = 0.0;
};

class RaggedVerifyFit {
 public:
  static constexpr int kFeatures = 3;  // 1, D / n, added feature
  using Vector = std::array<double, kFeatures>;

  // One ragged verify: `relative` = seconds / plain seconds - 1 of a step of n sequences whose D
  // draft rows give features {1, D / n, added}.
  void add(const Vector& features, double relative);
  int64_t samples() const { return samples_; }
  int64_t measured_at() const { return measured_at_; }
  void set_measured_at(int64_t step) { measured_at_ = step; }
  // The predicted relative extra cost, the coefficients pulled toward `prior` with weight kRidge.
  double predict(const Vector& features, const Vector& prior) const;

  static constexpr double kRidge = 0.25;  // the prior counts as a quarter of a step per coefficient
  static constexpr double kDecay = 0.95;  // later steps count more: the cost moves with the contexts

 private:
  std::array<double, kFeatures * kFeatures> xtx_{};
  Vector xty_{};
  int64_t samples_ = 0;
  int64_t measured_at_ = 0;
};

// The per-sequence drafts of a ragged verify that maximise expected tokens per second.
struct DraftAllocation {
  std::vector<int32_t> drafts;  // per sequence, <= available[i]
  int64_t draft_rows = 0;       // their sum
  double tokens = 0.0;          // expected tokens of the step
  double seconds = 0.0;         // predicted seconds
  double rate() const { return seconds > 0.0 ? tokens / seconds : 0.0; }
};

// `acceptance[i]` (clamped to [0, 0.99]) and `available[i]` drafts of sequence i; `seconds(D)` the
// predicted step time with D draft rows. Drafts the slowest tenth of the sequences (acceptance at
// most `slow_acceptance`) would get count toward `slow_drafts`; a D under which that tenth would
// progress slower than `slow_floor` of its plain pace (seconds(0) per token) is not a candidate.
DraftAllocation allocate_drafts(std::span<const double> acceptance, std::span<const int32_t> available,
                                const std::function<double(int64_t draft_rows)>& seconds, double slow_acceptance,
                                double slow_floor);

}  // namespace metrale
