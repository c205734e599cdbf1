#include "cache/prefix_cache.h"

#include <algorithm>

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include "core/error.h"

namespace metrale {

BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  const uint64_t words[2] = {parent.low, parent.high};
  XXH3_128bits_update(&state, words, sizeof(words));
  XXH3_128bits_update(&state, tokens.data(), tokens.size_bytes());
  const XXH128_hash_t digest = XXH3_128bits_digest(&state);
  return {digest.low64, digest.high64};
}

PrefixCache::PrefixCache(int32_t num_blocks, int32_t block_size) : block_size_(block_size) {
  if (num_blocks < 0 || block_size <= 0)
    raise(ErrorCode::kInvalidArgument, "prefix cache of {} blocks of {} tokens", num_blocks, block_size);
  entries_.resize(static_cast<size_t>(num_blocks));
  tokens_.assign(static_cast<size_t>(num_blocks) * static_cast<size_t>(block_size), 0);
}

const PrefixCache::Entry& PrefixCache::entry(int32_t block) const {
  METRALE_CHECK(block >= 0 && static_cast<size_t>(block) < entries_.size(), "block {} out of range", block);
  return entries_[static_cast<size_t>(block)];
}

std::span<const int32_t> PrefixCache::tokens_of(int32_t block) const {
  return {tokens_.data() + static_cast<size_t>(block) * static_cast<size_t>(block_size_), static_cast<size_t>(block_size_)};
}

bool PrefixCache::holds(int32_t block) const { return entry(block).valid; }

const BlockHash& PrefixCache::parent_of(int32_t block) const {
  const Entry& e = entry(block);
  METRALE_CHECK(e.valid, "block {} is not in the prefix index", block);
  return e.parent;
}

const BlockHash& PrefixCache::hash_of(int32_t block) const {
  METRALE_CHECK(holds(block), "block {} is not in the prefix cache", block);
  return entry(block).hash;
}

int32_t PrefixCache::find(const BlockHash& hash) const {
  const auto it = by_hash_.find(hash);
  return it == by_hash_.end() ? -1 : it->second;
}

int32_t PrefixCache::find(const BlockHash& hash, const BlockHash& parent, std::span<const int32_t> tokens) const {
  const int32_t block = find(hash);
  if (block < 0) return -1;
  const Entry& found = entry(block);
  const auto stored = tokens_of(block);
  if (!(found.parent == parent) || tokens.size() != stored.size() || !std::equal(tokens.begin(), tokens.end(), stored.begin()))
    return -1;  // a hash collision: treat it as a miss
  return block;
}

bool PrefixCache::insert(int32_t block, const BlockHash& hash, const BlockHash& parent, std::span<const int32_t> tokens) {
  METRALE_CHECK(!holds(block), "block {} is already in the prefix cache", block);
  METRALE_CHECK(tokens.size() == static_cast<size_t>(block_size_), "a cached block holds {} tokens, not {}", block_size_,
                tokens.size());
  if (!by_hash_.emplace(hash, block).second) return false;
  Entry& added = entries_[static_cast<size_t>(block)];
  added = Entry{true, hash, parent, -1};
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<ptrdiff_t>(block) * block_size_);
  return true;
}

int32_t PrefixCache::erase(int32_t block) {
  METRALE_CHECK(holds(block), "erase of block {} that is not in the prefix cache", block);
  Entry& removed = entries_[static_cast<size_t>(block)];
  const size_t erased = by_hash_.erase(removed.hash);
  METRALE_CHECK(erased == 1, "prefix cache index lost block {}", block);
  const int32_t slot = removed.checkpoint_slot;
  removed = Entry{};
  return slot;
}

int32_t PrefixCache::checkpoint(int32_t block) const { return holds(block) ? entry(block).checkpoint_slot : -1; }

void PrefixCache::set_checkpoint(int32_t block, int32_t slot) {
  METRALE_CHECK(holds(block), "checkpoint for block {} that is not in the prefix cache", block);
  Entry& target = entries_[static_cast<size_t>(block)];
  METRALE_CHECK(target.checkpoint_slot < 0, "block {} already has checkpoint slot {}", block, target.checkpoint_slot);
  target.checkpoint_slot = slot;
}

int32_t PrefixCache::take_checkpoint(int32_t block) {
  if (!holds(block)) return -1;
  Entry& target = entries_[static_cast<size_t>(block)];
  const int32_t slot = target.checkpoint_slot;
  target.checkpoint_slot = -1;
  return slot;
}

}  // namespace metrale
