// metrale_tokenizer_bench: encode (and decode) throughput of metrale's tokenizer on a corpus.
//
//   metrale_tokenizer_bench --model DIR --corpus FILE [--repeat N] [--threads T]
//
// FILE holds one JSON string per line (a document); every document is encoded separately, as a
// server encodes requests. One warm-up pass (which also fills the word cache, as HF's warms its
// own), then N timed passes; the best pass is reported. Time is process CPU time, which a busy
// machine distorts far less than wall time (wall time is reported too). With --threads T > 1 the
// documents are shared among T threads encoding at once through one Tokenizer (then wall time is
// what counts). Prints a human summary on stderr and one JSON object on stdout (read by
// tools/oracles/bench_tokenizer.mjs).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <time.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model;
  std::string corpus;
  int repeat = 5;
  int threads = 1;
};

[[noreturn]] void usage(const char* message) {
  std::fprintf(stderr, "metrale_tokenizer_bench: %s\nusage: metrale_tokenizer_bench --model DIR --corpus FILE "
                       "[--repeat N] [--threads T]\n", message);
  std::exit(2);
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (i + 1 >= argc) usage("every option takes a value");
    const char* value = argv[++i];
    if (flag == "--model") {
      options.model = value;
    } else if (flag == "--corpus") {
      options.corpus = value;
    } else if (flag == "--repeat") {
      options.repeat = std::max(1, std::atoi(value));
    } else if (flag == "--threads") {
      options.threads = std::max(1, std::atoi(value));
    } else {
      usage("unknown option");
    }
  }
  if (options.model.empty() || options.corpus.empty()) usage("--model and --corpus are required");
  return options;
}

std::vector<std::string> read_documents(const std::string& path) {
  std::ifstream in(path);
  if (!in) metrale::raise(metrale::ErrorCode::kNotFound, "cannot open {}", path);
  std::vector<std::string> documents;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) documents.push_back(nlohmann::json::parse(line).get<std::string>());
  }
  return documents;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// Best CPU and wall seconds of `repeat` runs of `run`.
template <typename Run>
std::pair<double, double> best_of(int repeat, Run&& run) {
  double best_cpu = 1e30;
  double best_wall = 1e30;
  for (int pass = 0; pass < repeat; ++pass) {
    const double cpu_start = cpu_seconds();
    const auto wall_start = Clock::now();
    run();
    best_cpu = std::min(best_cpu, cpu_seconds() - cpu_start);
    best_wall = std::min(best_wall, seconds_since(wall_start));
  }
  return {best_cpu, best_wall};
}

// Encodes every document once, spread over `threads` threads; returns the total token count.
int64_t encode_all(const metrale::Tokenizer& tokenizer, const std::vector<std::string>& documents, int threads,
                   std::vector<std::vector<int32_t>>& ids) {
  std::atomic<size_t> next{0};
  std::atomic<int64_t> tokens{0};
  const auto worker = [&] {
    int64_t count = 0;
    for (size_t i = next++; i < documents.size(); i = next++) {
      ids[i] = tokenizer.encode(documents[i]);
      count += static_cast<int64_t>(ids[i].size());
    }
    tokens += count;
  };
  if (threads == 1) {
    worker();
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(worker);
    for (auto& thread : pool) thread.join();
  }
  return tokens.load();
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  try {
    const auto load_start = Clock::now();
    const metrale::Tokenizer tokenizer = metrale::Tokenizer::from_dir(options.model);
    const double load_seconds = seconds_since(load_start);
    const std::vector<std::string> documents = read_documents(options.corpus);
    int64_t bytes = 0;
    for (const auto& document : documents) bytes += static_cast<int64_t>(document.size());

    std::vector<std::vector<int32_t>> ids(documents.size());
    const int64_t tokens = encode_all(tokenizer, documents, options.threads, ids);  // warm-up
    const auto [encode_cpu, encode_wall] =
        best_of(options.repeat, [&] { encode_all(tokenizer, documents, options.threads, ids); });
    size_t decoded_bytes = 0;
    const auto [decode_cpu, decode_wall] = best_of(options.repeat, [&] {
      decoded_bytes = 0;
      for (const auto& document_ids : ids) decoded_bytes += tokenizer.decode(document_ids).size();
    });
    if (decoded_bytes != static_cast<size_t>(bytes)) {
      std::fprintf(stderr, "note: decoded %zu bytes of %lld (normalization changed the text)\n", decoded_bytes,
                   static_cast<long long>(bytes));
    }
    // Single-threaded, CPU time is the robust measure; with threads, the wall time.
    const double best_encode = options.threads == 1 ? encode_cpu : encode_wall;
    const double best_decode = decode_cpu;

    const double mb = static_cast<double>(bytes) / 1e6;
    std::fprintf(stderr,
                 "metrale: %zu documents, %.2f MB, %lld tokens, %d thread(s); load %.3f s\n"
                 "  encode: %.3f s (%s) best of %d = %.2f MB/s, %.0f tokens/s\n"
                 "  decode: %.3f s best of %d = %.2f MB/s\n",
                 documents.size(), mb, static_cast<long long>(tokens), options.threads, load_seconds, best_encode,
                 options.threads == 1 ? "CPU" : "wall", options.repeat, mb / best_encode, static_cast<double>(tokens) / best_encode, best_decode,
                 options.repeat, mb / best_decode);
    const nlohmann::json result = {{"documents", documents.size()},    {"bytes", bytes},
                                   {"tokens", tokens},                 {"threads", options.threads},
                                   {"load_seconds", load_seconds},     {"encode_seconds", best_encode},
                                   {"encode_wall_seconds", encode_wall},
                                   {"encode_mb_per_s", mb / best_encode},
                                   {"encode_tokens_per_s", static_cast<double>(tokens) / best_encode},
                                   {"decode_seconds", best_decode},    {"decode_mb_per_s", mb / best_decode}};
    std::printf("%s\n", result.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "metrale_tokenizer_bench: error: %s\n", e.what());
    return 1;
  }
}
