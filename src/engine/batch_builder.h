// BatchBuilder: the one place that turns the rows of a step into the host arrays a ForwardBatch
// reads, and uploads them into device buffers at fixed addresses (so that CUDA graphs captured over
// those buffers replay with each step's contents).
//
// A step is a list of row groups, one per sequence (RowGroup): the rows it computes at consecutive
// positions, padding rows after them, its block table and state slot, which of its rows want logits
// and, for MTP steps, which hidden-state rows feed its rows. Every kind of step is such a list:
// prefill chunks, decode rows, mixed steps, verify rows (known tokens then drafts), the fixed
// layouts of graphs (padding rows and padding sequences), the MTP catch-up and chain, MTP key rows.
// fill() writes any of them into a BatchSlots layout (where each array of one batch sits in a
// staging buffer); batch_view() makes the ForwardBatch that reads them.
//
// Staging buffers (StagingBuffer) pair a pinned host buffer with a device buffer of the same size,
// allocated once; on the CPU the host buffer is the batch's memory. The builder owns three:
// - the step buffer: trunk steps (and eager MTP steps), sized for the engine's limits, uploaded array
//   by array (the rows used only);
// - the fixed buffer: a fixed-layout verify's commit parts and its MTP catch-up and chain, laid out
//   per shape (FixedLayout) and uploaded in one copy each;
// - the key-row buffer: batches of MTP key rows, uploaded synchronously (several run back to back).
//
// Model-declared per-row step inputs (StepInputSpec): per input a pinned host array and a device
// array of [max rows, per_row] at fixed addresses; after a trunk step's host arrays are filled the
// prestage hook fills the inputs' host rows (PrestageRows), and they go up with the step.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "model/forward_batch.h"
#include "runtime/buffer.h"
#include "runtime/tensor.h"

namespace metrale {

// Fills host_inputs[i] ([T, per_row] of the i-th spec, host memory) for the step (Model::prestage).
using PrestageHook = std::function<void(const PrestageRows&, std::span<const Tensor> host_inputs)>;

// One sequence's rows of a batch. Real row i (< real_rows) computes tokens[i] (past tokens.size():
// drafts[i - tokens.size()]) at position first_position + i and writes the cache there; rows
// [real_rows, rows) are padding: token 0 at first_position, writing nothing (cache slot -1). The
// sequence holds first_position + rows tokens after the step (padding rows count, so that its real
// rows keep their positions). A group without a block table is a padding sequence (it reads block 0).
struct RowGroup {
  int64_t first_position = 0;
  int64_t rows = 0;
  int64_t real_rows = 0;
  std::span<const int32_t> tokens;  // may be empty when the batch takes its token ids from the device
  std::span<const int32_t> drafts;
  std::span<const int32_t> block_table;
  int32_t state_slot = -1;
  int64_t logits_begin = 0, logits_end = 0;  // rows [begin, end) of the group are logits rows
  int64_t hidden_row = 0;                    // MTP: real row i reads hidden row hidden_row + i (padding: 0)
  std::span<const int32_t> history;          // tokens before first_position (prestage)
};

// Where one batch's arrays sit in a staging buffer, in int32 elements from its start; kNone: the
// batch has no such array (or, given to fill(), leaves it as it is).
struct BatchSlots {
  static constexpr size_t kNone = ~size_t{0};
  size_t token_ids = kNone, positions = kNone, slot_mapping = kNone, hidden_rows = kNone, logit_rows = kNone;
  size_t cu_q = kNone, kv_lens = kNone, block_tables = kNone, state_slots = kNone;
  int64_t max_rows = 0, max_seqs = 0, max_stride = 0;  // capacity of the arrays
};

// What fill() wrote.
struct BatchShape {
  int64_t num_tokens = 0, num_seqs = 0, num_logit_rows = 0;
  int64_t max_q_len = 0;     // the most rows of one group
  int64_t max_kv_len = 0;    // the longest sequence after the step
  int64_t block_stride = 0;  // block-table columns
};

// Writes the arrays of `groups` at `slots` into `host` (a staging buffer's host memory). `stride` > 0
// fixes the block-table stride (graphs: every sequence's longest table); 0 takes the widest table of
// the step (at least one column). Tables are zero-padded; cache slots are block * block_size +
// offset through each group's table.
BatchShape fill_batch(std::span<const RowGroup> groups, const BatchSlots& slots, int64_t block_size, int64_t stride,
                      int32_t* host);

// Lays out 256-byte aligned sections of int32 elements.
class StagingLayout {
 public:
  size_t take(int64_t count);
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

// A pinned host buffer and a device buffer of the same number of int32 elements, allocated once (on
// the CPU the host buffer serves both).
class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(size_t ints, Device device);

  bool empty() const { return ints_ == 0; }
  size_t size() const { return ints_; }
  int32_t* host(size_t offset = 0) const;
  std::span<const int32_t> host_span(size_t offset, int64_t count) const;
  // [shape] i32 on the device at `offset`.
  Tensor device(size_t offset, Shape shape) const;
  // Copies [offset, offset + count) from the host to the device: queued on the device's stream
  // (the host rows must then stay untouched until it runs), or at once when `synchronous`.
  void upload(size_t offset, size_t count, bool synchronous = false) const;

 private:
  size_t ints_ = 0;
  Device device_;
  PinnedBuffer host_;
  OwnedTensor device_buffer_;
};

// The ForwardBatch over a filled batch: device views of the arrays `slots` holds, host views of
// cu_q, kv_lens, logit rows and state slots.
ForwardBatch batch_view(const BatchSlots& slots, const BatchShape& shape, const StagingBuffer& buffer,
                        int64_t block_size);

// Per-row inputs of trunk steps (see the top of this file).
class StepInputs {
 public:
  StepInputs() = default;
  StepInputs(std::vector<StepInputSpec> specs, PrestageHook hook, int64_t max_rows, Device device);

  bool empty() const { return specs_.empty(); }
  // Runs the hook over the step's rows and uploads the first rows.num_tokens rows of every input;
  // returns their device views ([T, per_row] each, valid until the next call).
  std::span<const Tensor> prestage(const PrestageRows& rows);

 private:
  std::vector<StepInputSpec> specs_;
  PrestageHook hook_;
  int64_t max_rows_ = 0;
  Device device_;
  std::vector<PinnedBuffer> host_;
  std::vector<OwnedTensor> device_buffers_;
  std::vector<Tensor> host_views_, device_views_;
};

struct BatchLimits {
  int64_t max_rows = 0;     // rows of one step
  int64_t max_seqs = 0;     // sequences of one step
  int64_t max_stride = 0;   // block-table columns (the longest sequence's blocks)
  int64_t block_size = 16;
  int64_t max_drafts = 0;   // drafts per sequence of a fixed-layout verify (its commit and MTP chain)
};

// The fixed-layout arrays of one verify shape (S padded sequences, k drafts, T = S (1 + k) rows) in
// the fixed buffer: the commit parts [0, commit_end) and the MTP steps [commit_end, end) (the
// catch-up over every verify row, then chained steps of one row per sequence that share its block
// tables and each other's cu_q and logits rows). The same offsets for the same shape every time,
// which is what the graphs captured per shape rely on.
struct FixedLayout {
  int64_t seqs = 0, k = 0;
  size_t cu_parts = 0, part_kv_lens = 0, part_slots = 0;  // [2S + 1], [2S], [2S]
  size_t commit_end = 0;
  BatchSlots catch_up;  // tokens, positions, slots [T]; cu_q [S + 1]; kv_lens, logits rows [S]; tables [S, stride]
  size_t chain_positions = 0, chain_slots = 0, chain_kv_lens = 0;  // [(max_drafts - 1) S] each, step j at (j - 1) S
  size_t chain_cu_q = 0, chain_logit_rows = 0;                     // [S + 1] = 0..S, [S] = 0..S-1
  size_t end = 0;
  // Chained step j >= 1: token ids come from the device (the previous step's drafts).
  BatchSlots chain(int64_t j) const;
};

class BatchBuilder {
 public:
  BatchBuilder(const BatchLimits& limits, Device device);

  const BatchLimits& limits() const { return limits_; }
  // Every array of the step buffer (state slots and hidden rows included).
  const BatchSlots& step_slots() const { return step_slots_; }

  // ---- Trunk steps and eager MTP steps: the step buffer.
  struct StepOptions {
    int64_t stride = 0;        // fixed block-table stride (graphs); 0: the step's widest table
    int64_t max_kv_len = 0;    // > 0: this bound instead of the step's (graphs, workspace profiles)
    bool state_slots = false;  // the model keeps recurrent state: upload each sequence's slot
    bool hidden_rows = false;  // MTP: upload the hidden-state row of every row
    bool prestage = false;     // a trunk step: fill and upload the model's step inputs
  };
  struct Built {
    ForwardBatch batch;
    BatchShape shape;
    Tensor hidden_rows;                    // [T] i32 (StepOptions::hidden_rows)
    std::span<const Tensor> step_inputs;   // [T, per_row] each (StepOptions::prestage)
  };
  // Fills the step buffer with `groups`, prestages and uploads it.
  Built build_step(std::span<const RowGroup> groups, const StepOptions& options);

  // ---- Model-declared per-row step inputs (trunk steps).
  void set_step_inputs(std::vector<StepInputSpec> specs, PrestageHook hook);

  // ---- The fixed layout of verify steps (allocated for the largest shape by reserve_fixed).
  void reserve_fixed(int64_t seqs, int64_t k);
  FixedLayout fixed_layout(int64_t seqs, int64_t k) const;
  // The commit parts of `verify` (a fixed-layout verify batch) keeping kept[s] rows, uploaded.
  void stage_commit(const FixedLayout& layout, const ForwardBatch& verify, std::span<const int32_t> kept);
  VerifyCommit commit_view(const FixedLayout& layout) const;
  // The MTP catch-up (S groups of 1 + k rows) and `chain` (chained steps 1..n-1 back to back, S
  // groups of one row each), uploaded in one copy; returns the longest sequence of any of them.
  int64_t stage_mtp(const FixedLayout& layout, std::span<const RowGroup> catch_up, std::span<const RowGroup> chain);
  // The catch-up (j = 0) or chained step j as the model reads it (token ids of chained steps unset).
  ForwardBatch mtp_view(const FixedLayout& layout, int64_t j, int64_t max_kv_len) const;

  // ---- MTP key rows (Model::mtp_write_keys): token ids, positions, cache slots and hidden rows.
  void reserve_key_rows(int64_t rows);
  // `groups` (one row each, padding included) filled and uploaded synchronously.
  Built build_key_rows(std::span<const RowGroup> groups);

 private:
  BatchLimits limits_;
  Device device_;
  StagingBuffer step_;
  BatchSlots step_slots_;
  StepInputs step_inputs_;
  std::vector<std::span<const int32_t>> history_;  // prestage: one per sequence of the step
  StagingBuffer fixed_;
  StagingBuffer keys_;
  BatchSlots key_slots_;
};

}  // namespace metrale
