#include "engine/engine.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "kernels/sampling.h"
#include "runtime/buffer.h"
#include "runtime/stream.h"

#include <fmt/ranges.h>

namespace metrale {

std::string_view finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kNone: return "";
  }
  return "";
}

std::string EnginePlan::describe() const {
  std::string text = fmt::format("KV cache: {} blocks of {} tokens ({}, {} tokens); max model length {}", num_kv_blocks,
                                 block_size, format_bytes(kv_cache_bytes),
                                 static_cast<int64_t>(num_kv_blocks) * block_size, max_model_len);
  if (num_state_slots > 0) {
    text += fmt::format("; recurrent state: {} sequence slots + {} checkpoint slots of {} ({})", num_state_slots,
                        num_checkpoint_slots, format_bytes(state_bytes_per_slot), format_bytes(state_bytes));
  }
  text += fmt::format("; max {} sequences; prefix caching {}", max_num_seqs, prefix_caching ? "on" : "off");
  if (device_total_bytes > 0) {
    text += fmt::format("; workspace {}; in use before the cache {} of {}", format_bytes(workspace_bytes),
                        format_bytes(used_before_cache), format_bytes(device_total_bytes));
  }
  if (!graph_batch_sizes.empty()) text += fmt::format("; decode graphs for batch {}", fmt::join(graph_batch_sizes, ","));
  return text;
}

namespace {

// A verify's acceptance counts when the MTP head wrote the keys of all but 1 / kMtpMissedShare of
// the sequence's positions (it skips positions while drafting is off).
constexpr int64_t kMtpMissedShare = 8;

// How one memory budget is divided between recurrent-state slots and KV blocks.
struct CacheSplit {
  int64_t max_num_seqs = 0;
  int64_t checkpoint_slots = 0;
  int32_t num_kv_blocks = 0;
};

// State slots come first: one per sequence, the checkpoints and a padding slot. The budget must
// hold them and one sequence of max_model_len tokens (blocks_per_seq blocks); when it does not,
// checkpoints give way first, then max_num_seqs, so start-up never fails for a ratio it can
// compute. The rest goes to KV blocks, up to every sequence at full length.
CacheSplit split_cache_budget(uint64_t budget, uint64_t per_block, uint64_t per_slot, int64_t blocks_per_seq,
                              int64_t max_num_seqs, int64_t checkpoint_slots) {
  CacheSplit split{max_num_seqs, checkpoint_slots, 0};
  if (per_slot > 0) {
    const uint64_t one_sequence_kv = static_cast<uint64_t>(std::max<int64_t>(blocks_per_seq, 1)) * per_block;
    const auto slots_bytes = [&](int64_t seqs, int64_t checkpoints) {
      return static_cast<uint64_t>(seqs + checkpoints + 1) * per_slot;
    };
    if (slots_bytes(max_num_seqs, checkpoint_slots) + one_sequence_kv > budget) {
      const auto room = static_cast<int64_t>(budget > one_sequence_kv ? (budget - one_sequence_kv) / per_slot : 0);
      split.checkpoint_slots = std::clamp<int64_t>(room - 1 - max_num_seqs, 0, checkpoint_slots);
      split.max_num_seqs = std::clamp<int64_t>(room - 1 - split.checkpoint_slots, 1, max_num_seqs);
      if (slots_bytes(split.max_num_seqs, split.checkpoint_slots) + per_block > budget) {
        raise(ErrorCode::kOutOfMemory,
              "the cache budget {} cannot hold one sequence's recurrent state ({} per slot, plus a padding slot) and "
              "a KV block ({})",
              format_bytes(budget), format_bytes(per_slot), format_bytes(per_block));
      }
    }
    budget -= slots_bytes(split.max_num_seqs, split.checkpoint_slots);
  }
  const int64_t wanted = blocks_per_seq * split.max_num_seqs;
  const auto affordable = static_cast<int64_t>(budget / per_block);
  split.num_kv_blocks = static_cast<int32_t>(std::clamp<int64_t>(std::min(wanted, affordable), 1, 1 << 30));
  return split;
}

}  // namespace

EngineStats Engine::stats() const {
  EngineStats stats = stats_;
  const BlockPool& pool = cache_->pool();
  stats.kv_blocks_total = pool.num_blocks();
  stats.kv_blocks_used = pool.num_used();
  stats.kv_blocks_cached = pool.num_cached();
  stats.state_slots_total = cache_->num_state_slots();
  stats.state_slots_used = cache_->num_state_slots_used();
  return stats;
}

Engine::Engine(std::unique_ptr<Model> model, const EngineConfig& config)
    : model_(std::move(model)), config_(config), scheduler_(config.scheduler), seed_source_(std::random_device{}()) {
  const ModelConfig& model_config = model_->config();
  const Device device = model_->device();
  std::vector<LayerCacheSpec> specs = model_->cache_specs();
  configure_speculation(specs);
  if (config_.block_size <= 0) raise(ErrorCode::kInvalidArgument, "block size must be positive");
  if (config_.scheduler.max_num_seqs <= 0 || config_.scheduler.max_num_batched_tokens <= 0)
    raise(ErrorCode::kInvalidArgument, "max-num-seqs and max-num-batched-tokens must be positive");
  if (config_.state_checkpoint_interval <= 0)
    raise(ErrorCode::kInvalidArgument, "state-checkpoint-interval must be positive, got {}", config_.state_checkpoint_interval);
  if (!(config_.gpu_memory_utilization > 0.0 && config_.gpu_memory_utilization <= 1.0))
    raise(ErrorCode::kInvalidArgument, "gpu-memory-utilization must be in (0, 1], got {}", config_.gpu_memory_utilization);
  plan_.block_size = config_.block_size;
  plan_.max_model_len = config_.max_model_len > 0 ? config_.max_model_len : model_config.max_position_embeddings;

  RunnerLimits limits;
  limits.max_num_tokens = config_.scheduler.max_num_batched_tokens;
  limits.max_num_seqs = config_.scheduler.max_num_seqs;
  limits.max_model_len = plan_.max_model_len;
  limits.block_size = config_.block_size;
  if (speculating()) {
    // Verify steps ask for the logits of 1 + k rows per sequence.
    limits.max_logit_rows = std::min<int64_t>(limits.max_num_seqs * (1 + config_.speculative.num_drafts),
                                              std::max(limits.max_num_tokens, limits.max_num_seqs));
    limits.max_drafts = config_.speculative.num_drafts;
    limits.mtp = config_.speculative.method == SpeculativeMethod::kMtp;
  }
  runner_ = std::make_unique<Runner>(*model_, limits);

  const DType kv_dtype = device.is_cpu() ? DType::kF32 : DType::kBF16;
  const uint64_t per_block = std::max<uint64_t>(1, kv_bytes_per_block(specs, config_.block_size, kv_dtype));
  const uint64_t per_slot = state_bytes_per_slot(specs, dtype_size(kv_dtype));
  const int64_t blocks_per_seq = (plan_.max_model_len + config_.block_size - 1) / config_.block_size;
  uint64_t kv_budget = config_.kv_cache_bytes;
  if (device.is_cuda()) {
    // One budget: weights (already resident), then the workspace of the largest step, then the
    // graphs, then the KV cache gets what is left of utilization x total.
    plan_.workspace_bytes = runner_->plan_workspace();
    size_t free_bytes = 0, total_bytes = 0;
    device_memory_info(device, free_bytes, total_bytes);
    plan_.device_total_bytes = total_bytes;
    plan_.used_before_cache = total_bytes - free_bytes;
    const uint64_t graph_reserve = config_.cuda_graphs ? (256ull << 20) : 0;
    const auto allowed = static_cast<uint64_t>(config_.gpu_memory_utilization * static_cast<double>(total_bytes));
    const uint64_t committed = plan_.used_before_cache + graph_reserve;
    if (allowed <= committed + per_block + (per_slot > 0 ? 2 * per_slot : 0)) {
      raise(ErrorCode::kOutOfMemory,
            "no room for a KV cache: {} of {} in use after loading (weights + workspace {}), limit {} "
            "(raise --gpu-memory-utilization or lower --max-num-batched-tokens)",
            format_bytes(plan_.used_before_cache), format_bytes(total_bytes), format_bytes(plan_.workspace_bytes),
            format_bytes(allowed));
    }
    kv_budget = allowed - committed;
  }
  // Recurrent state: one slot per running sequence, checkpoint slots for the prefix cache and one
  // padding slot come out of the same budget as the KV blocks, before them (split_cache_budget).
  int64_t max_seqs = config_.scheduler.max_num_seqs;
  int64_t checkpoint_slots = 0;
  if (per_slot > 0 && config_.enable_prefix_caching)
    checkpoint_slots = config_.state_checkpoint_slots >= 0 ? config_.state_checkpoint_slots : max_seqs;
  if (config_.num_kv_blocks > 0) {
    plan_.num_kv_blocks = config_.num_kv_blocks;
  } else {
    const CacheSplit split = split_cache_budget(kv_budget, per_block, per_slot, blocks_per_seq, max_seqs, checkpoint_slots);
    if (split.checkpoint_slots < checkpoint_slots) {
      METRALE_LOG_INFO("memory: {} state checkpoint slots instead of {} ({} per slot, budget {})", split.checkpoint_slots,
                       checkpoint_slots, format_bytes(per_slot), format_bytes(kv_budget));
    }
    if (split.max_num_seqs < max_seqs) {
      METRALE_LOG_WARN("memory: lowering --max-num-seqs from {} to {}: the budget {} holds {} state slots of {} next to "
                       "one sequence of {} tokens",
                       max_seqs, split.max_num_seqs, format_bytes(kv_budget),
                       split.max_num_seqs + split.checkpoint_slots + 1, format_bytes(per_slot), plan_.max_model_len);
    }
    max_seqs = split.max_num_seqs;
    checkpoint_slots = split.checkpoint_slots;
    plan_.num_kv_blocks = split.num_kv_blocks;
  }
  if (max_seqs < config_.scheduler.max_num_seqs) {
    config_.scheduler.max_num_seqs = static_cast<int32_t>(max_seqs);
    scheduler_ = Scheduler(config_.scheduler);
    runner_->lower_max_num_seqs(max_seqs);
  }
  plan_.max_num_seqs = config_.scheduler.max_num_seqs;
  plan_.prefix_caching = config_.enable_prefix_caching;
  CacheConfig cache_config;
  cache_config.block_size = config_.block_size;
  cache_config.num_blocks = plan_.num_kv_blocks;
  cache_config.kv_dtype = kv_dtype;
  cache_config.num_state_slots = per_slot > 0 ? static_cast<int32_t>(max_seqs) : 0;
  cache_config.num_checkpoint_slots = static_cast<int32_t>(checkpoint_slots);
  cache_config.enable_prefix_caching = config_.enable_prefix_caching;
  cache_config.state_checkpoint_interval = config_.state_checkpoint_interval;
  cache_ = std::make_unique<CacheManager>(specs, cache_config, device);
  plan_.kv_cache_bytes = cache_->kv_memory_bytes();
  plan_.num_state_slots = cache_config.num_state_slots;
  plan_.num_checkpoint_slots = per_slot > 0 ? cache_config.num_checkpoint_slots : 0;
  plan_.state_bytes_per_slot = per_slot;
  plan_.state_bytes = cache_->state_memory_bytes();
  runner_->set_cache(cache_.get());
  if (device.is_cuda() && config_.cuda_graphs) {
    runner_->capture_decode_graphs(config_.graph_batch_sizes);
    plan_.graph_batch_sizes = runner_->graph_batch_sizes();
  }
  METRALE_LOG_INFO("{}", plan_.describe());
}

struct Engine::DeviceSampling {
  PinnedBuffer host;  // staging for the six parameter arrays, then the results
  OwnedTensor temperature, top_k, top_p, min_p, seed, step, tokens, logprobs;
  int64_t capacity = 0;
};

Engine::~Engine() = default;

bool Engine::sample_on_device(const StepResult& result, std::vector<SampledToken>& sampled) {
  const Device device = result.logits.device();
  const int64_t rows = static_cast<int64_t>(result.uses.size());
  for (int64_t i = 0; i < rows; ++i) {
    const LogitRowUse& use = result.uses[static_cast<size_t>(i)];
    const Sequence& sequence = *use.chunk.sequence;
    const SamplingParams& params = sequence.request.sampling;
    if (!use.chunk.samples || use.num_rows != 1 || use.first_row != i || sequence.request.max_tokens == 0 ||
        sequence.request.return_prompt_logits || params.top_logprobs > 0 || params.repetition_penalty != 1.0f ||
        params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f) {
      return false;
    }
  }
  if (!device_sampling_ || device_sampling_->capacity < rows) {
    auto state = std::make_unique<DeviceSampling>();
    state->capacity = std::max<int64_t>(rows, config_.scheduler.max_num_seqs);
    const int64_t n = state->capacity;
    state->host = PinnedBuffer(static_cast<size_t>(n) * 40);
    state->temperature = OwnedTensor(DType::kF32, {n}, device);
    state->top_k = OwnedTensor(DType::kI32, {n}, device);
    state->top_p = OwnedTensor(DType::kF32, {n}, device);
    state->min_p = OwnedTensor(DType::kF32, {n}, device);
    state->seed = OwnedTensor(DType::kI64, {n}, device);
    state->step = OwnedTensor(DType::kI64, {n}, device);
    state->tokens = OwnedTensor(DType::kI32, {n}, device);
    state->logprobs = OwnedTensor(DType::kF32, {n}, device);
    device_sampling_ = std::move(state);
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
  kernels::SamplingRowParams row_params{state.temperature.tensor.slice(0, 0, rows), state.top_k.tensor.slice(0, 0, rows),
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

int64_t Engine::add_request(Request request) {
  const int64_t vocab = model_->config().vocab_size;
  if (request.prompt.empty()) raise(ErrorCode::kInvalidArgument, "the prompt is empty");
  for (const int32_t id : request.prompt) {
    if (id < 0 || id >= vocab) raise(ErrorCode::kInvalidArgument, "prompt token id {} is outside the vocabulary [0, {})", id, vocab);
  }
  for (const int32_t id : request.stop_token_ids) {
    if (id < 0 || id >= vocab) raise(ErrorCode::kInvalidArgument, "stop token id {} is outside the vocabulary [0, {})", id, vocab);
  }
  if (request.max_tokens < 0) raise(ErrorCode::kInvalidArgument, "max_tokens must be >= 0, got {}", request.max_tokens);
  if (request.max_tokens == 0 && !request.return_prompt_logits)
    raise(ErrorCode::kInvalidArgument, "max_tokens must be at least 1");
  request.sampling.validate();
  const int64_t prompt_len = static_cast<int64_t>(request.prompt.size());
  if (prompt_len > plan_.max_model_len) {
    raise(ErrorCode::kInvalidArgument, "the prompt has {} tokens but the model's context is {}", prompt_len,
          plan_.max_model_len);
  }
  // The longest this request can get must fit in the whole cache, or it could never finish.
  const int64_t longest = std::min<int64_t>(prompt_len + request.max_tokens, plan_.max_model_len);
  if (cache_->blocks_for(longest) > plan_.num_kv_blocks) {
    raise(ErrorCode::kInvalidArgument, "the request needs up to {} tokens of KV cache but the cache holds {}", longest,
          static_cast<int64_t>(plan_.num_kv_blocks) * plan_.block_size);
  }
  auto sequence = std::make_unique<Sequence>();
  sequence->id = next_id_++;
  sequence->arrival = next_arrival_++;
  sequence->tokens = request.prompt;
  sequence->num_prompt = prompt_len;
  sequence->seed = request.sampling.seed.value_or(seed_source_());
  if (request.return_prompt_logits) sequence->prompt_logits.assign(static_cast<size_t>(prompt_len * vocab), 0.0f);
  sequence->request = std::move(request);
  Sequence* raw = sequence.get();
  sequences_.emplace(raw->id, std::move(sequence));
  stats_.prompt_tokens += prompt_len;
  waiting_.push_back(raw);
  return raw->id;
}

void Engine::abort_request(int64_t request_id) {
  const auto it = sequences_.find(request_id);
  if (it == sequences_.end() || it->second->finished()) return;
  Sequence& sequence = *it->second;
  running_.erase(std::remove(running_.begin(), running_.end(), &sequence), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &sequence), waiting_.end());
  finish(sequence, FinishReason::kAbort);
  TokenEvent event;
  event.request_id = request_id;
  event.finish_reason = FinishReason::kAbort;
  pending_events_.push_back(std::move(event));
}

void Engine::finish(Sequence& sequence, FinishReason reason) {
  sequence.status = SequenceStatus::kFinished;
  sequence.finish_reason = reason;
  cache_->free_sequence(sequence.id);
}

std::optional<FinishReason> Engine::stop_reason(const Sequence& sequence, int32_t token) const {
  const Request& request = sequence.request;
  if (!request.ignore_eos) {
    const auto& eos = model_->config().eos_token_ids;
    if (std::find(eos.begin(), eos.end(), token) != eos.end()) return FinishReason::kStop;
  }
  if (std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), token) != request.stop_token_ids.end())
    return FinishReason::kStop;
  if (sequence.num_output() >= request.max_tokens) return FinishReason::kLength;
  if (sequence.num_tokens() >= plan_.max_model_len) return FinishReason::kLength;
  return std::nullopt;
}

std::vector<TokenEvent> Engine::step() {
  std::vector<TokenEvent> events = std::move(pending_events_);
  pending_events_.clear();
  if (!has_unfinished()) return events;
  // A step's cost, for the speculation controller, is all of it: drafting and scheduling too.
  const auto step_start = std::chrono::steady_clock::now();
  if (speculating()) prepare_drafts();
  const SchedulePlan plan = scheduler_.schedule(running_, waiting_, *cache_);
  stats_.num_preemptions += static_cast<int64_t>(plan.preempted.size());
  stats_.prefix_cache_queries += plan.prefix_query_tokens;
  stats_.prefix_cache_hits += plan.prefix_hit_tokens;
  stats_.hybrid_state_restores += plan.state_restores;
  if (plan.empty()) {
    METRALE_CHECK(running_.empty() || !waiting_.empty(), "nothing schedulable with {} running", running_.size());
    return events;
  }
  const auto schedule_end = std::chrono::steady_clock::now();
  StepResult result = runner_->execute(plan);
  ++stats_.num_steps;
  const int64_t vocab = model_->config().vocab_size;
  std::vector<SampledToken> device_sampled;
  const size_t num_uses = result.uses.size();
  std::vector<std::vector<SampledToken>> emitted(num_uses);
  std::vector<int64_t> accepted(num_uses, 0);
  // Verify steps of greedy requests accept from the argmax rows: a fixed-layout step computed them
  // with the forward, a ragged one (prefill rows too) computes them now; either way a few bytes per
  // row reach the host instead of the logits rows.
  bool accepted_from_greedy = false;
  if (plan.num_draft_rows > 0 && all_greedy(result)) {
    if (result.greedy_tokens.empty()) runner_->greedy_rows(result);
    accepted_from_greedy = accept_greedy_rows(result, emitted, accepted);
  }
  const bool sampled_on_device =
      accepted_from_greedy || (!result.logits.device().is_cpu() && sample_on_device(result, device_sampled));
  if (!result.logits.device().is_cpu() && !sampled_on_device) {
    // Sampling runs on the host: bring back the rows the step asked for.
    int64_t rows = 0;
    for (const LogitRowUse& use : result.uses) rows = std::max(rows, use.first_row + use.num_rows);
    host_logits_.resize(static_cast<size_t>(rows * vocab));
    copy_bytes(host_logits_.data(), Device::cpu(), result.logits.data(), result.logits.device(),
               host_logits_.size() * sizeof(float));
    result.logits = Tensor(host_logits_.data(), DType::kF32, {rows, vocab}, Device::cpu());
  }
  // Pass 1: prompt logits, then the tokens each sampling chunk emits (acceptance of its drafts).
  for (size_t u = 0; u < num_uses && !accepted_from_greedy; ++u) {
    const LogitRowUse& use = result.uses[u];
    Sequence& sequence = *use.chunk.sequence;
    // Prompt logits for scoring: rows for positions below num_prompt.
    if (sequence.request.return_prompt_logits) {
      for (int64_t r = 0; r < use.num_rows; ++r) {
        const int64_t position = use.first_position + r;
        if (position >= sequence.num_prompt) break;
        const float* row = result.logits.data_as<const float>() + (use.first_row + r) * vocab;
        std::copy(row, row + vocab, sequence.prompt_logits.begin() + position * vocab);
      }
    }
    if (!use.chunk.samples || sequence.request.max_tokens == 0) continue;
    if (sampled_on_device) {
      emitted[u].push_back(device_sampled[static_cast<size_t>(use.first_row)]);
    } else {
      emitted[u] = accept_chunk(use, result.logits, accepted[u]);
    }
  }
  // Verify steps: every sequence keeps its known rows and its accepted drafts; the recurrent
  // layers' slots advance over exactly those rows.
  std::vector<int64_t> kept_rows(num_uses);
  for (size_t u = 0; u < num_uses; ++u) kept_rows[u] = result.uses[u].chunk.num_new + accepted[u];
  // MTP after a fixed-layout greedy verify or a decode step: queued now (beside the verify's commit),
  // collected after the bookkeeping, which it overlaps.
  const bool mtp_launched = mtp_active_ && !result.fixed.empty() &&
                            (plan.num_draft_rows == 0 || accepted_from_greedy) && all_greedy(result);
  if (plan.num_draft_rows > 0) {
    std::vector<int32_t> kept(kept_rows.begin(), kept_rows.end());
    runner_->commit_verified(result, kept, /*mtp_follows=*/mtp_launched);
    ++stats_.verify_steps;
  }
  if (mtp_launched) launch_mtp_drafter_fixed(result, accepted, emitted);

  // Pass 2: bookkeeping, stop conditions and events.
  std::vector<Sequence*> finished;
  for (size_t u = 0; u < num_uses; ++u) {
    const LogitRowUse& use = result.uses[u];
    Sequence& sequence = *use.chunk.sequence;
    const int64_t computed_before = sequence.num_computed;
    sequence.num_computed += kept_rows[u];
    stats_.computed_prompt_tokens +=
        std::max<int64_t>(0, std::min(sequence.num_computed, sequence.num_prompt) - computed_before);
    if (use.chunk.num_drafts > 0) {
      stats_.drafted_tokens += use.chunk.num_drafts;
      stats_.accepted_tokens += accepted[u];
      // Drafts of an MTP head that missed much of the sequence say little about drafting that stays on.
      const bool fresh_drafter = config_.speculative.method != SpeculativeMethod::kMtp ||
                                 sequence.mtp_missed * kMtpMissedShare <= sequence.num_computed;
      if (fresh_drafter) {
        sequence.acceptance_ema =
            spec_controller_.record_verify(sequence.acceptance_ema, use.chunk.num_drafts, accepted[u]);
      }
    }
    sequence.draft_tokens.clear();
    sequence.draft_probs.clear();
    sequence.draft_base = -1;
    // Full blocks become shareable; at a checkpoint point the state after them is kept too (the
    // copy is queued after this step's forward). Accepted drafts are computed tokens: they join the
    // sequence first; rejected drafts never do (their keys lie beyond num_computed and are
    // overwritten later).
    const size_t known_tokens = sequence.tokens.size();
    for (int64_t i = 0; i < accepted[u]; ++i) sequence.tokens.push_back(emitted[u][static_cast<size_t>(i)].token);
    cache_->cache_full_blocks(sequence.id, sequence.tokens, sequence.num_computed);
    if (cache_->is_checkpoint_position(sequence.num_prompt, sequence.num_computed))
      cache_->checkpoint_state(sequence.id, sequence.num_computed);
    sequence.tokens.resize(known_tokens);
    if (!use.chunk.samples) continue;
    if (sequence.request.max_tokens == 0) {  // scoring only
      finish(sequence, FinishReason::kLength);
      finished.push_back(&sequence);
      TokenEvent event;
      event.request_id = sequence.id;
      event.finish_reason = FinishReason::kLength;
      events.push_back(std::move(event));
      continue;
    }
    // Stop conditions apply to each emitted token in order; the rest are cut.
    for (SampledToken& sampled : emitted[u]) {
      TokenEvent event;
      event.request_id = sequence.id;
      event.sampled = std::move(sampled);
      sequence.tokens.push_back(event.sampled.token);
      ++stats_.generated_tokens;
      const auto reason = stop_reason(sequence, event.sampled.token);
      if (reason) {
        finish(sequence, *reason);
        finished.push_back(&sequence);
        event.finish_reason = *reason;
      }
      events.push_back(std::move(event));
      if (reason) break;
    }
  }
  if (mtp_launched) {
    collect_mtp_drafter_fixed(result);
  } else if (mtp_active_) {
    run_mtp_drafter(result, kept_rows);
  } else if (config_.speculative.method == SpeculativeMethod::kMtp) {
    write_mtp_keys(result, kept_rows);
  }
  if (speculating()) {
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - step_start;
    SpeculativeStepRecord record;
    for (const ScheduledChunk& chunk : plan.chunks) {
      if (chunk.decodes()) {
        ++record.num_decoding;
        record.drafts = std::max(record.drafts, static_cast<int32_t>(chunk.num_drafts));
      } else {
        record.other_rows += chunk.num_rows();
      }
    }
    // The step's k is its longest draft run (what the choice decides); a fixed layout may pad it
    // to a captured shape's, whose cost is then this k's.
    record.drafter_ran = mtp_active_;
    record.seconds = std::max(seconds.count() - spec_untimed_seconds_, 0.5 * seconds.count());
    spec_untimed_seconds_ = 0.0;
    spec_controller_.record_step(record);
    if (log_level() <= LogLevel::kDebug) {  // the drafted count is for the log only
      METRALE_LOG_DEBUG(
          "speculation: {} decoding ({} drafted) + {} rows, k {}{}, {:.3f} ms ({:.3f} to schedule), acceptance {:.2f}",
          record.num_decoding,
          std::count_if(plan.chunks.begin(), plan.chunks.end(),
                        [](const ScheduledChunk& c) { return c.num_drafts > 0; }),
          record.other_rows, record.drafts, record.drafter_ran ? " + MTP head" : "", 1e3 * record.seconds,
          1e3 * std::chrono::duration<double>(schedule_end - step_start).count(), spec_controller_.global_acceptance());
    }
  }
  if (!finished.empty()) {
    running_.erase(std::remove_if(running_.begin(), running_.end(), [](const Sequence* s) { return s->finished(); }),
                   running_.end());
  }
#ifndef NDEBUG
  if (!has_unfinished()) cache_->check_integrity();  // debug builds: the cache's books balance when idle
#endif
  return events;
}

const Sequence& Engine::sequence(int64_t request_id) const {
  const auto it = sequences_.find(request_id);
  if (it == sequences_.end()) raise(ErrorCode::kNotFound, "no request {}", request_id);
  return *it->second;
}

void Engine::release(int64_t request_id) {
  const auto it = sequences_.find(request_id);
  if (it == sequences_.end()) return;
  if (!it->second->finished()) abort_request(request_id);
  sequences_.erase(request_id);
  // Drop events of a released request that were not delivered yet.
  pending_events_.erase(std::remove_if(pending_events_.begin(), pending_events_.end(),
                                       [&](const TokenEvent& e) { return e.request_id == request_id; }),
                        pending_events_.end());
}

}  // namespace metrale
