#include "engine/scheduler.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "core/log.h"

namespace metrale {
namespace {

void reset_to_recompute(Sequence* sequence) {
  sequence->num_computed = 0;
  sequence->mtp_computed = 0;
  sequence->mtp_missed = 0;
}

}  // namespace

bool PreemptionCosts::prefers_swap(uint64_t swap_bytes, int64_t tokens) const {
  if (copy_bytes_per_second <= 0.0 || prefill_seconds_per_token <= 0.0) return true;
  const double swap_seconds = 2.0 * static_cast<double>(swap_bytes) / copy_bytes_per_second;
  return swap_seconds <= static_cast<double>(tokens) * prefill_seconds_per_token;
}

void Scheduler::preempt(Sequence* sequence, CacheManager& cache) const {
  sequence->clear_drafts();
  sequence->status = SequenceStatus::kWaiting;
  ++sequence->num_preemptions;
  if (config_.preemption_mode != PreemptionMode::kRecompute && cache.can_swap_out(sequence->id)) {
    const uint64_t bytes = cache.swap_bytes(sequence->id);
    const bool swap =
        config_.preemption_mode == PreemptionMode::kSwap || costs_.prefers_swap(bytes, sequence->num_computed);
    METRALE_LOG_DEBUG(
        "preempting sequence {}: swap {} bytes out and in at {:.2f} GB/s ({:.3f} ms) or recompute {} "
        "tokens at {:.3f} ms/token ({:.3f} ms): {}",
        sequence->id, bytes, costs_.copy_bytes_per_second / 1e9,
        costs_.copy_bytes_per_second > 0 ? 2e3 * static_cast<double>(bytes) / costs_.copy_bytes_per_second : 0.0,
        sequence->num_computed, costs_.prefill_seconds_per_token * 1e3,
        static_cast<double>(sequence->num_computed) * costs_.prefill_seconds_per_token * 1e3,
        swap ? "swap" : "recompute");
    if (swap && cache.swap_out(sequence->id)) return;
  }
  cache.free_sequence(sequence->id);
  reset_to_recompute(sequence);
}

SchedulePlan Scheduler::schedule(std::vector<Sequence*>& running, std::deque<Sequence*>& waiting, CacheManager& cache) {
  SchedulePlan plan;
  int64_t budget = config_.max_num_batched_tokens;
  // Prefill tokens still allowed this step: limited only when some running sequence decodes.
  const auto decodes_next = [](const Sequence* s) {
    return s->num_tokens() - s->num_computed == 1 && !s->request.return_prompt_logits;
  };
  int64_t prefill_left = std::numeric_limits<int64_t>::max();
  if (prefill_limit_ > 0 && std::any_of(running.begin(), running.end(), decodes_next)) prefill_left = prefill_limit_;
  const auto chunk_for = [&](const Sequence& sequence) {
    int64_t count = std::min(sequence.num_tokens() - sequence.num_computed, budget);
    if (count > 1) count = std::min(count, prefill_left);
    if (config_.max_prefill_chunk > 0) count = std::min<int64_t>(count, config_.max_prefill_chunk);
    // Hybrid models: the chunk ends at the next state checkpoint point, so that the state there exists.
    const int64_t checkpoint = cache.next_checkpoint_position(sequence.num_prompt, sequence.num_computed);
    if (checkpoint > sequence.num_computed) count = std::min(count, checkpoint - sequence.num_computed);
    return count;
  };

  // Running sequences, oldest first. If one cannot grow, preempt from the newest end.
  std::sort(running.begin(), running.end(), [](const Sequence* a, const Sequence* b) { return a->arrival < b->arrival; });
  std::vector<Sequence*> kept;
  kept.reserve(running.size());
  for (size_t i = 0; i < running.size(); ++i) {
    Sequence* sequence = running[i];
    const int64_t count = chunk_for(*sequence);
    if (count <= 0) {
      kept.push_back(sequence);
      continue;
    }
    // Drafts ride on a chunk that reaches the end of the known tokens (a decode row), under the
    // same budget; they are the first thing given up when blocks are short.
    int64_t drafts = 0;
    if (sequence->num_computed + count == sequence->num_tokens() && sequence->draft_base == sequence->num_tokens())
      drafts = std::clamp<int64_t>(budget - count, 0, static_cast<int64_t>(sequence->draft_tokens.size()));
    bool reserved = cache.reserve(sequence->id, sequence->num_computed + count + drafts);
    if (!reserved && drafts > 0) {
      drafts = 0;
      reserved = cache.reserve(sequence->id, sequence->num_computed + count);
    }
    while (!reserved && running.size() > i + 1) {
      Sequence* victim = running.back();
      running.pop_back();
      preempt(victim, cache);
      plan.preempted.push_back(victim);
      reserved = cache.reserve(sequence->id, sequence->num_computed + count);
    }
    if (!reserved) {
      // Even alone it does not fit this step: preempt it too (it is rescheduled when blocks free up).
      preempt(sequence, cache);
      plan.preempted.push_back(sequence);
      continue;
    }
    kept.push_back(sequence);
    if (sequence->num_tokens() - sequence->num_computed > 1) prefill_left -= count;
    plan.chunks.push_back({sequence, count, sequence->num_computed + count == sequence->num_tokens(), drafts});
    plan.num_tokens += count + drafts;
    plan.num_draft_rows += drafts;
    budget -= count + drafts;
  }
  running = std::move(kept);
  // Preempted sequences go back to the front of the queue, oldest first.
  std::sort(plan.preempted.begin(), plan.preempted.end(),
            [](const Sequence* a, const Sequence* b) { return a->arrival > b->arrival; });
  for (Sequence* sequence : plan.preempted) waiting.push_front(sequence);

  // Admit waiting sequences while there is room. A preemption this step means memory is tight:
  // admit nothing new until the running set has drained a little.
  while (plan.preempted.empty() && budget > 0 && prefill_left > 0 && !waiting.empty() &&
         static_cast<int32_t>(running.size()) < config_.max_num_seqs) {
    Sequence* sequence = waiting.front();
    // Its disk reads (queued ahead of admission) still run: admitting it now would hold the whole
    // step until they land. With nothing else to run there is nothing to hold up.
    if (!running.empty() && cache.reads_pending(sequence->id)) break;
    if (cache.is_swapped(sequence->id)) {
      // Swapped out by a preemption: it comes back whole (its blocks and its slot) and goes on.
      const int64_t count = chunk_for(*sequence);
      if (count <= 0 || !cache.can_swap_in(sequence->id, sequence->num_computed + count)) break;
      if (cache.swap_in(sequence->id) == SwapIn::kDone) {
        METRALE_CHECK(cache.reserve(sequence->id, sequence->num_computed + count),
                      "swapped sequence {} did not fit as can_swap_in said", sequence->id);
        ++plan.swapped_in;
        waiting.pop_front();
        if (sequence->num_tokens() - sequence->num_computed > 1) prefill_left -= count;
        sequence->status = SequenceStatus::kRunning;
        running.push_back(sequence);
        plan.chunks.push_back({sequence, count, sequence->num_computed + count == sequence->num_tokens(), 0});
        plan.num_tokens += count;
        budget -= count;
        continue;
      }
      // Its swapped contents were lost in the tier (the cache has dropped them): admitted afresh.
      reset_to_recompute(sequence);
    }
    METRALE_CHECK(sequence->num_computed == 0 && !cache.has_sequence(sequence->id),
                  "waiting sequence {} holds cache entries", sequence->id);
    const bool use_prefix_cache = cache.prefix_caching() && !sequence->request.return_prompt_logits;
    const auto match = cache.begin_sequence(sequence->id, sequence->tokens, use_prefix_cache);
    if (!match) break;  // no state slot free
    sequence->num_computed = match->cached_tokens;
    const int64_t count = chunk_for(*sequence);
    if (count <= 0 || !cache.reserve(sequence->id, sequence->num_computed + count)) {
      // Not this step: give the prefix back (its blocks stay cached) and keep the queue order.
      cache.free_sequence(sequence->id);
      sequence->num_computed = 0;
      break;
    }
    if (use_prefix_cache) {
      plan.prefix_query_tokens += sequence->num_tokens();
      plan.prefix_hit_tokens += match->cached_tokens;
      plan.state_restores += match->restored_state ? 1 : 0;
    }
    waiting.pop_front();
    if (sequence->num_tokens() - sequence->num_computed > 1) prefill_left -= count;
    sequence->status = SequenceStatus::kRunning;
    running.push_back(sequence);
    sequence->mtp_computed = sequence->num_computed;  // a prefix hit's blocks hold its MTP keys too
    plan.chunks.push_back({sequence, count, sequence->num_computed + count == sequence->num_tokens(), 0});
    plan.num_tokens += count;
    budget -= count;
  }
  return plan;
}

}  // namespace metrale
