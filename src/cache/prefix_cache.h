// PrefixCache: the index of KV blocks that hold a full block of some sequence's tokens, so that a
// later sequence starting with the same tokens can reuse them instead of computing them again.
//
// A block is keyed by a hash chain: hash_i = XXH3-128(hash_{i-1} || tokens of block i), with a zero
// hash before the first block, so a hash names the whole prefix up to the end of its block. A hash
// collision cannot hand out wrong keys: a lookup also compares the block's own tokens and its
// parent hash, so a false hit needs two independent 128-bit collisions at once.
//
// The index knows block ids and hashes only; reference counts and eviction order live in the
// BlockPool, and the CacheManager keeps the two in step (a block is in the index exactly when the
// pool marks it cached). Caches with per-slot tensors also keep, per cached block, an optional state
// checkpoint: the state slot holding the state after the block's last token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace metrale {

struct BlockHash {
  uint64_t low = 0;
  uint64_t high = 0;
  bool operator==(const BlockHash&) const = default;
};

struct BlockHashHasher {
  size_t operator()(const BlockHash& hash) const { return static_cast<size_t>(hash.low ^ (hash.high * 0x9e3779b97f4a7c15ull)); }
};

// The hash of a block of `tokens` that follows the prefix hashed as `parent` ({} for the first block).
BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens);

class PrefixCache {
 public:
  PrefixCache(int32_t num_blocks, int32_t block_size);

  int32_t block_size() const { return block_size_; }
  size_t size() const { return by_hash_.size(); }
  bool holds(int32_t block) const;
  const BlockHash& hash_of(int32_t block) const;
  const BlockHash& parent_of(int32_t block) const;       // the hash of the prefix before the block
  std::span<const int32_t> tokens_of(int32_t block) const;  // the block's tokens (block_size)

  // The block that holds `hash` for these tokens after `parent`, or -1.
  int32_t find(const BlockHash& hash, const BlockHash& parent, std::span<const int32_t> tokens) const;
  // The block that holds `hash`, or -1 (no token check: for blocks the caller hashed itself).
  int32_t find(const BlockHash& hash) const;
  // Registers `block` (block_size tokens) under `hash`. Returns false and changes nothing when a
  // block already holds that hash (two sequences computed the same prefix at once).
  bool insert(int32_t block, const BlockHash& hash, const BlockHash& parent, std::span<const int32_t> tokens);
  // Forgets the block (it was evicted). Returns its checkpoint slot, now the caller's to free, or -1.
  int32_t erase(int32_t block);

  // Recurrent-state checkpoint after the block's last token: a state slot, or -1.
  int32_t checkpoint(int32_t block) const;
  void set_checkpoint(int32_t block, int32_t slot);
  // Detaches and returns the block's checkpoint slot (-1 when it has none).
  int32_t take_checkpoint(int32_t block);

 private:
  struct Entry {
    bool valid = false;
    BlockHash hash;
    BlockHash parent;
    int32_t checkpoint_slot = -1;
  };
  const Entry& entry(int32_t block) const;

  int32_t block_size_;
  std::vector<Entry> entries_;  // per block
  std::vector<int32_t> tokens_;  // [num_blocks, block_size]: the tokens of each indexed block
  std::unordered_map<BlockHash, int32_t, BlockHashHasher> by_hash_;
};

}  // namespace metrale
