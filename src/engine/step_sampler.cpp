#include "engine/step_sampler.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/sampling.h"
#include "runtime/buffer.h"
#include "runtime/stream.h"

namespace metrale {

struct StepSampler::DeviceSampling {
  PinnedBuffer host;  // staging for the six parameter arrays, then the results
  OwnedTensor temperature, top_k, top_p, min_p, seed, step, tokens, logprobs;
  int64_t capacity = 0;
};

namespace {

void allocate_sampling(StepSampler::DeviceSampling& state, int64_t n, Device device) {
  state.capacity = n;
  state.host = PinnedBuffer(static_cast<size_t>(n) * 40);
  state.temperature = OwnedTensor(DType::kF32, {n}, device);
  state.top_k = OwnedTensor(DType::kI32, {n}, device);
  state.top_p = OwnedTensor(DType::kF32, {n}, device);
  state.min_p = OwnedTensor(DType::kF32, {n}, device);
  state.seed = OwnedTensor(DType::kI64, {n}, device);
  state.step = OwnedTensor(DType::kI64, {n}, device);
  state.tokens = OwnedTensor(DType::kI32, {n}, device);
  state.logprobs = OwnedTensor(DType::kF32, {n}, device);
}

// The staging area's parameter arrays. Host layout: temperature f32 | top_k i32 | top_p f32 |
// min_p f32 | seed i64 | step i64, each [capacity].
struct RowArrays {
  float* temperature;
  int32_t* top_k;
  float* top_p;
  float* min_p;
  int64_t* seed;
  int64_t* step;
};

RowArrays host_arrays(StepSampler::DeviceSampling& state) {
  const int64_t n = state.capacity;
  auto* base = static_cast<char*>(state.host.data());
  return {reinterpret_cast<float*>(base),          reinterpret_cast<int32_t*>(base + 4 * n),
          reinterpret_cast<float*>(base + 8 * n),  reinterpret_cast<float*>(base + 12 * n),
          reinterpret_cast<int64_t*>(base + 16 * n), reinterpret_cast<int64_t*>(base + 24 * n)};
}

void upload_arrays(StepSampler::DeviceSampling& state, const RowArrays& host, int64_t rows, Device device) {
  const auto upload = [&](OwnedTensor& target, const void* source, size_t element) {
    copy_bytes_async(target.tensor.data(), device, source, Device::cpu(), static_cast<size_t>(rows) * element);
  };
  upload(state.temperature, host.temperature, 4);
  upload(state.top_k, host.top_k, 4);
  upload(state.top_p, host.top_p, 4);
  upload(state.min_p, host.min_p, 4);
  upload(state.seed, host.seed, 8);
  upload(state.step, host.step, 8);
}

kernels::SamplingRowParams row_params(StepSampler::DeviceSampling& state, int64_t begin, int64_t end) {
  return {state.temperature.tensor.slice(0, begin, end), state.top_k.tensor.slice(0, begin, end),
          state.top_p.tensor.slice(0, begin, end),       state.min_p.tensor.slice(0, begin, end),
          state.seed.tensor.slice(0, begin, end),        state.step.tensor.slice(0, begin, end)};
}

}  // namespace

StepSampler::StepSampler(const SpeculativeConfig& speculative, int64_t vocab_size, int64_t max_num_seqs)
    : speculative_(speculative),
      vocab_(vocab_size),
      max_num_seqs_(max_num_seqs),
      constrained_(std::make_unique<ConstrainedRows>(vocab_size)) {}

void StepSampler::begin_step(const SchedulePlan& plan) { constrained_->begin(plan); }

void StepSampler::abandon() noexcept { constrained_->abandon(); }

StepSampler::~StepSampler() = default;
StepSampler::StepSampler(StepSampler&&) noexcept = default;
StepSampler& StepSampler::operator=(StepSampler&&) noexcept = default;

StepTokens StepSampler::sample(const SchedulePlan& plan, StepResult& result, Runner& runner) {
  const size_t num_uses = result.uses.size();
  constrained_->wait();
  StepTokens tokens;
  tokens.emitted.resize(num_uses);
  tokens.accepted.assign(num_uses, 0);
  tokens.all_greedy = all_greedy(result);
  // Verify steps of greedy requests accept from the argmax rows: a fixed-layout step computed them
  // with the forward, a ragged one (prefill rows too) computes them now; either way a few bytes per
  // row reach the host instead of the logits rows. When constraints are the only processing, their
  // masks are applied on the device first and the argmax rows are taken again from the masked rows
  // (the step is then not all_greedy: the MTP head does not chain from the forward's argmax).
  const bool masked_greedy = plan.num_draft_rows > 0 && !tokens.all_greedy && !result.logits.device().is_cpu() &&
                             greedy_but_for_constraints(result);
  if (plan.num_draft_rows > 0 && (tokens.all_greedy || masked_greedy)) {
    if (masked_greedy) {
      constrained_->apply_to_logits(result.logits, result.uses);
      runner.greedy_rows(result);
    } else if (result.greedy_tokens.empty()) {
      runner.greedy_rows(result);
    }
    accept_greedy_rows(result, runner, tokens);
    for (size_t u = 0; u < num_uses; ++u) ConstrainedRows::accept(*result.uses[u].chunk.sequence, tokens.emitted[u]);
  } else if (plan.num_draft_rows > 0 && verifies_on_device(result)) {
    accept_sampled_rows(result, tokens);
  }
  std::vector<SampledToken> device_sampled;
  const bool sampled_on_device =
      tokens.from_greedy_rows || (!result.logits.device().is_cpu() && sample_on_device(result, device_sampled));
  if (!result.logits.device().is_cpu() && !sampled_on_device) {
    // Sampling runs on the host: bring back the rows the step asked for.
    int64_t rows = 0;
    for (const LogitRowUse& use : result.uses) rows = std::max(rows, use.first_row + use.num_rows);
    host_logits_.resize(static_cast<size_t>(rows * vocab_));
    copy_bytes(host_logits_.data(), Device::cpu(), result.logits.data(), result.logits.device(),
               host_logits_.size() * sizeof(float));
    result.logits = Tensor(host_logits_.data(), DType::kF32, {rows, vocab_}, Device::cpu());
  }
  // Prompt logits, then the tokens each sampling chunk emits (acceptance of its drafts).
  for (size_t u = 0; u < num_uses && !tokens.from_greedy_rows; ++u) {
    const LogitRowUse& use = result.uses[u];
    const Sequence& sequence = *use.chunk.sequence;
    if (sequence.request.return_prompt_logits) copy_prompt_logits(use, result.logits);
    if (!use.chunk.samples || sequence.request.max_tokens == 0) continue;
    if (sampled_on_device) {
      tokens.emitted[u].push_back(device_sampled[static_cast<size_t>(use.first_row)]);
    } else {
      tokens.emitted[u] = accept_chunk(use, result.logits, tokens.accepted[u]);
    }
    ConstrainedRows::accept(*use.chunk.sequence, tokens.emitted[u]);
  }
  // Every sequence keeps its known rows and its accepted drafts; the recurrent layers' slots
  // advance over exactly those rows.
  tokens.kept_rows.resize(num_uses);
  for (size_t u = 0; u < num_uses; ++u) tokens.kept_rows[u] = result.uses[u].chunk.num_new + tokens.accepted[u];
  return tokens;
}

void StepSampler::copy_prompt_logits(const LogitRowUse& use, const Tensor& logits) const {
  Sequence& sequence = *use.chunk.sequence;
  for (int64_t r = 0; r < use.num_rows; ++r) {
    const int64_t position = use.first_position + r;
    if (position >= sequence.num_prompt) break;
    const float* row = logits.data_as<const float>() + (use.first_row + r) * vocab_;
    if (sequence.request.prompt_logprobs >= 0) {
      // The row of position p predicts prompt token p + 1.
      if (position + 1 < sequence.num_prompt) {
        const int32_t next = sequence.tokens[static_cast<size_t>(position + 1)];
        sequence.prompt_logprobs[static_cast<size_t>(position + 1)] =
            describe_token(std::span<const float>(row, static_cast<size_t>(vocab_)), next, sequence.request.prompt_logprobs);
      }
      continue;
    }
    std::copy(row, row + vocab_, sequence.prompt_logits.begin() + position * vocab_);
  }
}

bool StepSampler::all_greedy(const StepResult& result) const {
  return greedy_but_for_constraints(result) &&
         std::none_of(result.uses.begin(), result.uses.end(),
                      [](const LogitRowUse& use) { return use.chunk.sequence->request.constraint != nullptr; });
}

bool StepSampler::greedy_but_for_constraints(const StepResult& result) const {
  for (const LogitRowUse& use : result.uses) {
    const SamplingParams& params = use.chunk.sequence->request.sampling;
    // Benchmark replay accepts by a seeded draw, whatever the parameters; the emitted token is
    // then the row's argmax.
    const bool replay = speculative_.replay_accept_rate >= 0.0;
    if (!replay && !params.is_greedy()) return false;
    if (params.top_logprobs > 0 || params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f ||
        params.frequency_penalty != 0.0f || use.chunk.sequence->request.return_prompt_logits ||
        ConstrainedRows::needs_host_processing(*use.chunk.sequence))
      return false;
  }
  return true;
}

bool StepSampler::verifies_on_device(const StepResult& result) const {
  for (const LogitRowUse& use : result.uses) {
    const Sequence& sequence = *use.chunk.sequence;
    const SamplingParams& params = sequence.request.sampling;
    if (!sequence.draft_probs.empty() || params.top_logprobs > 0 || params.repetition_penalty != 1.0f ||
        params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f || sequence.request.return_prompt_logits ||
        ConstrainedRows::needs_processing(sequence))
      return false;
  }
  return true;
}

void StepSampler::accept_sampled_rows(const StepResult& result, StepTokens& out) {
  const Device device = result.logits.device();
  const int64_t rows = result.logits.size(0);
  if (!verify_sampling_ || verify_sampling_->capacity < rows) {
    verify_sampling_ = std::make_unique<DeviceSampling>();
    allocate_sampling(*verify_sampling_, std::max<int64_t>(rows, max_num_seqs_), device);
  }
  DeviceSampling& state = *verify_sampling_;
  RowArrays host = host_arrays(state);
  // Rows nobody reads (padding rows of the fixed layout, prompt rows) take the argmax: any valid
  // row is fine for the kernel, which marks rows without a valid logit with token -1.
  std::fill(host.temperature, host.temperature + rows, 0.0f);
  std::fill(host.top_k, host.top_k + rows, 0);
  std::fill(host.top_p, host.top_p + rows, 1.0f);
  std::fill(host.min_p, host.min_p + rows, 0.0f);
  std::fill(host.seed, host.seed + rows, 0);
  std::fill(host.step, host.step + rows, 0);
  // Row i of a verify chunk draws the token that follows i accepted drafts with the uniform that
  // plain decoding would use for that token (the Sampler's (seed, step) stream): a deterministic
  // draft d is kept when the draw is d. Drawing t ~ p and keeping d iff t == d is rejection
  // sampling for a one-hot q (accepted with probability p(d); on rejection t follows p without d,
  // renormalised), so the output follows the model's distribution; and since every row uses plain
  // decoding's uniform, the tokens are the ones plain decoding samples for the same seed.
  for (const LogitRowUse& use : result.uses) {
    const Sequence& sequence = *use.chunk.sequence;
    if (!use.chunk.samples || sequence.request.max_tokens == 0) continue;
    const SamplingParams& params = sequence.request.sampling;
    const int64_t first = use.first_row + use.num_rows - 1 - use.chunk.num_drafts;
    for (int64_t i = 0; i <= use.chunk.num_drafts; ++i) {
      const int64_t row = first + i;
      host.temperature[row] = params.temperature;
      host.top_k[row] = params.top_k;
      host.top_p[row] = params.top_p;
      host.min_p[row] = params.min_p;
      host.seed[row] = static_cast<int64_t>(sequence.seed);
      host.step[row] = sequence.num_output() + i;
    }
  }
  upload_arrays(state, host, rows, device);
  const auto sample = [&](int64_t begin, int64_t end) {
    kernels::sample_tokens(result.logits.slice(0, begin, end), row_params(state, begin, end),
                           state.tokens.tensor.slice(0, begin, end), state.logprobs.tensor.slice(0, begin, end));
  };
  if (device.is_cpu()) {
    // The CPU kernel rejects non-finite rows: only the rows the sequences own.
    for (const LogitRowUse& use : result.uses) sample(use.first_row, use.first_row + use.num_rows);
  } else {
    sample(0, rows);
  }
  auto* tokens = reinterpret_cast<int32_t*>(state.host.data());
  auto* logprobs = reinterpret_cast<float*>(tokens + state.capacity);
  copy_bytes_async(tokens, Device::cpu(), state.tokens.tensor.data(), device, static_cast<size_t>(rows) * 4);
  copy_bytes_async(logprobs, Device::cpu(), state.logprobs.tensor.data(), device, static_cast<size_t>(rows) * 4);
  if (device.is_cuda()) synchronize(device);
  accept_rows(result, {tokens, static_cast<size_t>(rows)}, {logprobs, static_cast<size_t>(rows)}, out);
}

void StepSampler::accept_greedy_rows(const StepResult& result, Runner& runner, StepTokens& out) {
  const auto [tokens, logprobs] = runner.fetch_greedy_rows(result);
  accept_rows(result, tokens, logprobs, out);
}

void StepSampler::accept_rows(const StepResult& result, std::span<const int32_t> tokens,
                              std::span<const float> logprobs, StepTokens& out) {
  const bool replay = speculative_.replay_accept_rate >= 0.0;
  for (size_t u = 0; u < result.uses.size(); ++u) {
    const LogitRowUse& use = result.uses[u];
    const Sequence& sequence = *use.chunk.sequence;
    const int64_t num_drafts = use.chunk.num_drafts;
    int64_t& accepted = out.accepted[u];
    std::vector<SampledToken>& emitted = out.emitted[u];
    accepted = 0;
    emitted.clear();
    if (!use.chunk.samples || sequence.request.max_tokens == 0) continue;
    // The row of the chunk's last known token, then one per draft (a prefill chunk's last row).
    const int64_t first = use.first_row + use.num_rows - 1 - num_drafts;
    for (int64_t i = 0; i <= num_drafts; ++i) {
      const int64_t row = first + i;
      const int32_t best = tokens[static_cast<size_t>(row)];
      if (best < 0) raise(ErrorCode::kInternal, "verify found no valid logit in row {}", row);
      const bool last = i == num_drafts;
      const int32_t draft = last ? -1 : sequence.draft_tokens[static_cast<size_t>(i)];
      if (replay && !last) {
        const auto step = static_cast<uint64_t>(sequence.num_output() + i);
        if (stream_uniform(speculative_.replay_seed ^ sequence.seed, kReplayStream, step) <
            speculative_.replay_accept_rate) {
          // Benchmark mode: the draft stands in for the target's choice; its logprob is not computed.
          SampledToken token;
          token.token = draft;
          token.logprob = 0.0f;
          emitted.push_back(token);
          ++accepted;
          continue;
        }
      }
      SampledToken token;
      token.token = best;
      token.logprob = logprobs[static_cast<size_t>(row)];
      emitted.push_back(token);
      if (last || replay || best != draft) break;
      ++accepted;
    }
  }
  out.from_greedy_rows = true;
}

std::vector<SampledToken> StepSampler::accept_chunk(const LogitRowUse& use, const Tensor& logits, int64_t& accepted) {
  Sequence& sequence = *use.chunk.sequence;
  const SamplingParams& params = sequence.request.sampling;
  const int64_t num_drafts = use.chunk.num_drafts;
  METRALE_CHECK(use.num_rows >= 1 + num_drafts, "sequence {}: {} logit rows for {} drafts", sequence.id, use.num_rows,
                num_drafts);
  const int64_t first = use.first_row + use.num_rows - 1 - num_drafts;  // the row of the last known token
  const bool replay = speculative_.replay_accept_rate >= 0.0;
  accepted = 0;
  std::vector<SampledToken> emitted;
  // The output as the token being chosen sees it: accepted drafts included (penalties).
  std::vector<int32_t> history(sequence.output().begin(), sequence.output().end());
  scratch_.resize(static_cast<size_t>(vocab_));
  for (int64_t i = 0; i <= num_drafts; ++i) {
    float* row = logits.data_as<float>() + (first + i) * vocab_;
    const std::span<float> raw(row, static_cast<size_t>(vocab_));
    // Bias and mask first: every choice below (and every reported logprob) sees the processed row.
    if (ConstrainedRows::needs_processing(sequence)) constrained_->process_row(sequence, i, raw);
    const auto step = static_cast<uint64_t>(sequence.num_output() + i);
    const bool last = i == num_drafts;
    const int32_t draft = last ? -1 : sequence.draft_tokens[static_cast<size_t>(i)];
    if (replay && !last) {
      // Benchmark mode: a seeded Bernoulli(p) stands in for the comparison with the target.
      if (stream_uniform(speculative_.replay_seed ^ sequence.seed, kReplayStream, step) <
          speculative_.replay_accept_rate) {
        emitted.push_back(describe_token(raw, draft, params.top_logprobs));
        ++accepted;
        continue;
      }
    }
    if (params.is_greedy() || last || replay || sequence.draft_probs.empty()) {
      // The target's own choice, exactly as without speculation (greedy: the argmax; sampling: the
      // Sampler's draw with plain decoding's uniform); a draft is kept when it is that choice. For a
      // deterministic (one-hot) draft this is rejection sampling: kept with probability p(draft),
      // otherwise a token of p without the draft. The last row (bonus) samples as a plain decode
      // row does.
      std::copy(raw.begin(), raw.end(), scratch_.begin());
      SampledToken token = sampler_.sample(scratch_, params, sequence.prompt(), history, sequence.seed, step);
      const bool matches = !last && !replay && token.token == draft;
      emitted.push_back(std::move(token));
      if (!matches) break;
      ++accepted;
      history.push_back(draft);
      continue;
    }
    // Sampling: rejection sampling against the target distribution of this row.
    std::copy(raw.begin(), raw.end(), scratch_.begin());
    probs_.resize(static_cast<size_t>(vocab_));
    target_distribution(sampler_, scratch_, params, sequence.prompt(), history, probs_);
    std::span<const float> q;
    if (!sequence.draft_probs.empty()) {
      q = std::span<const float>(sequence.draft_probs).subspan(static_cast<size_t>(i * vocab_), static_cast<size_t>(vocab_));
    }
    bool kept = false;
    const int32_t token = rejection_sample(probs_, q, draft, stream_uniform(sequence.seed, kAcceptStream, step),
                                           stream_uniform(sequence.seed, kResidualStream, step), kept);
    emitted.push_back(describe_token(raw, token, params.top_logprobs));
    if (!kept) break;
    ++accepted;
    history.push_back(draft);
  }
  return emitted;
}

bool StepSampler::sample_on_device(const StepResult& result, std::vector<SampledToken>& sampled) {
  const Device device = result.logits.device();
  const int64_t rows = static_cast<int64_t>(result.uses.size());
  for (int64_t i = 0; i < rows; ++i) {
    const LogitRowUse& use = result.uses[static_cast<size_t>(i)];
    const Sequence& sequence = *use.chunk.sequence;
    const SamplingParams& params = sequence.request.sampling;
    if (!use.chunk.samples || use.num_rows != 1 || use.first_row != i || sequence.request.max_tokens == 0 ||
        sequence.request.return_prompt_logits || params.top_logprobs > 0 || params.repetition_penalty != 1.0f ||
        params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f ||
        ConstrainedRows::needs_host_processing(sequence)) {
      return false;
    }
  }
  if (!device_sampling_ || device_sampling_->capacity < rows) {
    device_sampling_ = std::make_unique<DeviceSampling>();
    allocate_sampling(*device_sampling_, std::max<int64_t>(rows, max_num_seqs_), device);
  }
  DeviceSampling& state = *device_sampling_;
  // Host layout: temperature f32 | top_k i32 | top_p f32 | min_p f32 | seed i64 | step i64, each [n].
  const int64_t n = state.capacity;
  auto* base = static_cast<char*>(state.host.data());
  auto* temperature = reinterpret_cast<float*>(base);
  auto* top_k = reinterpret_cast<int32_t*>(base + 4 * n);
  auto* top_p = reinterpret_cast<float*>(base + 8 * n);
  auto* min_p = reinterpret_cast<float*>(base + 12 * n);
  auto* seed = reinterpret_cast<int64_t*>(base + 16 * n);
  auto* step = reinterpret_cast<int64_t*>(base + 24 * n);
  for (int64_t i = 0; i < rows; ++i) {
    const Sequence& sequence = *result.uses[static_cast<size_t>(i)].chunk.sequence;
    const SamplingParams& params = sequence.request.sampling;
    temperature[i] = params.temperature;
    top_k[i] = params.top_k;
    top_p[i] = params.top_p;
    min_p[i] = params.min_p;
    seed[i] = static_cast<int64_t>(sequence.seed);
    step[i] = sequence.num_output();
  }
  const auto upload = [&](OwnedTensor& target, const void* source, size_t element) {
    copy_bytes_async(target.tensor.data(), device, source, Device::cpu(), static_cast<size_t>(rows) * element);
  };
  upload(state.temperature, temperature, 4);
  upload(state.top_k, top_k, 4);
  upload(state.top_p, top_p, 4);
  upload(state.min_p, min_p, 4);
  upload(state.seed, seed, 8);
  upload(state.step, step, 8);
  // Constrained rows: their masks (computed during the forward) go up in one copy and are applied
  // in place; a step without them uploads and launches nothing.
  constrained_->apply_to_logits(result.logits.slice(0, 0, rows), result.uses);
  kernels::SamplingRowParams row_params{
      state.temperature.tensor.slice(0, 0, rows), state.top_k.tensor.slice(0, 0, rows),
      state.top_p.tensor.slice(0, 0, rows),       state.min_p.tensor.slice(0, 0, rows),
      state.seed.tensor.slice(0, 0, rows),        state.step.tensor.slice(0, 0, rows)};
  kernels::sample_tokens(result.logits.slice(0, 0, rows), row_params, state.tokens.tensor.slice(0, 0, rows),
                         state.logprobs.tensor.slice(0, 0, rows));
  // Results come back into the (now consumed) staging area: tokens i32 then logprobs f32.
  auto* tokens_out = reinterpret_cast<int32_t*>(base);
  auto* logprobs_out = reinterpret_cast<float*>(base + 4 * n);
  copy_bytes_async(tokens_out, Device::cpu(), state.tokens.tensor.data(), device, static_cast<size_t>(rows) * 4);
  copy_bytes_async(logprobs_out, Device::cpu(), state.logprobs.tensor.data(), device, static_cast<size_t>(rows) * 4);
  synchronize(device);
  sampled.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    if (tokens_out[i] < 0) raise(ErrorCode::kInternal, "device sampling found no valid logit in row {}", i);
    sampled[static_cast<size_t>(i)].token = tokens_out[i];
    sampled[static_cast<size_t>(i)].logprob = logprobs_out[i];
  }
  return true;
}

}  // namespace metrale
