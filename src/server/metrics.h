// Server metrics in the Prometheus text format (version 0.0.4), served at GET /metrics. Counters
// and histograms are recorded by the request handlers; gauges (running and waiting requests, KV
// usage, prefix-cache counters) are read from the engine's stats when the page is rendered.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "engine/async_engine.h"

namespace metrale::server {

// A cumulative histogram with fixed upper bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // Appends the _bucket, _sum and _count series of `name`.
  void render(std::string_view name, std::string_view help, std::string& out) const;

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0.0;
  int64_t count_ = 0;
};

// What one finished choice (one engine request) contributes.
struct ChoiceRecord {
  std::string finish_reason;  // "stop", "length", "abort", "error"
  int64_t generation_tokens = 0;
  double e2e_seconds = 0.0;   // submission to the end
  double ttft_seconds = -1.0; // submission to the first token; < 0: no token
  double tpot_seconds = -1.0; // mean time per output token after the first; < 0: fewer than 2 tokens
};

class ServerMetrics {
 public:
  ServerMetrics();

  void record_http(std::string_view route, int status);
  void record_prompt_tokens(int64_t tokens);  // once per admitted prompt
  void record_choice(const ChoiceRecord& record);
  // Gauges from `stats` plus every counter and histogram.
  std::string render(const AsyncEngineStats& stats) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> http_requests_;  // (route, status) -> count
  std::map<std::string, int64_t> finished_;                      // finish reason -> count
  int64_t prompt_tokens_ = 0;
  int64_t generation_tokens_ = 0;
  Histogram ttft_;
  Histogram tpot_;
  Histogram e2e_;
};

}  // namespace metrale::server
