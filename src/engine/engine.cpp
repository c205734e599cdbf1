#include "engine/engine.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "core/checked_math.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "engine/tensor_parallel_model.h"
#include "runtime/buffer.h"
#include "runtime/stream.h"

namespace metrale {

std::string_view finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
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
  if (host_tier_bytes > 0) {
    text += fmt::format("; host tier {} ({} blocks, {} state slots", format_bytes(host_tier_bytes), num_host_blocks,
                        num_host_slots);
    if (copy_bytes_per_second > 0) text += fmt::format(", copies at {:.1f} GB/s", copy_bytes_per_second / 1e9);
    if (num_host_staging_blocks > 0)
      text += fmt::format(", staged through {} device blocks ({})", num_host_staging_blocks,
                          format_bytes(host_staging_bytes));
    text += ")";
  }
  if (disk_tier_bytes > 0) {
    text += fmt::format("; disk tier {} in {} ({} blocks, {} state slots)", format_bytes(disk_tier_bytes),
                        disk_tier_dir, num_disk_blocks, num_disk_slots);
  }
  if (!graph_batch_sizes.empty()) text += fmt::format("; decode graphs for batch {}", fmt::join(graph_batch_sizes, ","));
  return text;
}

namespace {

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
                              int64_t max_num_seqs, int64_t checkpoint_slots, int64_t block_size) {
  CacheSplit split{max_num_seqs, checkpoint_slots, 0};
  if (per_slot > 0) {
    const uint64_t one_sequence_kv = checked_mul<uint64_t>(static_cast<uint64_t>(std::max<int64_t>(blocks_per_seq, 1)),
                                                           per_block, "one sequence's KV bytes", ErrorCode::kOutOfMemory);
    const auto slots_bytes = [&](int64_t seqs, int64_t checkpoints) {
      return checked_mul<uint64_t>(static_cast<uint64_t>(seqs + checkpoints + 1), per_slot, "state slot bytes",
                                   ErrorCode::kOutOfMemory);
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
  const int64_t wanted = checked_mul<int64_t>(blocks_per_seq, split.max_num_seqs, "KV blocks wanted");
  const auto affordable = static_cast<int64_t>(std::min<uint64_t>(budget / per_block, uint64_t{1} << 40));
  // Cache slots (block x block_size + offset) are int32: at most 2^31 tokens of KV.
  const int64_t slot_limit = std::numeric_limits<int32_t>::max() / block_size;
  split.num_kv_blocks = static_cast<int32_t>(std::clamp<int64_t>(std::min(wanted, affordable), 1, std::min<int64_t>(slot_limit, 1 << 30)));
  return split;
}

// A tier's bytes (host or disk) split into KV blocks and state slots. Without per-slot state: all
// blocks. With it (hybrid models): up to `swap_slots` slots for preempted sequences' states (at most
// a quarter of the bytes); then, with prefix caching, units of one checkpoint slot and the
// `blocks_per_checkpoint` blocks of a checkpoint interval, since a hybrid's cached prefix is usable
// only up to its last checkpoint (a tier of blocks without checkpoints would hold no usable prefix);
// without prefix caching the rest is blocks.
struct HostSplit {
  int32_t num_blocks = 0;
  int32_t num_slots = 0;
};
HostSplit split_tier_space(uint64_t bytes, uint64_t per_block, uint64_t per_slot, int64_t swap_slots,
                           bool prefix_caching, int64_t blocks_per_checkpoint) {
  HostSplit split;
  if (bytes == 0 || per_block == 0) return split;
  uint64_t slots = 0, blocks = 0;
  if (per_slot > 0) {
    slots = std::min<uint64_t>(static_cast<uint64_t>(std::max<int64_t>(swap_slots, 0)), bytes / 4 / per_slot);
    bytes -= slots * per_slot;
    if (prefix_caching && blocks_per_checkpoint > 0) {
      const uint64_t unit = static_cast<uint64_t>(blocks_per_checkpoint) * per_block + per_slot;
      const uint64_t units = bytes / unit;
      slots += units;
      blocks += units * static_cast<uint64_t>(blocks_per_checkpoint);
      bytes -= units * unit;
    }
  }
  blocks += bytes / per_block;
  constexpr uint64_t kMax = std::numeric_limits<int32_t>::max();
  split.num_blocks = static_cast<int32_t>(std::min(blocks, kMax));
  split.num_slots = static_cast<int32_t>(std::min(slots, kMax));
  return split;
}

// Host <-> device copy bandwidth (bytes/s): one 64 MiB copy each way, after a warm-up copy, between
// pinned host memory (plain on the CPU device) and the device, as the host tier copies.
double measure_copy_bandwidth(Device device) {
  constexpr size_t kBytes = 64ull << 20;
  PinnedBuffer host(kBytes);
  Buffer target(device, kBytes);
  std::memset(host.data(), 1, kBytes);
  copy_bytes_async(target.data(), device, host.data(), Device::cpu(), 1 << 20);
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  copy_bytes_async(target.data(), device, host.data(), Device::cpu(), kBytes);
  copy_bytes_async(host.data(), Device::cpu(), target.data(), device, kBytes);
  synchronize(device);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return seconds > 0 ? 2.0 * static_cast<double>(kBytes) / seconds : 0.0;
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
  const SwapCounters& swaps = cache_->swap_counters();
  stats.swapped_out_sequences = swaps.sequences_out;
  stats.swapped_in_sequences = swaps.sequences_in;
  stats.swapped_out_blocks = swaps.blocks_out;
  stats.swapped_in_blocks = swaps.blocks_in;
  stats.swapped_out_slots = swaps.slots_out;
  stats.swapped_in_slots = swaps.slots_in;
  stats.prefix_blocks_to_host = swaps.prefix_blocks_out;
  stats.prefix_blocks_from_host = swaps.prefix_blocks_in;
  stats.swapped_to_disk_sequences = swaps.sequences_to_disk;
  stats.prefix_blocks_to_disk = swaps.prefix_blocks_to_disk;
  stats.prefix_blocks_written_ahead = swaps.prefix_blocks_written_ahead;
  stats.prefix_blocks_from_disk = swaps.prefix_blocks_from_disk;
  stats.disk_hits_declined = swaps.disk_hits_declined;
  stats.prefix_prefetches = swaps.prefix_prefetches;
  stats.checkpoints_to_host = swaps.checkpoints_out;
  stats.checkpoints_restored_from_tiers = swaps.checkpoints_in;
  stats.tier_entries_lost = swaps.lost_entries;
  const HostTier& host = cache_->host_tier();
  stats.host_blocks_total = host.num_blocks();
  stats.host_blocks_used = host.num_used_blocks();
  stats.host_slots_total = host.num_slots();
  stats.host_slots_used = host.num_used_slots() - cache_->num_host_checkpoints();
  return stats;
}

Engine::Engine(std::unique_ptr<Model> model, const EngineConfig& config)
    : model_(std::move(model)), config_(config), scheduler_(config.scheduler), seed_source_(std::random_device{}()) {
  tensor_parallel_ = dynamic_cast<TensorParallelModel*>(model_.get());
  faults_ = config_.fault_injection ? FaultInjector::parse(*config_.fault_injection) : FaultInjector::from_environment();
  if (faults_.armed()) METRALE_LOG_WARN("fault injection armed: {} (METRALE_FAULT_INJECT)", faults_.describe());
  configure_speculation(config_.speculative, *model_);
  if (model_->device().is_cuda() && config_.cuda_graphs && !model_->capabilities().graph_safe) {
    METRALE_LOG_WARN("CUDA graphs are off: model '{}' has blocks that cannot run inside a graph",
                     model_->config().model_type);
    config_.cuda_graphs = false;
  }
  validate_config();
  if (config_.max_mixed_step_ratio > 0.0) {
    // The least prefill a mixed step still carries: prompts progress however slow the model.
    constexpr int64_t kMinPrefillTokens = 256;
    const int64_t budget = config_.scheduler.max_num_batched_tokens;
    prefill_budget_.emplace(config_.max_mixed_step_ratio, std::min(kMinPrefillTokens, budget), budget);
  }
  plan_.block_size = config_.block_size;
  plan_.max_model_len = config_.max_model_len > 0 ? config_.max_model_len : model_->config().max_position_embeddings;
  runner_ = std::make_unique<Runner>(*model_, runner_limits());
  plan_cache(engine_cache_specs(*model_, config_.speculative.method == SpeculativeMethod::kMtp));
  runner_->set_cache(cache_.get());
  if (model_->device().is_cuda() && config_.cuda_graphs) {
    runner_->capture_decode_graphs(config_.graph_batch_sizes);
    plan_.graph_batch_sizes = runner_->graph_batch_sizes();
  }
  sampler_ =
      std::make_unique<StepSampler>(config_.speculative, model_->config().vocab_size, config_.scheduler.max_num_seqs);
  if (config_.speculative.method != SpeculativeMethod::kNone) {
    SpeculativeLimits limits;
    limits.max_model_len = plan_.max_model_len;
    limits.max_num_batched_tokens = config_.scheduler.max_num_batched_tokens;
    limits.max_num_seqs = config_.scheduler.max_num_seqs;
    const auto lookup = [this](int64_t id) -> Sequence* {
      const auto it = sequences_.find(id);
      return it == sequences_.end() ? nullptr : it->second.get();
    };
    speculative_ =
        std::make_unique<SpeculativeDecoder>(config_.speculative, limits, *model_, *runner_, *cache_, faults_, lookup);
  }
  METRALE_LOG_INFO("{}", plan_.describe());
}

Engine::~Engine() = default;

void Engine::validate_config() const {
  if (config_.block_size <= 0) raise(ErrorCode::kInvalidArgument, "block size must be positive");
  if (config_.scheduler.max_num_seqs <= 0 || config_.scheduler.max_num_batched_tokens <= 0)
    raise(ErrorCode::kInvalidArgument, "max-num-seqs and max-num-batched-tokens must be positive");
  if (config_.max_mixed_step_ratio != 0.0 && !(config_.max_mixed_step_ratio > 1.0 && config_.max_mixed_step_ratio < 1e6)) {
    raise(ErrorCode::kInvalidArgument, "max-mixed-step-ratio must be 0 (off) or above 1, got {}",
          config_.max_mixed_step_ratio);
  }
  if (config_.state_checkpoint_interval <= 0)
    raise(ErrorCode::kInvalidArgument, "state-checkpoint-interval must be positive, got {}", config_.state_checkpoint_interval);
  if (!(config_.gpu_memory_utilization > 0.0 && config_.gpu_memory_utilization <= 1.0))
    raise(ErrorCode::kInvalidArgument, "gpu-memory-utilization must be in (0, 1], got {}", config_.gpu_memory_utilization);
  // Positions, cache slots (block x block_size + offset) and row counts are int32 on the device.
  const int64_t positions = model_->config().max_position_embeddings;
  if (config_.max_model_len < 0 || config_.max_model_len > positions) {
    raise(ErrorCode::kInvalidArgument, "max-model-len {} is outside the model's {} positions (max_position_embeddings)",
          config_.max_model_len, positions);
  }
  if (positions <= 0 || positions > std::numeric_limits<int32_t>::max()) {
    raise(ErrorCode::kInvalidArgument, "the model's max_position_embeddings {} is outside [1, 2^31)", positions);
  }
  if (config_.num_kv_blocks < 0 ||
      checked_mul<int64_t>(config_.num_kv_blocks, config_.block_size, "KV cache slots") >
          std::numeric_limits<int32_t>::max()) {
    raise(ErrorCode::kInvalidArgument, "{} KV blocks of {} tokens do not fit int32 cache slots", config_.num_kv_blocks,
          config_.block_size);
  }
}

RunnerLimits Engine::runner_limits() const {
  RunnerLimits limits;
  limits.max_num_tokens = config_.scheduler.max_num_batched_tokens;
  limits.max_num_seqs = config_.scheduler.max_num_seqs;
  limits.max_model_len = plan_.max_model_len;
  limits.block_size = config_.block_size;
  if (config_.speculative.method != SpeculativeMethod::kNone) {
    // Verify steps ask for the logits of 1 + k rows per sequence.
    limits.max_logit_rows = std::min<int64_t>(limits.max_num_seqs * (1 + config_.speculative.num_drafts),
                                              std::max(limits.max_num_tokens, limits.max_num_seqs));
    limits.max_drafts = config_.speculative.num_drafts;
    limits.mtp = config_.speculative.method == SpeculativeMethod::kMtp;
  }
  return limits;
}

void Engine::plan_cache(const std::vector<CacheSpec>& specs) {
  const Device device = model_->device();
  const DType activation = model_->activation_dtype();
  const uint64_t per_block = std::max<uint64_t>(1, paged_bytes_per_block(specs, config_.block_size, activation));
  const uint64_t per_slot = slot_bytes_per_slot(specs, activation);
  const int64_t blocks_per_seq = checked_ceil_div<int64_t>(plan_.max_model_len, config_.block_size, "blocks per sequence");
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
    if (config_.swap_space_bytes > 0) {
      // The host tier's staging ring: enough device blocks for a step's worth of evictions to leave
      // the forward's stream at device speed (up to 64 blocks or 256 MiB; at least 2).
      const uint64_t staging = std::clamp<uint64_t>((256ull << 20) / per_block, 2, 64);
      if (kv_budget > 4 * staging * per_block) {
        plan_.num_host_staging_blocks = static_cast<int32_t>(staging);
        plan_.host_staging_bytes = staging * per_block;
        kv_budget -= plan_.host_staging_bytes;
      }
    }
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
    const CacheSplit split = split_cache_budget(kv_budget, per_block, per_slot, blocks_per_seq, max_seqs, checkpoint_slots,
                                                config_.block_size);
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
  cache_config.activation_dtype = activation;
  cache_config.num_state_slots = per_slot > 0 ? static_cast<int32_t>(max_seqs) : 0;
  cache_config.num_checkpoint_slots = static_cast<int32_t>(checkpoint_slots);
  cache_config.enable_prefix_caching = config_.enable_prefix_caching;
  cache_config.state_checkpoint_interval = config_.state_checkpoint_interval;
  // Tier slots hold swapped sequences' state and prefix-cache checkpoints (one per checkpoint interval of blocks).
  const int64_t blocks_per_checkpoint =
      (config_.state_checkpoint_interval + config_.block_size - 1) / config_.block_size;
  const HostSplit host = split_tier_space(config_.swap_space_bytes, per_block, per_slot, max_seqs,
                                          config_.enable_prefix_caching, blocks_per_checkpoint);
  cache_config.num_host_blocks = host.num_blocks;
  cache_config.num_host_slots = host.num_slots;
  cache_config.num_host_staging_blocks = host.num_blocks > 0 ? plan_.num_host_staging_blocks : 0;
  if (!config_.swap_disk_dir.empty()) {
    if (config_.swap_space_bytes == 0 || config_.swap_disk_bytes == 0)
      raise(ErrorCode::kInvalidArgument, "--high-speed-swap needs --swap-space and --swap-disk-space above 0");
    const HostSplit disk = split_tier_space(config_.swap_disk_bytes, per_block, per_slot, 4 * max_seqs,
                                            config_.enable_prefix_caching, blocks_per_checkpoint);
    cache_config.disk_dir = config_.swap_disk_dir;
    cache_config.num_disk_blocks = disk.num_blocks;
    cache_config.num_disk_slots = disk.num_slots;
  }
  if (tensor_parallel_ != nullptr) {
    cache_ = std::make_unique<CacheManager>(specs, cache_config, tensor_parallel_->devices());
    tensor_parallel_->bind_caches(cache_.get());
  } else {
    cache_ = std::make_unique<CacheManager>(specs, cache_config, device);
  }
  plan_.num_host_blocks = cache_->host_tier().num_blocks();
  plan_.num_host_slots = cache_->host_tier().num_slots();
  plan_.host_tier_bytes = cache_->host_tier().memory_bytes();
  plan_.num_host_staging_blocks = cache_->host_tier().num_staging_blocks();
  if (plan_.num_host_staging_blocks == 0) plan_.host_staging_bytes = 0;
  if (const DiskTier* disk = cache_->disk_tier()) {
    plan_.num_disk_blocks = disk->num_blocks();
    plan_.num_disk_slots = disk->num_slots();
    plan_.disk_tier_bytes = disk->capacity_bytes();
    plan_.disk_tier_dir = disk->directory().string();
  }
  if (plan_.host_tier_bytes > 0) {
    plan_.copy_bytes_per_second = measure_copy_bandwidth(device);
    PreemptionCosts costs = scheduler_.preemption_costs();
    costs.copy_bytes_per_second = plan_.copy_bytes_per_second;
    scheduler_.set_preemption_costs(costs);
  }
  plan_.kv_cache_bytes = cache_->kv_memory_bytes();
  plan_.num_state_slots = cache_config.num_state_slots;
  plan_.num_checkpoint_slots = per_slot > 0 ? cache_config.num_checkpoint_slots : 0;
  plan_.state_bytes_per_slot = per_slot;
  plan_.state_bytes = cache_->state_memory_bytes();
}

int64_t Engine::add_request(Request request) {
  if (!health_.serving) raise(ErrorCode::kUnavailable, "the engine can no longer serve: {}", health_.reason);
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
  if (request.prompt_logprobs > SamplingParams::kMaxTopLogprobs)
    raise(ErrorCode::kInvalidArgument, "prompt_logprobs must be at most {}, got {}", SamplingParams::kMaxTopLogprobs,
          request.prompt_logprobs);
  for (const auto& entry : request.sampling.logit_bias) {
    if (entry.first >= vocab)
      raise(ErrorCode::kInvalidArgument, "logit_bias token id {} is outside the vocabulary [0, {})", entry.first, vocab);
  }
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
  if (request.return_prompt_logits && request.prompt_logprobs >= 0) {
    sequence->prompt_logprobs.assign(static_cast<size_t>(prompt_len), SampledToken{});
  } else if (request.return_prompt_logits) {
    sequence->prompt_logits.assign(static_cast<size_t>(prompt_len * vocab), 0.0f);
  }
  sequence->request = std::move(request);
  Sequence* raw = sequence.get();
  sequences_.emplace(raw->id, std::move(sequence));
  stats_.prompt_tokens += prompt_len;
  waiting_.push_back(raw);
  prefetch_waiting();  // a prefix on disk starts coming back while the current steps run
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
  if (!health_.serving) {
    fail_unfinished(events);
    return events;
  }
  const size_t first_step_event = events.size();
  try {
    run_step(events);
  } catch (const std::exception& e) {
    abandon_step(e.what(), first_step_event, events);
  }
  return events;
}

void Engine::run_step(std::vector<TokenEvent>& events) {
  // A step's cost, for the speculation controller, is all of it: drafting and scheduling too.
  const auto step_start = std::chrono::steady_clock::now();
  step_scheduled_ = false;
  step_sequences_.clear();
  if (speculative_) speculative_->prepare(running_, waiting_.size());
  if (prefill_budget_) {
    const auto decoding = std::count_if(running_.begin(), running_.end(), [](const Sequence* s) {
      return s->num_tokens() - s->num_computed == 1 && !s->request.return_prompt_logits;
    });
    scheduler_.set_prefill_limit(prefill_budget_->limit(decoding));
  }
  SchedulePlan plan = schedule_step();
  if (plan.empty()) return;
  if (speculative_) plan.ragged_verify = speculative_->ragged_verify();
  const auto schedule_end = std::chrono::steady_clock::now();
  sampler_->begin_step(plan);  // constrained rows' masks, overlapping the forward
  StepResult result = forward(plan);
  faults_.hit(FaultSite::kSample);
  StepTokens tokens = sampler_->sample(plan, result, *runner_);
  if (speculative_) speculative_->commit(result, tokens, static_cast<int64_t>(running_.size()));
  if (plan.num_draft_rows > 0) ++stats_.verify_steps;
  for (size_t u = 0; u < result.uses.size(); ++u) {
    const LogitRowUse& use = result.uses[u];
    advance(use, tokens.kept_rows[u], tokens.accepted[u], tokens.emitted[u]);
    emit(use, tokens.emitted[u], events);
  }
  if (speculative_) {
    speculative_->finish_step(plan, result, tokens, static_cast<int64_t>(running_.size()), step_start, schedule_end);
  }
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](const Sequence* s) { return s->finished(); }),
                 running_.end());
  step_sequences_.clear();
  if (prefill_budget_) record_step_cost(plan, step_start);
  record_prefill_cost(plan, step_start);
  // The step's results are on the host, so the copies into the host tier queued on its stream have
  // landed (those on a copy lane are sealed once their ticket is done): seal them.
  cache_->seal_host_tier();
  cache_->write_back_host_blocks();  // keeps host blocks empty for the next evictions, off this thread
  prefetch_waiting();
#ifndef NDEBUG
  if (!has_unfinished()) cache_->check_integrity();  // debug builds: the cache's books balance when idle
#endif
}

void Engine::prefetch_waiting() {
  // Disk reads for the next waiting sequences, overlapping the next steps: a swapped one's contents,
  // or the disk hits of a new one's prefix match (the scheduler admits neither while its reads run).
  size_t looked_at = 0;
  for (auto it = waiting_.begin();
       it != waiting_.end() && looked_at < static_cast<size_t>(std::max(config_.swap_prefetch, 0)); ++it, ++looked_at) {
    const Sequence& sequence = **it;
    if (cache_->is_swapped_to_disk(sequence.id)) {
      cache_->prefetch(sequence.id);
    } else if (!cache_->is_swapped(sequence.id) && !sequence.request.return_prompt_logits) {
      cache_->prefetch_prefix(sequence.id, sequence.tokens);
    }
  }
}

void Engine::record_step_cost(const SchedulePlan& plan, std::chrono::steady_clock::time_point step_start) {
  int64_t decoding = 0, decode_rows = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.decodes()) continue;
    ++decoding;
    decode_rows += chunk.num_rows();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
  prefill_budget_->record(decoding, plan.num_tokens - decode_rows, seconds);
}

void Engine::record_prefill_cost(const SchedulePlan& plan, std::chrono::steady_clock::time_point step_start) {
  // Only steps made mostly of prefill chunks tell the cost of recomputing a token.
  int64_t prefill = 0;
  for (const ScheduledChunk& chunk : plan.chunks)
    if (!chunk.decodes()) prefill += chunk.num_new;
  constexpr int64_t kMinPrefillTokens = 32;
  if (prefill < kMinPrefillTokens || 2 * prefill < plan.num_tokens) return;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
  PreemptionCosts costs = scheduler_.preemption_costs();
  const double per_token = seconds / static_cast<double>(plan.num_tokens);
  // An exponential average: steps vary with their batch.
  costs.prefill_seconds_per_token =
      costs.prefill_seconds_per_token > 0 ? 0.8 * costs.prefill_seconds_per_token + 0.2 * per_token : per_token;
  scheduler_.set_preemption_costs(costs);
  cache_->set_recompute_seconds_per_token(costs.prefill_seconds_per_token);
}

SchedulePlan Engine::schedule_step() {
  SchedulePlan plan = scheduler_.schedule(running_, waiting_, *cache_);
  step_scheduled_ = true;
  for (const ScheduledChunk& chunk : plan.chunks) step_sequences_.push_back(chunk.sequence);
  stats_.num_preemptions += static_cast<int64_t>(plan.preempted.size());
  stats_.prefix_cache_queries += plan.prefix_query_tokens;
  stats_.prefix_cache_hits += plan.prefix_hit_tokens;
  stats_.hybrid_state_restores += plan.state_restores;
  if (plan.empty()) {
    METRALE_CHECK(running_.empty() || !waiting_.empty(), "nothing schedulable with {} running", running_.size());
  }
  return plan;
}

StepResult Engine::forward(const SchedulePlan& plan) {
  StepResult result = runner_->execute(plan);
  ++stats_.num_steps;
  if (speculative_) speculative_->track(result);
  faults_.hit(plan.num_draft_rows > 0 ? FaultSite::kVerify : FaultSite::kForward);
  return result;
}

void Engine::advance(const LogitRowUse& use, int64_t kept_rows, int64_t accepted,
                     const std::vector<SampledToken>& emitted) {
  Sequence& sequence = *use.chunk.sequence;
  const int64_t computed_before = sequence.num_computed;
  sequence.num_computed += kept_rows;
  stats_.computed_prompt_tokens +=
      std::max<int64_t>(0, std::min(sequence.num_computed, sequence.num_prompt) - computed_before);
  if (use.chunk.num_drafts > 0) {
    stats_.drafted_tokens += use.chunk.num_drafts;
    stats_.accepted_tokens += accepted;
    speculative_->record_verify(sequence, use.chunk.num_drafts, accepted);
  }
  sequence.clear_drafts();
  // Full blocks become shareable; at a checkpoint point the state after them is kept too (the
  // copy is queued after this step's forward). Accepted drafts are computed tokens: they join the
  // sequence first; rejected drafts never do (their keys lie beyond num_computed and are
  // overwritten later).
  const size_t known_tokens = sequence.tokens.size();
  for (int64_t i = 0; i < accepted; ++i) sequence.tokens.push_back(emitted[static_cast<size_t>(i)].token);
  cache_->cache_full_blocks(sequence.id, sequence.tokens, sequence.num_computed);
  if (cache_->is_checkpoint_position(sequence.num_prompt, sequence.num_computed))
    cache_->checkpoint_state(sequence.id, sequence.num_computed);
  sequence.tokens.resize(known_tokens);
}

void Engine::emit(const LogitRowUse& use, std::vector<SampledToken>& emitted, std::vector<TokenEvent>& events) {
  Sequence& sequence = *use.chunk.sequence;
  if (!use.chunk.samples) return;
  if (sequence.request.max_tokens == 0) {  // scoring only
    finish(sequence, FinishReason::kLength);
    TokenEvent event;
    event.request_id = sequence.id;
    event.finish_reason = FinishReason::kLength;
    events.push_back(std::move(event));
    return;
  }
  // Stop conditions apply to each emitted token in order; the rest are cut.
  for (SampledToken& sampled : emitted) {
    TokenEvent event;
    event.request_id = sequence.id;
    event.sampled = std::move(sampled);
    if (sequence.num_output() == 0) event.prompt_logprobs = std::move(sequence.prompt_logprobs);
    sequence.tokens.push_back(event.sampled.token);
    ++stats_.generated_tokens;
    const auto reason = stop_reason(sequence, event.sampled.token);
    if (reason) {
      finish(sequence, *reason);
      event.finish_reason = *reason;
    }
    events.push_back(std::move(event));
    if (reason) break;
  }
}

void Engine::abandon_step(const std::string& what, size_t first_step_event, std::vector<TokenEvent>& events) {
  ++stats_.failed_steps;
  sampler_->abandon();  // the mask worker may still hold the step's sequences
  // The requests of the step: those it scheduled, or every running one when it failed before its
  // schedule was made. Those that finished in it before the failure keep their events.
  std::vector<Sequence*> failing = step_scheduled_ ? step_sequences_ : running_;
  step_scheduled_ = false;
  step_sequences_.clear();
  failing.erase(std::remove_if(failing.begin(), failing.end(), [](const Sequence* s) { return s->finished(); }),
                failing.end());
  METRALE_LOG_ERROR("a step failed ({}): its {} requests fail; the engine keeps serving", what, failing.size());
  const std::string message = fmt::format("the engine failed while running this request: {}", what);
  try {
    faults_.hit(FaultSite::kRecover);
    // Nothing the step queued may still run when the next step refills the buffers, and nothing it
    // left pending (a commit, an MTP chain) may outlive it.
    runner_->abandon();
    if (speculative_) speculative_->abandon();
    // The failing requests' events of this step are dropped: they end with the error instead.
    const auto failed = [&](const TokenEvent& event) {
      return std::any_of(failing.begin(), failing.end(), [&](const Sequence* s) { return s->id == event.request_id; });
    };
    events.erase(std::remove_if(events.begin() + static_cast<std::ptrdiff_t>(first_step_event), events.end(), failed),
                 events.end());
    for (Sequence* sequence : failing) fail_request(*sequence, message, events);
    // A failure inside the schedule may have taken a sequence out of both queues: it fails too.
    std::vector<Sequence*> lost;
    for (auto& [id, owned] : sequences_) {
      Sequence* sequence = owned.get();
      const bool queued = std::find(running_.begin(), running_.end(), sequence) != running_.end() ||
                          std::find(waiting_.begin(), waiting_.end(), sequence) != waiting_.end();
      if (!sequence->finished() && !queued) lost.push_back(sequence);
    }
    for (Sequence* sequence : lost) fail_request(*sequence, message, events);
    // Sequences that finished in the step before it failed leave the running set as they would have.
    running_.erase(std::remove_if(running_.begin(), running_.end(), [](const Sequence* s) { return s->finished(); }),
                   running_.end());
    cache_->check_integrity();
  } catch (const std::exception& e) {
    health_.serving = false;
    health_.reason = fmt::format("recovering from a failed step failed: {} (the step failed with: {})", e.what(), what);
    METRALE_LOG_ERROR("the engine can no longer serve: {}", health_.reason);
    fail_unfinished(events);
  }
}

void Engine::fail_request(Sequence& sequence, const std::string& message, std::vector<TokenEvent>& events) {
  running_.erase(std::remove(running_.begin(), running_.end(), &sequence), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &sequence), waiting_.end());
  sequence.error = message;
  ++stats_.failed_requests;
  TokenEvent event;
  event.request_id = sequence.id;
  event.finish_reason = FinishReason::kError;
  event.error = message;
  events.push_back(std::move(event));
  finish(sequence, FinishReason::kError);
}

void Engine::fail_unfinished(std::vector<TokenEvent>& events) {
  const std::string message = fmt::format("the engine can no longer serve: {}", health_.reason);
  std::vector<Sequence*> unfinished;
  for (auto& [id, sequence] : sequences_)
    if (!sequence->finished()) unfinished.push_back(sequence.get());
  for (Sequence* sequence : unfinished) {
    try {
      fail_request(*sequence, message, events);
    } catch (const std::exception& e) {
      // The cache is past saving; the request ends all the same.
      sequence->status = SequenceStatus::kFinished;
      sequence->finish_reason = FinishReason::kError;
      METRALE_LOG_ERROR("freeing request {}: {}", sequence->id, e.what());
    }
  }
  running_.clear();
  waiting_.clear();
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
