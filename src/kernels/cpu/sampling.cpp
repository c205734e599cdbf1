// The CPU twin of the CUDA sampling kernel: the same decision (see kernels/sampling.h), computed the
// plain way: weights for the whole row, the kept tokens sorted by (logit desc, id asc), running masses
// in 128-bit fixed point. It is the reference the kernel is tested against, and is itself checked
// against the engine's Sampler (tests/cuda/sampling_test.cpp).
#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

using sampling_detail::Fixed128;

constexpr float kInfinity = std::numeric_limits<float>::infinity();

struct Candidate {
  uint32_t key;  // sort_key(logit)
  int32_t id;
  float weight;
  Fixed128 fixed;  // fixed_weight(weight)
};

// Descending probability, ties to the lower id: a strict total order.
bool more_likely(const Candidate& a, const Candidate& b) { return a.key > b.key || (a.key == b.key && a.id < b.id); }

struct RowParams {
  float temperature;
  int32_t top_k;
  float top_p;
  float min_p;
  uint64_t seed;
  uint64_t step;
};

void validate(const RowParams& p, int64_t row) {
  if (!(std::isfinite(p.temperature) && p.temperature >= 0.0f)) {
    raise(ErrorCode::kInvalidArgument, "sample_tokens row {}: temperature {} must be finite and >= 0", row,
          p.temperature);
  }
  if (p.top_k < -1) raise(ErrorCode::kInvalidArgument, "sample_tokens row {}: top_k {} must be >= -1", row, p.top_k);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    raise(ErrorCode::kInvalidArgument, "sample_tokens row {}: top_p {} must be in (0, 1]", row, p.top_p);
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    raise(ErrorCode::kInvalidArgument, "sample_tokens row {}: min_p {} must be in [0, 1]", row, p.min_p);
  }
}

// The first candidate of `ordered` whose running mass reaches `target`, and that running mass.
struct Crossing {
  size_t index;
  Fixed128 mass;
};
Crossing first_reaching(std::span<const Candidate> ordered, Fixed128 target, int64_t row) {
  Fixed128 running = 0;
  for (size_t i = 0; i < ordered.size(); ++i) {
    running += ordered[i].fixed;
    if (running >= target) return {i, running};
  }
  raise(ErrorCode::kInternal, "sample_tokens row {}: no kept token reaches the target mass", row);
}

void sample_row(std::span<const float> logits, const RowParams& params, int64_t row, std::vector<Candidate>& kept,
                int32_t& token, float& logprob) {
  using namespace sampling_detail;
  validate(params, row);
  const auto vocab = static_cast<int64_t>(logits.size());
  uint32_t max_key = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = logits[static_cast<size_t>(i)];
    if (!(x < kInfinity)) {
      raise(ErrorCode::kInternal, "sample_tokens row {}: logit {} at token {} (the forward pass produced it)", row, x,
            i);
    }
    max_key = std::max(max_key, raw_key(x));
  }
  const float max_logit = from_raw_key(max_key);
  if (max_logit == -kInfinity) raise(ErrorCode::kInternal, "sample_tokens row {}: every logit is -inf", row);

  // Reported logprob: log-softmax of the raw row, the sum in double.
  double sum_exp = 0.0;
  for (float x : logits) sum_exp += exp_nonpositive(sub_rn(x, max_logit));
  const double log_normalizer = static_cast<double>(max_logit) + std::log(sum_exp);
  auto finish = [&](int64_t id) {
    token = static_cast<int32_t>(id);
    logprob = static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) - log_normalizer);
  };

  if (params.temperature <= kGreedyTemperature) {
    finish(std::find(logits.begin(), logits.end(), max_logit) - logits.begin());  // lowest id holding the maximum
    return;
  }

  kept.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = logits[static_cast<size_t>(i)];
    const float weight = weight_of(x, max_logit, params.temperature);
    kept.push_back({sort_key(x), static_cast<int32_t>(i), weight, fixed_weight(weight)});
  }
  // top-k: the k most likely tokens.
  if (params.top_k > 0 && params.top_k < vocab) {
    const auto kth = kept.begin() + (params.top_k - 1);
    std::nth_element(kept.begin(), kth, kept.end(), more_likely);
    kept.erase(kth + 1, kept.end());
  }
  Fixed128 mass = 0;
  for (const Candidate& c : kept) mass += c.fixed;
  // Tokens of weight 0 carry no mass and are never a crossing: drop them before sorting.
  std::erase_if(kept, [](const Candidate& c) { return c.fixed == 0; });
  std::sort(kept.begin(), kept.end(), more_likely);

  // top-p: the shortest prefix whose mass reaches top_p x the kept mass.
  if (params.top_p < 1.0f) {
    const Crossing cut = first_reaching(kept, top_p_target(params.top_p, mass), row);
    kept.resize(cut.index + 1);
    mass = cut.mass;
  }
  // min-p, token by token (weights are not monotone to the last bit).
  if (params.min_p > 0.0f) {
    std::erase_if(kept, [&](const Candidate& c) { return !(c.weight >= params.min_p); });
    mass = 0;
    for (const Candidate& c : kept) mass += c.fixed;
  }
  // The draw: the first token whose running mass exceeds u x the kept mass.
  const float uniform = rng::uniform_for(params.seed, params.step);
  const Crossing drawn = first_reaching(kept, draw_target(uniform, mass), row);
  finish(kept[drawn.index].id);
}

void check_row_tensor(const Tensor& t, DType dtype, int64_t rows, const char* what) {
  METRALE_CHECK(t.device().is_cpu() && t.ndim() == 1 && t.dtype() == dtype && t.numel() == rows &&
                    (rows <= 1 || t.stride(0) == 1),
                "sample_tokens {}: {} for {} rows", what, t.describe(), rows);
}

}  // namespace

void sample_tokens(const Tensor& logits, const SamplingRowParams& params, const Tensor& tokens,
                   const Tensor& logprobs) {
  METRALE_CHECK(logits.device().is_cpu() && logits.ndim() == 2 && logits.dtype() == DType::kF32 && logits.stride(1) == 1 &&
                    logits.stride(0) >= logits.size(1),
                "sample_tokens logits {}", logits.describe());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  METRALE_CHECK(vocab >= 1 && vocab < (int64_t{1} << 27), "sample_tokens: vocabulary of {}", vocab);
  check_row_tensor(params.temperature, DType::kF32, rows, "temperature");
  check_row_tensor(params.top_k, DType::kI32, rows, "top_k");
  check_row_tensor(params.top_p, DType::kF32, rows, "top_p");
  check_row_tensor(params.min_p, DType::kF32, rows, "min_p");
  check_row_tensor(params.seed, DType::kI64, rows, "seed");
  check_row_tensor(params.step, DType::kI64, rows, "step");
  check_row_tensor(tokens, DType::kI32, rows, "tokens");
  check_row_tensor(logprobs, DType::kF32, rows, "logprobs");
  const auto* logit_data = logits.data_as<const float>();
  std::vector<Candidate> kept;
  for (int64_t r = 0; r < rows; ++r) {
    const RowParams row_params{params.temperature.data_as<const float>()[r], params.top_k.data_as<const int32_t>()[r],
                               params.top_p.data_as<const float>()[r],       params.min_p.data_as<const float>()[r],
                               static_cast<uint64_t>(params.seed.data_as<const int64_t>()[r]),
                               static_cast<uint64_t>(params.step.data_as<const int64_t>()[r])};
    const std::span<const float> row(logit_data + r * logits.stride(0), static_cast<size_t>(vocab));
    sample_row(row, row_params, r, kept, tokens.data_as<int32_t>()[r], logprobs.data_as<float>()[r]);
  }
}

}  // namespace metrale::kernels::cpu
