// Options shared by the subcommands that load a model: where it is, where it runs, and how the
// engine is sized.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/engine.h"
#include "model/config.h"
#include "model/model.h"
#include "model/registry.h"

namespace metrale::cli {

struct EngineOptions {
  std::string model;                  // directory; empty: the bundled default model
  std::string device;                 // "cpu", "cuda", "cuda:N"; empty: GPU when present
  bool allow_unused_weights = false;  // checkpoint tensors the model does not read: a warning, not an error
  std::string quantization = "none";  // none | fp8: quantise the dense projection weights to FP8 at load
  std::string dtype = "auto";         // auto | bfloat16 | float32: activations (LoadOptions::compute_dtype)
  std::string kv_cache_dtype = "auto";  // auto | bf16 | fp32 | fp8 (fp8_e4m3): the attention KV cache's dtype
  bool calculate_kv_scales = false;     // FP8 KV cache: calibrate the scales on the first step served
  int threads = 0;                    // CPU threads; 0: all cores
  int tensor_parallel_size = 1;       // ranks (engine/tensor_parallel_model.h): CPU threads or GPUs
  int block_size = 16;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int64_t max_model_len = 0;
  double max_mixed_step_ratio = 0.0;  // engine/prefill_budget.h; 0: off
  std::string kv_cache_memory = "2GiB";   // CPU KV-cache budget
  double gpu_memory_utilization = 0.90;   // GPU: share of device memory for weights, workspace, graphs, cache
  double swap_space_gib = 0.0;            // host tier for preempted sequences' KV blocks and state slots; 0: none
  std::string high_speed_swap;            // disk tier directory; empty: none
  double swap_disk_space_gib = 0.0;       // disk tier bound
  std::string preemption_mode = "auto";   // auto | swap | recompute
  int32_t load_threads = 0;               // checkpoint reader threads; 0: hardware concurrency
  bool no_cuda_graphs = false;
  bool enable_prefix_caching = true;
  // Hybrid models: tokens between prefill state checkpoints, a multiple of block_size; 0: 512
  // rounded up to a multiple of block_size.
  int64_t state_checkpoint_interval = 0;
  int state_checkpoint_slots = -1;          // hybrid models: checkpoint slots; -1: --max-num-seqs
  // Speculative decoding (engine/speculator.h).
  std::string speculative_method = "none";  // none | ngram | mtp
  int num_drafts = 3;
  int ngram_min = 1;
  int ngram_max = 4;
  bool no_adaptive_speculation = false;     // verify num_drafts every step whatever it costs
  double spec_accept_rate = -1.0;           // bench only: replayed acceptance (< 0: off)
};

// The EngineConfig the flags describe (limits, memory, graphs); the scheduler's chunk cap aside.
EngineConfig engine_config_from(const EngineOptions& options);

// The bundled default model: $METRALE_DEFAULT_MODEL, else models/demo of the source tree the
// binary was built from.
std::filesystem::path default_model_dir();

// `--model` and the engine flags. `model_required`: whether --model may be omitted.
void add_model_option(CLI::App& command, EngineOptions& options);
void add_engine_options(CLI::App& command, EngineOptions& options);
// The sampling flags (--temperature, --top-p, --top-k, --min-p and the three penalties) into `sampling`.
void add_sampling_options(CLI::App& command, SamplingParams& sampling);
// The model's generation_config.json defaults, overridden by the sampling flags the user gave.
SamplingParams sampling_from_flags(const CLI::App& command, const SamplingParams& flags,
                                   const std::filesystem::path& model_dir);
// Only --device and --threads (commands that load no model accept them too).
void add_device_options(CLI::App& command, EngineOptions& options);

std::filesystem::path resolve_model_dir(const EngineOptions& options);
// The load options the flags ask for (--allow-unused-weights, --quantization, --dtype,
// --load-threads, --kv-cache-dtype, --calculate-kv-scales).
LoadOptions load_options(const EngineOptions& options);
// --dtype as LoadOptions::compute_dtype: nullopt for auto (the device's default).
std::optional<DType> compute_dtype(const EngineOptions& options);
KvCacheOptions kv_cache_options(const EngineOptions& options);
// Loads the model and builds the engine; `scheduler` overrides are applied on top of the flags.
// The flags are checked against the model first (check_engine_options).
std::unique_ptr<Engine> make_engine(const EngineOptions& options, int max_prefill_chunk = 0);
// An engine on `model` (loaded or random) with the flags checked against it.
std::unique_ptr<Engine> make_engine_for(std::unique_ptr<Model> model, const EngineOptions& options,
                                        int max_prefill_chunk = 0);

// The flags against each other and against the model: --max-model-len within the model's
// max_position_embeddings, a --state-checkpoint-interval given a multiple of --block-size,
// --ngram-min <= --ngram-max. Throws kInvalidArgument (exit code 2) naming the flags.
void check_engine_options(const EngineOptions& options, const ModelConfig& config);
// Sets the CPU thread pool from --threads (0: every CPU); more than 4 threads per CPU of the
// machine is a usage error.
void apply_cpu_threads(const EngineOptions& options);
// The device --device names (default: the GPU when present), or kInvalidArgument when it cannot run.
Device chosen_device(const EngineOptions& options);
// --tensor-parallel-size N: the ranks' devices, rank r on the r-th: N CPU ranks (threads) on the CPU,
// or the N GPUs from the chosen one on (cuda:i .. cuda:i+N-1). One device without the flag.
std::vector<Device> rank_devices(const EngineOptions& options);
// The model of `dir` (or, from random weights, of `config`) on the chosen device, or split over
// rank_devices() when --tensor-parallel-size is above 1 (engine/tensor_parallel_model.h).
std::unique_ptr<Model> load_engine_model(const EngineOptions& options, const std::filesystem::path& dir);
std::unique_ptr<Model> random_engine_model(const EngineOptions& options, const ModelConfig& config);

// Parses a comma-separated list of token ids, each in [0, vocab_size) (vocab_size 0: only
// non-negative and within int32); throws kInvalidArgument naming `what` and the id.
std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what, int64_t vocab_size);

// One engine step for the commands that drive the engine themselves: a request the step failed
// (FinishReason::kError, see Engine::step) ends the command with that error, as it would have
// without containment.
std::vector<TokenEvent> step_or_throw(Engine& engine);

// Sampling defaults from <dir>/generation_config.json (temperature, top_p, top_k, min_p,
// repetition_penalty; do_sample false means greedy); library defaults where absent.
SamplingParams load_generation_defaults(const std::filesystem::path& model_dir);

// Parses "512MiB", "2GiB", "1.5G", "1048576" into bytes; throws kInvalidArgument.
uint64_t parse_byte_size(const std::string& text, const std::string& what);

}  // namespace metrale::cli
