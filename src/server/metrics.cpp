#include "server/metrics.h"

#include <algorithm>

#include <fmt/format.h>

namespace metrale::server {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const auto bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[static_cast<size_t>(bucket)];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string_view name, std::string_view help, std::string& out) const {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  cumulative += counts_.back();
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cumulative, name, sum_, name, count_);
}

namespace {

// Buckets in seconds, from vLLM's choices for the same series.
const std::vector<double> kTtftBounds = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5,   5.0,   7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kTpotBounds = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                         2.5,  5.0,   7.5,  10.0,  20.0, 40.0, 80.0};
const std::vector<double> kE2eBounds = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0, 15.0,
                                        20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0};

void counter(std::string& out, std::string_view name, std::string_view help, int64_t value) {
  out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, value);
}

void gauge(std::string& out, std::string_view name, std::string_view help, double value) {
  out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{} {}\n", name, help, name, name, value);
}

}  // namespace

ServerMetrics::ServerMetrics() : ttft_(kTtftBounds), tpot_(kTpotBounds), e2e_(kE2eBounds) {
  for (const char* reason : {"stop", "length", "abort", "error"}) finished_[reason] = 0;
}

void ServerMetrics::record_http(std::string_view route, int status) {
  std::lock_guard lock(mutex_);
  ++http_requests_[{std::string(route), status}];
}

void ServerMetrics::record_prompt_tokens(int64_t tokens) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += tokens;
}

void ServerMetrics::record_choice(const ChoiceRecord& record) {
  std::lock_guard lock(mutex_);
  ++finished_[record.finish_reason];
  generation_tokens_ += record.generation_tokens;
  e2e_.observe(record.e2e_seconds);
  if (record.ttft_seconds >= 0.0) ttft_.observe(record.ttft_seconds);
  if (record.tpot_seconds >= 0.0) tpot_.observe(record.tpot_seconds);
}

std::string ServerMetrics::render(const AsyncEngineStats& stats) const {
  const EngineStats& engine = stats.engine;
  std::string out;
  out.reserve(8192);
  gauge(out, "metrale_num_requests_running", "Requests the engine is running.", static_cast<double>(stats.num_running));
  gauge(out, "metrale_num_requests_waiting", "Requests waiting for a running slot.",
        static_cast<double>(stats.num_waiting));
  const double kv_usage =
      engine.kv_blocks_total > 0 ? static_cast<double>(engine.kv_blocks_used) / engine.kv_blocks_total : 0.0;
  gauge(out, "metrale_kv_cache_usage_perc", "Fraction of KV-cache blocks held by running requests (0 to 1).", kv_usage);
  gauge(out, "metrale_kv_cache_blocks_total", "KV-cache blocks.", engine.kv_blocks_total);
  gauge(out, "metrale_kv_cache_blocks_used", "KV-cache blocks held by running requests.", engine.kv_blocks_used);
  gauge(out, "metrale_kv_cache_blocks_cached", "Free KV-cache blocks that hold reusable prefixes.",
        engine.kv_blocks_cached);
  gauge(out, "metrale_state_slots_total",
        "Recurrent-state slots: one per running sequence plus the prefix-cache checkpoint slots.",
        engine.state_slots_total);
  gauge(out, "metrale_state_slots_used",
        "Recurrent-state slots in use: those of running requests plus the prefix-cache checkpoints held.",
        engine.state_slots_used);
  gauge(out, "metrale_host_tier_blocks_total", "Host-tier KV blocks (--swap-space).", engine.host_blocks_total);
  gauge(out, "metrale_host_tier_blocks_used", "Host-tier KV blocks held by swapped-out requests.", engine.host_blocks_used);
  gauge(out, "metrale_host_tier_slots_total", "Host-tier recurrent-state slots (--swap-space).", engine.host_slots_total);
  gauge(out, "metrale_host_tier_slots_used", "Host-tier recurrent-state slots held by swapped-out requests.",
        engine.host_slots_used);
  counter(out, "metrale_swapped_out_sequences_total", "Preemptions that swapped a request out to the host tier.",
          engine.swapped_out_sequences);
  counter(out, "metrale_swapped_in_sequences_total", "Swapped-out requests brought back from the host tier.",
          engine.swapped_in_sequences);
  counter(out, "metrale_swapped_out_blocks_total", "KV blocks copied to the host tier.", engine.swapped_out_blocks);
  counter(out, "metrale_swapped_in_blocks_total", "KV blocks copied back from the host tier.", engine.swapped_in_blocks);
  counter(out, "metrale_swapped_out_slots_total", "Recurrent-state slots copied to the host tier.",
          engine.swapped_out_slots);
  counter(out, "metrale_swapped_in_slots_total", "Recurrent-state slots copied back from the host tier.",
          engine.swapped_in_slots);
  counter(out, "metrale_swapped_to_disk_sequences_total", "Swapped-out requests moved from the host tier to disk.",
          engine.swapped_to_disk_sequences);
  counter(out, "metrale_prefix_blocks_to_disk_total", "Prefix-cache blocks spilled from the host tier to disk.",
          engine.prefix_blocks_to_disk);
  counter(out, "metrale_prefix_blocks_from_disk_total", "Prefix-cache blocks brought back from disk on a hit.",
          engine.prefix_blocks_from_disk);
  counter(out, "metrale_prefix_blocks_written_ahead_total",
          "Prefix-cache blocks written from the host tier to disk ahead of their eviction.",
          engine.prefix_blocks_written_ahead);
  counter(out, "metrale_disk_hits_declined_total",
          "Prefix-cache blocks found on disk but recomputed: reading them was measured slower.",
          engine.disk_hits_declined);
  counter(out, "metrale_prefix_prefetches_total",
          "Waiting requests whose prefix-cache disk hits were read ahead of their admission.",
          engine.prefix_prefetches);
  counter(out, "metrale_state_checkpoints_to_host_total",
          "Recurrent-state checkpoints kept in the host tier after "
          "leaving the device.",
          engine.checkpoints_to_host);
  counter(out, "metrale_state_checkpoints_restored_total",
          "Recurrent-state checkpoints restored from the host or "
          "disk tier on a prefix hit.",
          engine.checkpoints_restored_from_tiers);
  counter(out, "metrale_tier_entries_lost_total",
          "Host or disk tier entries that failed their integrity check "
          "(recomputed).",
          engine.tier_entries_lost);
  counter(out, "metrale_prefix_cache_blocks_to_host_total",
          "Prefix-cache blocks evicted from device memory into the host tier.", engine.prefix_blocks_to_host);
  counter(out, "metrale_prefix_cache_blocks_from_host_total",
          "Prefix-cache blocks the host tier gave back on a hit.", engine.prefix_blocks_from_host);
  counter(out, "metrale_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          engine.prefix_cache_queries);
  counter(out, "metrale_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", engine.prefix_cache_hits);
  gauge(out, "metrale_prefix_cache_hit_rate", "Prefix-cache hits over queries since start-up (tokens).",
        engine.prefix_cache_queries > 0
            ? static_cast<double>(engine.prefix_cache_hits) / static_cast<double>(engine.prefix_cache_queries)
            : 0.0);
  counter(out, "metrale_hybrid_state_restores_total", "Prefix-cache hits that restored a recurrent-state checkpoint.",
          engine.hybrid_state_restores);
  counter(out, "metrale_computed_prompt_tokens_total", "Prompt tokens run through the model (prefix-cache misses).",
          engine.computed_prompt_tokens);
  counter(out, "metrale_num_preemptions_total", "Requests preempted for lack of KV-cache blocks.",
          engine.num_preemptions);
  counter(out, "metrale_engine_steps_total", "Engine steps.", engine.num_steps);
  counter(out, "metrale_engine_failed_steps_total",
          "Engine steps abandoned after a failure (their requests failed; the engine recovered).",
          engine.failed_steps);
  counter(out, "metrale_spec_decode_num_draft_tokens_total", "Draft tokens verified (speculative decoding).",
          engine.drafted_tokens);
  counter(out, "metrale_spec_decode_num_accepted_tokens_total", "Draft tokens accepted (speculative decoding).",
          engine.accepted_tokens);
  counter(out, "metrale_spec_decode_num_verify_steps_total", "Engine steps that verified drafts.", engine.verify_steps);
  out += "# HELP metrale_engine_requests_total Engine requests by how they ended.\n"
         "# TYPE metrale_engine_requests_total counter\n";
  out += fmt::format("metrale_engine_requests_total{{status=\"stop\"}} {}\n", stats.finished_stop);
  out += fmt::format("metrale_engine_requests_total{{status=\"length\"}} {}\n", stats.finished_length);
  out += fmt::format("metrale_engine_requests_total{{status=\"abort\"}} {}\n", stats.finished_abort);
  out += fmt::format("metrale_engine_requests_total{{status=\"failed\"}} {}\n", stats.failed);
  out += fmt::format("metrale_engine_requests_total{{status=\"rejected\"}} {}\n", stats.rejected);
  counter(out, "metrale_queue_full_total", "Submissions refused because the waiting queue was full.",
          stats.refused_queue_full);

  std::lock_guard lock(mutex_);
  out += "# HELP metrale_request_success_total Finished choices by finish reason.\n"
         "# TYPE metrale_request_success_total counter\n";
  for (const auto& [reason, count] : finished_)
    out += fmt::format("metrale_request_success_total{{finished_reason=\"{}\"}} {}\n", reason, count);
  counter(out, "metrale_prompt_tokens_total", "Prompt tokens of admitted requests.", prompt_tokens_);
  counter(out, "metrale_generation_tokens_total", "Generated tokens.", generation_tokens_);
  ttft_.render("metrale_time_to_first_token_seconds", "Time from submission to the first token.", out);
  tpot_.render("metrale_time_per_output_token_seconds", "Mean time per output token after the first, per request.",
               out);
  e2e_.render("metrale_e2e_request_latency_seconds", "Time from submission to the end of a request.", out);
  out += "# HELP metrale_http_requests_total HTTP requests by route and status.\n"
         "# TYPE metrale_http_requests_total counter\n";
  for (const auto& [key, count] : http_requests_)
    out += fmt::format("metrale_http_requests_total{{route=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, count);
  return out;
}

}  // namespace metrale::server
