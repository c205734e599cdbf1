// The Prometheus text of /metrics: histogram buckets, counters from the handlers and gauges from
// the engine's stats, in a form a Prometheus parser accepts.
#include "server/metrics.h"

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <sstream>

namespace metrale::server {
namespace {

// Parses "name{labels} value" lines; checks that comments are HELP/TYPE lines.
std::map<std::string, double> parse(const std::string& text) {
  std::map<std::string, double> values;
  std::istringstream lines(text);
  const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?) (-?[0-9.e+-]+|\+Inf|NaN)$)");
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    std::smatch match;
    EXPECT_TRUE(std::regex_match(line, match, sample)) << "not a sample line: '" << line << "'";
    if (match.size() == 4) values[match[1]] = std::stod(match[3]);
  }
  return values;
}

TEST(Metrics, HistogramIsCumulative) {
  Histogram histogram({0.1, 1.0});
  histogram.observe(0.05);
  histogram.observe(0.1);  // on a bound: counted in that bucket (le)
  histogram.observe(0.5);
  histogram.observe(7.0);
  std::string out;
  histogram.render("h", "help", out);
  const auto values = parse(out);
  EXPECT_EQ(values.at("h_bucket{le=\"0.1\"}"), 2);
  EXPECT_EQ(values.at("h_bucket{le=\"1\"}"), 3);
  EXPECT_EQ(values.at("h_bucket{le=\"+Inf\"}"), 4);
  EXPECT_EQ(values.at("h_count"), 4);
  EXPECT_DOUBLE_EQ(values.at("h_sum"), 7.65);
  EXPECT_NE(out.find("# TYPE h histogram"), std::string::npos);
}

TEST(Metrics, RenderCountersAndGauges) {
  ServerMetrics metrics;
  metrics.record_http("/v1/completions", 200);
  metrics.record_http("/v1/completions", 200);
  metrics.record_http("/v1/completions", 429);
  metrics.record_prompt_tokens(10);
  metrics.record_prompt_tokens(5);
  metrics.record_choice({"stop", 4, 1.0, 0.2, 0.05});
  metrics.record_choice({"abort", 1, 0.5, 0.3, -1.0});
  metrics.record_choice({"length", 0, 0.1, -1.0, -1.0});

  AsyncEngineStats stats;
  stats.num_running = 3;
  stats.num_waiting = 2;
  stats.finished_abort = 1;
  stats.refused_queue_full = 7;
  stats.engine.kv_blocks_total = 200;
  stats.engine.kv_blocks_used = 50;
  stats.engine.prefix_cache_queries = 40;
  stats.engine.prefix_cache_hits = 10;
  stats.engine.hybrid_state_restores = 2;
  stats.engine.drafted_tokens = 90;
  stats.engine.accepted_tokens = 60;
  stats.engine.verify_steps = 30;
  const auto values = parse(metrics.render(stats));

  EXPECT_EQ(values.at("metrale_num_requests_running"), 3);
  EXPECT_EQ(values.at("metrale_num_requests_waiting"), 2);
  EXPECT_DOUBLE_EQ(values.at("metrale_kv_cache_usage_perc"), 0.25);
  EXPECT_DOUBLE_EQ(values.at("metrale_prefix_cache_hit_rate"), 0.25);
  EXPECT_EQ(values.at("metrale_prefix_cache_hits_total"), 10);
  EXPECT_EQ(values.at("metrale_hybrid_state_restores_total"), 2);
  EXPECT_EQ(values.at("metrale_queue_full_total"), 7);
  EXPECT_EQ(values.at("metrale_spec_decode_num_draft_tokens_total"), 90);
  EXPECT_EQ(values.at("metrale_spec_decode_num_accepted_tokens_total"), 60);
  EXPECT_EQ(values.at("metrale_spec_decode_num_verify_steps_total"), 30);
  EXPECT_EQ(values.at("metrale_engine_requests_total{status=\"abort\"}"), 1);
  EXPECT_EQ(values.at("metrale_request_success_total{finished_reason=\"stop\"}"), 1);
  EXPECT_EQ(values.at("metrale_request_success_total{finished_reason=\"abort\"}"), 1);
  EXPECT_EQ(values.at("metrale_request_success_total{finished_reason=\"length\"}"), 1);
  EXPECT_EQ(values.at("metrale_request_success_total{finished_reason=\"error\"}"), 0);
  EXPECT_EQ(values.at("metrale_prompt_tokens_total"), 15);
  EXPECT_EQ(values.at("metrale_generation_tokens_total"), 5);
  EXPECT_EQ(values.at("metrale_time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(values.at("metrale_time_per_output_token_seconds_count"), 1);
  EXPECT_EQ(values.at("metrale_e2e_request_latency_seconds_count"), 3);
  EXPECT_EQ(values.at("metrale_http_requests_total{route=\"/v1/completions\",status=\"200\"}"), 2);
  EXPECT_EQ(values.at("metrale_http_requests_total{route=\"/v1/completions\",status=\"429\"}"), 1);
}

TEST(Metrics, EmptyEngineHasNoDivisionByZero) {
  const auto values = parse(ServerMetrics().render(AsyncEngineStats{}));
  EXPECT_EQ(values.at("metrale_kv_cache_usage_perc"), 0);
  EXPECT_EQ(values.at("metrale_prefix_cache_hit_rate"), 0);
}

// The state-slot gauges count the prefix-cache checkpoints too (the CacheManager's slots are the
// running sequences' and the checkpoints'): their help must say so, or a dashboard reads an idle
// server that keeps checkpoints as one with requests running.
TEST(Metrics, StateSlotGaugesSayTheyCountCheckpoints) {
  AsyncEngineStats stats;
  stats.engine.state_slots_total = 9;
  stats.engine.state_slots_used = 4;
  const std::string text = ServerMetrics().render(stats);
  const auto values = parse(text);
  EXPECT_EQ(values.at("metrale_state_slots_total"), 9);
  EXPECT_EQ(values.at("metrale_state_slots_used"), 4);
  const auto help = [&](const std::string& name) {
    const std::string prefix = "# HELP " + name + " ";
    const size_t at = text.find(prefix);
    return at == std::string::npos ? std::string() : text.substr(at, text.find('\n', at) - at);
  };
  EXPECT_NE(help("metrale_state_slots_used").find("checkpoint"), std::string::npos) << help("metrale_state_slots_used");
  EXPECT_NE(help("metrale_state_slots_total").find("checkpoint"), std::string::npos) << help("metrale_state_slots_total");
}

}  // namespace
}  // namespace metrale::server
