// ForwardBatch: one step's ragged batch as the model sees it. S sequences; sequence s adds
// q_len_s = cu_q[s+1] - cu_q[s] tokens at positions [kv_lens[s] - q_len_s, kv_lens[s]).
// Decode, prefill, chunked prefill and mixed steps are all this one shape.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "runtime/tensor.h"

namespace metrale {

struct ForwardBatch {
  int64_t num_tokens = 0;  // T
  int64_t num_seqs = 0;    // S
  int64_t block_size = 0;  // tokens per KV block
  // Upper bounds over the batch (exact for eager steps; CUDA graphs capture with the bounds of
  // the graph's shape), for kernels that plan on the host.
  int64_t max_q_len = 0;
  int64_t max_kv_len = 0;

  // On the model's device:
  Tensor token_ids;     // [T] i32
  Tensor positions;     // [T] i32
  Tensor cu_q;          // [S+1] i32, cu_q[0] = 0, cu_q[S] = T
  Tensor kv_lens;       // [S] i32, tokens in the cache after this step's write
  Tensor block_tables;  // [S, max_blocks] i32
  Tensor slot_mapping;  // [T] i32, cache slot of each new token (block * block_size + offset)
  Tensor logit_rows;    // [R] i32, rows of the batch whose logits the step returns
  // Per-slot cache tensors: the state slot of each sequence ([S] i32; empty when the model declares
  // none). A sequence whose cached length is 0 (kv_lens[s] == q_len_s) starts from its initial
  // state whatever its slot holds; every forward leaves the state after the sequence's last row of
  // this step in its slot.
  Tensor state_slots;

  // Host copies of the same metadata, for planning and CPU kernels.
  std::span<const int32_t> host_cu_q;
  std::span<const int32_t> host_kv_lens;
  std::span<const int32_t> host_logit_rows;
  std::span<const int32_t> host_state_slots;

  // Optional output (empty: not asked for): [T, H] in the activation dtype (f32 on the CPU, bf16 on
  // the GPU), contiguous. Model::forward writes the final normalised hidden state of every row (after
  // the model's final norm: the vector the LM head multiplies, h_t of the MTP head);
  // Model::mtp_forward writes the MTP head's output o_t (after its norm), the `hidden` of a chained
  // draft step.
  Tensor hidden_out;

  // Speculative verify (Model::commit_verified). When set, blocks with per-slot state read their
  // slots but do not write them; they keep their per-row inputs in verify_scratch instead, and
  // Model::commit_verified then advances every sequence's slots over its accepted rows. Paged cache
  // tensors are written for every row as usual (the engine truncates the rejected tail). Logits and
  // hidden_out are exactly those of a plain step over the same rows (GDN layers run the
  // token-by-token delta rule, as decode does).
  bool verify = false;
  Tensor verify_scratch;  // [>= Model::verify_scratch_bytes(T, S)] u8 on the device, caller-owned;
                          // must stay untouched until commit_verified

  // Per-row inputs the model declared (Model::step_input_specs), prepared on the host by
  // Model::prestage: step_inputs[i] is [T, per_row] of entry i's dtype on the model's device, at fixed
  // addresses (CUDA graphs replay them). Empty when the model declares none.
  std::span<const Tensor> step_inputs;

  // Set on the first step the engine serves and on the MTP head's forwards that follow it (never on
  // warm-up, profiling or graph-capture steps): blocks that calibrate their KV-cache scales on real
  // tokens (--calculate-kv-scales) do it on the first such batch that writes keys, then keep them.
  bool calibrate_kv_scales = false;

  bool all_decode() const { return num_tokens == num_seqs; }  // every sequence adds exactly one token
};

// The rows of a verify step that its sequences keep: sequence s keeps the first kept_s rows of its
// q_len_s rows (1 <= kept_s <= q_len_s), the row it was verified from plus its accepted drafts.
// The commit replays the verify batch's own rows split into 2S parts: part 2s holds sequence s's
// kept rows (its state slot), part 2s + 1 the rows it rejects (slot -1: computed, never kept), so
// that nothing needs gathering. Arrays on the model's device: built on the host and uploaded, or
// laid out in fixed buffers and replayed from a CUDA graph.
struct VerifyCommit {
  int64_t max_rows = 0;  // bound on the longest part (host planning)
  Tensor cu_parts;       // [2S+1] i32 over the verify batch's rows; cu_parts[2S] = T
  Tensor kv_lens;        // [2S] i32: kept parts: context + kept_s; rejected parts: their length
  Tensor slots;          // [2S] i32: kept parts: the sequence's state slot; rejected parts: -1
};

// The host arrays of a VerifyCommit ([2S + 1], [2S], [2S] i32): sequence s of the verify batch
// (its rows from cu_q [S + 1], kv_lens [S], state_slots [S] or empty) keeps its first kept[s] rows;
// sequences past kept.size() keep 1 (padding sequences of a fixed layout). Part 2s holds the kept
// rows on the sequence's slot, part 2s + 1 the rejected rest on slot -1. Throws kInvalidArgument
// unless 1 <= kept[s] <= q_len_s. Returns the longest q_len (VerifyCommit::max_rows).
int64_t fill_commit_parts(std::span<const int32_t> cu_q, std::span<const int32_t> kv_lens,
                          std::span<const int32_t> state_slots, std::span<const int32_t> kept, int32_t* cu_parts,
                          int32_t* part_kv_lens, int32_t* part_slots);

// A per-row input of a step, prepared on the host before upload (e.g. PLE table rows).
struct StepInputSpec {
  std::string name;
  DType dtype = DType::kI32;
  int64_t per_row = 1;  // elements per batch row
};

// What prestage() sees of a step: the host arrays of the batch (padding rows included: their
// sequence has an empty history and they may be filled with anything).
struct PrestageRows {
  int64_t num_tokens = 0, num_seqs = 0;
  std::span<const int32_t> token_ids;  // [T]
  std::span<const int32_t> positions;  // [T]
  std::span<const int32_t> cu_q;       // [S + 1]
  // [S]: sequence s's tokens before its first row of this step (its cached context, in order).
  std::span<const std::span<const int32_t>> history;
};

}  // namespace metrale
