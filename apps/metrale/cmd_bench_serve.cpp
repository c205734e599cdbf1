// metrale bench-serve: load on a running OpenAI-compatible server, measured the way vLLM's
// `bench serve` does. Sends --num-prompts streaming /v1/completions requests of --input-len prompt
// tokens and --output-len generated tokens (ignore_eos), at most --concurrency at once and/or at
// --request-rate per second (Poisson arrivals), then reports request and token throughput and
// TTFT / TPOT / ITL mean, median and p99, and writes them as JSON with --result-file.
//
// With --turns N each prompt opens a conversation of N requests sent one after the other: turn t + 1's
// prompt is turn t's prompt, its output's token ids (return_token_ids) and --turn-input-len new
// random ids, as a chat client resends its history. Follow-up turns can reuse the cached prefix, so
// their TTFT, reported apart from the first turns', measures the prefix cache and its host and disk
// tiers. A follow-up queues behind the turns already waiting (--turn-order interleaved, as users read
// and type between turns) or follows at once (sequential). --concurrency bounds the requests in
// flight; --request-rate paces the conversations' first turns.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "options.h"
#include "text/tokenizer.h"

namespace metrale::cli {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct BenchServeOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string model;          // "": ask the server (GET /v1/models)
  std::string api_key;
  int concurrency = 0;        // 0: no limit (all at once, or as the rate releases them)
  double request_rate = 0.0;  // requests per second; 0: all at once
  int num_prompts = 100;
  int input_len = 1024;
  int output_len = 128;
  int turns = 1;               // requests per conversation
  int turn_input_len = 128;    // new prompt tokens of every follow-up turn
  std::string turn_order = "interleaved";  // or "sequential": a conversation's turns back to back
  bool random_tokens = false;  // prompts as token ids (exact lengths) instead of text
  std::string tokenizer;       // model directory whose tokenizer makes the text prompts
  uint64_t seed = 0;
  std::string result_file;
  int timeout_seconds = 3600;
};

struct RequestResult {
  bool ok = false;
  std::string error;
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  double latency = 0.0;     // seconds, send to the last byte
  double ttft = 0.0;        // seconds, send to the first token
  std::vector<double> itl;  // seconds between successive token chunks
  std::vector<int32_t> output_ids;  // return_token_ids (multi-turn runs)
  bool has_output_ids = false;
};

struct Summary {
  double mean = 0.0, median = 0.0, p99 = 0.0;
};

Summary summarize(std::vector<double> values) {
  Summary summary;
  if (values.empty()) return summary;
  std::sort(values.begin(), values.end());
  summary.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  const auto at = [&](double q) {  // linear interpolation between ranks, as numpy.percentile
    const double rank = q * static_cast<double>(values.size() - 1);
    const auto low = static_cast<size_t>(std::floor(rank));
    const size_t high = std::min(low + 1, values.size() - 1);
    return values[low] + (values[high] - values[low]) * (rank - static_cast<double>(low));
  };
  summary.median = at(0.5);
  summary.p99 = at(0.99);
  return summary;
}

httplib::Headers request_headers(const BenchServeOptions& options) {
  httplib::Headers headers = {{"Content-Type", "application/json"}};
  if (!options.api_key.empty()) headers.emplace("Authorization", "Bearer " + options.api_key);
  return headers;
}

std::string served_model(const BenchServeOptions& options) {
  httplib::Client client(options.url);
  client.set_read_timeout(30, 0);
  const auto result = client.Get("/v1/models", request_headers(options));
  if (!result) raise(ErrorCode::kInvalidArgument, "cannot reach {}: {}", options.url, httplib::to_string(result.error()));
  if (result->status != 200)
    raise(ErrorCode::kInvalidArgument, "GET {}/v1/models answered {}: {}", options.url, result->status, result->body);
  const json models = json::parse(result->body);
  return models.at("data").at(0).at("id").get<std::string>();
}

struct Conversation {
  json prompt;                                   // the first turn's: token ids or text
  std::vector<std::vector<int32_t>> follow_ups;  // [turns - 1][turn_input_len] new ids of later turns
};

// The prompts: random token ids (ids from the ordinary vocabulary, away from special tokens), sent
// as ids, or those ids decoded to text. The tokenizer (the server model's) bounds the ids; token-id
// prompts can do without one (ids below 30,000 then).

std::vector<Conversation> make_conversations(const BenchServeOptions& options) {
  std::optional<Tokenizer> tokenizer;
  const std::filesystem::path dir =
      options.tokenizer.empty() ? default_model_dir() : std::filesystem::path(options.tokenizer);
  if (!options.random_tokens || std::filesystem::exists(dir / "tokenizer.json")) tokenizer = Tokenizer::from_dir(dir);
  int32_t high = 30000;
  if (tokenizer) high = static_cast<int32_t>(std::min<int64_t>(tokenizer->vocab_size() * 9 / 10, 100000));
  std::mt19937_64 generator(options.seed);
  std::uniform_int_distribution<int32_t> pick(std::min(1000, high / 10), high);
  std::vector<Conversation> conversations;
  for (int i = 0; i < options.num_prompts; ++i) {
    Conversation conversation;
    std::vector<int32_t> ids(static_cast<size_t>(options.input_len));
    for (int32_t& id : ids) id = pick(generator);
    if (options.random_tokens) conversation.prompt = ids;
    else conversation.prompt = tokenizer->decode(ids, /*skip_special_tokens=*/true);
    conversations.push_back(std::move(conversation));
  }
  // Drawn after every first prompt, so that --turns leaves the first turns' prompts as they were.
  for (Conversation& conversation : conversations) {
    conversation.follow_ups.resize(static_cast<size_t>(options.turns - 1));
    for (std::vector<int32_t>& ids : conversation.follow_ups) {
      ids.resize(static_cast<size_t>(options.turn_input_len));
      for (int32_t& id : ids) id = pick(generator);
    }
  }
  return conversations;
}

// One streaming request; SSE events are parsed as the bytes arrive.
RequestResult run_request(httplib::Client& client, const BenchServeOptions& options, const std::string& body) {
  RequestResult result;
  std::string buffer;
  std::string raw;  // the whole body, for error messages
  const Clock::time_point start = Clock::now();
  Clock::time_point last_token = start;
  bool seen_token = false;
  int64_t token_chunks = 0;
  const auto on_event = [&](std::string_view data) {
    if (data == "[DONE]") return;
    json event;
    try {
      event = json::parse(data);
    } catch (const json::exception&) {
      return;
    }
    if (event.contains("error")) {
      result.error = event["error"].value("message", "error event");
      return;
    }
    if (event.contains("usage") && event["usage"].is_object()) {
      result.prompt_tokens = event["usage"].value("prompt_tokens", int64_t{0});
      result.output_tokens = event["usage"].value("completion_tokens", int64_t{0});
    }
    if (!event.contains("choices") || event["choices"].empty()) return;
    for (const json& choice : event["choices"]) {
      if (!choice.contains("token_ids") || !choice["token_ids"].is_array()) continue;
      result.has_output_ids = true;
      for (const json& id : choice["token_ids"]) result.output_ids.push_back(id.get<int32_t>());
    }
    const Clock::time_point now = Clock::now();
    ++token_chunks;
    if (!seen_token) {
      result.ttft = std::chrono::duration<double>(now - start).count();
      seen_token = true;
    } else {
      result.itl.push_back(std::chrono::duration<double>(now - last_token).count());
    }
    last_token = now;
  };
  httplib::Request request;
  request.method = "POST";
  request.path = "/v1/completions";
  request.headers = request_headers(options);
  request.body = body;
  request.content_receiver = [&](const char* data, size_t length, uint64_t, uint64_t) {
    if (raw.size() < 4096) raw.append(data, std::min<size_t>(length, 4096));
    buffer.append(data, length);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) == 0) on_event(std::string_view(event).substr(6));
    }
    return true;
  };
  httplib::Response response;
  httplib::Error error = httplib::Error::Success;
  const bool sent = client.send(request, response, error);
  result.latency = std::chrono::duration<double>(Clock::now() - start).count();
  if (!sent) {
    result.error = "request failed: " + httplib::to_string(error);
  } else if (response.status != 200) {
    result.error = fmt::format("HTTP {}: {}", response.status, raw);
  } else if (result.error.empty()) {
    if (result.output_tokens == 0) result.output_tokens = token_chunks;
    result.ok = seen_token;
    if (!seen_token) result.error = "no token came back";
  }
  return result;
}

// One turn: the streaming request of `prompt` (with return_token_ids when there are several turns).
RequestResult run_turn(httplib::Client& client, const BenchServeOptions& options, const std::string& model,
                       const json& prompt) {
  const bool multi_turn = options.turns > 1;
  json body = {{"model", model},
               {"prompt", prompt},
               {"max_tokens", options.output_len},
               {"ignore_eos", true},
               {"temperature", 0.0},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  if (multi_turn) body["return_token_ids"] = true;
  RequestResult result = run_request(client, options, body.dump());
  if (result.ok && multi_turn && !result.has_output_ids) {
    result.ok = false;
    result.error = "the server sent no token_ids (return_token_ids), which --turns needs";
  }
  return result;
}

// The next turn's prompt: this turn's, its output's ids, and the conversation's new ids.
json follow_up_prompt(const json& prompt, const RequestResult& result, const std::vector<int32_t>& added) {
  std::vector<int32_t> next = prompt.get<std::vector<int32_t>>();
  next.insert(next.end(), result.output_ids.begin(), result.output_ids.end());
  next.insert(next.end(), added.begin(), added.end());
  return next;
}

// The turns waiting to be sent, shared by the workers. A turn that ends queues its conversation's
// next one at the back (interleaved: the other conversations' turns come first, as between users
// who read and type) or hands it straight back to its worker (sequential).
class TurnQueue {
 public:
  struct Turn {
    size_t conversation = 0;
    int turn = 0;
    json prompt;
  };
  TurnQueue(const std::vector<Conversation>& conversations, int turns) : left_(conversations.size() * turns) {
    for (size_t c = 0; c < conversations.size(); ++c) waiting_.push_back({c, 0, conversations[c].prompt});
  }
  // The next turn, or nullopt when every turn has been run or given up.
  std::optional<Turn> take() {
    std::unique_lock lock(mutex_);
    ready_.wait(lock, [&] { return !waiting_.empty() || left_ == 0; });
    if (waiting_.empty()) return std::nullopt;
    Turn turn = std::move(waiting_.front());
    waiting_.pop_front();
    return turn;
  }
  // `finished` turns are done (run or given up); `next` (if any) is queued at the back.
  void done(size_t finished, std::optional<Turn> next) {
    {
      std::lock_guard lock(mutex_);
      left_ -= finished;
      if (next) waiting_.push_back(std::move(*next));
    }
    ready_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Turn> waiting_;
  size_t left_;
};

// A worker: runs turns until none is left. A failed turn ends its conversation (the turns after it
// fail too, saying so). Only first turns wait for their arrival time.
void run_turns(TurnQueue& queue, const BenchServeOptions& options, const std::string& model,
               const std::vector<Conversation>& conversations, const std::vector<double>& arrivals,
               Clock::time_point start, std::vector<RequestResult>& results) {
  httplib::Client client(options.url);
  client.set_read_timeout(options.timeout_seconds, 0);
  client.set_write_timeout(options.timeout_seconds, 0);
  client.set_connection_timeout(30, 0);
  client.set_keep_alive(true);
  const auto turns = static_cast<size_t>(options.turns);
  std::optional<TurnQueue::Turn> item = queue.take();
  while (item) {
    const size_t c = item->conversation;
    if (item->turn == 0) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(arrivals[c])));
    }
    RequestResult& result = results[c * turns + static_cast<size_t>(item->turn)];
    result = run_turn(client, options, model, item->prompt);
    std::optional<TurnQueue::Turn> next;
    size_t finished = 1;
    if (!result.ok) {
      for (int rest = item->turn + 1; rest < options.turns; ++rest, ++finished)
        results[c * turns + static_cast<size_t>(rest)].error = fmt::format("turn {} of its conversation failed", item->turn);
    } else if (item->turn + 1 < options.turns) {
      next = TurnQueue::Turn{c, item->turn + 1,
                             follow_up_prompt(item->prompt, result,
                                              conversations[c].follow_ups[static_cast<size_t>(item->turn)])};
    }
    if (next && options.turn_order == "sequential") {
      queue.done(finished, std::nullopt);
      item = std::move(next);
    } else {
      queue.done(finished, std::move(next));
      item = queue.take();
    }
  }
}

int run_bench_serve(const BenchServeOptions& options) {
  if (options.turns > 1 && !options.random_tokens)
    raise(ErrorCode::kInvalidArgument, "--turns {} needs --random-tokens (follow-up prompts are token ids)", options.turns);
  const std::string model = options.model.empty() ? served_model(options) : options.model;
  const std::vector<Conversation> conversations = make_conversations(options);
  const auto turns = static_cast<size_t>(options.turns);

  // Arrival times of the conversations: all at once, or a Poisson process of the given rate.
  std::vector<double> arrivals(conversations.size(), 0.0);
  if (options.request_rate > 0.0) {
    std::mt19937_64 generator(options.seed + 1);
    std::exponential_distribution<double> gap(options.request_rate);
    double t = 0.0;
    for (double& arrival : arrivals) {
      arrival = t;
      t += gap(generator);
    }
  }
  const int workers = options.concurrency > 0 ? std::min(options.concurrency, options.num_prompts)
                                              : std::min(options.num_prompts, 4096);
  std::vector<RequestResult> results(conversations.size() * turns);
  TurnQueue queue(conversations, options.turns);
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&] { run_turns(queue, options, model, conversations, arrivals, start, results); });
  }
  for (std::thread& thread : threads) thread.join();
  const double duration = std::chrono::duration<double>(Clock::now() - start).count();

  int64_t completed = 0, input_tokens = 0, output_tokens = 0;
  std::vector<double> ttft, tpot, itl, e2e, ttft_first, ttft_follow_up;
  std::vector<std::string> errors;
  for (size_t i = 0; i < results.size(); ++i) {
    const RequestResult& result = results[i];
    if (!result.ok) {
      errors.push_back(result.error);
      continue;
    }
    ++completed;
    input_tokens += result.prompt_tokens;
    output_tokens += result.output_tokens;
    ttft.push_back(result.ttft * 1e3);
    (i % turns == 0 ? ttft_first : ttft_follow_up).push_back(result.ttft * 1e3);
    e2e.push_back(result.latency * 1e3);
    if (result.output_tokens > 1)
      tpot.push_back((result.latency - result.ttft) * 1e3 / static_cast<double>(result.output_tokens - 1));
    for (const double gap : result.itl) itl.push_back(gap * 1e3);
  }
  const Summary ttft_summary = summarize(ttft), tpot_summary = summarize(tpot), itl_summary = summarize(itl),
                e2e_summary = summarize(e2e), first_summary = summarize(ttft_first),
                follow_up_summary = summarize(ttft_follow_up);
  const double request_throughput = static_cast<double>(completed) / duration;
  const double output_throughput = static_cast<double>(output_tokens) / duration;
  const double total_throughput = static_cast<double>(input_tokens + output_tokens) / duration;

  std::printf("============ Serving Benchmark Result ============\n");
  std::printf("%-40s %d\n", "Concurrency limit:", options.concurrency);
  std::printf("%-40s %s\n", "Request rate (req/s):",
              options.request_rate > 0 ? fmt::format("{:.2f}", options.request_rate).c_str() : "inf");
  if (turns > 1) std::printf("%-40s %zu x %zu\n", "Conversations x turns:", conversations.size(), turns);
  std::printf("%-40s %lld\n", "Successful requests:", static_cast<long long>(completed));
  std::printf("%-40s %zu\n", "Failed requests:", errors.size());
  std::printf("%-40s %.2f\n", "Benchmark duration (s):", duration);
  std::printf("%-40s %lld\n", "Total input tokens:", static_cast<long long>(input_tokens));
  std::printf("%-40s %lld\n", "Total generated tokens:", static_cast<long long>(output_tokens));
  std::printf("%-40s %.2f\n", "Request throughput (req/s):", request_throughput);
  std::printf("%-40s %.2f\n", "Output token throughput (tok/s):", output_throughput);
  std::printf("%-40s %.2f\n", "Total token throughput (tok/s):", total_throughput);
  const auto section = [](const char* title, const char* name, const Summary& summary) {
    if (*title != '\0') std::printf("%s\n", title);
    std::printf("%-40s %.2f\n", fmt::format("Mean {} (ms):", name).c_str(), summary.mean);
    std::printf("%-40s %.2f\n", fmt::format("Median {} (ms):", name).c_str(), summary.median);
    std::printf("%-40s %.2f\n", fmt::format("P99 {} (ms):", name).c_str(), summary.p99);
  };
  section("---------------Time to First Token----------------", "TTFT", ttft_summary);
  if (turns > 1) {
    section("----------TTFT of first turns / follow-ups---------", "first-turn TTFT", first_summary);
    section("", "follow-up TTFT", follow_up_summary);
  }
  section("-----Time per Output Token (excl. 1st token)------", "TPOT", tpot_summary);
  section("---------------Inter-token Latency----------------", "ITL", itl_summary);
  section("----------------End-to-end Latency----------------", "E2EL", e2e_summary);
  std::printf("==================================================\n");
  for (size_t i = 0; i < std::min<size_t>(errors.size(), 5); ++i) std::fprintf(stderr, "error: %s\n", errors[i].c_str());

  if (!options.result_file.empty()) {
    const auto summary_json = [](const Summary& summary) {
      return json{{"mean", summary.mean}, {"median", summary.median}, {"p99", summary.p99}};
    };
    const json report = {{"url", options.url},
                         {"model", model},
                         {"num_prompts", options.num_prompts},
                         {"input_len", options.input_len},
                         {"output_len", options.output_len},
                         {"turns", options.turns},
                         {"turn_input_len", options.turn_input_len},
                         {"turn_order", options.turn_order},
                         {"random_tokens", options.random_tokens},
                         {"concurrency", options.concurrency},
                         {"request_rate", options.request_rate > 0 ? json(options.request_rate) : json("inf")},
                         {"completed", completed},
                         {"failed", errors.size()},
                         {"duration_s", duration},
                         {"total_input_tokens", input_tokens},
                         {"total_output_tokens", output_tokens},
                         {"request_throughput", request_throughput},
                         {"output_throughput", output_throughput},
                         {"total_token_throughput", total_throughput},
                         {"ttft_ms", summary_json(ttft_summary)},
                         {"tpot_ms", summary_json(tpot_summary)},
                         {"itl_ms", summary_json(itl_summary)},
                         {"e2el_ms", summary_json(e2e_summary)},
                         {"ttft_first_turn_ms", summary_json(first_summary)},
                         {"ttft_follow_up_ms", summary_json(follow_up_summary)}};
    std::ofstream file(options.result_file);
    if (!file) raise(ErrorCode::kInvalidArgument, "cannot write {}", options.result_file);
    file << report.dump(2) << "\n";
  }
  return errors.empty() ? kExitOk : kExitRuntimeError;
}

}  // namespace

void register_bench_serve(CLI::App& root, Action& action) {
  auto options = std::make_shared<BenchServeOptions>();
  CLI::App* command = root.add_subcommand("bench-serve", "Benchmark a running OpenAI-compatible server (as vLLM bench serve)");
  command->add_option("--url", options->url, "the server")->capture_default_str();
  command->add_option("--model", options->model, "model name to send (default: the server's)");
  command->add_option("--api-key", options->api_key, "bearer token");
  command->add_option("--concurrency", options->concurrency, "requests in flight at most (0: no limit)")
      ->capture_default_str()->check(CLI::Range(0, 1 << 20));
  command->add_option("--request-rate", options->request_rate, "requests per second, Poisson (0: all at once)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  command->add_option("--num-prompts", options->num_prompts, "requests (with --turns: conversations) to send")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  command->add_option("--input-len", options->input_len, "prompt tokens per request")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  command->add_option("--output-len", options->output_len, "generated tokens per request")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  command->add_option("--turns", options->turns,
                      "requests per conversation: each follow-up resends the history (prompt, output ids) plus "
                      "--turn-input-len new tokens; needs --random-tokens")
      ->capture_default_str()->check(CLI::Range(1, 1 << 16));
  command->add_option("--turn-input-len", options->turn_input_len, "new prompt tokens of every follow-up turn")
      ->capture_default_str()->check(CLI::Range(0, 1 << 24));
  command->add_option("--turn-order", options->turn_order,
                      "interleaved: a follow-up waits behind the turns queued before it (other conversations', as "
                      "users read and type between turns); sequential: a conversation's turns back to back")
      ->capture_default_str()->check(CLI::IsMember({"interleaved", "sequential"}));
  command->add_flag("--random-tokens", options->random_tokens,
                    "send prompts as random token ids (exact lengths) instead of text");
  command->add_option("--tokenizer", options->tokenizer,
                      "the served model's directory (its tokenizer makes the text prompts and bounds random ids; "
                      "default: the bundled default model)");
  command->add_option("--seed", options->seed, "seed of the prompts and arrivals")->capture_default_str();
  command->add_option("--result-file", options->result_file, "write the results as JSON here");
  command->add_option("--timeout", options->timeout_seconds, "seconds a request may take")->capture_default_str();
  command->callback([options, &action] { action = [options] { return run_bench_serve(*options); }; });
}

}  // namespace metrale::cli
