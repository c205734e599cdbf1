#include "engine/speculator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "core/error.h"
#include "kernels/rejection_sampling.h"

namespace metrale {

bool decodes_next(const Sequence& sequence) {
  return sequence.num_computed == sequence.num_tokens() - 1 && sequence.num_output() > 0 &&
         !sequence.request.return_prompt_logits;
}

float stream_uniform(uint64_t seed, uint64_t stream, uint64_t step) {
  return uniform_for(splitmix64_at(seed, stream), step);
}

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
  METRALE_CHECK(draft >= 0 && static_cast<size_t>(draft) < p.size() && (q.empty() || q.size() == p.size()),
                "rejection_sample: draft {} of {}", draft, p.size());
  // One row of the rejection-sampling kernel's CPU implementation: the decision the GPU twin makes.
  const auto vocab = static_cast<int64_t>(p.size());
  const auto view = [](const void* data, DType dtype, Shape shape) {
    return Tensor(const_cast<void*>(data), dtype, std::move(shape), Device::cpu());
  };
  int32_t token = -1, kept = 0;
  kernels::rejection_sample_rows({view(p.data(), DType::kF32, {1, vocab}),
                                  q.empty() ? Tensor() : view(q.data(), DType::kF32, {1, vocab}),
                                  view(&draft, DType::kI32, {1}), view(&accept_uniform, DType::kF32, {1}),
                                  view(&residual_uniform, DType::kF32, {1})},
                                 view(&token, DType::kI32, {1}), view(&kept, DType::kI32, {1}));
  accepted = kept != 0;
  return token;
}

// ---- SpeculationController

double expected_tokens(double acceptance, int32_t drafts) {
  double total = 0.0, term = 1.0;
  for (int32_t i = 0; i <= drafts; ++i) {
    total += term;
    term *= acceptance;
  }
  return total;
}

namespace {

// A k > 0 is chosen only for this much more predicted throughput than plain: the cost cells are
// noisy EMAs, and flapping between layouts costs more than a marginal gain.
constexpr double kDraftMargin = 1.03;
// An exploration re-measures a neighbour only when it is predicted within this of the best.
constexpr double kExploreWithin = 0.7;
// Per-sequence acceptance: an EMA of the per-draft rate with this weight on each verify. Over
// Bernoulli(a) samples its variance is about kSequenceDecay / (2 - kSequenceDecay) a (1 - a).
constexpr double kSequenceDecay = 0.15;

}  // namespace

SpeculationController::SpeculationController(const SpeculativeConfig& config, double prior_acceptance,
                                             StepCostFeature feature)
    : config_(config), feature_(std::move(feature)), global_acceptance_(prior_acceptance) {}

size_t SpeculationController::bucket_index(int64_t num_decoding) {
  size_t index = 0;
  while ((int64_t{1} << index) < num_decoding) ++index;
  return index;
}

SpeculationController::Bucket& SpeculationController::bucket(int64_t num_decoding) {
  const size_t index = bucket_index(num_decoding);
  if (buckets_.size() <= index) buckets_.resize(index + 1);
  Bucket& found = buckets_[index];
  if (found.cells.empty()) found.cells.resize(static_cast<size_t>(config_.num_drafts) + 1);
  return found;
}

const SpeculationController::Bucket* SpeculationController::find_bucket(int64_t num_decoding) const {
  const size_t index = bucket_index(num_decoding);
  if (index >= buckets_.size() || buckets_[index].cells.empty()) return nullptr;
  return &buckets_[index];
}

double SpeculationController::measured_seconds(int64_t num_decoding, int32_t drafts) const {
  const Bucket* found = find_bucket(num_decoding);
  if (found == nullptr || drafts < 0 || drafts > config_.num_drafts) return -1.0;
  const Cell& cell = found->cells[static_cast<size_t>(drafts)];
  return cell.samples > 0 ? cell.seconds : -1.0;
}

double SpeculationController::estimate_seconds(const Bucket* found, int64_t num_decoding, int32_t drafts) const {
  const auto rows = [&](int32_t k) { return static_cast<double>(num_decoding * (1 + k)); };
  if (found != nullptr) {
    const auto seconds = [&](int32_t k) { return found->cells[static_cast<size_t>(k)].seconds; };
    if (found->cells[static_cast<size_t>(drafts)].samples > 0) return seconds(drafts);
    // The two measured cells of the bucket nearest to k (the lower one on a tie) give a line in k;
    // one alone is scaled by the rows fit of all decode-only steps.
    int32_t nearest[2] = {-1, -1};
    int32_t found_cells = 0;
    for (int32_t distance = 1; distance <= config_.num_drafts && found_cells < 2; ++distance) {
      for (const int32_t k : {drafts - distance, drafts + distance}) {
        if (k < 0 || k > config_.num_drafts || found->cells[static_cast<size_t>(k)].samples == 0) continue;
        if (found_cells < 2) nearest[found_cells++] = k;
      }
    }
    if (found_cells == 2) {
      const int32_t low = std::min(nearest[0], nearest[1]), high = std::max(nearest[0], nearest[1]);
      const double slope = std::max(0.0, (seconds(high) - seconds(low)) / static_cast<double>(high - low));
      return std::max(seconds(low) + slope * static_cast<double>(drafts - low), 0.05 * seconds(low));
    }
    if (found_cells == 1) {
      const int32_t k = nearest[0];
      const double scale =
          decode_fit_.measured() ? decode_fit_.predict(rows(drafts)) / decode_fit_.predict(rows(k)) : 1.0;
      return seconds(k) * scale;
    }
  }
  return decode_fit_.measured() ? decode_fit_.predict(rows(drafts)) : 1.0;
}

RaggedVerifyFit::Vector SpeculationController::ragged_features(int64_t num_decoding, int64_t draft_rows) const {
  return {1.0, static_cast<double>(draft_rows) / static_cast<double>(std::max<int64_t>(num_decoding, 1)),
          feature_.added(num_decoding, draft_rows)};
}

double SpeculationController::ragged_seconds(const Bucket* found, int64_t num_decoding, int64_t draft_rows) const {
  const double plain = estimate_seconds(found, num_decoding, 0);
  if (draft_rows <= 0) return plain;
  // The prior: what one draft per sequence costs in the fixed layout (draft_rows = num_decoding),
  // put on the weights those rows select when the model reports them (a memory-bound MoE step pays
  // for its experts, not its rows), on the rows otherwise.
  const double one_draft = std::max(0.0, estimate_seconds(found, num_decoding, 1) / plain - 1.0);
  const double added_by_one = feature_.added(num_decoding, num_decoding);
  RaggedVerifyFit::Vector prior{0.0, 0.0, 0.0};
  if (feature_.active() && added_by_one > 0.05) {
    prior[2] = one_draft / added_by_one;
  } else {
    prior[1] = one_draft;
  }
  const RaggedVerifyFit::Vector features = ragged_features(num_decoding, draft_rows);
  double relative = 0.0;
  if (found != nullptr) {
    relative = found->ragged.predict(features, prior);
  } else {
    for (size_t i = 0; i < features.size(); ++i) relative += prior[i] * features[i];
  }
  // Rows never make a step cheaper than plain.
  return plain * (1.0 + std::max(relative, 0.0));
}

double SpeculationController::predicted_ragged_seconds(int64_t num_decoding, int64_t draft_rows) const {
  return ragged_seconds(find_bucket(num_decoding), num_decoding, draft_rows);
}

int64_t SpeculationController::ragged_samples(int64_t num_decoding) const {
  const Bucket* found = find_bucket(num_decoding);
  return found != nullptr ? found->ragged.samples() : 0;
}

DraftAllocation SpeculationController::ragged_allocation(const Bucket* found, std::span<const double> acceptance,
                                                         std::span<const int32_t> available) const {
  const auto num_decoding = static_cast<int64_t>(acceptance.size());
  std::vector<int32_t> capped(available.begin(), available.end());
  for (int32_t& drafts : capped) drafts = std::clamp(drafts, 0, config_.num_drafts);
  // The slowest tenth may lose what the margin allows: every sequence pays the step's draft rows,
  // and those of the slow tenth often get none.
  return allocate_drafts(
      acceptance, capped, [&](int64_t rows) { return ragged_seconds(found, num_decoding, rows); },
      slow_acceptance(acceptance), 1.0 / kDraftMargin);
}

bool SpeculationController::candidate(const Bucket* found, int32_t drafts) const {
  if (drafts == 0) return true;
  const auto measured = [&](int32_t k) {
    return k >= 0 && k <= config_.num_drafts && found->cells[static_cast<size_t>(k)].samples > 0;
  };
  if (found == nullptr ||
      std::none_of(found->cells.begin(), found->cells.end(), [](const Cell& c) { return c.samples > 0; }))
    return drafts == 1;
  return measured(drafts) || measured(drafts - 1) || measured(drafts + 1);
}

double SpeculationController::slow_acceptance(std::span<const double> acceptance) {
  if (acceptance.empty()) return 0.0;
  std::vector<double> sorted(acceptance.begin(), acceptance.end());
  const auto tenth = static_cast<std::ptrdiff_t>(sorted.size() / 10);
  std::nth_element(sorted.begin(), sorted.begin() + tenth, sorted.end());
  const double lowest = sorted[static_cast<size_t>(tenth)];
  // The estimates are EMAs of a dozen verifies: the lowest of eight of them sits well below the
  // batch's mean even when every sequence accepts alike. Shrink the slow tenth toward the mean by
  // the share of the spread that noise explains (empirical Bayes), so that only a real spread counts.
  double mean = 0.0, spread = 0.0;
  for (const double a : acceptance) mean += a;
  mean /= static_cast<double>(acceptance.size());
  for (const double a : acceptance) spread += (a - mean) * (a - mean);
  spread /= static_cast<double>(acceptance.size());
  const double noise = kSequenceDecay / (2.0 - kSequenceDecay) * mean * (1.0 - mean);
  const double reliability = spread > 0.0 ? std::clamp(1.0 - noise / spread, 0.0, 1.0) : 0.0;
  return std::clamp(mean + reliability * (lowest - mean), 0.0, 0.99);
}

int32_t SpeculationController::best_drafts(const Bucket* found, int64_t num_decoding, std::span<const double> tokens,
                                           int32_t most_available, double slow_acceptance) const {
  // A step's layout verifies as many drafts as its longest proposal: a cap above that costs the same.
  const auto seconds = [&](int32_t k) { return estimate_seconds(found, num_decoding, std::min(k, most_available)); };
  const auto rate = [&](int32_t k) { return tokens[static_cast<size_t>(k)] / seconds(k); };
  const double plain_rate = rate(0);
  int32_t best = 0;
  double best_rate = 0.0;
  for (int32_t k = 1; k < static_cast<int32_t>(tokens.size()); ++k) {
    if (!candidate(found, std::min(k, most_available))) continue;
    // Every sequence pays the step's k, whatever it gains: the throughput is the goal only among
    // the k under which the batch's slowest tenth still progresses as fast as plain decoding (a
    // batch finishes with its slowest sequence; a served request should not be slowed down).
    if (expected_tokens(slow_acceptance, std::min(k, most_available)) * seconds(0) < seconds(k)) continue;
    const double r = rate(k);
    if (r > best_rate) {
      best = k;
      best_rate = r;
    }
  }
  return best_rate >= kDraftMargin * plain_rate ? best : 0;
}

SpeculationController::Choice SpeculationController::decide(const Bucket* found, int64_t step, int64_t num_decoding,
                                                            std::span<const double> tokens,
                                                            double slow_acceptance) const {
  const auto most_available = static_cast<int32_t>(tokens.size()) - 1;
  const int32_t best = best_drafts(found, num_decoding, tokens, most_available, slow_acceptance);
  if (found == nullptr || most_available == 0) return {best, false};
  // Off: a one-draft probe now and then measures acceptance (and the cost) again.
  if (best == 0 && step >= found->next_probe) return {1, true, true};
  // Plain decoding is the reference: measure it early in a new bucket (after the first step, which
  // verifies the drafts an MTP head prepared during prefill).
  if (found->cells[0].samples == 0 && step >= 2) return {0, true};
  if (step % kExploreEvery != 0) return {best, false};
  // Re-measure the stalest neighbour of the best k (plain first while it was never measured).
  const auto rate = [&](int32_t k) {
    return tokens[static_cast<size_t>(k)] / estimate_seconds(found, num_decoding, k);
  };
  const double best_rate = rate(best);
  int32_t pick = -1;
  int64_t pick_age = -1;
  for (const int32_t k : {0, best - 1, best + 1}) {
    if (k < 0 || k > most_available || k == best || !candidate(found, k)) continue;
    const Cell& cell = found->cells[static_cast<size_t>(k)];
    // A cell of one (provisional) sample is re-measured at the first chance.
    const int64_t age = cell.samples > 1 ? step - cell.measured_at : std::numeric_limits<int64_t>::max();
    if (age < kStaleSteps) continue;
    const bool never_plain = k == 0 && cell.samples == 0;
    if (!never_plain && rate(k) < kExploreWithin * best_rate) continue;
    if (age > pick_age) {
      pick = k;
      pick_age = age;
    }
  }
  return pick >= 0 ? Choice{pick, true} : Choice{best, false};
}

std::vector<double> SpeculationController::tokens_by_drafts(std::span<const double> acceptance,
                                                            std::span<const int32_t> available) const {
  METRALE_CHECK(acceptance.size() == available.size(), "acceptance of {} sequences, drafts of {}", acceptance.size(),
                available.size());
  int32_t most = 0;
  for (const int32_t drafts : available) most = std::max(most, std::min(drafts, config_.num_drafts));
  std::vector<double> tokens(static_cast<size_t>(most) + 1, 0.0);
  for (size_t i = 0; i < acceptance.size(); ++i) {
    const double a = std::clamp(acceptance[i], 0.0, 0.99);
    for (int32_t k = 0; k <= most; ++k) tokens[static_cast<size_t>(k)] += expected_tokens(a, std::min(k, available[i]));
  }
  return tokens;
}

int32_t SpeculationController::choose_mixed(std::span<const double> tokens, int64_t num_decoding,
                                            int64_t other_rows) const {
  // Until a mixed verify step has been timed, assume it costs what a plain step of as many rows
  // costs, and verify one draft: the first such steps measure the truth. Then one plain mixed step
  // is timed too (otherwise plain would only ever be the verify fit's guess).
  if (mixed_verify_.measured() && !mixed_plain_.measured()) return 0;
  const StepCostFit& plain = mixed_plain_.measured() ? mixed_plain_ : mixed_verify_;
  const StepCostFit& verify = mixed_verify_.measured() ? mixed_verify_ : mixed_plain_;
  const auto rows = [&](int32_t k) { return static_cast<double>(other_rows + num_decoding * (1 + k)); };
  const double plain_rate = tokens[0] / plain.predict(rows(0));
  const auto most = static_cast<int32_t>(tokens.size()) - 1;
  int32_t best = 0;
  double best_rate = plain_rate;
  for (int32_t k = 1; k <= (mixed_verify_.measured() ? most : std::min(most, 1)); ++k) {
    const double rate = tokens[static_cast<size_t>(k)] / verify.predict(rows(k));
    if (rate > best_rate) {
      best = k;
      best_rate = rate;
    }
  }
  return best_rate >= 1.05 * plain_rate ? best : 0;
}

SpeculationController::Choice SpeculationController::choose(std::span<const double> acceptance,
                                                            std::span<const int32_t> available, int64_t other_rows) {
  const auto num_decoding = static_cast<int64_t>(acceptance.size());
  if (config_.method == SpeculativeMethod::kNone || num_decoding == 0) return {};
  if (!config_.adaptive) return {config_.num_drafts, false};
  const std::vector<double> tokens = tokens_by_drafts(acceptance, available);
  if (other_rows > 0) return {choose_mixed(tokens, num_decoding, other_rows), false};
  Bucket& found = bucket(num_decoding);
  ++found.steps;
  const double slow = slow_acceptance(acceptance);
  last_tokens_ = tokens;
  last_slow_acceptance_ = slow;
  Choice choice = decide(&found, found.steps, num_decoding, tokens, slow);
  if (choice.probe) {
    choice.ragged = true;  // only the sequences with drafts get draft rows
  } else if (!choice.explored && found.ragged.samples() > 0) {
    // Measured ragged verifies: per-sequence drafts may pay where one k for all does not.
    const DraftAllocation allocation = ragged_allocation(&found, acceptance, available);
    const auto most = static_cast<int32_t>(tokens.size()) - 1;
    const int32_t k = std::min(choice.drafts, most);
    const double fixed_rate = tokens[static_cast<size_t>(k)] / estimate_seconds(&found, num_decoding, k);
    if (allocation.draft_rows > 0 && allocation.rate() >= kDraftMargin * fixed_rate) {
      choice.drafts = *std::max_element(allocation.drafts.begin(), allocation.drafts.end());
      choice.ragged = true;
    }
  }
  if (!choice.explored && !choice.ragged && choice.drafts > 0 && found.steps % kExploreEvery == kExploreEvery / 2 &&
      (found.ragged.samples() == 0 || found.steps - found.ragged.measured_at() >= kStaleSteps)) {
    // Drafting pays in the fixed layout: now and then the same drafts run ragged, so that the
    // ragged fit is measured where per-sequence drafts might pay more.
    choice.explored = true;
    choice.ragged = true;
  }
  probe_pending_ = choice.probe;
  if (choice.probe) {
    // A probe: the next one waits twice as long unless drafting turns on meanwhile.
    found.next_probe = found.steps + found.probe_interval;
    found.probe_interval = std::min(2 * found.probe_interval, kLongestProbeInterval);
  } else if (choice.drafts > 0 && !choice.explored) {
    found.probe_interval = kFirstProbe;
    found.next_probe = found.steps + kFirstProbe;
  }
  return choice;
}

int32_t SpeculationController::refine(int32_t cap, std::span<const double> acceptance,
                                      std::span<const int32_t> available, int64_t other_rows) const {
  const auto num_decoding = static_cast<int64_t>(acceptance.size());
  if (cap <= 0 || num_decoding == 0 || !config_.adaptive) return cap;
  std::vector<double> tokens = tokens_by_drafts(acceptance, available);
  if (tokens.size() > static_cast<size_t>(cap) + 1) tokens.resize(static_cast<size_t>(cap) + 1);
  if (other_rows > 0) return std::min(cap, choose_mixed(tokens, num_decoding, other_rows));
  return best_drafts(find_bucket(num_decoding), num_decoding, tokens, static_cast<int32_t>(tokens.size()) - 1,
                     slow_acceptance(acceptance));
}

SpeculationController::Layout SpeculationController::layout(const Choice& choice, std::span<const double> acceptance,
                                                            std::span<const int32_t> available,
                                                            int64_t other_rows) const {
  METRALE_CHECK(acceptance.size() == available.size(), "acceptance of {} sequences, drafts of {}", acceptance.size(),
                available.size());
  const auto num_decoding = static_cast<int64_t>(acceptance.size());
  Layout out;
  out.drafts.assign(acceptance.size(), 0);
  const auto uniform = [&](int32_t cap) {
    for (size_t i = 0; i < available.size(); ++i) out.drafts[i] = std::clamp(available[i], 0, std::max(cap, 0));
  };
  if (num_decoding == 0 || choice.drafts <= 0) return out;
  if (!config_.adaptive || other_rows > 0 || choice.explored) {
    // Mixed steps run ragged anyway; an exploration or a probe keeps its choice (a probe, and an
    // exploration of the ragged layout, in the ragged layout).
    uniform(choice.explored || !config_.adaptive ? choice.drafts
                                                 : refine(choice.drafts, acceptance, available, other_rows));
    out.ragged = choice.explored && choice.ragged && other_rows == 0;
    return out;
  }
  const int32_t cap = refine(choice.drafts, acceptance, available, 0);
  uniform(cap);
  const Bucket* found = find_bucket(num_decoding);
  if (!choice.ragged || found == nullptr) return out;
  const DraftAllocation allocation = ragged_allocation(found, acceptance, available);
  if (allocation.draft_rows == 0) return out;
  const std::vector<double> tokens = tokens_by_drafts(acceptance, available);
  const int32_t k = std::min(cap, static_cast<int32_t>(tokens.size()) - 1);
  const double fixed_rate = tokens[static_cast<size_t>(k)] / estimate_seconds(found, num_decoding, k);
  if (allocation.rate() >= kDraftMargin * fixed_rate) {
    out.drafts = allocation.drafts;
    out.ragged = true;
  }
  return out;
}

int32_t SpeculationController::planned_drafts(int64_t num_decoding) const {
  if (config_.method == SpeculativeMethod::kNone || num_decoding <= 0) return 0;
  if (!config_.adaptive) return config_.num_drafts;
  // The next step looks like the last one when it has as many sequences (the same estimates, so
  // that the head does not run for a step that then verifies nothing); otherwise every sequence at
  // the global acceptance.
  std::vector<double> tokens = last_tokens_;
  double slow = last_slow_acceptance_;
  if (tokens.empty() || std::abs(tokens[0] - static_cast<double>(num_decoding)) > 0.5) {
    const double a = std::clamp(global_acceptance_, 0.0, 0.99);
    slow = a;
    tokens.resize(static_cast<size_t>(config_.num_drafts) + 1);
    for (int32_t k = 0; k <= config_.num_drafts; ++k)
      tokens[static_cast<size_t>(k)] = static_cast<double>(num_decoding) * expected_tokens(a, k);
  }
  const Bucket* found = find_bucket(num_decoding);
  const int32_t drafts = decide(found, found != nullptr ? found->steps + 1 : 1, num_decoding, tokens, slow).drafts;
  if (drafts > 0 || found == nullptr || found->ragged.samples() == 0) return drafts;
  // The next step may still draft for some sequences in the ragged layout.
  const std::vector<double> acceptance(static_cast<size_t>(num_decoding), std::clamp(global_acceptance_, 0.0, 0.99));
  const std::vector<int32_t> available(static_cast<size_t>(num_decoding), config_.num_drafts);
  const DraftAllocation allocation = ragged_allocation(found, acceptance, available);
  if (allocation.draft_rows == 0 ||
      allocation.rate() < kDraftMargin * static_cast<double>(num_decoding) / estimate_seconds(found, num_decoding, 0))
    return 0;
  return *std::max_element(allocation.drafts.begin(), allocation.drafts.end());
}

double SpeculationController::record_verify(double sequence_ema, int64_t drafted, int64_t accepted) {
  if (drafted <= 0) return sequence_ema;
  // Acceptance of one draft from a run of `accepted` of `drafted`: the chain stops at the first
  // rejection, so the per-draft rate is accepted / (accepted + rejected), rejected <= 1.
  const double rejected = accepted < drafted ? 1.0 : 0.0;
  const double rate = static_cast<double>(accepted) / (static_cast<double>(accepted) + rejected);
  const double weight = std::min(1.0, static_cast<double>(accepted) + rejected);
  // The global estimate moves once per step (record_step), by the step's pooled rate: a step of
  // many sequences is one sample of the rate, not many.
  step_accepted_ += static_cast<double>(accepted);
  step_trials_ += static_cast<double>(accepted) + rejected;
  // A sequence's first verify starts from the global estimate rather than from its one sample, so
  // that one early rejection does not write the sequence off.
  const double start = sequence_ema < 0.0 ? global_acceptance_ : sequence_ema;
  return start + kSequenceDecay * weight * (rate - start);
}

void SpeculationController::abandon_step() {
  step_accepted_ = step_trials_ = 0.0;
  probe_pending_ = false;
}

void SpeculationController::record_step(const SpeculativeStepRecord& step) {
  const bool probe = probe_pending_;
  probe_pending_ = false;
  double pooled = -1.0;  // this step's acceptance
  if (step_trials_ > 0.0) {
    // Weight: a step's pooled rate counts fully from 8 trials on.
    constexpr double kGlobalDecay = 0.1;
    const double weight = std::min(1.0, step_trials_ / 8.0);
    pooled = step_accepted_ / step_trials_;
    global_acceptance_ += kGlobalDecay * weight * (pooled - global_acceptance_);
    step_accepted_ = step_trials_ = 0.0;
  }
  if (!(step.seconds > 0.0) || step.num_decoding <= 0) return;
  record_cost(step);
  if (!probe || pooled < 0.0) return;
  // Acceptance often changes while drafting is off (text turns repetitive as a generation goes on),
  // and the EMAs follow one probe by a tenth of the way: a probe whose own acceptance and cost say
  // drafting pays calls for the next one at once, until the estimates turn drafting on.
  Bucket& found = bucket(step.num_decoding);
  const int32_t drafts = std::clamp(step.drafts, 1, config_.num_drafts);
  const double plain = estimate_seconds(&found, step.num_decoding, 0);
  const double a = std::clamp(pooled, 0.0, 0.99);
  const auto n = static_cast<double>(step.num_decoding);
  // A ragged probe: the sequences that drafted gain, every sequence pays the step.
  const bool pays = step.ragged ? (n + a * static_cast<double>(step.draft_rows)) * plain >=
                                      kDraftMargin * n * ragged_seconds(&found, step.num_decoding, step.draft_rows)
                                : expected_tokens(a, drafts) * plain >=
                                      kDraftMargin * estimate_seconds(&found, step.num_decoding, drafts);
  if (pays) {
    found.next_probe = found.steps + 1;
    found.probe_interval = kFirstProbe;
  }
}

void SpeculationController::record_cost(const SpeculativeStepRecord& step) {
  const int32_t drafts = std::clamp(step.drafts, 0, config_.num_drafts);
  const int64_t rows = step.other_rows + step.num_decoding * (1 + drafts);
  if (step.other_rows > 0) {
    (drafts > 0 ? mixed_verify_ : mixed_plain_).add(rows, step.seconds);
    return;
  }
  // A plain step that also ran the MTP head (preparing the next step's drafts) is neither plain
  // nor a verify: it joins no cell. (An MTP verify that ran no head, the last before plain steps,
  // does join its cell: a probe measures that way.)
  if (drafts == 0 && step.drafter_ran) return;
  Bucket& found = bucket(step.num_decoding);
  if (step.ragged && drafts > 0) {
    // The ragged layout has its own fit, relative to the bucket's plain step.
    const double plain = estimate_seconds(&found, step.num_decoding, 0);
    const int64_t draft_rows = step.draft_rows > 0 ? step.draft_rows : step.num_decoding * drafts;
    found.ragged.add(ragged_features(step.num_decoding, draft_rows), step.seconds / plain - 1.0);
    found.ragged.set_measured_at(found.steps);
    return;
  }
  decode_fit_.add(rows, step.seconds);
  Cell& cell = found.cells[static_cast<size_t>(drafts)];
  // A cell's first sample is provisional (a shape's first step can pay one-off costs): a cheaper
  // second one replaces it. Then samples are averaged, and later ones decay (0.2): the cost moves
  // with context lengths.
  ++cell.samples;
  if (cell.samples == 2 && step.seconds < cell.seconds) {
    cell.seconds = step.seconds;
  } else {
    const double weight = std::max(0.2, 1.0 / static_cast<double>(cell.samples));
    cell.seconds += weight * (step.seconds - cell.seconds);
  }
  cell.measured_at = found.steps;
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
