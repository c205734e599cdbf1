#include "engine/speculator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace metrale {

std::string_view speculative_method_name(SpeculativeMethod method) {
  switch (method) {
    case SpeculativeMethod::kNone: return "none";
    case SpeculativeMethod::kNgram: return "ngram";
    case SpeculativeMethod::kMtp: return "mtp";
  }
  return "none";
}

SpeculativeMethod parse_speculative_method(std::string_view name) {
  if (name == "none" || name.empty()) return SpeculativeMethod::kNone;
  if (name == "ngram") return SpeculativeMethod::kNgram;
  if (name == "mtp") return SpeculativeMethod::kMtp;
  raise(ErrorCode::kInvalidArgument, "unknown speculative method '{}' (none, ngram or mtp)", name);
}

void SpeculativeConfig::validate() const {
  if (method == SpeculativeMethod::kNone) return;
  if (num_drafts < 1 || num_drafts > 15) raise(ErrorCode::kInvalidArgument, "num-drafts must be in [1, 15], got {}", num_drafts);
  if (ngram_min < 1 || ngram_max < ngram_min)
    raise(ErrorCode::kInvalidArgument, "n-gram sizes must satisfy 1 <= ngram-min <= ngram-max, got {} and {}", ngram_min,
          ngram_max);
  if (replay_accept_rate > 1.0)
    raise(ErrorCode::kInvalidArgument, "spec-accept-rate must be in [0, 1] (or negative: off), got {}", replay_accept_rate);
}

std::vector<int32_t> propose_ngram_drafts(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max,
                                          int32_t max_drafts) {
  const auto size = static_cast<int64_t>(tokens.size());
  if (max_drafts <= 0) return {};  // the scan below is linear in the sequence: skip it when off
  for (int64_t n = std::min<int64_t>(ngram_max, size - 1); n >= ngram_min; --n) {
    const auto suffix = tokens.subspan(static_cast<size_t>(size - n));
    // Latest earlier occurrence first: it is the likeliest to continue the same way.
    for (int64_t start = size - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) continue;
      const int64_t follow = start + n;
      const int64_t count = std::min<int64_t>(max_drafts, size - follow);
      return {tokens.begin() + follow, tokens.begin() + follow + count};
    }
  }
  return {};
}

void target_distribution(Sampler& sampler, std::span<float> logits, const SamplingParams& params,
                         std::span<const int32_t> prompt, std::span<const int32_t> output, std::span<float> probs) {
  METRALE_CHECK(!params.is_greedy(), "target_distribution of a greedy request");
  METRALE_CHECK(probs.size() == logits.size(), "probs [{}] for logits [{}]", probs.size(), logits.size());
  sampler.apply_penalties(logits, params, prompt, output);
  const size_t vocab = logits.size();
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  // The Sampler's weights: exp((logit - max) / T) in float, masses summed in double, order
  // (logit desc, id asc).
  std::vector<float> weights(vocab);
  for (size_t i = 0; i < vocab; ++i) weights[i] = std::exp((logits[i] - max_logit) / params.temperature);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  const auto more_likely = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  size_t kept = vocab;
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < vocab) {
    kept = static_cast<size_t>(params.top_k);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kept), order.end(), more_likely);
  } else {
    std::sort(order.begin(), order.end(), more_likely);
  }
  if (params.top_k > 0 && params.top_p < 1.0f) {
    std::sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kept), more_likely);
  }
  double mass = 0.0;
  for (size_t i = 0; i < kept; ++i) mass += weights[static_cast<size_t>(order[i])];
  if (params.top_p < 1.0f) {
    const double threshold = static_cast<double>(params.top_p) * mass;
    double running = 0.0;
    for (size_t i = 0; i < kept; ++i) {
      running += weights[static_cast<size_t>(order[i])];
      if (running >= threshold) {
        kept = i + 1;
        break;
      }
    }
  }
  std::fill(probs.begin(), probs.end(), 0.0f);
  double total = 0.0;
  for (size_t i = 0; i < kept; ++i) {
    const float weight = weights[static_cast<size_t>(order[i])];
    if (params.min_p > 0.0f && weight < params.min_p) continue;
    total += weight;
  }
  for (size_t i = 0; i < kept; ++i) {
    const auto id = static_cast<size_t>(order[i]);
    if (params.min_p > 0.0f && weights[id] < params.min_p) continue;
    probs[id] = static_cast<float>(weights[id] / total);
  }
}

SampledToken describe_token(std::span<const float> logits, int32_t token, int32_t top_logprobs) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (const float x : logits) sum += std::exp(static_cast<double>(x - max_logit));
  const double log_normalizer = static_cast<double>(max_logit) + std::log(sum);
  SampledToken result;
  result.token = token;
  result.logprob = static_cast<float>(logits[static_cast<size_t>(token)] - log_normalizer);
  const size_t num_top = std::min(static_cast<size_t>(std::max(top_logprobs, 0)), logits.size());
  if (num_top > 0) {
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(num_top), order.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    for (size_t i = 0; i < num_top; ++i) {
      const int32_t id = order[i];
      result.top_logprobs.emplace_back(id, static_cast<float>(logits[static_cast<size_t>(id)] - log_normalizer));
    }
  }
  return result;
}

int32_t rejection_sample(std::span<const float> p, std::span<const float> q, int32_t draft, float accept_uniform,
                         float residual_uniform, bool& accepted) {
  const auto d = static_cast<size_t>(draft);
  METRALE_CHECK(d < p.size() && (q.empty() || q.size() == p.size()), "rejection_sample: draft {} of {}", draft, p.size());
  const double q_draft = q.empty() ? 1.0 : static_cast<double>(q[d]);
  const double ratio = q_draft > 0.0 ? static_cast<double>(p[d]) / q_draft : 1.0;
  accepted = static_cast<double>(accept_uniform) < ratio;
  if (accepted) return draft;
  // Residual norm(max(0, p - q)); for a one-hot q that is p without the draft.
  const auto residual = [&](size_t i) {
    const double qi = q.empty() ? (i == d ? 1.0 : 0.0) : static_cast<double>(q[i]);
    return std::max(0.0, static_cast<double>(p[i]) - qi);
  };
  double total = 0.0;
  for (size_t i = 0; i < p.size(); ++i) total += residual(i);
  if (!(total > 0.0)) {
    // p <= q everywhere means p == q (up to rounding): the draft is then accepted with probability 1.
    accepted = true;
    return draft;
  }
  const double target = static_cast<double>(residual_uniform) * total;
  double running = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    const double mass = residual(i);
    if (mass <= 0.0) continue;
    running += mass;
    last = static_cast<int32_t>(i);
    if (running > target) return last;
  }
  return last;  // rounding left the target past the running mass
}

// ---- SpeculationController

SpeculationController::SpeculationController(const SpeculativeConfig& config, double prior_acceptance)
    : config_(config), global_acceptance_(prior_acceptance) {}

namespace {

// Expected tokens a verify of k drafts emits with per-draft acceptance a (drafts accepted in order,
// plus the replacement or bonus token): 1 + a + ... + a^k.
double expected_tokens(double a, int32_t k) {
  double total = 0.0, term = 1.0;
  for (int32_t i = 0; i <= k; ++i) {
    total += term;
    term *= a;
  }
  return total;
}

}  // namespace

int32_t SpeculationController::choose_num_drafts(int64_t num_decoding, int64_t other_rows) const {
  if (config_.method == SpeculativeMethod::kNone || num_decoding <= 0) return 0;
  if (!config_.adaptive) return config_.num_drafts;
  const double a = std::clamp(global_acceptance_, 0.0, 0.99);
  // Until a verify step has been timed, assume it costs what a plain step of as many rows costs
  // (and verify one draft): the first verify steps then measure the truth.
  const StepCostFit& plain = plain_.measured() ? plain_ : verify_;
  const StepCostFit& verify = verify_.measured() ? verify_ : plain_;
  const auto rows = [&](int32_t k) { return static_cast<double>(other_rows + num_decoding * (1 + k)); };
  const double plain_rate = static_cast<double>(num_decoding) / plain.predict(rows(0));
  int32_t best = 0;
  double best_rate = plain_rate;
  // Until a verify step has been timed, explore with one draft: a verify of k drafts can cost far
  // more than its rows suggest (a MoE touches more experts), and one draft costs the least to learn.
  const int32_t most = verify_.measured() ? config_.num_drafts : std::min<int32_t>(config_.num_drafts, 1);
  for (int32_t k = 1; k <= most; ++k) {
    const double rate = static_cast<double>(num_decoding) * expected_tokens(a, k) / verify.predict(rows(k));
    if (rate > best_rate) {
      best = k;
      best_rate = rate;
    }
  }
  // Speculate only for a clear predicted gain: the model of cost is approximate.
  return best_rate >= 1.05 * plain_rate ? best : 0;
}

double SpeculationController::record_verify(double sequence_ema, int64_t drafted, int64_t accepted) {
  if (drafted <= 0) return sequence_ema;
  // Acceptance of one draft from a run of `accepted` of `drafted`: the chain stops at the first
  // rejection, so the per-draft rate is accepted / (accepted + rejected), rejected <= 1.
  const double rejected = accepted < drafted ? 1.0 : 0.0;
  const double rate = static_cast<double>(accepted) / (static_cast<double>(accepted) + rejected);
  const double weight = std::min(1.0, static_cast<double>(accepted) + rejected);
  constexpr double kSequenceDecay = 0.3, kGlobalDecay = 0.05;
  // A sequence's first verify starts from the global estimate rather than from its one sample, so
  // that one early rejection does not write the sequence off.
  const double start = sequence_ema < 0.0 ? global_acceptance_ : sequence_ema;
  global_acceptance_ += kGlobalDecay * weight * (rate - global_acceptance_);
  return start + kSequenceDecay * weight * (rate - start);
}

void SpeculationController::record_step(int64_t rows, double seconds, bool verify) {
  (verify ? verify_ : plain_).add(rows, seconds);
}

void StepCostFit::add(int64_t rows, double seconds) {
  if (rows <= 0 || !(seconds > 0.0)) return;
  constexpr double kDecay = 0.98;
  const auto x = static_cast<double>(rows);
  w_ = kDecay * w_ + 1.0;
  sx_ = kDecay * sx_ + x;
  sy_ = kDecay * sy_ + seconds;
  sxx_ = kDecay * sxx_ + x * x;
  sxy_ = kDecay * sxy_ + x * seconds;
  const double mean_x = sx_ / w_, mean_y = sy_ / w_;
  const double var_x = sxx_ / w_ - mean_x * mean_x;
  if (var_x > 0.25) {
    per_row_ = std::max(0.0, (sxy_ / w_ - mean_x * mean_y) / var_x);
    fixed_ = std::max(mean_y - per_row_ * mean_x, 0.05 * mean_y);
  } else {
    // One batch size only so far: the rows cannot be told from the fixed part. Assume the step is
    // fixed cost until steps of other sizes show otherwise.
    fixed_ = mean_y;
    per_row_ = 0.0;
  }
}

}  // namespace metrale
