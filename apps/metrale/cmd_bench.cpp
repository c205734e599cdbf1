// metrale bench: measures the device's ceilings (copy bandwidth, bf16 GEMM rate) and then the
// model's decode step time and prefill throughput in the same run, each as a fraction of the
// roofline (bytes that must be read / time / measured bandwidth; FLOPs / time / measured GEMM rate).
// Runs on a checkpoint (--model) or on a preset with weights generated on the device
// (--config configs/<preset>.json --random-weights). Decode rows see a cached context of the
// requested length whose contents are arbitrary: the speed does not depend on them.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "core/strings.h"
#include "cost_model.h"
#include "engine/step_sampler.h"
#include "kernels/linear.h"
#include "kernels/random_fill.h"
#include "model/registry.h"
#include "options.h"
#include "runtime/stream.h"
#include "runtime/thread_pool.h"
#if METRALE_WITH_CUDA
#include <cuda_profiler_api.h>

#include "runtime/cuda/cuda_graph.h"
#endif

namespace metrale::cli {
namespace {

struct BenchOptions {
  EngineOptions engine;
  std::string config;
  bool random_weights = false;
  std::string batches = "1,8,32,128";
  int64_t context = 1024;
  std::string prefills = "512,2048,8192";
  int warmup = 3;
  int iters = 20;
  bool json = false;
  int64_t spec_tokens = 128;  // speculative decode: tokens generated per sequence
  int64_t spec_prompt = 64;   // speculative decode: prompt tokens per sequence
  int spec_repeat = 1;        // speculative decode: runs of each mode per batch size (medians reported)
  int spec_warmup = 1;        // speculative decode: untimed runs of each mode per batch size first
  bool sampled = false;       // decode rows also timed with every row sampled (Qwen3's defaults)
};

// Times work on one device: CUDA events on the GPU, the steady clock on the CPU.
class DeviceTimer {
 public:
  explicit DeviceTimer(Device device) : device_(device) {
#if METRALE_WITH_CUDA
    // Events only on a GPU: a CUDA build timing the CPU may run where no driver is installed.
    if (device_.is_cuda()) {
      begin_.emplace();
      end_.emplace();
    }
#endif
  }
  void start() {
#if METRALE_WITH_CUDA
    if (device_.is_cuda()) {
      begin_->record(static_cast<cudaStream_t>(current_stream(device_)));
      return;
    }
#endif
    host_begin_ = std::chrono::steady_clock::now();
  }
  double stop_ms() {
#if METRALE_WITH_CUDA
    if (device_.is_cuda()) {
      end_->record(static_cast<cudaStream_t>(current_stream(device_)));
      end_->synchronize();
      return end_->elapsed_ms_since(*begin_);
    }
#endif
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_begin_).count();
  }

 private:
  Device device_;
#if METRALE_WITH_CUDA
  std::optional<CudaEvent> begin_, end_;
#endif
  std::chrono::steady_clock::time_point host_begin_;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

// Device-to-device copy of a large buffer: bytes read plus bytes written over time.
double measure_copy_bandwidth(Device device) {
  const size_t bytes = device.is_cuda() ? (2ull << 30) : (256ull << 20);
  Buffer src(device, bytes), dst(device, bytes);
  kernels::random_fill(Tensor(src.data(), DType::kF32, {static_cast<int64_t>(bytes / 4)}, device), {1, 0.0f, 1.0f});
  DeviceTimer timer(device);
  std::vector<double> times;
  for (int i = 0; i < 8; ++i) {
    timer.start();
    copy_bytes_async(dst.data(), device, src.data(), device, bytes);
    const double ms = timer.stop_ms();
    if (i >= 2) times.push_back(ms);
  }
  return 2.0 * static_cast<double>(bytes) / (median(times) * 1e-3);
}

// A large bf16 GEMM through the engine's own linear op, on random data (never zeros).
double measure_gemm_rate(Device device) {
  const int64_t n = device.is_cuda() ? 8192 : 512;
  const DType dtype = device.is_cuda() ? DType::kBF16 : DType::kF32;
  OwnedTensor a(dtype, {n, n}, device), b(dtype, {n, n}, device), c(dtype, {n, n}, device);
  kernels::random_fill(a.tensor, {2, 0.0f, 1.0f});
  kernels::random_fill(b.tensor, {3, 0.0f, 1.0f});
  DeviceTimer timer(device);
  std::vector<double> times;
  for (int i = 0; i < 8; ++i) {
    timer.start();
    kernels::linear(a.tensor, b.tensor, c.tensor);
    const double ms = timer.stop_ms();
    if (i >= 2) times.push_back(ms);
  }
  return 2.0 * static_cast<double>(n * n) * static_cast<double>(n) / (median(times) * 1e-3);
}

struct Row {
  std::string name;
  int64_t batch = 0, tokens = 0, context = 0;
  double step_ms = 0, tokens_per_s = 0, bytes = 0, flops = 0, bandwidth_fraction = 0, compute_fraction = 0;
  double sampled_step_ms = 0;  // --sampled: the step with its tokens sampled (0: not measured)
  bool graph = false;
};

// The sampling parameters of --sampled decode rows: Qwen3's generation_config.json defaults.
SamplingParams bench_sampling() {
  SamplingParams params;
  params.temperature = 0.6f;
  params.top_k = 20;
  params.top_p = 0.95f;
  params.seed = 1;
  return params;
}

// Decode: `batch` sequences with `context` cached tokens each add one token per step, the forward
// alone (the requests' sampling left at its defaults, so these rows time what they always did).
// With `sampler`, the same steps again, each followed by sampling every row at bench_sampling()'s
// parameters as Engine::step does (on the device when it can), timed through the tokens' arrival
// on the host.
Row bench_decode(Engine& engine, const CostModel& cost, const BenchOptions& options, int64_t batch, bool profile,
                 StepSampler* sampler) {
  const ModelConfig& config = engine.model().config();
  CacheManager& cache = engine.mutable_cache();
  Runner& runner = engine.runner();
  DeviceTimer timer(engine.model().device());
  std::vector<std::unique_ptr<Sequence>> sequences;
  SchedulePlan plan;
  for (int64_t s = 0; s < batch; ++s) {
    auto sequence = std::make_unique<Sequence>();
    sequence->id = 1'000'000 + s;
    sequence->tokens.assign(static_cast<size_t>(options.context + 1), static_cast<int32_t>((s * 7919) % config.vocab_size));
    sequence->num_prompt = options.context + 1;
    sequence->num_computed = options.context;
    if (!cache.reserve(sequence->id, options.context + 1)) {
      raise(ErrorCode::kOutOfMemory, "the KV cache cannot hold {} sequences of {} tokens", batch, options.context + 1);
    }
    plan.chunks.push_back({sequence.get(), 1, true});
    plan.num_tokens += 1;
    sequences.push_back(std::move(sequence));
  }
  std::vector<double> times, sampled_times;
  bool graph = false;
  for (int i = 0; i < options.warmup + options.iters; ++i) {
#if METRALE_WITH_CUDA
    if (profile && i == options.warmup) cudaProfilerStart();
#endif
    timer.start();
    graph = runner.execute(plan).used_graph;
    const double ms = timer.stop_ms();
#if METRALE_WITH_CUDA
    if (profile && i == options.warmup) cudaProfilerStop();
#else
    (void)profile;
#endif
    if (i >= options.warmup) times.push_back(ms);
  }
  if (sampler != nullptr) {
    for (const auto& sequence : sequences) sequence->request.sampling = bench_sampling();
    for (int i = 0; i < options.warmup + options.iters; ++i) {
      timer.start();
      StepResult result = runner.execute(plan);
      sampler->begin_step(plan);
      (void)sampler->sample(plan, result, runner);
      const double ms = timer.stop_ms();
      if (i >= options.warmup) sampled_times.push_back(ms);
    }
  }
  for (const auto& sequence : sequences) cache.free_sequence(sequence->id);
  Row row;
  row.name = "decode";
  row.batch = batch;
  row.tokens = batch;
  row.context = options.context;
  row.step_ms = median(times);
  row.sampled_step_ms = sampled_times.empty() ? 0.0 : median(sampled_times);
  row.graph = graph;
  const StepCost step = cost.decode(batch, options.context);
  row.bytes = step.bytes;
  row.flops = step.flops;
  return row;
}

// End-to-end generation through Engine::step (scheduling, prefill, verify, acceptance, drafting
// included): `batch` greedy requests of spec_prompt tokens each generate spec_tokens, timed from
// the first step to the last. The whole run, not a window after prefill: speculation already emits
// several tokens a step for the sequences that decode while others prefill, so a window starting
// once every prompt is in would hand the two modes different amounts of work.
struct GenerationResult {
  double tokens_per_s = 0, step_ms = 0, acceptance = 0, tokens_per_step = 0;  // tokens: every sequence's
  int64_t steps = 0;
};

// METRALE_PROFILE_DECODE=1: steps [kProfileFirstStep, +kProfileSteps) of each speculative run are
// bracketed by cudaProfilerStart/Stop, for `ncu --profile-from-start off` per-kernel timings.
constexpr int64_t kProfileFirstStep = 48;
constexpr int64_t kProfileSteps = 4;

GenerationResult bench_generation(std::unique_ptr<Model> model, const EngineConfig& config, int64_t batch,
                                  const BenchOptions& options, bool profile = false) {
#if !METRALE_WITH_CUDA
  (void)profile;
#endif
  const int64_t vocab = model->config().vocab_size;
  Engine engine(std::move(model), config);
  const Device device = engine.model().device();
  for (int64_t s = 0; s < batch; ++s) {
    Request request;
    // Each prompt repeats a short phrase of its own (n-gram lookup has something to find, as in
    // code or quoted text); any ids are valid input.
    for (int64_t t = 0; t < options.spec_prompt; ++t)
      request.prompt.push_back(static_cast<int32_t>((s * 7919 + (t % 16) * 104729) % vocab));
    request.max_tokens = static_cast<int32_t>(options.spec_tokens);
    request.ignore_eos = true;
    request.sampling.temperature = 0.0f;
    engine.add_request(std::move(request));
  }
  int64_t generated = 0, steps = 0;
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  while (engine.has_unfinished()) {
#if METRALE_WITH_CUDA
    if (profile && steps == kProfileFirstStep) cudaProfilerStart();
#endif
    generated += static_cast<int64_t>(step_or_throw(engine).size());
    ++steps;
#if METRALE_WITH_CUDA
    if (profile && steps == kProfileFirstStep + kProfileSteps) cudaProfilerStop();
#endif
  }
  synchronize(device);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const EngineStats stats = engine.stats();
  GenerationResult result;
  result.steps = steps;
  result.tokens_per_s = static_cast<double>(generated) / seconds;
  result.step_ms = steps > 0 ? 1e3 * seconds / static_cast<double>(steps) : 0.0;
  const auto drafted = static_cast<double>(stats.drafted_tokens);
  result.acceptance = drafted > 0 ? static_cast<double>(stats.accepted_tokens) / drafted : 0.0;
  result.tokens_per_step = steps > 0 ? static_cast<double>(generated) / static_cast<double>(steps) : 0.0;
  return result;
}

// `bench --speculative-method ...`: decode tokens/s with and without speculation per batch size.
int run_speculative_bench(const BenchOptions& options) {
  const auto batches = parse_int_list(options.batches, "--batch");
  const auto load = [&]() -> std::unique_ptr<Model> {
    if (options.random_weights) {
      const ModelConfig config = parse_model_config(nlohmann::json::parse(read_file(options.config)), options.config);
      return random_engine_model(options.engine, config);
    }
    return load_engine_model(options.engine, resolve_model_dir(options.engine));
  };
  EngineConfig spec_config = engine_config_from(options.engine);
  const int64_t max_batch = batches.empty() ? 1 : *std::max_element(batches.begin(), batches.end());
  spec_config.max_model_len = options.spec_prompt + options.spec_tokens + 32;
  spec_config.scheduler.max_num_seqs = static_cast<int32_t>(max_batch);
  spec_config.scheduler.max_num_batched_tokens =
      static_cast<int32_t>(std::max<int64_t>(spec_config.scheduler.max_num_batched_tokens,
                                             max_batch * (1 + spec_config.speculative.num_drafts)));
  EngineConfig plain_config = spec_config;
  plain_config.speculative = SpeculativeConfig{};
  if (spec_config.speculative.replay_accept_rate >= 0.0) {
    std::cout << fmt::format("BENCHMARK MODE: drafts accepted by a seeded Bernoulli({}), outputs are not the model's\n",
                             spec_config.speculative.replay_accept_rate);
  }
  nlohmann::json results = nlohmann::json::array();
  std::cout << fmt::format(
      "speculative decoding: {} with up to {} drafts{}; prompt {} tokens, {} generated{}\n",
      options.engine.speculative_method, spec_config.speculative.num_drafts,
      spec_config.speculative.adaptive ? " (adaptive)" : "", options.spec_prompt, options.spec_tokens,
      options.spec_repeat > 1 ? fmt::format("; medians of {} runs, paired speedups' range", options.spec_repeat) : "");
  std::cout << fmt::format("{:>6} {:>14} {:>14} {:>9} {:>11} {:>13}\n", "batch", "plain tok/s", "spec tok/s", "speedup",
                           "acceptance", "tok/seq/step");
  const bool profile = std::getenv("METRALE_PROFILE_DECODE") != nullptr;
  // The run with the median throughput of each mode; the modes alternate so that drifts of the
  // machine (clocks, other tenants) reach both alike. Each run starts from a fresh engine.
  const auto median_run = [](std::vector<GenerationResult> runs) {
    std::sort(runs.begin(), runs.end(),
              [](const GenerationResult& a, const GenerationResult& b) { return a.tokens_per_s < b.tokens_per_s; });
    return runs[runs.size() / 2];
  };
  for (const int64_t batch : batches) {
    // Untimed runs first: a process's first steps of a shape choose and load their kernels (several
    // ms), which would otherwise land on whichever mode runs first.
    for (int w = 0; w < options.spec_warmup; ++w) {
      (void)bench_generation(load(), plain_config, batch, options);
      (void)bench_generation(load(), spec_config, batch, options);
    }
    std::vector<GenerationResult> plain_runs, spec_runs;
    for (int r = 0; r < options.spec_repeat; ++r) {
      plain_runs.push_back(bench_generation(load(), plain_config, batch, options));
      spec_runs.push_back(bench_generation(load(), spec_config, batch, options, profile && r == 0));
    }
    std::vector<double> speedups;
    for (size_t r = 0; r < spec_runs.size(); ++r)
      speedups.push_back(spec_runs[r].tokens_per_s / plain_runs[r].tokens_per_s);
    const GenerationResult plain = median_run(plain_runs);
    const GenerationResult spec = median_run(spec_runs);
    const double speedup = spec.tokens_per_s / plain.tokens_per_s;
    const auto [lowest, highest] = std::minmax_element(speedups.begin(), speedups.end());
    std::cout << fmt::format("{:>6} {:>14.1f} {:>14.1f} {:>8.2f}x {:>11.3f} {:>13.2f}{}\n", batch, plain.tokens_per_s,
                             spec.tokens_per_s, speedup, spec.acceptance,
                             spec.tokens_per_step / static_cast<double>(batch),
                             speedups.size() > 1 ? fmt::format("   {:.2f}-{:.2f}x", *lowest, *highest) : "");
    results.push_back({{"batch", batch},
                       {"plain_tokens_per_s", plain.tokens_per_s},
                       {"spec_tokens_per_s", spec.tokens_per_s},
                       {"speedup", speedup},
                       {"acceptance", spec.acceptance},
                       {"plain_step_ms", plain.step_ms},
                       {"spec_step_ms", spec.step_ms},
                       {"runs", options.spec_repeat},
                       {"paired_speedups", speedups}});
  }
  if (options.json) {
    std::cout << nlohmann::json({{"speculative_method", options.engine.speculative_method},
                                 {"num_drafts", spec_config.speculative.num_drafts},
                                 {"replay_accept_rate", spec_config.speculative.replay_accept_rate},
                                 {"results", results}})
                     .dump(2)
              << "\n";
  }
  return kExitOk;
}

int run_bench(const BenchOptions& options) {
  if (options.config.empty() == options.engine.model.empty()) {
    raise(ErrorCode::kInvalidArgument, "give either --model DIR or --config FILE --random-weights");
  }
  if (!options.config.empty() && !options.random_weights) {
    raise(ErrorCode::kInvalidArgument, "--config needs --random-weights (a preset has no weights)");
  }
  apply_cpu_threads(options.engine);
  const Device device = chosen_device(options.engine);
  if (options.engine.speculative_method != "none") return run_speculative_bench(options);
  const auto batches = parse_int_list(options.batches, "--batch");
  const auto prefills = parse_int_list(options.prefills, "--prefill");
  const int64_t max_batch = batches.empty() ? 1 : *std::max_element(batches.begin(), batches.end());
  const int64_t max_prefill = prefills.empty() ? 1 : *std::max_element(prefills.begin(), prefills.end());

  // Ceilings first, before the model takes the memory.
  const double bandwidth = measure_copy_bandwidth(device);
  const double gemm_rate = measure_gemm_rate(device);

  std::unique_ptr<Model> model;
  std::string source;
  if (options.random_weights) {
    const ModelConfig config = parse_model_config(nlohmann::json::parse(read_file(options.config)), options.config);
    const LoadOptions load = load_options(options.engine);
    model = random_engine_model(options.engine, config);
    source = options.config +
             (load.quantization == WeightQuantization::kFp8 ? " (random FP8 weights)" : " (random weights)");
  } else {
    model = load_engine_model(options.engine, resolve_model_dir(options.engine));
    source = options.engine.model;
  }
  const ModelConfig config = model->config();
  // FP8 weights halve the bytes of the mixer and FFN weights in the roofline.
  const bool fp8_weights =
      load_options(options.engine).quantization == WeightQuantization::kFp8 || checkpoint_has_fp8_weights(config);
  const CostModel cost(config, fp8_weights);

  EngineConfig engine_config = engine_config_from(options.engine);
  engine_config.max_model_len = std::max<int64_t>(options.context + options.warmup + options.iters + 2, max_prefill);
  engine_config.scheduler.max_num_seqs = static_cast<int32_t>(max_batch);
  engine_config.scheduler.max_num_batched_tokens = static_cast<int32_t>(std::max(max_prefill, max_batch));
  Engine engine(std::move(model), engine_config);
  CacheManager& cache = engine.mutable_cache();
  Runner& runner = engine.runner();
  DeviceTimer timer(device);
  std::vector<Row> rows;
  std::optional<StepSampler> sampler;
  if (options.sampled) sampler.emplace(SpeculativeConfig{}, config.vocab_size, max_batch);

  for (const int64_t batch : batches) {
    // METRALE_PROFILE_DECODE=1: the first timed step of the first batch size is bracketed by
    // cudaProfilerStart/Stop, for `ncu --profile-from-start off` per-kernel timings.
    const bool profile = std::getenv("METRALE_PROFILE_DECODE") != nullptr && batch == batches.front();
    Row row = bench_decode(engine, cost, options, batch, profile, sampler ? &*sampler : nullptr);
    row.tokens_per_s = static_cast<double>(batch) / (row.step_ms * 1e-3);
    row.bandwidth_fraction = row.bytes / (row.step_ms * 1e-3) / bandwidth;
    row.compute_fraction = row.flops / (row.step_ms * 1e-3) / gemm_rate;
    rows.push_back(row);
  }

  // Prefill: one sequence of `tokens` prompt tokens from an empty cache, in one step.
  for (const int64_t tokens : prefills) {
    std::vector<double> times;
    const int iters = std::max(2, options.iters / 4);
    for (int i = 0; i < options.warmup + iters; ++i) {
      Sequence sequence;
      sequence.id = 2'000'000;
      sequence.tokens.resize(static_cast<size_t>(tokens));
      for (int64_t t = 0; t < tokens; ++t) sequence.tokens[static_cast<size_t>(t)] = static_cast<int32_t>((t * 104729) % config.vocab_size);
      sequence.num_prompt = tokens;
      if (!cache.reserve(sequence.id, tokens)) raise(ErrorCode::kOutOfMemory, "the KV cache cannot hold {} tokens", tokens);
      SchedulePlan plan;
      plan.chunks.push_back({&sequence, tokens, true});
      plan.num_tokens = tokens;
      timer.start();
      runner.execute(plan);
      const double ms = timer.stop_ms();
      if (i >= options.warmup) times.push_back(ms);
      cache.free_sequence(sequence.id);
    }
    Row row;
    row.name = "prefill";
    row.batch = 1;
    row.tokens = tokens;
    row.step_ms = median(times);
    const StepCost step = cost.prefill(tokens);
    row.bytes = step.bytes;
    row.flops = step.flops;
    row.tokens_per_s = static_cast<double>(tokens) / (row.step_ms * 1e-3);
    row.bandwidth_fraction = step.bytes / (row.step_ms * 1e-3) / bandwidth;
    row.compute_fraction = step.flops / (row.step_ms * 1e-3) / gemm_rate;
    rows.push_back(row);
  }

  if (options.json) {
    nlohmann::json out = {{"model", source},
                          {"model_type", config.model_type},
                          {"device", device.to_string()},
                          {"copy_bandwidth_bytes_per_s", bandwidth},
                          {"gemm_flops_per_s", gemm_rate},
                          {"weight_bytes", cost.weight_bytes()},
                          {"plan", engine.plan().describe()},
                          {"results", nlohmann::json::array()}};
    for (const Row& row : rows) {
      out["results"].push_back({{"phase", row.name}, {"batch", row.batch}, {"tokens", row.tokens},
                                {"context", row.context}, {"step_ms", row.step_ms}, {"tokens_per_s", row.tokens_per_s},
                                {"bytes", row.bytes}, {"flops", row.flops}, {"bandwidth_fraction", row.bandwidth_fraction},
                                {"compute_fraction", row.compute_fraction}, {"cuda_graph", row.graph}});
      if (row.sampled_step_ms > 0) out["results"].back()["sampled_step_ms"] = row.sampled_step_ms;
    }
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << fmt::format("model: {} ({}, {:.2f} GB of weights)\n", source, config.model_type, cost.weight_bytes() / 1e9);
  std::cout << fmt::format("device: {}; measured copy bandwidth {:.0f} GB/s, bf16 GEMM {:.0f} TFLOP/s\n",
                           device.to_string(), bandwidth / 1e9, gemm_rate / 1e12);
  std::cout << engine.plan().describe() << "\n\n";
  if (options.sampled) {
    const SamplingParams sampling = bench_sampling();
    std::cout << fmt::format("sampled ms: the decode step with every row sampled (temperature {}, top-k {}, top-p {})\n",
                             sampling.temperature, sampling.top_k, sampling.top_p);
  }
  std::cout << fmt::format("{:<8} {:>6} {:>7} {:>8} {:>10} {:>12} {:>10} {:>10} {:>6}{}\n", "phase", "batch", "tokens",
                           "context", "step ms", "tokens/s", "% HBM", "% GEMM", "graph",
                           options.sampled ? fmt::format(" {:>11}", "sampled ms") : "");
  for (const Row& row : rows) {
    std::cout << fmt::format("{:<8} {:>6} {:>7} {:>8} {:>10.3f} {:>12.1f} {:>9.1f}% {:>9.1f}% {:>6}{}\n", row.name,
                             row.batch, row.tokens, row.context, row.step_ms, row.tokens_per_s,
                             100.0 * row.bandwidth_fraction, 100.0 * row.compute_fraction, row.graph ? "yes" : "no",
                             row.sampled_step_ms > 0 ? fmt::format(" {:>11.3f}", row.sampled_step_ms) : "");
  }
  return kExitOk;
}

}  // namespace

void register_bench(CLI::App& root, Action& action) {
  auto options = std::make_shared<BenchOptions>();
  CLI::App* command = root.add_subcommand("bench", "Measure decode and prefill speed against the device's limits");
  add_model_option(*command, options->engine);
  command->add_option("--config", options->config, "a config.json preset (e.g. configs/qwen3-8b.json)");
  command->add_flag("--random-weights", options->random_weights, "generate weights on the device (with --config)");
  command->add_option("--batch", options->batches, "decode batch sizes")->capture_default_str();
  command->add_option("--context", options->context, "cached tokens per decode row")->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 22));
  command->add_option("--prefill", options->prefills, "prefill lengths (empty: none)")->capture_default_str();
  command->add_option("--warmup", options->warmup, "untimed iterations")->capture_default_str()->check(CLI::Range(0, 1000));
  command->add_option("--iters", options->iters, "timed iterations")->capture_default_str()->check(CLI::Range(1, 100000));
  command->add_flag("--json", options->json, "print the results as JSON");
  command->add_flag("--sampled", options->sampled,
                    "also time each decode step with its rows sampled as the engine does (temperature 0.6, "
                    "top-k 20, top-p 0.95: Qwen3's defaults)");
  add_engine_options(*command, options->engine);
  command->add_option("--spec-tokens", options->spec_tokens,
                      "with --speculative-method: tokens each sequence generates (plain vs speculative decode)")
      ->capture_default_str()->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  command
      ->add_option("--spec-repeat", options->spec_repeat,
                   "with --speculative-method: runs of each mode per batch size, alternating (medians reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  command
      ->add_option("--spec-warmup", options->spec_warmup,
                   "with --speculative-method: untimed runs of each mode per batch size before the timed ones")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  command->add_option("--spec-prompt", options->spec_prompt, "with --speculative-method: prompt tokens per sequence")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  command->add_option("--spec-accept-rate", options->engine.spec_accept_rate,
                      "BENCHMARK MODE (random weights): accept each draft by a seeded Bernoulli(p) instead of "
                      "comparing it with the target; outputs are then not the model's")
      ->check(CLI::Range(0.0, 1.0));
  command->callback([options, &action] { action = [options] { return run_bench(*options); }; });
}

}  // namespace metrale::cli
