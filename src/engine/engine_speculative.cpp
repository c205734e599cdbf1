// Engine: the speculative-decoding parts of the step (engine/speculator.h has the scheme).
#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "runtime/buffer.h"

namespace metrale {
namespace {

// Independent counter-based random streams of a request, besides the Sampler's own (seed, step).
constexpr uint64_t kAcceptStream = 0x5eca'cce9'7000'0001ull;
constexpr uint64_t kResidualStream = 0x5eca'cce9'7000'0002ull;
constexpr uint64_t kDraftStream = 0x5eca'cce9'7000'0003ull;
constexpr uint64_t kReplayStream = 0x5eca'cce9'7000'0004ull;

float stream_uniform(uint64_t seed, uint64_t stream, uint64_t step) {
  return uniform_for(splitmix64_at(seed, stream), step);
}

// A sequence that decodes next step: its only uncomputed token is the last one.
bool is_decoding(const Sequence& sequence) {
  return sequence.num_computed == sequence.num_tokens() - 1 && sequence.num_output() > 0 &&
         !sequence.request.return_prompt_logits;
}

// Drafts worth verifying for a sequence: the j-th draft is kept while the chance that the chain
// reaches it stays above this.
constexpr double kMinDraftReach = 0.15;

}  // namespace

void Engine::configure_speculation(std::vector<LayerCacheSpec>& specs) {
  SpeculativeConfig& spec = config_.speculative;
  spec.validate();
  if (spec.method == SpeculativeMethod::kNone) return;
  const bool recurrent = std::any_of(specs.begin(), specs.end(), [](const LayerCacheSpec& layer) {
    return layer.kind == LayerCacheKind::kRecurrent && !layer.states.empty();
  });
  if (recurrent && model_->verify_scratch_bytes(2, 1) == 0) {
    // Without the verify contract a verify step would advance the recurrent state over rejected
    // drafts: speculation would change the output.
    METRALE_LOG_WARN("speculative decoding is off: model '{}' has recurrent layers that cannot verify drafts",
                     model_->config().model_type);
    spec.method = SpeculativeMethod::kNone;
    return;
  }
  if (spec.method == SpeculativeMethod::kMtp) {
    if (!model_->has_mtp()) {
      raise(ErrorCode::kInvalidArgument, "--speculative-method mtp: model '{}' has no MTP head (mtp.* weights)",
            model_->config().model_type);
    }
    const std::vector<LayerCacheSpec> mtp = model_->mtp_cache_specs();
    specs.insert(specs.end(), mtp.begin(), mtp.end());
  }
  // Priors until measured: the MTP head of a trained checkpoint accepts most drafts; n-gram lookup
  // only where text repeats.
  spec_controller_ = SpeculationController(spec, spec.method == SpeculativeMethod::kMtp ? 0.6 : 0.4);
  METRALE_LOG_INFO("speculative decoding: {} with up to {} drafts{}", speculative_method_name(spec.method),
                   spec.num_drafts, spec.replay_accept_rate >= 0.0 ? " (BENCHMARK MODE: acceptance replayed)" : "");
}

void Engine::prepare_drafts() {
  const SpeculativeConfig& spec = config_.speculative;
  const bool replay = spec.replay_accept_rate >= 0.0;
  // Decoding sequences, their expected acceptance and the drafts each could verify.
  std::vector<Sequence*> decoding;
  std::vector<double> acceptance;
  std::vector<int32_t> available;
  int64_t other_rows = 0;
  for (Sequence* sequence : running_) {
    if (!is_decoding(*sequence)) {
      other_rows +=
          std::min<int64_t>(sequence->num_tokens() - sequence->num_computed, config_.scheduler.max_num_batched_tokens);
      sequence->draft_tokens.clear();
      sequence->draft_probs.clear();
      continue;
    }
    // No drafts past max_tokens (the verify emits one token more than it accepts) or the context.
    int64_t limit = std::min<int64_t>(spec.num_drafts, sequence->request.max_tokens - sequence->num_output() - 1);
    limit = std::min<int64_t>(limit, plan_.max_model_len - sequence->num_tokens());
    const double a = spec_controller_.acceptance(sequence->acceptance_ema);
    if (spec.adaptive && !replay) {
      // Drafts the chain is unlikely to reach cost rows in the ragged layout: keep those it reaches
      // with some chance, at least one (a sequence cut to none would never verify again and its
      // estimate could never recover).
      int64_t worth = 0;
      for (double reach = a; worth < limit && reach >= kMinDraftReach; reach *= a) ++worth;
      limit = std::min(limit, std::max<int64_t>(worth, 1));
    }
    decoding.push_back(sequence);
    acceptance.push_back(a);
    available.push_back(static_cast<int32_t>(std::max<int64_t>(limit, 0)));
  }
  SpeculationController::Choice choice = spec_controller_.choose(acceptance, available, other_rows);
  if (forced_plain_steps_ > 0) {
    --forced_plain_steps_;
    choice = {0, true};
  }
  // Proposals up to the step's cap.
  for (size_t i = 0; i < decoding.size(); ++i) {
    Sequence& sequence = *decoding[i];
    const int32_t limit = std::min(choice.drafts, available[i]);
    if (spec.method == SpeculativeMethod::kNgram) {
      // Tokens appended while this sequence drafted nothing are indexed apart and left out of the
      // step's measured cost: paid once, not by every step that drafts (a probe after a pause would
      // otherwise measure drafting as dear as the backlog).
      if (limit > 0 && sequence.ngram_index.pending(sequence.tokens) > 1 + spec.num_drafts) {
        const auto start = std::chrono::steady_clock::now();
        sequence.ngram_index.update(sequence.tokens, spec.ngram_min, spec.ngram_max);
        spec_untimed_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      sequence.draft_tokens = sequence.ngram_index.propose(sequence.tokens, spec.ngram_min, spec.ngram_max, limit);
      sequence.draft_probs.clear();
      sequence.draft_base = sequence.num_tokens();
    } else if (sequence.draft_base != sequence.num_tokens()) {
      sequence.draft_tokens.clear();  // MTP drafts of an older state (e.g. made before a preemption)
      sequence.draft_probs.clear();
    }
    if (replay) {
      // Benchmark mode: rows matter, not what they hold; pad to the step's count.
      sequence.draft_tokens.resize(static_cast<size_t>(limit), sequence.tokens.back());
      sequence.draft_probs.clear();
      sequence.draft_base = sequence.num_tokens();
    }
    available[i] = std::min(limit, static_cast<int32_t>(sequence.draft_tokens.size()));
  }
  // With the proposals known, verify only what pays (e.g. not the drafts of a few sequences of a
  // large batch); an exploration or probe keeps its choice.
  const int32_t cap =
      choice.explored ? choice.drafts : spec_controller_.refine(choice.drafts, acceptance, available, other_rows);
  for (size_t i = 0; i < decoding.size(); ++i) {
    Sequence& sequence = *decoding[i];
    const auto limit = static_cast<size_t>(std::min(cap, available[i]));
    if (sequence.draft_tokens.size() > limit) {
      sequence.draft_tokens.resize(limit);
      if (!sequence.draft_probs.empty())
        sequence.draft_probs.resize(limit * static_cast<size_t>(model_->config().vocab_size));
    }
  }
  // MTP: the head runs after this step (catch-up, and drafts for the next) when the next step is
  // expected to verify drafts. While it is off only its keys are written (write_mtp_keys), decode
  // steps' in batches: the head's view of the sequence stays whole, so drafting can resume, and a
  // probe measures acceptance, as if it had never stopped. A step exploring plain runs no head: it
  // measures plain decoding.
  // Prefill steps count the sequences about to decode: the waiting ones are admitted by this step's
  // schedule.
  const auto next_decoding =
      std::min<int64_t>(static_cast<int64_t>(running_.size() + waiting_.size()), config_.scheduler.max_num_seqs);
  // A probe runs the head too: when it finds that drafting pays, the next step probes again (see
  // SpeculationController::record_step) and needs its drafts.
  mtp_active_ = spec.method == SpeculativeMethod::kMtp && !(choice.explored && choice.drafts == 0) &&
                (!spec.adaptive || choice.probe || spec_controller_.planned_drafts(next_decoding) > 0);
  // MTP: every step's hidden states are kept, for the head or for the keys it would have written.
  runner_->set_keep_hidden(spec.method == SpeculativeMethod::kMtp);
}

int32_t Engine::mtp_chain_length() const {
  return std::max(1, spec_controller_.planned_drafts(static_cast<int64_t>(running_.size())));
}

std::vector<SampledToken> Engine::accept_chunk(const LogitRowUse& use, const Tensor& logits, int64_t& accepted) {
  Sequence& sequence = *use.chunk.sequence;
  const SamplingParams& params = sequence.request.sampling;
  const int64_t vocab = model_->config().vocab_size;
  const int64_t num_drafts = use.chunk.num_drafts;
  METRALE_CHECK(use.num_rows >= 1 + num_drafts, "sequence {}: {} logit rows for {} drafts", sequence.id, use.num_rows,
                num_drafts);
  const int64_t first = use.first_row + use.num_rows - 1 - num_drafts;  // the row of the last known token
  const bool replay = config_.speculative.replay_accept_rate >= 0.0;
  accepted = 0;
  std::vector<SampledToken> emitted;
  // The output as the token being chosen sees it: accepted drafts included (penalties).
  std::vector<int32_t> history(sequence.output().begin(), sequence.output().end());
  spec_scratch_.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i <= num_drafts; ++i) {
    float* row = logits.data_as<float>() + (first + i) * vocab;
    const std::span<float> raw(row, static_cast<size_t>(vocab));
    const auto step = static_cast<uint64_t>(sequence.num_output() + i);
    const bool last = i == num_drafts;
    const int32_t draft = last ? -1 : sequence.draft_tokens[static_cast<size_t>(i)];
    if (replay && !last) {
      // Benchmark mode: a seeded Bernoulli(p) stands in for the comparison with the target.
      if (stream_uniform(config_.speculative.replay_seed ^ sequence.seed, kReplayStream, step) <
          config_.speculative.replay_accept_rate) {
        emitted.push_back(describe_token(raw, draft, params.top_logprobs));
        ++accepted;
        continue;
      }
    }
    if (params.is_greedy() || last || replay) {
      // Greedy: the target's own choice, exactly as without speculation; a draft is kept when it
      // is that choice. The last row (bonus) samples as a plain decode row does.
      std::copy(raw.begin(), raw.end(), spec_scratch_.begin());
      SampledToken token = sampler_.sample(spec_scratch_, params, sequence.prompt(), history, sequence.seed, step);
      const bool matches = !last && !replay && token.token == draft;
      emitted.push_back(std::move(token));
      if (!matches) break;
      ++accepted;
      history.push_back(draft);
      continue;
    }
    // Sampling: rejection sampling against the target distribution of this row.
    std::copy(raw.begin(), raw.end(), spec_scratch_.begin());
    spec_probs_.resize(static_cast<size_t>(vocab));
    target_distribution(sampler_, spec_scratch_, params, sequence.prompt(), history, spec_probs_);
    std::span<const float> q;
    if (!sequence.draft_probs.empty()) {
      q = std::span<const float>(sequence.draft_probs).subspan(static_cast<size_t>(i * vocab), static_cast<size_t>(vocab));
    }
    bool kept = false;
    const int32_t token = rejection_sample(spec_probs_, q, draft, stream_uniform(sequence.seed, kAcceptStream, step),
                                           stream_uniform(sequence.seed, kResidualStream, step), kept);
    emitted.push_back(describe_token(raw, token, params.top_logprobs));
    if (!kept) break;
    ++accepted;
    history.push_back(draft);
  }
  return emitted;
}

void Engine::run_mtp_drafter(const StepResult& result, std::span<const int64_t> kept_rows) {
  const SpeculativeConfig& spec = config_.speculative;
  const int64_t vocab = model_->config().vocab_size;
  const int64_t num_layers = std::max<int64_t>(model_->num_mtp_layers(), 1);
  flush_mtp_stash();  // the head attends to every earlier position
  // Catch-up: every kept row of this step gets its MTP keys (row t with h_t and x_{t+1}). The last
  // row of a decoding sequence runs the whole head and drafts the token after its new one; the
  // other rows (prompts, accepted drafts) only write their keys.
  std::vector<MtpKeyRow> key_rows;
  std::vector<MtpRows> rows;
  std::vector<Sequence*> drafting;
  for (size_t u = 0; u < result.uses.size(); ++u) {
    const LogitRowUse& use = result.uses[u];
    Sequence& sequence = *use.chunk.sequence;
    const int64_t count = kept_rows[u];
    if (sequence.finished() || count <= 0) continue;
    const int64_t first_position = sequence.num_computed - count;
    const bool drafts = is_decoding(sequence);
    append_mtp_key_rows(use, count, drafts ? count - 1 : count, key_rows);
    if (drafts) {
      MtpRows seq_rows;
      seq_rows.seq_id = sequence.id;
      seq_rows.first_position = sequence.num_computed - 1;
      seq_rows.next_tokens = {sequence.tokens[static_cast<size_t>(sequence.num_computed)]};
      seq_rows.first_hidden_row = use.first_batch_row + count - 1;
      seq_rows.wants_logits = true;
      rows.push_back(std::move(seq_rows));
      drafting.push_back(&sequence);
    }
    advance_mtp(sequence, first_position, sequence.num_computed);
  }
  if (!key_rows.empty()) runner_->run_mtp_keys(key_rows, result.hidden);
  if (drafting.empty()) return;
  Tensor hidden;
  Tensor logits = runner_->run_mtp(rows, result.hidden, 0, hidden);
  // Draft j + 1 of a sequence continues from its o_t row of the step that drafted j (one row each).
  std::vector<int64_t> hidden_row(drafting.size());
  for (size_t d = 0; d < drafting.size(); ++d) hidden_row[d] = static_cast<int64_t>(d);
  const auto take_drafts = [&](const Tensor& step_logits, std::span<Sequence* const> sequences) {
    const bool argmax_only = std::all_of(sequences.begin(), sequences.end(), [&](const Sequence* sequence) {
      return sequence->request.sampling.is_greedy() || spec.replay_accept_rate >= 0.0;
    });
    if (argmax_only && step_logits.device().is_cuda()) {
      // Greedy drafts: the argmax on the device (a few bytes per row come back, not the rows).
      const std::vector<int32_t> best = runner_->argmax_rows(step_logits);
      // A row without a valid logit (-1) drafts token 0: a draft's value only affects acceptance.
      for (size_t d = 0; d < sequences.size(); ++d) sequences[d]->draft_tokens.push_back(std::max(best[d], 0));
      return;
    }
    std::vector<float> host(static_cast<size_t>(step_logits.numel()));
    copy_bytes(host.data(), Device::cpu(), step_logits.data(), step_logits.device(), host.size() * sizeof(float));
    for (size_t d = 0; d < sequences.size(); ++d) {
      Sequence& sequence = *sequences[d];
      const SamplingParams& params = sequence.request.sampling;
      const std::span<float> row(host.data() + static_cast<int64_t>(d) * vocab, static_cast<size_t>(vocab));
      if (params.is_greedy() || spec.replay_accept_rate >= 0.0) {
        // Argmax, lowest id on ties; NaN never wins (a draft's value only affects acceptance).
        int32_t best = 0;
        for (int64_t v = 1; v < vocab; ++v)
          if (row[static_cast<size_t>(v)] > row[static_cast<size_t>(best)]) best = static_cast<int32_t>(v);
        sequence.draft_tokens.push_back(best);
        continue;
      }
      // Sampling: draw the draft from the head's distribution under the request's parameters and
      // keep that distribution (q) for rejection sampling.
      std::vector<int32_t> history(sequence.output().begin(), sequence.output().end());
      history.insert(history.end(), sequence.draft_tokens.begin(), sequence.draft_tokens.end());
      for (float& x : row) {
        if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
      }
      const size_t offset = sequence.draft_probs.size();
      sequence.draft_probs.resize(offset + static_cast<size_t>(vocab));
      const std::span<float> q(sequence.draft_probs.data() + offset, static_cast<size_t>(vocab));
      target_distribution(sampler_, row, params, sequence.prompt(), history, q);
      const auto step = static_cast<uint64_t>(sequence.num_output() + static_cast<int64_t>(sequence.draft_tokens.size()) + 1);
      const double target = static_cast<double>(stream_uniform(sequence.seed, kDraftStream, step));
      double running = 0.0;
      int32_t chosen = -1;
      for (int64_t v = 0; v < vocab; ++v) {
        if (q[static_cast<size_t>(v)] <= 0.0f) continue;
        running += q[static_cast<size_t>(v)];
        chosen = static_cast<int32_t>(v);
        if (running > target) break;
      }
      sequence.draft_tokens.push_back(std::max(chosen, 0));
    }
  };
  for (Sequence* sequence : drafting) {
    sequence->draft_tokens.clear();
    sequence->draft_probs.clear();
    sequence->draft_base = sequence->num_tokens();
  }
  take_drafts(logits, drafting);
  // Chained drafts: row t + j with the draft before it and the o_t of the previous MTP step.
  const int32_t wanted = mtp_chain_length();
  std::vector<Sequence*> active = drafting;
  for (int32_t j = 1; j < wanted && !active.empty(); ++j) {
    std::vector<MtpRows> chain;
    std::vector<Sequence*> next_active;
    std::vector<int64_t> next_hidden_row;
    for (size_t d = 0; d < active.size(); ++d) {
      Sequence& sequence = *active[d];
      const int64_t position = sequence.num_computed - 1 + j;
      // Room for this row's MTP keys (the verify step reserves the same blocks anyway).
      if (position + 1 > plan_.max_model_len || !cache_->reserve(sequence.id, position + 1)) continue;
      MtpRows row;
      row.seq_id = sequence.id;
      row.first_position = position;
      row.next_tokens = {sequence.draft_tokens.back()};
      row.first_hidden_row = hidden_row[d];
      row.wants_logits = true;
      chain.push_back(std::move(row));
      next_active.push_back(&sequence);
      next_hidden_row.push_back(static_cast<int64_t>(next_active.size()) - 1);
    }
    if (chain.empty()) break;
    Tensor next_hidden;
    const Tensor chain_logits = runner_->run_mtp(chain, hidden, j % num_layers, next_hidden);
    take_drafts(chain_logits, next_active);
    hidden = next_hidden;
    active = std::move(next_active);
    hidden_row = std::move(next_hidden_row);
  }
}

}  // namespace metrale

namespace metrale {

bool Engine::all_greedy(const StepResult& result) const {
  for (const LogitRowUse& use : result.uses) {
    const SamplingParams& params = use.chunk.sequence->request.sampling;
    // Benchmark replay accepts by a seeded draw, whatever the parameters; the emitted token is
    // then the row's argmax.
    const bool replay = config_.speculative.replay_accept_rate >= 0.0;
    if (!replay && !params.is_greedy()) return false;
    if (params.top_logprobs > 0 || params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f ||
        params.frequency_penalty != 0.0f || use.chunk.sequence->request.return_prompt_logits)
      return false;
  }
  return true;
}

bool Engine::accept_greedy_rows(const StepResult& result, std::vector<std::vector<SampledToken>>& emitted,
                                std::vector<int64_t>& accepted) {
  const auto [tokens, logprobs] = runner_->fetch_greedy_rows(result);
  const bool replay = config_.speculative.replay_accept_rate >= 0.0;
  for (size_t u = 0; u < result.uses.size(); ++u) {
    const LogitRowUse& use = result.uses[u];
    const Sequence& sequence = *use.chunk.sequence;
    const int64_t num_drafts = use.chunk.num_drafts;
    accepted[u] = 0;
    emitted[u].clear();
    if (!use.chunk.samples || sequence.request.max_tokens == 0) continue;
    // The row of the chunk's last known token, then one per draft (a prefill chunk's last row).
    const int64_t first = use.first_row + use.num_rows - 1 - num_drafts;
    for (int64_t i = 0; i <= num_drafts; ++i) {
      const int64_t row = first + i;
      const int32_t best = tokens[static_cast<size_t>(row)];
      if (best < 0) raise(ErrorCode::kInternal, "greedy verify found no valid logit in row {}", row);
      const bool last = i == num_drafts;
      const int32_t draft = last ? -1 : sequence.draft_tokens[static_cast<size_t>(i)];
      if (replay && !last) {
        const auto step = static_cast<uint64_t>(sequence.num_output() + i);
        if (stream_uniform(config_.speculative.replay_seed ^ sequence.seed, kReplayStream, step) <
            config_.speculative.replay_accept_rate) {
          // Benchmark mode: the draft stands in for the target's choice; its logprob is not computed.
          SampledToken token;
          token.token = draft;
          token.logprob = 0.0f;
          emitted[u].push_back(token);
          ++accepted[u];
          continue;
        }
      }
      SampledToken token;
      token.token = best;
      token.logprob = logprobs[static_cast<size_t>(row)];
      emitted[u].push_back(token);
      if (last || replay || best != draft) break;
      ++accepted[u];
    }
  }
  return true;
}

void Engine::launch_mtp_drafter_fixed(const StepResult& result, std::span<const int64_t> accepted,
                                      const std::vector<std::vector<SampledToken>>& emitted) {
  flush_mtp_stash();  // the head attends to every earlier position
  const int32_t wanted = mtp_chain_length();
  std::vector<MtpFixedRow> rows(result.uses.size());
  for (size_t u = 0; u < result.uses.size(); ++u) {
    Sequence& sequence = *result.uses[u].chunk.sequence;
    MtpFixedRow& row = rows[u];
    // Before this step's bookkeeping: the verify's known token sits at t = num_computed, rows
    // t..t+a are kept and row t + i's next token is the i-th emitted one. A sequence that finishes
    // in the bookkeeping drafts for nothing (its drafts are dropped).
    const int64_t t = sequence.num_computed, a = accepted[u];
    if (static_cast<int64_t>(emitted[u].size()) != a + 1) continue;
    row.drafting = true;
    row.accepted = static_cast<int32_t>(a);
    for (const SampledToken& token : emitted[u]) row.next_tokens.push_back(token.token);
    // Chained draft j writes its MTP keys at t + a + j: room for as many as fit.
    for (int64_t j = 1; j < wanted; ++j) {
      const int64_t position = t + a + j;
      if (position + 1 > plan_.max_model_len || !cache_->reserve(sequence.id, position + 1)) break;
      row.chain_positions = j;
    }
    advance_mtp(sequence, t, t + a + 1);
  }
  mtp_chain_ = runner_->launch_mtp_fixed(result.fixed, rows, wanted);
}

void Engine::append_mtp_key_rows(const LogitRowUse& use, int64_t kept, int64_t count,
                                 std::vector<MtpKeyRow>& rows) const {
  const Sequence& sequence = *use.chunk.sequence;
  const int64_t first_position = sequence.num_computed - kept;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t position = first_position + i;
    rows.push_back(
        {sequence.id, position, sequence.tokens[static_cast<size_t>(position + 1)], use.first_batch_row + i});
  }
}

void Engine::advance_mtp(Sequence& sequence, int64_t first_position, int64_t end) {
  sequence.mtp_missed += std::max<int64_t>(0, first_position - sequence.mtp_computed);
  sequence.mtp_computed = end;
}

void Engine::write_mtp_keys(const StepResult& result, std::span<const int64_t> kept_rows) {
  std::vector<MtpKeyRow> rows;
  // A decode step without drafts: sequence u's hidden state sits in row u (both layouts).
  bool decode_step = true;
  for (size_t u = 0; u < result.uses.size(); ++u) {
    const LogitRowUse& use = result.uses[u];
    Sequence& sequence = *use.chunk.sequence;
    decode_step = decode_step && use.chunk.decodes() && use.chunk.num_drafts == 0 &&
                  use.first_batch_row == static_cast<int64_t>(u);
    const int64_t count = kept_rows[u];
    if (sequence.finished() || count <= 0) continue;
    append_mtp_key_rows(use, count, count, rows);
    advance_mtp(sequence, sequence.num_computed - count, sequence.num_computed);
  }
  if (rows.empty()) return;
  const auto step_rows = static_cast<int64_t>(result.uses.size());
  if (!decode_step || step_rows > runner_->mtp_stash_rows()) {
    runner_->run_mtp_keys(rows, result.hidden);
    return;
  }
  if (mtp_stash_used_ + step_rows > runner_->mtp_stash_rows()) flush_mtp_stash();
  runner_->stash_hidden_rows(result.hidden, 0, step_rows, mtp_stash_used_);
  for (MtpKeyRow& row : rows) {
    row.hidden_row += mtp_stash_used_;
    mtp_stash_rows_.push_back(row);
  }
  mtp_stash_used_ += step_rows;
}

void Engine::flush_mtp_stash() {
  if (mtp_stash_rows_.empty()) return;
  // A sequence that finished, or was preempted and has not recomputed the position, lost its blocks
  // there: its rows are dropped.
  std::vector<MtpKeyRow> rows;
  rows.reserve(mtp_stash_rows_.size());
  for (const MtpKeyRow& row : mtp_stash_rows_) {
    const auto it = sequences_.find(row.seq_id);
    if (it == sequences_.end() || it->second->finished() || row.position >= it->second->num_computed) continue;
    rows.push_back(row);
  }
  mtp_stash_rows_.clear();
  mtp_stash_used_ = 0;
  if (!rows.empty()) runner_->run_mtp_keys(rows, runner_->mtp_stash());
}

void Engine::collect_mtp_drafter_fixed(const StepResult& result) {
  const std::vector<std::vector<int32_t>> drafts = runner_->collect_mtp_fixed(mtp_chain_);
  mtp_chain_ = MtpChain();
  for (size_t u = 0; u < result.uses.size(); ++u) {
    Sequence& sequence = *result.uses[u].chunk.sequence;
    sequence.draft_tokens.clear();
    sequence.draft_probs.clear();
    if (drafts[u].empty() || sequence.finished() || !is_decoding(sequence)) continue;
    sequence.draft_tokens = drafts[u];
    sequence.draft_base = sequence.num_tokens();
  }
}

}  // namespace metrale
