#include "engine/speculation_cost.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/error.h"
#include "engine/speculator.h"

namespace metrale {

CostFeatureScale::CostFeatureScale(StepCostFeature feature) : feature_(std::move(feature)) {
  if (!feature_) return;
  // Every weight group is selected by some row of a step this large.
  constexpr int64_t kSaturatedRows = int64_t{1} << 20;
  const double saturated = feature_(kSaturatedRows) - feature_(0);
  saturation_ = std::isfinite(saturated) && saturated > 0.0 ? saturated : 0.0;
}

double CostFeatureScale::added(int64_t rows, int64_t extra) const {
  if (!active() || extra <= 0) return 0.0;
  return std::clamp((feature_(rows + extra) - feature_(rows)) / saturation_, 0.0, 1.0);
}

void RaggedVerifyFit::add(const Vector& features, double relative) {
  if (!std::isfinite(relative)) return;
  for (double& v : xtx_) v *= kDecay;
  for (double& v : xty_) v *= kDecay;
  for (int i = 0; i < kFeatures; ++i) {
    for (int j = 0; j < kFeatures; ++j) xtx_[static_cast<size_t>(i * kFeatures + j)] += features[i] * features[j];
    xty_[static_cast<size_t>(i)] += features[i] * relative;
  }
  ++samples_;
}

double RaggedVerifyFit::predict(const Vector& features, const Vector& prior) const {
  // (X^T W X + kRidge I) b = X^T W y + kRidge prior, by Gaussian elimination with partial pivoting
  // (the ridge keeps the system positive definite).
  std::array<double, kFeatures*(kFeatures + 1)> m{};
  const auto at = [&](int r, int c) -> double& { return m[static_cast<size_t>(r * (kFeatures + 1) + c)]; };
  for (int i = 0; i < kFeatures; ++i) {
    for (int j = 0; j < kFeatures; ++j)
      at(i, j) = xtx_[static_cast<size_t>(i * kFeatures + j)] + (i == j ? kRidge : 0.0);
    at(i, kFeatures) = xty_[static_cast<size_t>(i)] + kRidge * prior[static_cast<size_t>(i)];
  }
  for (int c = 0; c < kFeatures; ++c) {
    int pivot = c;
    for (int r = c + 1; r < kFeatures; ++r)
      if (std::abs(at(r, c)) > std::abs(at(pivot, c))) pivot = r;
    for (int j = 0; j <= kFeatures; ++j) std::swap(at(c, j), at(pivot, j));
    for (int r = c + 1; r < kFeatures; ++r) {
      const double f = at(r, c) / at(c, c);
      for (int j = c; j <= kFeatures; ++j) at(r, j) -= f * at(c, j);
    }
  }
  Vector b{};
  for (int r = kFeatures - 1; r >= 0; --r) {
    double v = at(r, kFeatures);
    for (int j = r + 1; j < kFeatures; ++j) v -= at(r, j) * b[static_cast<size_t>(j)];
    b[static_cast<size_t>(r)] = v / at(r, r);
  }
  double relative = 0.0;
  for (int i = 0; i < kFeatures; ++i) relative += b[static_cast<size_t>(i)] * features[static_cast<size_t>(i)];
  return relative;
}

DraftAllocation allocate_drafts(std::span<const double> acceptance, std::span<const int32_t> available,
                                const std::function<double(int64_t draft_rows)>& seconds, double slow_acceptance,
                                double slow_floor) {
  METRALE_CHECK(acceptance.size() == available.size(), "acceptance of {} sequences, drafts of {}", acceptance.size(),
                available.size());
  // Every draft's marginal expected tokens: the j-th draft of sequence i adds a_i^j.
  struct Increment {
    double tokens;
    uint32_t sequence;
  };
  std::vector<Increment> increments;
  int32_t most = 0;
  for (size_t i = 0; i < acceptance.size(); ++i) {
    const double a = std::clamp(acceptance[i], 0.0, 0.99);
    double reach = 1.0;
    most = std::max(most, available[i]);
    for (int32_t j = 0; j < available[i]; ++j) {
      reach *= a;
      increments.push_back({reach, static_cast<uint32_t>(i)});
    }
  }
  // Largest first; ties by sequence (a stable order: the same inputs give the same allocation).
  std::stable_sort(increments.begin(), increments.end(),
                   [](const Increment& x, const Increment& y) { return x.tokens > y.tokens; });
  const auto n = static_cast<double>(acceptance.size());
  const double plain_seconds = seconds(0);
  const double slow = std::clamp(slow_acceptance, 0.0, 0.99);
  DraftAllocation best;
  best.tokens = n;
  best.seconds = plain_seconds;
  size_t best_count = 0;
  double tokens = n;
  for (size_t count = 1; count <= increments.size(); ++count) {
    tokens += increments[count - 1].tokens;
    // Drafts that are as likely to pay as the last one taken are taken too; a sequence of the slow
    // tenth gets those of its drafts whose reach is at least the cut's.
    const double cut = increments[count - 1].tokens;
    int32_t slow_drafts = 0;
    for (double reach = slow; slow_drafts < most && reach >= cut && reach > 0.0; reach *= slow) ++slow_drafts;
    const double step_seconds = seconds(static_cast<int64_t>(count));
    if (!(step_seconds > 0.0)) continue;
    if (expected_tokens(slow, slow_drafts) * plain_seconds < slow_floor * step_seconds) continue;
    if (tokens / step_seconds > best.rate()) {
      best.tokens = tokens;
      best.seconds = step_seconds;
      best_count = count;
    }
  }
  best.drafts.assign(acceptance.size(), 0);
  for (size_t c = 0; c < best_count; ++c) ++best.drafts[increments[c].sequence];
  best.draft_rows = static_cast<int64_t>(best_count);
  return best;
}

}  // namespace metrale
