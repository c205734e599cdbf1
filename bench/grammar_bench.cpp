// metrale_grammar_bench: the cost of constrained decoding on one CPU core (Google Benchmark).
//
//   metrale_grammar_bench [--benchmark_filter=...]   (run from the repository root, or set
//                                                      METRALE_SOURCE_DIR to it)
//
// For each tokenizer (the Qwen3 vocabulary of models/default, 151,643 tokens + added ones, masks of
// 151,936 bits; the demo model's 8,190) and each schema (a flat object, nested objects with arrays
// and enums, any JSON object (response_format json_object), a tool call in the Qwen3 JSON and Qwen3.5
// XML formats):
//   Compile/...  JSON schema -> grammar -> automata -> every position's token classes (no cache);
//   CompileCached/...  the same with the tokenizer's rule cache warm (the same schema or tools again,
//                or another grammar sharing rules with it);
//   Mask/...     one fill_next_token_bitmask, averaged over every step of a valid output (the
//                output is tokenized by the real tokenizer, so the steps are those a model takes);
//   Accept/...   one accept_token, averaged the same way.
// The per-step numbers are reported as the time per iteration of one mask (or token), averaged over
// the steps; slowest_step_us is the slowest single step of the output (best of 50 runs of it).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "text/grammar/compiled_grammar.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/matcher.h"
#include "text/grammar/tool_call_grammar.h"
#include "text/tokenizer.h"

namespace {

using metrale::Tokenizer;
using metrale::ToolCallFormat;
using metrale::ToolDefinition;
using metrale::grammar::CompiledGrammar;
using metrale::grammar::GrammarMatcher;
using metrale::grammar::TokenizerInfo;
using Json = nlohmann::ordered_json;

std::filesystem::path source_dir() {
  if (const char* dir = std::getenv("METRALE_SOURCE_DIR")) return dir;
#ifdef METRALE_SOURCE_DIR
  return METRALE_SOURCE_DIR;
#else
  return std::filesystem::current_path();
#endif
}

struct Vocabulary {
  std::unique_ptr<Tokenizer> tokenizer;
  std::shared_ptr<const TokenizerInfo> info;
};

const Vocabulary* vocabulary(const std::string& model) {
  static std::map<std::string, Vocabulary> cache;
  if (const auto it = cache.find(model); it != cache.end()) return &it->second;
  const std::filesystem::path dir = source_dir() / "models" / model;
  if (!std::filesystem::exists(dir / "tokenizer.json")) return nullptr;
  Vocabulary v;
  v.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_dir(dir));
  const int64_t logits = model == "default" ? 151936 : v.tokenizer->vocab_size();
  v.info = TokenizerInfo::from_tokenizer(*v.tokenizer, logits);
  return &cache.emplace(model, std::move(v)).first->second;
}

const std::vector<ToolDefinition>& tools() {
  static const std::vector<ToolDefinition> list = metrale::tool_definitions_from_openai(Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
      "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_web", "parameters": {"type": "object",
      "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 50}},
      "required": ["query"]}}}])"));
  return list;
}

struct Workload {
  std::string name;
  std::function<metrale::grammar::Grammar()> grammar;
  std::string output;  // a valid output, tokenized for the per-step benchmarks
};

const std::vector<Workload>& workloads() {
  static const std::vector<Workload> all = [] {
    std::vector<Workload> list;
    const Json flat =
        Json::parse(R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
      "email": {"type": "string"}, "active": {"type": "boolean"}}, "required": ["name", "age", "email", "active"]})");
    list.push_back({"flat_object", [flat] { return metrale::grammar::json_schema_grammar(flat); },
                    R"({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": true})"});
    const Json nested = Json::parse(R"({"type": "object", "properties": {
      "order_id": {"type": "string"}, "status": {"enum": ["pending", "shipped", "delivered"]},
      "customer": {"type": "object", "properties": {"name": {"type": "string"}, "address": {"type": "object",
        "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
        "required": ["street", "city", "zip"]}}, "required": ["name", "address"]},
      "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"},
        "quantity": {"type": "integer", "minimum": 1}, "tags": {"type": "array", "items": {"enum": ["gift", "fragile", "bulk"]}}},
        "required": ["sku", "quantity"]}}}, "required": ["order_id", "status", "customer", "items"]})");
    list.push_back(
        {"nested_arrays_enums", [nested] { return metrale::grammar::json_schema_grammar(nested); },
         R"({"order_id": "A-1029", "status": "shipped", "customer": {"name": "Grace Hopper", "address": )"
         R"({"street": "1 Navy Way", "city": "Arlington", "zip": "22201"}}, "items": [{"sku": "KB-01", )"
         R"("quantity": 2, "tags": ["gift"]}, {"sku": "MS-7", "quantity": 1, "tags": ["fragile", "bulk"]}]})"});
    list.push_back(
        {"json_object", [] { return metrale::grammar::json_object_grammar(); },
         R"({"id": 7, "tags": ["a", "b"], "meta": {"score": 0.93, "nested": {"ok": true, "list": [1, 2, {"x": null}]}}, )"
         R"("text": "The quick brown fox jumps over the lazy dog."})"});
    list.push_back({"tool_call_qwen3_json",
                    [] { return metrale::grammar::tool_call_grammar(ToolCallFormat::kHermes, tools(), {}); },
                    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"San Francisco\", \"unit\": "
                    "\"celsius\", \"days\": 3}}\n</tool_call>"});
    list.push_back(
        {"tool_call_qwen35_xml",
         [] { return metrale::grammar::tool_call_grammar(ToolCallFormat::kQwen3Coder, tools(), {}); },
         "<tool_call>\n<function=search_web>\n<parameter=query>\nbest hiking trails near Seattle\n</parameter>\n"
         "<parameter=max_results>\n5\n</parameter>\n</function>\n</tool_call>"});
    return list;
  }();
  return all;
}

std::shared_ptr<const CompiledGrammar> compiled(const Vocabulary& v, const Workload& w) {
  static std::map<std::pair<const TokenizerInfo*, std::string>, std::shared_ptr<const CompiledGrammar>> cache;
  const auto key = std::make_pair(v.info.get(), w.name);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  return cache.emplace(key, metrale::grammar::compile_grammar(w.grammar(), v.info)).first->second;
}

// The matcher before every step of the workload's output, and the tokens taken.
std::vector<GrammarMatcher> steps(const Vocabulary& v, const Workload& w, std::vector<int32_t>& tokens) {
  tokens = v.tokenizer->encode(w.output);
  GrammarMatcher matcher(compiled(v, w));
  std::vector<GrammarMatcher> states;
  for (int32_t token : tokens) {
    states.push_back(matcher);
    if (!matcher.accept_token(token)) {
      std::fprintf(stderr, "%s: the grammar refuses token %d of its own output\n", w.name.c_str(), token);
      std::abort();
    }
  }
  states.push_back(matcher);  // the stop token's step
  return states;
}

void compile_benchmark(benchmark::State& state, const std::string& model, size_t workload, bool use_cache) {
  const Vocabulary* v = vocabulary(model);
  if (v == nullptr) {
    state.SkipWithError("tokenizer missing");
    return;
  }
  const Workload& w = workloads()[workload];
  metrale::grammar::GrammarCompileOptions options;
  options.use_cache = use_cache;
  std::shared_ptr<const CompiledGrammar> grammar =
      metrale::grammar::compile_grammar(w.grammar(), v->info);  // warms the cache
  for (auto _ : state) {
    grammar = metrale::grammar::compile_grammar(w.grammar(), v->info, options);
    benchmark::DoNotOptimize(grammar);
  }
  const auto stats = grammar->stats();
  state.counters["positions"] = stats.num_positions;
  state.counters["states"] = static_cast<double>(stats.num_states);
  state.counters["uncertain"] = static_cast<double>(stats.num_uncertain);
  state.counters["mask_MiB"] = static_cast<double>(stats.mask_bytes) / (1 << 20);
  state.counters["cached_rules"] = stats.cached_rules;
}

void mask_benchmark(benchmark::State& state, const std::string& model, size_t workload) {
  const Vocabulary* v = vocabulary(model);
  if (v == nullptr) {
    state.SkipWithError("tokenizer missing");
    return;
  }
  std::vector<int32_t> tokens;
  const std::vector<GrammarMatcher> states = steps(*v, workloads()[workload], tokens);
  std::vector<uint32_t> bitmask(static_cast<size_t>(v->info->bitmask_words()));
  // The slowest step, each step timed alone (best of 50, to keep other load out).
  double slowest_us = 0;
  for (const GrammarMatcher& matcher : states) {
    double best = 1e30;
    for (int rep = 0; rep < 50; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      matcher.fill_next_token_bitmask(bitmask);
      benchmark::DoNotOptimize(bitmask.data());
      best =
          std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    }
    slowest_us = std::max(slowest_us, best);
  }
  size_t i = 0;
  for (auto _ : state) {
    states[i].fill_next_token_bitmask(bitmask);
    benchmark::DoNotOptimize(bitmask.data());
    i = i + 1 == states.size() ? 0 : i + 1;
  }
  state.counters["steps"] = static_cast<double>(states.size());
  state.counters["slowest_step_us"] = slowest_us;
}

void accept_benchmark(benchmark::State& state, const std::string& model, size_t workload) {
  const Vocabulary* v = vocabulary(model);
  if (v == nullptr) {
    state.SkipWithError("tokenizer missing");
    return;
  }
  std::vector<int32_t> tokens;
  const std::vector<GrammarMatcher> states = steps(*v, workloads()[workload], tokens);
  GrammarMatcher matcher = states[0];
  size_t i = 0;
  for (auto _ : state) {
    if (i == tokens.size()) {
      state.PauseTiming();
      matcher.reset();
      i = 0;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(matcher.accept_token(tokens[i++]));
  }
}

int register_all() {
  for (const std::string model : {"default", "demo"}) {
    const std::string tokenizer = model == "default" ? "qwen3" : "demo";
    for (size_t w = 0; w < workloads().size(); ++w) {
      const std::string suffix = tokenizer + "/" + workloads()[w].name;
      benchmark::RegisterBenchmark(("Compile/" + suffix).c_str(), compile_benchmark, model, w, false)
          ->Unit(benchmark::kMillisecond)
          ->Iterations(model == "default" ? 3 : 20);
      benchmark::RegisterBenchmark(("CompileCached/" + suffix).c_str(), compile_benchmark, model, w, true)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("Mask/" + suffix).c_str(), mask_benchmark, model, w)->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("Accept/" + suffix).c_str(), accept_benchmark, model, w)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  return 0;
}

const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
