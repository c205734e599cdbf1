// A mini-runner that feeds a Model hand-built ragged ForwardBatches, without the engine floor:
// sequences' block tables and state slots come from a SequenceCaches, the runner builds the host
// arrays of each step (and, when the model declares step inputs, runs Model::prestage with each
// sequence's history), calls Model::forward and returns the logits of the step's rows.
//
// TestCache is the SequenceCaches the model tests use (floors 1-4 only): every cache tensor the model
// declares, poisoned (NaN, or -1 for integer tensors) so that a read of a row nobody wrote spoils
// the logits, with blocks and slots handed out in shuffled order so that every sequence's blocks are
// scattered and out of order. tests/cache runs the same runner over a CacheManager.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "model/model.h"
#include "runtime/arena.h"

namespace metrale::testing {

// One step's chunk of a sequence.
struct SeqChunk {
  int64_t seq_id;
  std::vector<int32_t> tokens;  // this step's new tokens of the sequence
};

// The host arrays of a hand-built ragged batch and the ForwardBatch that views them. Moving keeps the
// views valid: a moved vector keeps its buffer.
struct HostBatch {
  std::vector<int32_t> token_ids, positions, slot_mapping, cu_q{0}, kv_lens, logit_rows, state_slots;
  std::vector<int32_t> block_tables;  // [seqs][max_blocks], padding entries 0 (a correct kernel never reads them)
  std::vector<int64_t> seq_ids;
  int64_t max_blocks = 1;
  ForwardBatch batch;
};

// Where a runner's sequences keep their cache.
class SequenceCaches {
 public:
  virtual ~SequenceCaches() = default;
  virtual int32_t block_size() const = 0;
  // Grows the sequence's block table to hold `total_tokens` tokens (creating the sequence).
  virtual void reserve(int64_t seq_id, int64_t total_tokens) = 0;
  virtual std::span<const int32_t> block_table(int64_t seq_id) = 0;
  // The sequence's state slot (-1: none).
  virtual int32_t state_slot(int64_t seq_id) = 0;
  virtual ModelCaches caches() = 0;
};

// Builds the batch of `chunks` (in batch order): each sequence's tokens at its next positions, from
// lengths[seq_id] on, which it advances. Logit rows: every row, or with `last_rows_only` each chunk's
// last row (what a generating engine asks for).
void build_batch(const std::vector<SeqChunk>& chunks, std::map<int64_t, int64_t>& lengths, bool last_rows_only,
                 SequenceCaches& caches, HostBatch& host);

class TestCache : public SequenceCaches {
 public:
  // The caches of `blocks` (ModelCaches::blocks) and `mtp` (ModelCaches::mtp) in the activation dtype
  // f32.
  TestCache(std::vector<CacheSpec> blocks, std::vector<CacheSpec> mtp, Device device, int32_t block_size,
            int32_t num_blocks, int32_t num_state_slots, uint64_t seed);

  int32_t block_size() const override { return block_size_; }
  void reserve(int64_t seq_id, int64_t total_tokens) override;
  std::span<const int32_t> block_table(int64_t seq_id) override { return tables_[seq_id]; }
  int32_t state_slot(int64_t seq_id) override;  // assigned on first use
  ModelCaches caches() override { return split_model_caches(caches_, num_block_caches_); }
  // Gives `to` copies of the paged rows and the state slot of `from`.
  void copy_sequence(int64_t from, int64_t to);

 private:
  int32_t take_block();

  int32_t block_size_;
  size_t num_block_caches_;
  std::vector<CacheSpec> specs_;      // the blocks', then the MTP layers'
  std::vector<OwnedTensor> storage_;  // every declared tensor
  std::vector<BlockCache> caches_;    // one per spec
  std::vector<int32_t> free_blocks_;  // shuffled; taken from the back
  std::vector<int32_t> free_slots_;   // shuffled; taken from the back
  std::map<int64_t, std::vector<int32_t>> tables_;
  std::map<int64_t, int32_t> slots_;
};

// Drives Model::forward with hand-built ragged batches, tracking how many tokens each sequence has in
// the cache and, for models with step inputs, each sequence's tokens (the history prestage sees).
class ForwardRunner {
 public:
  // Over a TestCache of its own.
  explicit ForwardRunner(Model& model, int32_t block_size = 4, int32_t num_blocks = 64, uint64_t seed = 5,
                         int32_t num_state_slots = 8);
  // Over the caller's caches (which must outlive the runner).
  ForwardRunner(Model& model, SequenceCaches& caches);

  using Chunk = SeqChunk;
  // Runs one step over the chunks (in batch order) and returns the logits of every row, [T][V], or
  // with `last_rows_only` of each chunk's last row, [S][V] (what a generating engine asks for).
  std::vector<std::vector<float>> step(const std::vector<Chunk>& chunks, bool last_rows_only = false);
  std::span<const int32_t> block_table(int64_t seq_id) { return caches_->block_table(seq_id); }
  // A new sequence `to` with a copy of everything `from` has cached: its paged rows (copied into
  // blocks of its own) and its state slot. `to` then continues exactly as `from` would. Own TestCache
  // only.
  void fork(int64_t from, int64_t to);
  // Forgets the sequence (its cache is the SequenceCaches' to release).
  void forget(int64_t seq_id);

 private:
  Model& model_;
  std::unique_ptr<TestCache> own_cache_;
  SequenceCaches* caches_;
  std::map<int64_t, int64_t> cached_;                 // tokens each sequence has in the cache
  std::map<int64_t, std::vector<int32_t>> history_;   // the tokens themselves
  Arena arena_;
};

// The rows of `values` [rows * width], one vector each.
std::vector<std::vector<float>> split_rows(const std::vector<float>& values, int64_t rows, int64_t width);

// Elements [begin, end) of `v`: token ranges, rows of logit matrices.
template <typename T>
std::vector<T> slice(const std::vector<T>& v, size_t begin, size_t end) {
  return {v.begin() + static_cast<ptrdiff_t>(begin), v.begin() + static_cast<ptrdiff_t>(end)};
}

// Relative L2 distance of two logit matrices (infinite when `actual` holds a non-finite value).
double relative_l2(const std::vector<std::vector<float>>& actual, const std::vector<std::vector<double>>& expected);
double relative_l2(const std::vector<std::vector<float>>& actual, const std::vector<std::vector<float>>& expected);

using StepLogits = std::vector<std::vector<std::vector<float>>>;  // [step][row][vocab]

// Two sequences of `tokens` (cycled) through one ForwardRunner: prefill chunks of 7 + 5 and 9 + 11
// tokens, then four decode steps of both; the logits of every row of every step. The same calls on
// two models (one rank against several, one device against another) must give the same logits.
StepLogits run_two_sequence_steps(Model& model, const std::vector<int32_t>& tokens, int64_t block_size,
                                  int64_t num_blocks);

// Relative L2 distance over every step, row and logit.
double relative_l2(const StepLogits& actual, const StepLogits& expected);

}  // namespace metrale::testing
