#include "engine/batch_builder.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

constexpr size_t kNone = BatchSlots::kNone;

bool has(size_t offset) { return offset != kNone; }

// The paged-cache slot (block * block_size + offset) of `position` in a sequence's block table.
int32_t cache_slot_of(std::span<const int32_t> table, int64_t position, int64_t block_size) {
  return table[static_cast<size_t>(position / block_size)] * static_cast<int32_t>(block_size) +
         static_cast<int32_t>(position % block_size);
}

}  // namespace

BatchShape fill_batch(std::span<const RowGroup> groups, const BatchSlots& slots, int64_t block_size, int64_t stride,
                      int32_t* host) {
  BatchShape shape;
  const auto num_seqs = static_cast<int64_t>(groups.size());
  const bool per_seq = has(slots.cu_q) || has(slots.kv_lens) || has(slots.block_tables) || has(slots.state_slots);
  METRALE_CHECK(!per_seq || num_seqs <= slots.max_seqs, "batch of {} sequences exceeds its arrays ({})", num_seqs,
                slots.max_seqs);
  if (stride <= 0) {
    // The widest table, or the blocks a group's rows (padding rows included) reach.
    stride = 1;
    for (const RowGroup& group : groups) {
      if (group.block_table.empty()) continue;
      const int64_t reach = (group.first_position + group.rows + block_size - 1) / block_size;
      stride = std::max({stride, static_cast<int64_t>(group.block_table.size()), reach});
    }
  }
  METRALE_CHECK(!has(slots.block_tables) || stride <= slots.max_stride, "block-table stride {} exceeds {}", stride,
                slots.max_stride);
  const auto at = [host](size_t offset) { return offset == kNone ? nullptr : host + offset; };
  int32_t* token_ids = at(slots.token_ids);
  int32_t* positions = at(slots.positions);
  int32_t* cache_slots = at(slots.slot_mapping);
  int32_t* hidden_rows = at(slots.hidden_rows);
  int32_t* logit_rows = at(slots.logit_rows);
  int32_t* cu_q = at(slots.cu_q);
  int32_t* kv_lens = at(slots.kv_lens);
  int32_t* tables = at(slots.block_tables);
  int32_t* state_slots = at(slots.state_slots);
  if (tables != nullptr) std::fill(tables, tables + num_seqs * stride, 0);
  if (cu_q != nullptr) cu_q[0] = 0;
  int64_t t = 0, r = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const RowGroup& group = groups[static_cast<size_t>(s)];
    const auto known = static_cast<int64_t>(group.tokens.size());
    METRALE_CHECK(group.real_rows >= 0 && group.real_rows <= group.rows && group.rows >= 1,
                  "row group {}: {} real rows of {}", s, group.real_rows, group.rows);
    METRALE_CHECK(token_ids == nullptr || known + static_cast<int64_t>(group.drafts.size()) >= group.real_rows,
                  "row group {}: {} tokens for {} rows", s, known + static_cast<int64_t>(group.drafts.size()),
                  group.real_rows);
    METRALE_CHECK(group.real_rows == 0 ||
                      static_cast<int64_t>(group.block_table.size()) * block_size >= group.first_position + group.real_rows,
                  "row group {}: {} blocks for rows up to position {}", s, group.block_table.size(),
                  group.first_position + group.real_rows);
    METRALE_CHECK(0 <= group.logits_begin && group.logits_begin <= group.logits_end && group.logits_end <= group.rows,
                  "row group {}: logits rows [{}, {}) of {}", s, group.logits_begin, group.logits_end, group.rows);
    METRALE_CHECK(t + group.rows <= slots.max_rows, "batch exceeds its {} rows", slots.max_rows);
    if (tables != nullptr) std::copy(group.block_table.begin(), group.block_table.end(), tables + s * stride);
    const int64_t first_row = t;
    for (int64_t i = 0; i < group.rows; ++i, ++t) {
      const bool real = i < group.real_rows;
      if (token_ids != nullptr) {
        token_ids[t] = !real                  ? 0
                       : i < known            ? group.tokens[static_cast<size_t>(i)]
                                              : group.drafts[static_cast<size_t>(i - known)];
      }
      if (positions != nullptr) positions[t] = static_cast<int32_t>(group.first_position + (real ? i : 0));
      if (cache_slots != nullptr)
        cache_slots[t] = real ? cache_slot_of(group.block_table, group.first_position + i, block_size) : -1;
      if (hidden_rows != nullptr) hidden_rows[t] = real ? static_cast<int32_t>(group.hidden_row + i) : 0;
    }
    for (int64_t i = group.logits_begin; i < group.logits_end; ++i, ++r) {
      if (logit_rows != nullptr) logit_rows[r] = static_cast<int32_t>(first_row + i);
    }
    const int64_t kv_len = group.first_position + group.rows;
    if (cu_q != nullptr) cu_q[s + 1] = static_cast<int32_t>(t);
    if (kv_lens != nullptr) kv_lens[s] = static_cast<int32_t>(kv_len);
    if (state_slots != nullptr) state_slots[s] = group.state_slot;
    shape.max_q_len = std::max(shape.max_q_len, group.rows);
    shape.max_kv_len = std::max(shape.max_kv_len, kv_len);
  }
  shape.num_tokens = t;
  shape.num_seqs = num_seqs;
  shape.num_logit_rows = r;
  shape.block_stride = stride;
  return shape;
}

size_t StagingLayout::take(int64_t count) {
  const size_t offset = size_;
  size_ += static_cast<size_t>((std::max<int64_t>(count, 0) + 63) / 64 * 64);  // 256-byte aligned sections
  return offset;
}

StagingBuffer::StagingBuffer(size_t ints, Device device)
    : ints_(ints), device_(device), host_(std::max<size_t>(ints, 1) * sizeof(int32_t)) {
  if (!device.is_cpu()) device_buffer_ = OwnedTensor(DType::kI32, {static_cast<int64_t>(std::max<size_t>(ints, 1))}, device);
}

int32_t* StagingBuffer::host(size_t offset) const {
  METRALE_CHECK(offset <= ints_, "staging offset {} of {}", offset, ints_);
  return static_cast<int32_t*>(host_.data()) + offset;
}

std::span<const int32_t> StagingBuffer::host_span(size_t offset, int64_t count) const {
  METRALE_CHECK(offset + static_cast<size_t>(count) <= ints_, "staging rows [{}, {}) of {}", offset,
                offset + static_cast<size_t>(count), ints_);
  return {host(offset), static_cast<size_t>(count)};
}

Tensor StagingBuffer::device(size_t offset, Shape shape) const {
  METRALE_CHECK(offset + static_cast<size_t>(shape.numel()) <= ints_, "staging view [{}, +{}) of {}", offset,
                shape.numel(), ints_);
  if (device_.is_cpu()) return Tensor(host(offset), DType::kI32, shape, device_);
  return Tensor(static_cast<int32_t*>(device_buffer_.tensor.data()) + offset, DType::kI32, shape, device_);
}

void StagingBuffer::upload(size_t offset, size_t count, bool synchronous) const {
  METRALE_CHECK(offset + count <= ints_, "upload [{}, {}) of {}", offset, offset + count, ints_);
  if (device_.is_cpu() || count == 0) return;
  void* target = static_cast<int32_t*>(device_buffer_.tensor.data()) + offset;
  if (synchronous) {
    copy_bytes(target, device_, host(offset), Device::cpu(), count * sizeof(int32_t));
  } else {
    copy_bytes_async(target, device_, host(offset), Device::cpu(), count * sizeof(int32_t));
  }
}

ForwardBatch batch_view(const BatchSlots& slots, const BatchShape& shape, const StagingBuffer& buffer,
                        int64_t block_size) {
  ForwardBatch batch;
  const int64_t t = shape.num_tokens, s = shape.num_seqs, r = shape.num_logit_rows;
  batch.num_tokens = t;
  batch.block_size = block_size;
  batch.max_q_len = shape.max_q_len;
  batch.max_kv_len = shape.max_kv_len;
  if (has(slots.token_ids)) batch.token_ids = buffer.device(slots.token_ids, {t});
  if (has(slots.positions)) batch.positions = buffer.device(slots.positions, {t});
  if (has(slots.slot_mapping)) batch.slot_mapping = buffer.device(slots.slot_mapping, {t});
  if (has(slots.logit_rows)) {
    batch.logit_rows = buffer.device(slots.logit_rows, {r});
    batch.host_logit_rows = buffer.host_span(slots.logit_rows, r);
  }
  if (!has(slots.cu_q)) return batch;  // rows without sequences (MTP key rows)
  batch.num_seqs = s;
  batch.cu_q = buffer.device(slots.cu_q, {s + 1});
  batch.host_cu_q = buffer.host_span(slots.cu_q, s + 1);
  if (has(slots.kv_lens)) {
    batch.kv_lens = buffer.device(slots.kv_lens, {s});
    batch.host_kv_lens = buffer.host_span(slots.kv_lens, s);
  }
  if (has(slots.block_tables)) batch.block_tables = buffer.device(slots.block_tables, {s, shape.block_stride});
  if (has(slots.state_slots)) {
    batch.state_slots = buffer.device(slots.state_slots, {s});
    batch.host_state_slots = buffer.host_span(slots.state_slots, s);
  }
  return batch;
}

StepInputs::StepInputs(std::vector<StepInputSpec> specs, PrestageHook hook, int64_t max_rows, Device device)
    : specs_(std::move(specs)), hook_(std::move(hook)), max_rows_(max_rows), device_(device) {
  METRALE_CHECK(specs_.empty() || hook_, "step inputs without a prestage hook");
  for (const StepInputSpec& spec : specs_) {
    METRALE_CHECK(spec.per_row >= 1, "step input '{}' with {} elements per row", spec.name, spec.per_row);
    const size_t bytes = static_cast<size_t>(max_rows * spec.per_row) * dtype_size(spec.dtype);
    host_.emplace_back(std::max<size_t>(bytes, 1));
    if (!device.is_cpu()) device_buffers_.emplace_back(spec.dtype, Shape{max_rows, spec.per_row}, device);
  }
}

std::span<const Tensor> StepInputs::prestage(const PrestageRows& rows) {
  METRALE_CHECK(rows.num_tokens <= max_rows_, "step inputs for {} rows (at most {})", rows.num_tokens, max_rows_);
  host_views_.clear();
  device_views_.clear();
  for (size_t i = 0; i < specs_.size(); ++i) {
    const Shape shape{rows.num_tokens, specs_[i].per_row};
    host_views_.emplace_back(host_[i].data(), specs_[i].dtype, shape, Device::cpu());
  }
  hook_(rows, host_views_);
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (device_.is_cpu()) {
      device_views_.push_back(host_views_[i]);
      continue;
    }
    const Tensor device_view(device_buffers_[i].tensor.data(), specs_[i].dtype, host_views_[i].shape(), device_);
    copy_bytes_async(device_view.data(), device_, host_views_[i].data(), Device::cpu(), host_views_[i].nbytes());
    device_views_.push_back(device_view);
  }
  return device_views_;
}

BatchSlots FixedLayout::chain(int64_t j) const {
  METRALE_CHECK(j >= 1, "chained MTP step {}", j);
  BatchSlots slots;
  const size_t at = static_cast<size_t>((j - 1) * seqs);
  slots.positions = chain_positions + at;
  slots.slot_mapping = chain_slots + at;
  slots.kv_lens = chain_kv_lens + at;
  slots.cu_q = chain_cu_q;
  slots.logit_rows = chain_logit_rows;
  slots.block_tables = catch_up.block_tables;
  slots.max_rows = seqs;
  slots.max_seqs = seqs;
  slots.max_stride = catch_up.max_stride;
  return slots;
}

BatchBuilder::BatchBuilder(const BatchLimits& limits, Device device) : limits_(limits), device_(device) {
  const int64_t rows = limits_.max_rows, seqs = limits_.max_seqs;
  StagingLayout layout;
  step_slots_.token_ids = layout.take(rows);
  step_slots_.positions = layout.take(rows);
  step_slots_.slot_mapping = layout.take(rows);
  step_slots_.logit_rows = layout.take(rows);
  step_slots_.hidden_rows = layout.take(rows);
  step_slots_.cu_q = layout.take(seqs + 1);
  step_slots_.kv_lens = layout.take(seqs);
  step_slots_.block_tables = layout.take(seqs * limits_.max_stride);
  step_slots_.state_slots = layout.take(seqs);
  step_slots_.max_rows = rows;
  step_slots_.max_seqs = seqs;
  step_slots_.max_stride = limits_.max_stride;
  step_ = StagingBuffer(layout.size(), device);
}

BatchBuilder::Built BatchBuilder::build_step(std::span<const RowGroup> groups, const StepOptions& options) {
  BatchSlots slots = step_slots_;
  if (!options.state_slots) slots.state_slots = kNone;
  if (!options.hidden_rows) slots.hidden_rows = kNone;
  Built built;
  built.shape = fill_batch(groups, slots, limits_.block_size, options.stride, step_.host());
  if (options.max_kv_len > 0) built.shape.max_kv_len = options.max_kv_len;
  const BatchShape& shape = built.shape;
  if (options.prestage && !step_inputs_.empty()) {
    history_.clear();
    for (const RowGroup& group : groups) history_.push_back(group.history);
    PrestageRows rows;
    rows.num_tokens = shape.num_tokens;
    rows.num_seqs = shape.num_seqs;
    rows.token_ids = step_.host_span(slots.token_ids, shape.num_tokens);
    rows.positions = step_.host_span(slots.positions, shape.num_tokens);
    rows.cu_q = step_.host_span(slots.cu_q, shape.num_seqs + 1);
    rows.history = history_;
    built.step_inputs = step_inputs_.prestage(rows);
  }
  // One upload per array, of the rows this step uses.
  const auto rows_of = [&](size_t offset, int64_t count) {
    if (has(offset)) step_.upload(offset, static_cast<size_t>(count));
  };
  rows_of(slots.token_ids, shape.num_tokens);
  rows_of(slots.positions, shape.num_tokens);
  rows_of(slots.slot_mapping, shape.num_tokens);
  rows_of(slots.logit_rows, shape.num_logit_rows);
  rows_of(slots.hidden_rows, shape.num_tokens);
  rows_of(slots.cu_q, shape.num_seqs + 1);
  rows_of(slots.kv_lens, shape.num_seqs);
  rows_of(slots.block_tables, shape.num_seqs * shape.block_stride);
  rows_of(slots.state_slots, shape.num_seqs);
  built.batch = batch_view(slots, shape, step_, limits_.block_size);
  if (options.hidden_rows) built.hidden_rows = step_.device(slots.hidden_rows, {shape.num_tokens});
  return built;
}

void BatchBuilder::set_step_inputs(std::vector<StepInputSpec> specs, PrestageHook hook) {
  step_inputs_ = StepInputs(std::move(specs), std::move(hook), limits_.max_rows, device_);
}

FixedLayout BatchBuilder::fixed_layout(int64_t seqs, int64_t k) const {
  FixedLayout a;
  a.seqs = seqs;
  a.k = k;
  const int64_t rows = seqs * (1 + k);
  StagingLayout layout;
  a.cu_parts = layout.take(2 * seqs + 1);
  a.part_kv_lens = layout.take(2 * seqs);
  a.part_slots = layout.take(2 * seqs);
  a.commit_end = layout.size();
  BatchSlots& c = a.catch_up;
  c.token_ids = layout.take(rows);
  c.positions = layout.take(rows);
  c.slot_mapping = layout.take(rows);
  c.cu_q = layout.take(seqs + 1);
  c.kv_lens = layout.take(seqs);
  c.logit_rows = layout.take(seqs);
  const int64_t chain = std::max<int64_t>(limits_.max_drafts - 1, 1);  // chained steps at most
  a.chain_positions = layout.take(chain * seqs);
  a.chain_slots = layout.take(chain * seqs);
  a.chain_kv_lens = layout.take(chain * seqs);
  a.chain_cu_q = layout.take(seqs + 1);
  a.chain_logit_rows = layout.take(seqs);
  c.block_tables = layout.take(seqs * limits_.max_stride);
  c.max_rows = rows;
  c.max_seqs = seqs;
  c.max_stride = limits_.max_stride;
  a.end = layout.size();
  return a;
}

void BatchBuilder::reserve_fixed(int64_t seqs, int64_t k) {
  fixed_ = StagingBuffer(fixed_layout(seqs, k).end, device_);
}

void BatchBuilder::stage_commit(const FixedLayout& layout, const ForwardBatch& verify, std::span<const int32_t> kept) {
  METRALE_CHECK(layout.end <= fixed_.size(), "fixed layout of {} ints in a buffer of {}", layout.end, fixed_.size());
  METRALE_CHECK(verify.num_seqs == layout.seqs, "commit of {} sequences in a layout of {}", verify.num_seqs,
                layout.seqs);
  int32_t* host = fixed_.host();
  fill_commit_parts(verify.host_cu_q, verify.host_kv_lens, verify.host_state_slots, kept, host + layout.cu_parts,
                    host + layout.part_kv_lens, host + layout.part_slots);
  fixed_.upload(0, layout.commit_end);
}

VerifyCommit BatchBuilder::commit_view(const FixedLayout& layout) const {
  VerifyCommit commit;
  commit.max_rows = 1 + layout.k;
  commit.cu_parts = fixed_.device(layout.cu_parts, {2 * layout.seqs + 1});
  commit.kv_lens = fixed_.device(layout.part_kv_lens, {2 * layout.seqs});
  commit.slots = fixed_.device(layout.part_slots, {2 * layout.seqs});
  return commit;
}

int64_t BatchBuilder::stage_mtp(const FixedLayout& layout, std::span<const RowGroup> catch_up,
                                std::span<const RowGroup> chain) {
  METRALE_CHECK(layout.end <= fixed_.size(), "fixed layout of {} ints in a buffer of {}", layout.end, fixed_.size());
  const auto seqs = static_cast<size_t>(layout.seqs);
  METRALE_CHECK(catch_up.size() == seqs && chain.size() % std::max<size_t>(seqs, 1) == 0,
                "MTP steps of {} and {} groups for {} sequences", catch_up.size(), chain.size(), seqs);
  const int64_t stride = layout.catch_up.max_stride;
  int32_t* host = fixed_.host();
  int64_t longest = fill_batch(catch_up, layout.catch_up, limits_.block_size, stride, host).max_kv_len;
  for (size_t j = 1; seqs > 0 && j <= chain.size() / seqs; ++j) {
    BatchSlots slots = layout.chain(static_cast<int64_t>(j));
    slots.block_tables = kNone;  // the catch-up's
    const BatchShape shape = fill_batch(chain.subspan((j - 1) * seqs, seqs), slots, limits_.block_size, stride, host);
    longest = std::max(longest, shape.max_kv_len);
  }
  fixed_.upload(layout.commit_end, layout.end - layout.commit_end);
  return longest;
}

ForwardBatch BatchBuilder::mtp_view(const FixedLayout& layout, int64_t j, int64_t max_kv_len) const {
  const int64_t seqs = layout.seqs;
  BatchShape shape;
  shape.num_seqs = seqs;
  shape.num_logit_rows = seqs;
  shape.max_kv_len = max_kv_len;
  shape.block_stride = layout.catch_up.max_stride;
  if (j == 0) {
    shape.num_tokens = seqs * (1 + layout.k);
    shape.max_q_len = 1 + layout.k;
    return batch_view(layout.catch_up, shape, fixed_, limits_.block_size);
  }
  shape.num_tokens = seqs;
  shape.max_q_len = 1;
  return batch_view(layout.chain(j), shape, fixed_, limits_.block_size);
}

void BatchBuilder::reserve_key_rows(int64_t rows) { keys_ = StagingBuffer(static_cast<size_t>(4 * rows), device_); }

BatchBuilder::Built BatchBuilder::build_key_rows(std::span<const RowGroup> groups) {
  int64_t rows = 0;
  for (const RowGroup& group : groups) rows += group.rows;
  if (keys_.size() < static_cast<size_t>(4 * rows)) {
    // Eager steps may allocate; no queued kernel may still read the old buffer.
    if (!device_.is_cpu()) synchronize(device_);
    reserve_key_rows(rows);
  }
  // [4, rows] i32: token ids x_{t+1}, positions t, cache slots (-1: none), hidden rows.
  BatchSlots slots;
  slots.token_ids = 0;
  slots.positions = static_cast<size_t>(rows);
  slots.slot_mapping = static_cast<size_t>(2 * rows);
  slots.hidden_rows = static_cast<size_t>(3 * rows);
  slots.max_rows = rows;
  Built built;
  built.shape = fill_batch(groups, slots, limits_.block_size, 1, keys_.host());
  keys_.upload(0, static_cast<size_t>(4 * rows), /*synchronous=*/true);
  built.batch = batch_view(slots, built.shape, keys_, limits_.block_size);
  built.batch.max_q_len = built.batch.max_kv_len = 0;  // rows without sequences: nothing to plan
  built.hidden_rows = keys_.device(slots.hidden_rows, {rows});
  return built;
}

}  // namespace metrale
