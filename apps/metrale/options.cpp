#include "options.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/strings.h"
#include "core/log.h"
#include "core/startup.h"
#include "engine/tensor_parallel_model.h"
#include "model/registry.h"
#include "runtime/device_hooks.h"
#include "runtime/thread_pool.h"

namespace metrale::cli {

std::filesystem::path default_model_dir() {
  if (const char* env = std::getenv("METRALE_DEFAULT_MODEL"); env != nullptr && *env != '\0') return env;
  // The trained demo model (a small qwen3_5 hybrid, tools/demo_model); models/default is the tiny
  // random Qwen3 over the real Qwen3 tokenizer that tests use.
  return std::filesystem::path(METRALE_SOURCE_DIR) / "models" / "demo";
}

std::optional<DType> compute_dtype(const EngineOptions& options) {
  if (options.dtype == "auto") return std::nullopt;
  if (options.dtype == "bfloat16") return DType::kBF16;
  if (options.dtype == "float32") return DType::kF32;
  raise(ErrorCode::kInvalidArgument, "--dtype {}: expected auto, bfloat16 or float32", options.dtype);
}

KvCacheOptions kv_cache_options(const EngineOptions& options) {
  return KvCacheOptions{parse_kv_cache_dtype(options.kv_cache_dtype), options.calculate_kv_scales};
}

LoadOptions load_options(const EngineOptions& options) {
  return LoadOptions{options.allow_unused_weights, parse_weight_quantization(options.quantization),
                     compute_dtype(options), options.load_threads, kv_cache_options(options)};
}

void add_model_option(CLI::App& command, EngineOptions& options) {
  command.add_option("--model,-m", options.model,
                     "Hugging Face model directory (default: the bundled demo model, models/demo)");
}

void add_device_options(CLI::App& command, EngineOptions& options) {
  command
      .add_option("--load-threads", options.load_threads,
                  "threads that read the checkpoint into memory while the model is built (0: one per hardware "
                  "thread, at most 32)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  command.add_flag("--allow-unused-weights", options.allow_unused_weights,
                   "load a checkpoint whose tensors the model does not all read (a warning instead of an error)");
  command
      .add_option("--quantization", options.quantization,
                  "fp8: quantise the projection weights (attention, MLA, GDN, KDA, QSA, dense MLP, MoE experts) "
                  "to FP8 (e4m3, 128x128 block scales) at load, or generate them in FP8 with --random-weights; "
                  "none: as stored (a checkpoint declaring fp8 loads in FP8 either way)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "fp8"}));
  command
      .add_option("--dtype", options.dtype,
                  "activation dtype: auto (float32 on the CPU, bfloat16 on the GPU), bfloat16, or float32 (on the "
                  "GPU: weights converted to float32 at load and the whole forward in float32, for exact "
                  "comparisons; slower, twice the weight memory). The CPU computes in float32 only")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "bfloat16", "float32"}));
  command.add_option("--kv-cache-dtype", options.kv_cache_dtype,
                     "dtype of the attention layers' KV cache: auto (the activation dtype: bf16 on a GPU, fp32 on "
                     "the CPU), bf16, fp32, or fp8 (= fp8_e4m3: e4m3 keys and values with per-layer, per-head "
                     "scales, half the bytes of bf16; MLA latents and QSA attention stay in the activation dtype)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "bf16", "fp32", "fp8", "fp8_e4m3"}));
  command.add_flag("--calculate-kv-scales", options.calculate_kv_scales,
                   "FP8 KV cache: calibrate the per-head scales on the keys and values of the first step served, "
                   "then freeze them (logged); default: the checkpoint's k_scale / v_scale, else 1.0");
  command.add_option("--device", options.device, "cpu, cuda or cuda:N (default: the GPU when present, else cpu)");
  command.add_option("--tensor-parallel-size,--tp", options.tensor_parallel_size,
                     "tensor-parallel ranks, threads of this process: attention, linear-attention and expert heads, "
                     "MLP units and the LM head split over N GPUs from --device on (NCCL), or over N CPU threads")
      ->capture_default_str()->check(CLI::Range(1, 64));
  command.add_option("--threads", options.threads, "CPU threads (default: all cores; at most 4 per core)")
      ->check(CLI::Range(0, ThreadPool::kMaxThreads));
}

void add_engine_options(CLI::App& command, EngineOptions& options) {
  add_device_options(command, options);
  command.add_option("--block-size", options.block_size, "tokens per KV-cache block")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  command.add_option("--max-num-seqs", options.max_num_seqs, "sequences per step at most")
      ->capture_default_str()->check(CLI::Range(1, 65536));
  command.add_option("--max-num-batched-tokens", options.max_num_batched_tokens, "tokens per step at most")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  command.add_option("--max-mixed-step-ratio", options.max_mixed_step_ratio,
                     "a step that carries decode rows takes at most this many times a decode-only step (measured); "
                     "its prefill chunks are cut to fit (0: off)")
      ->check(CLI::Range(0.0, 1e6));
  command.add_option("--max-model-len", options.max_model_len,
                     "context length (default and upper bound: the model's max_position_embeddings)")
      ->check(CLI::NonNegativeNumber);
  command.add_option("--kv-cache-memory", options.kv_cache_memory, "CPU: memory for the KV cache, e.g. 512MiB, 4GiB")
      ->capture_default_str();
  command.add_option("--gpu-memory-utilization", options.gpu_memory_utilization,
                     "GPU: share of device memory for weights, workspace, graphs and KV cache")
      ->capture_default_str()->check(CLI::Range(0.05, 1.0));
  command
      .add_option("--swap-space", options.swap_space_gib,
                  "GiB of host memory (pinned on a GPU) that preempted sequences' KV blocks and recurrent state "
                  "are swapped to instead of being recomputed, and that evicted prefix-cache blocks and state "
                  "checkpoints are kept in (default 0: recompute)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  command.add_option("--high-speed-swap", options.high_speed_swap,
                     "directory on a local disk for the blocks and state slots the host tier (--swap-space) spills, "
                     "least recently used first (needs --swap-disk-space)");
  command
      .add_option("--preemption-mode", options.preemption_mode,
                  "how a preempted sequence comes back: auto (swap when moving its cache to the host and back is "
                  "cheaper than recomputing it, by measured costs), swap (whenever the host tier has room), "
                  "recompute")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "swap", "recompute"}));
  command
      .add_option("--swap-disk-space", options.swap_disk_space_gib,
                  "GiB of disk the --high-speed-swap directory may hold")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e7));
  command.add_flag("--no-cuda-graphs", options.no_cuda_graphs, "GPU: run decode steps without CUDA graphs");
  command.add_flag("--enable-prefix-caching,!--no-prefix-caching", options.enable_prefix_caching,
                   "reuse the cached KV blocks (and recurrent state) of shared prompt prefixes (default: on)");
  command.add_option("--state-checkpoint-interval", options.state_checkpoint_interval,
                     "hybrid models: tokens between recurrent-state checkpoints during prefill, a multiple of "
                     "--block-size (default: 512 rounded up to one)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  command.add_option("--state-checkpoint-slots", options.state_checkpoint_slots,
                     "hybrid models: recurrent-state checkpoint slots for the prefix cache (default: --max-num-seqs)")
      ->check(CLI::Range(0, 1 << 20));
  command.add_option("--speculative-method", options.speculative_method,
                     "speculative decoding: none, ngram (prompt lookup) or mtp (the checkpoint's MTP head)")
      ->capture_default_str()->check(CLI::IsMember({"none", "ngram", "mtp"}));
  command.add_option("--num-drafts", options.num_drafts, "speculative decoding: draft tokens per step at most")
      ->capture_default_str()->check(CLI::Range(1, 15));
  command.add_option("--ngram-min", options.ngram_min, "n-gram speculation: shortest suffix matched")
      ->capture_default_str()->check(CLI::Range(1, 64));
  command.add_option("--ngram-max", options.ngram_max, "n-gram speculation: longest suffix matched")
      ->capture_default_str()->check(CLI::Range(1, 64));
  command.add_flag("--no-adaptive-speculation", options.no_adaptive_speculation,
                   "speculative decoding: always verify --num-drafts drafts (default: fewer or none when they would not pay)");
}

uint64_t parse_byte_size(const std::string& text, const std::string& what) {
  size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    raise(ErrorCode::kInvalidArgument, "{}: '{}' is not a size", what, text);
  }
  std::string unit = text.substr(end);
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KiB" || unit == "KB") scale = 1024.0;
  else if (unit == "M" || unit == "MiB" || unit == "MB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB" || unit == "GB") scale = 1024.0 * 1024 * 1024;
  else raise(ErrorCode::kInvalidArgument, "{}: unknown unit '{}' in '{}'", what, unit, text);
  if (!(value > 0) || !std::isfinite(value)) raise(ErrorCode::kInvalidArgument, "{}: '{}' must be positive", what, text);
  // A double converts to uint64 only below 2^64; sizes beyond 2^62 bytes are nonsense anyway.
  if (value * scale >= 0x1p62) raise(ErrorCode::kInvalidArgument, "{}: '{}' is too large", what, text);
  return static_cast<uint64_t>(value * scale);
}

void add_sampling_options(CLI::App& command, SamplingParams& sampling) {
  command.add_option("--temperature,-t", sampling.temperature, "sampling temperature (0: greedy)")->capture_default_str();
  command.add_option("--top-p", sampling.top_p, "nucleus sampling mass")->capture_default_str();
  command.add_option("--top-k", sampling.top_k, "keep the k most likely tokens (0: off)")->capture_default_str();
  command.add_option("--min-p", sampling.min_p, "drop tokens below min-p x the top probability")->capture_default_str();
  command.add_option("--repetition-penalty", sampling.repetition_penalty)->capture_default_str();
  command.add_option("--presence-penalty", sampling.presence_penalty)->capture_default_str();
  command.add_option("--frequency-penalty", sampling.frequency_penalty)->capture_default_str();
}

SamplingParams sampling_from_flags(const CLI::App& command, const SamplingParams& flags,
                                   const std::filesystem::path& model_dir) {
  // Flags the user did not give take the model's generation_config.json defaults, as the model's
  // authors intend (vLLM's --generation-config auto).
  SamplingParams sampling = load_generation_defaults(model_dir);
  const auto given = [&](const char* flag) { return command.count(flag) > 0; };
  if (given("--temperature")) sampling.temperature = flags.temperature;
  if (given("--top-p")) sampling.top_p = flags.top_p;
  if (given("--top-k")) sampling.top_k = flags.top_k;
  if (given("--min-p")) sampling.min_p = flags.min_p;
  if (given("--repetition-penalty")) sampling.repetition_penalty = flags.repetition_penalty;
  if (given("--presence-penalty")) sampling.presence_penalty = flags.presence_penalty;
  if (given("--frequency-penalty")) sampling.frequency_penalty = flags.frequency_penalty;
  return sampling;
}

SamplingParams load_generation_defaults(const std::filesystem::path& model_dir) {
  SamplingParams params;
  const auto path = model_dir / "generation_config.json";
  if (!std::filesystem::exists(path)) return params;
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCode::kBadFormat, "{}: invalid JSON: {}", path.string(), e.what());
  }
  const auto number = [&](const char* key, auto& field) {
    if (config.contains(key) && config[key].is_number()) field = config[key].get<std::decay_t<decltype(field)>>();
  };
  number("temperature", params.temperature);
  number("top_p", params.top_p);
  number("top_k", params.top_k);
  number("min_p", params.min_p);
  number("repetition_penalty", params.repetition_penalty);
  if (config.value("do_sample", true) == false) params.temperature = 0.0f;
  return params;
}

std::filesystem::path resolve_model_dir(const EngineOptions& options) {
  const std::filesystem::path dir = options.model.empty() ? default_model_dir() : std::filesystem::path(options.model);
  if (!std::filesystem::is_directory(dir)) {
    raise(ErrorCode::kInvalidArgument, "model directory {} does not exist", dir.string());
  }
  return dir;
}

EngineConfig engine_config_from(const EngineOptions& options) {
  EngineConfig config;
  config.block_size = options.block_size;
  config.max_model_len = options.max_model_len;
  config.kv_cache_bytes = parse_byte_size(options.kv_cache_memory, "--kv-cache-memory");
  config.swap_space_bytes = static_cast<uint64_t>(options.swap_space_gib * 1024.0 * 1024.0 * 1024.0);
  config.swap_disk_dir = options.high_speed_swap;
  config.swap_disk_bytes = static_cast<uint64_t>(options.swap_disk_space_gib * 1024.0 * 1024.0 * 1024.0);
  config.scheduler.max_num_seqs = options.max_num_seqs;
  config.scheduler.preemption_mode = options.preemption_mode == "swap"        ? PreemptionMode::kSwap
                                     : options.preemption_mode == "recompute" ? PreemptionMode::kRecompute
                                                                              : PreemptionMode::kAuto;
  config.scheduler.max_num_batched_tokens = options.max_num_batched_tokens;
  config.gpu_memory_utilization = options.gpu_memory_utilization;
  config.cuda_graphs = !options.no_cuda_graphs;
  config.enable_prefix_caching = options.enable_prefix_caching;
  config.state_checkpoint_interval = options.state_checkpoint_interval > 0
                                         ? options.state_checkpoint_interval
                                         : (512 + options.block_size - 1) / options.block_size * options.block_size;
  config.state_checkpoint_slots = options.state_checkpoint_slots;
  config.speculative.method = parse_speculative_method(options.speculative_method);
  config.speculative.num_drafts = options.num_drafts;
  config.speculative.ngram_min = options.ngram_min;
  config.speculative.ngram_max = options.ngram_max;
  config.speculative.adaptive = !options.no_adaptive_speculation;
  config.max_mixed_step_ratio = options.max_mixed_step_ratio;
  config.speculative.replay_accept_rate = options.spec_accept_rate;
  return config;
}

std::vector<TokenEvent> step_or_throw(Engine& engine) {
  std::vector<TokenEvent> events = engine.step();
  for (const TokenEvent& event : events) {
    if (event.finish_reason == FinishReason::kError) raise(ErrorCode::kInternal, "{}", event.error);
  }
  return events;
}

void apply_cpu_threads(const EngineOptions& options) {
  const int cpus = machine_cpu_count();
  if (options.threads > 4 * cpus) {
    raise(ErrorCode::kInvalidArgument, "--threads {}: this machine has {} CPUs; use at most {} threads", options.threads,
          cpus, 4 * cpus);
  }
  if (options.threads > 0) set_cpu_threads(options.threads);
}

std::vector<Device> rank_devices(const EngineOptions& options) {
  const Device first = chosen_device(options);
  std::vector<Device> devices;
  for (int r = 0; r < options.tensor_parallel_size; ++r)
    devices.push_back(first.is_cpu() ? Device::cpu() : Device::cuda(first.index + r));
  if (first.is_cuda() && (cuda_hooks() == nullptr || devices.back().index >= cuda_hooks()->device_count())) {
    raise(ErrorCode::kInvalidArgument, "--tensor-parallel-size {} from {}: there is no {}",
          options.tensor_parallel_size, first.to_string(), devices.back().to_string());
  }
  return devices;
}

std::unique_ptr<Model> load_engine_model(const EngineOptions& options, const std::filesystem::path& dir) {
  if (options.tensor_parallel_size > 1) return TensorParallelModel::load(dir, rank_devices(options), load_options(options));
  return load_model(dir, chosen_device(options), load_options(options));
}

std::unique_ptr<Model> random_engine_model(const EngineOptions& options, const ModelConfig& config) {
  if (options.tensor_parallel_size > 1)
    return TensorParallelModel::random(config, rank_devices(options), 1, load_options(options));
  return make_random_model(config, chosen_device(options), 1, load_options(options));
}

Device chosen_device(const EngineOptions& options) {
  const Device device = options.device.empty() ? default_device() : parse_device(options.device);
  if (device.is_cuda() && !cuda_available()) {
    raise(ErrorCode::kInvalidArgument, "--device {}: no CUDA device is available in this build or machine",
          options.device);
  }
  return device;
}

void check_engine_options(const EngineOptions& options, const ModelConfig& config) {
  if (options.max_model_len > config.max_position_embeddings) {
    raise(ErrorCode::kInvalidArgument,
          "--max-model-len {} is beyond the {} positions of the model (max_position_embeddings in {})",
          options.max_model_len, config.max_position_embeddings, config.source.string());
  }
  if (options.state_checkpoint_interval > 0 && options.state_checkpoint_interval % options.block_size != 0) {
    raise(ErrorCode::kInvalidArgument,
          "--state-checkpoint-interval {} is not a multiple of --block-size {} (checkpoints are taken at block "
          "boundaries)",
          options.state_checkpoint_interval, options.block_size);
  }
  if (options.ngram_min > options.ngram_max) {
    raise(ErrorCode::kInvalidArgument, "--ngram-min {} is above --ngram-max {}", options.ngram_min, options.ngram_max);
  }
}

std::unique_ptr<Engine> make_engine_for(std::unique_ptr<Model> model, const EngineOptions& options,
                                        int max_prefill_chunk) {
  check_engine_options(options, model->config());
  EngineConfig config = engine_config_from(options);
  config.scheduler.max_prefill_chunk = max_prefill_chunk;
  report_startup("engine_start", "planning memory and building the engine");
  const auto started = std::chrono::steady_clock::now();
  auto engine = std::make_unique<Engine>(std::move(model), config);
  const EnginePlan& plan = engine->plan();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  report_startup("engine_done", fmt::format("engine ready in {:.1f} s: {}", seconds, plan.describe()),
                 {{"seconds", seconds},
                  {"max_model_len", plan.max_model_len},
                  {"max_num_seqs", static_cast<int64_t>(plan.max_num_seqs)},
                  {"num_kv_blocks", static_cast<int64_t>(plan.num_kv_blocks)},
                  {"block_size", static_cast<int64_t>(plan.block_size)},
                  {"kv_cache_bytes", static_cast<int64_t>(plan.kv_cache_bytes)},
                  {"num_state_slots", static_cast<int64_t>(plan.num_state_slots)},
                  {"prefix_caching", plan.prefix_caching},
                  {"cuda_graph_batch_sizes", static_cast<int64_t>(plan.graph_batch_sizes.size())}});
  return engine;
}

std::unique_ptr<Engine> make_engine(const EngineOptions& options, int max_prefill_chunk) {
  apply_cpu_threads(options);
  rank_devices(options);         // --device and --tensor-parallel-size name devices that exist
  engine_config_from(options);  // the flags' own errors (sizes) before the model loads
  const std::filesystem::path dir = resolve_model_dir(options);
  check_engine_options(options, load_model_config(dir));  // before the weights load
  return make_engine_for(load_engine_model(options, dir), options, max_prefill_chunk);
}

std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what, int64_t vocab_size) {
  std::vector<int32_t> ids;
  for (const int64_t id : parse_int_list(text, what)) {
    const int64_t limit = vocab_size > 0 ? vocab_size : int64_t{std::numeric_limits<int32_t>::max()} + 1;
    if (id < 0 || id >= limit) {
      if (vocab_size > 0)
        raise(ErrorCode::kInvalidArgument, "{}: token id {} is outside the vocabulary [0, {})", what, id, vocab_size);
      raise(ErrorCode::kInvalidArgument, "{}: token id {} is out of range", what, id);
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace metrale::cli
