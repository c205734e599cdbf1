// What each stateful block keeps per sequence between steps, and the views of that memory a forward
// gets. Blocks declare specs; the cache floor (src/cache) owns and allocates the memory, without
// knowing what a tensor means.
//
// A block's cache is a list of typed tensors, each indexed one of three ways:
// - per token: one row per token, paged by the block table. Every paged tensor of every block shares
//   one block numbering and one block table per sequence: [num_blocks, block_size, ...shape]
//   (attention K and V, an MLA latent, indexer keys);
// - per group: one row per group_size consecutive tokens, paged with the block that holds the group's
//   last token: [num_blocks, block_size / group_size, ...shape] (pooled keys). Group g of a sequence
//   (tokens [g * group_size, (g + 1) * group_size)) sits in block table entry
//   g * group_size / block_size at row g % (block_size / group_size);
// - per slot: fixed size per sequence, in a *state slot*: [num_slots, ...shape] (conv windows,
//   recurrent matrices, token history). A sequence holds one slot index valid in every per-slot
//   tensor of every block (ForwardBatch::state_slots).
// Prefix sharing, state checkpoints (a copy of every per-slot tensor), preemption and the memory
// planner treat every tensor alike; rejected speculative rows are dropped by truncating the sequence
// (paged tensors) or by the block's commit (per-slot tensors).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tensor.h"

namespace metrale {

enum class CacheIndexing {
  kPerToken,  // one row per token, paged by the block table: [num_blocks, block_size, ...shape]
  kPerGroup,  // one row per group_size tokens, paged with the block holding the group's last token:
              // [num_blocks, block_size / group_size, ...shape] (block_size % group_size == 0)
  kPerSlot,   // one entry per state slot: [num_slots, ...shape]
};

std::string_view cache_indexing_name(CacheIndexing indexing);  // "per token", "per group", "per slot"

struct CacheTensorSpec {
  std::string name;                    // "k", "v", "conv", "recurrent", "latent", "index_keys", ...
  CacheIndexing indexing = CacheIndexing::kPerToken;
  std::vector<int64_t> shape;          // per token / per group / per slot
  std::optional<DType> dtype;          // nullopt: the cache's activation dtype (f32 CPU, bf16 GPU)
  int64_t group_size = 1;              // kPerGroup only

  static CacheTensorSpec per_token(std::string name, std::vector<int64_t> shape, std::optional<DType> dtype = {});
  static CacheTensorSpec per_group(std::string name, int64_t group_size, std::vector<int64_t> shape,
                                   std::optional<DType> dtype = {});
  static CacheTensorSpec per_slot(std::string name, std::vector<int64_t> shape, std::optional<DType> dtype = {});

  bool paged() const { return indexing != CacheIndexing::kPerSlot; }
  DType dtype_or(DType activation) const { return dtype.value_or(activation); }
  uint64_t elements_per_unit() const;  // the product of shape
  // Rows one block holds: block_size per token, block_size / group_size per group, 0 per slot.
  int64_t rows_per_block(int64_t block_size) const;
  // The allocated tensor's shape: [num_blocks, rows_per_block, ...shape] or [num_slots, ...shape].
  Shape storage_shape(int64_t num_blocks, int64_t block_size, int64_t num_slots) const;
};

// What one stateful block keeps between steps (empty: nothing).
struct CacheSpec {
  std::vector<CacheTensorSpec> tensors;

  bool empty() const { return tensors.empty(); }
  bool has_paged() const;  // any kPerToken / kPerGroup tensor
  bool has_slots() const;  // any kPerSlot tensor
};

// The memory of one block's cache as its forward sees it: tensors[i] belongs to spec.tensors[i], with
// the shape CacheTensorSpec::storage_shape gives, contiguous. A per-slot entry is meaningful only for
// a sequence whose cached length is > 0: a sequence starting from position 0 (kv_lens[s] == q_len_s)
// must ignore what its slot holds and start from its initial state; the forward then overwrites it.
struct BlockCache {
  std::vector<Tensor> tensors;
};

// Throws kInvalidArgument (naming `owner` and the tensor) unless every tensor of `spec` can be
// allocated: a name, positive dims that fit a Tensor with its leading index, a group size that divides
// block_size (per group) or is 1 (otherwise).
void check_cache_spec(const CacheSpec& spec, int64_t block_size, std::string_view owner);

// Bytes one block costs across every per-token and per-group tensor of `specs`.
uint64_t paged_bytes_per_block(std::span<const CacheSpec> specs, int64_t block_size, DType activation);
// Bytes one state slot costs across every per-slot tensor of `specs`.
uint64_t slot_bytes_per_slot(std::span<const CacheSpec> specs, DType activation);

}  // namespace metrale
