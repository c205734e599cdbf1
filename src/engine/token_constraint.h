// TokenConstraint: a per-request restriction of which tokens may come next (constrained decoding:
// JSON schemas, forced tool calls). The engine knows nothing of grammars: a caller above it (the
// server, with the grammar matcher of text/grammar/) implements this interface and hands one object
// per request in Request::constraint.
//
// The engine's protocol per sampling chunk (StepSampler):
//   before the forward (on the mask worker, overlapping the forward): for each row of the chunk,
//     fill_next_mask(row mask), then accept(draft) for the draft that row verifies; a draft the
//     constraint refuses ends the walk (later drafts cannot be accepted); then rollback() of every
//     draft accepted during the walk, so the state is again that of the sequence's known tokens;
//   after the forward: each row's logits get -inf where its mask bit is clear, the row is sampled
//     (greedy or rejection sampling of drafts), and every emitted token is accept()ed in order.
// A mask-free row (fill_next_mask returned false: e.g. inside a reasoning block) samples unmasked.
//
// One object is used by one thread at a time (the engine hands it between its thread and the mask
// worker with a happens-before edge). An exception from it fails the step (and so its requests),
// as any other failure inside a step does.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

namespace metrale {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;

  // Writes the tokens allowed next into `bitmask` (ceil(vocab / 32) words, zeroed by the caller;
  // bit t % 32 of word t / 32 set: token t allowed) and returns true; false (bitmask untouched) when
  // every token is allowed at this point.
  virtual bool fill_next_mask(std::span<uint32_t> bitmask) = 0;
  // Advances by one token; false (and nothing changes) when the constraint does not allow it.
  virtual bool accept(int32_t token) = 0;
  // Undoes the last `num_tokens` accepted tokens.
  virtual void rollback(int32_t num_tokens) = 0;
};

// Bit t of a token bitmask (see TokenConstraint::fill_next_mask).
inline bool token_allowed(std::span<const uint32_t> bitmask, int64_t token) {
  return ((bitmask[static_cast<size_t>(token >> 5)] >> (token & 31)) & 1u) != 0;
}

// logits[t] = -inf for every token t whose bit is clear: [V] f32 row, bitmask of ceil(V / 32) words.
// Returns false (and leaves the row unchanged) when the mask allows no token of the row.
bool apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> bitmask);

}  // namespace metrale
