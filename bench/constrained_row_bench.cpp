// metrale_constrained_row_bench: what one constrained row costs the engine per step on one CPU core
// (Google Benchmark), on the Qwen3 vocabulary of models/default (masks of 151,936 bits):
//   RowMask/...   GrammarConstraint::fill_next_mask into a zeroed bitmask: the work of the mask
//                 worker (engine/constrained_rows.h), which overlaps the forward;
//   RowApply/...  apply_token_bitmask on a [151936] f32 logits row: the work added to the sampling
//                 of the row after the forward;
//   RowClosing/...the mask when the budget forces the end (every single-byte token tried on the
//                 matcher), the slowest kind of step.
//   RowApplyDevice/<workload>/<rows> (CUDA builds, with a GPU): what the engine adds to a step
//                 whose <rows> decode rows are all constrained: one asynchronous upload of their
//                 masks from pinned memory and kernels::apply_token_bitmask on [rows, 151936]
//                 logits, timed with CUDA events (manual time, per step).
// Each is averaged over the steps of a valid output tokenized by the real tokenizer.
//
//   metrale_constrained_row_bench [--benchmark_filter=...]   (from the repository root, or set
//                                                              METRALE_SOURCE_DIR)
#include <benchmark/benchmark.h>

#if METRALE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "runtime/cuda/cuda_graph.h"
#endif

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/token_constraint.h"
#include "kernels/token_bitmask.h"
#include "runtime/buffer.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"
#include "server/grammar_constraint.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/tool_call_grammar.h"
#include "text/tokenizer.h"

namespace {

using metrale::Tokenizer;
using metrale::server::ConstraintVocabulary;
using metrale::server::GrammarConstraint;
using metrale::server::GrammarConstraintOptions;
using Json = nlohmann::ordered_json;

constexpr int64_t kLogits = 151936;

std::filesystem::path source_dir() {
  if (const char* dir = std::getenv("METRALE_SOURCE_DIR")) return dir;
#ifdef METRALE_SOURCE_DIR
  return METRALE_SOURCE_DIR;
#else
  return std::filesystem::current_path();
#endif
}

struct Setup {
  std::unique_ptr<Tokenizer> tokenizer;
  std::shared_ptr<const metrale::grammar::TokenizerInfo> info;
  std::shared_ptr<const ConstraintVocabulary> vocabulary;
};

const Setup* setup() {
  static std::unique_ptr<Setup> built = [] {
    const std::filesystem::path dir = source_dir() / "models" / "default";
    if (!std::filesystem::exists(dir / "tokenizer.json")) return std::unique_ptr<Setup>();
    auto s = std::make_unique<Setup>();
    s->tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_dir(dir));
    s->info = metrale::grammar::TokenizerInfo::from_tokenizer(*s->tokenizer, kLogits);
    auto vocabulary = std::make_shared<ConstraintVocabulary>();
    vocabulary->first_byte.assign(static_cast<size_t>(s->tokenizer->vocab_size()), ConstraintVocabulary::kNoFirstByte);
    for (int32_t id = 0; id < s->tokenizer->vocab_size(); ++id) {
      const std::string_view bytes = s->tokenizer->token_bytes(id);
      if (s->tokenizer->is_special(id) || bytes.empty()) continue;
      vocabulary->first_byte[static_cast<size_t>(id)] = static_cast<uint8_t>(bytes[0]);
      if (bytes.size() == 1) vocabulary->byte_tokens.push_back(id);
    }
    vocabulary->stop_token_ids = {151645};
    s->vocabulary = vocabulary;
    return s;
  }();
  return built.get();
}

struct Workload {
  const char* name;
  metrale::grammar::Grammar (*grammar)();
  const char* output;
};

const std::vector<metrale::ToolDefinition>& tools() {
  static const auto list = metrale::tool_definitions_from_openai(Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
      "required": ["city"]}}}])"));
  return list;
}

const Workload kWorkloads[] = {
    {"flat_object",
     [] {
       return metrale::grammar::json_schema_grammar(Json::parse(
           R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
           "email": {"type": "string"}, "active": {"type": "boolean"}}, "required": ["name", "age", "email", "active"]})"));
     },
     R"({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": true})"},
    {"json_object", [] { return metrale::grammar::json_object_grammar(); },
     R"({"id": 7, "tags": ["a", "b"], "meta": {"score": 0.93, "nested": {"ok": true}}, "text": "The quick brown fox."})"},
    {"tool_call_qwen3_json",
     [] { return metrale::grammar::tool_call_grammar(metrale::ToolCallFormat::kHermes, tools(), {}); },
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"San Francisco\", \"unit\": \"celsius\"}}\n"
     "</tool_call>"},
};

// The constraint before every step of the workload's output.
std::vector<GrammarConstraint> steps(const Setup& s, const Workload& w, int64_t max_tokens) {
  static std::map<std::string, std::shared_ptr<const metrale::grammar::CompiledGrammar>> grammars;
  auto& grammar = grammars[w.name];
  if (!grammar) grammar = metrale::grammar::compile_grammar(w.grammar(), s.info);
  GrammarConstraintOptions options;
  options.max_tokens = max_tokens;
  GrammarConstraint constraint(grammar, s.vocabulary, options);
  std::vector<GrammarConstraint> states;
  for (const int32_t token : s.tokenizer->encode(w.output)) {
    states.push_back(constraint);
    if (!constraint.accept(token)) std::abort();
  }
  return states;
}

void row_mask(benchmark::State& state, const Workload& w, bool closing) {
  const Setup* s = setup();
  if (s == nullptr) {
    state.SkipWithError("models/default/tokenizer.json missing");
    return;
  }
  // Closing: a budget of exactly the output's length, so every step is in the closing phase.
  std::vector<GrammarConstraint> states = steps(*s, w, closing ? 1 : 0);
  std::vector<uint32_t> bitmask(static_cast<size_t>((kLogits + 31) / 32));
  size_t i = 0;
  for (auto _ : state) {
    std::fill(bitmask.begin(), bitmask.end(), 0u);
    states[i].fill_next_mask(bitmask);
    benchmark::DoNotOptimize(bitmask.data());
    i = (i + 1) % states.size();
  }
  state.counters["steps"] = static_cast<double>(states.size());
}

void row_apply(benchmark::State& state, const Workload& w) {
  const Setup* s = setup();
  if (s == nullptr) {
    state.SkipWithError("models/default/tokenizer.json missing");
    return;
  }
  std::vector<GrammarConstraint> states = steps(*s, w, 0);
  std::vector<std::vector<uint32_t>> masks;
  for (GrammarConstraint& constraint : states) {
    masks.emplace_back(static_cast<size_t>((kLogits + 31) / 32), 0u);
    constraint.fill_next_mask(masks.back());
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> source(kLogits);
  for (float& x : source) x = normal(rng);
  std::vector<float> row(kLogits);
  size_t i = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::copy(source.begin(), source.end(), row.begin());
    state.ResumeTiming();
    metrale::apply_token_bitmask(row, masks[i]);
    benchmark::DoNotOptimize(row.data());
    i = (i + 1) % masks.size();
  }
}

#if METRALE_WITH_CUDA
void row_apply_device(benchmark::State& state, const Workload& w) {
  const Setup* s = setup();
  if (s == nullptr) {
    state.SkipWithError("models/default/tokenizer.json missing");
    return;
  }
  if (!metrale::cuda_available()) {
    state.SkipWithError("no GPU");
    return;
  }
  using metrale::Device;
  using metrale::DType;
  const int64_t rows = state.range(0);
  const int64_t words = (kLogits + 31) / 32;
  // One mask per row, from successive steps of the workload's output, in pinned memory as the
  // engine keeps them (ConstrainedRows).
  std::vector<GrammarConstraint> states = steps(*s, w, 0);
  metrale::PinnedBuffer host_masks(static_cast<size_t>(rows * words) * 4);
  metrale::PinnedBuffer host_rows(static_cast<size_t>(rows) * 4);
  auto* masks = static_cast<uint32_t*>(host_masks.data());
  auto* row_ids = static_cast<int32_t*>(host_rows.data());
  std::fill(masks, masks + rows * words, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    states[static_cast<size_t>(r) % states.size()].fill_next_mask(
        std::span<uint32_t>(masks + r * words, static_cast<size_t>(words)));
    row_ids[r] = static_cast<int32_t>(r);
  }
  const Device gpu = Device::cuda();
  metrale::OwnedTensor logits(DType::kF32, {rows, kLogits}, gpu);
  metrale::OwnedTensor device_masks(DType::kI32, {rows, words}, gpu);
  metrale::OwnedTensor device_rows(DType::kI32, {rows}, gpu);
  std::vector<float> source(static_cast<size_t>(rows * kLogits));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& x : source) x = normal(rng);
  metrale::copy_bytes(logits.tensor.data(), gpu, source.data(), Device::cpu(), source.size() * sizeof(float));
  const auto stream = static_cast<cudaStream_t>(metrale::current_stream(gpu));
  metrale::CudaEvent start, stop;
  const auto step = [&] {
    metrale::copy_bytes_async(device_masks.tensor.data(), gpu, masks, Device::cpu(),
                              static_cast<size_t>(rows * words) * 4);
    metrale::copy_bytes_async(device_rows.tensor.data(), gpu, row_ids, Device::cpu(), static_cast<size_t>(rows) * 4);
    metrale::kernels::apply_token_bitmask(logits.tensor, device_masks.tensor, device_rows.tensor);
  };
  step();  // warm-up (module load)
  metrale::synchronize(gpu);
  for (auto _ : state) {
    start.record(stream);
    step();
    stop.record(stream);
    stop.synchronize();
    state.SetIterationTime(stop.elapsed_ms_since(start) * 1e-3);
  }
  state.counters["rows"] = static_cast<double>(rows);
}
#endif

void register_all() {
  for (const Workload& w : kWorkloads) {
    benchmark::RegisterBenchmark((std::string("RowMask/") + w.name).c_str(), [&w](benchmark::State& st) { row_mask(st, w, false); })
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((std::string("RowApply/") + w.name).c_str(), [&w](benchmark::State& st) { row_apply(st, w); })
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((std::string("RowClosing/") + w.name).c_str(), [&w](benchmark::State& st) { row_mask(st, w, true); })
        ->Unit(benchmark::kMicrosecond);
#if METRALE_WITH_CUDA
    benchmark::RegisterBenchmark((std::string("RowApplyDevice/") + w.name).c_str(),
                                 [&w](benchmark::State& st) { row_apply_device(st, w); })
        ->Arg(1)
        ->Arg(16)
        ->Arg(64)
        ->Arg(256)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
#endif
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
