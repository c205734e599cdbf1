// CacheManager: owns the memory of every stateful block's cache and maps sequences to it, without
// knowing what a tensor means (model/cache_spec.h).
// - Paged tensors (per token and per group): one tensor each, all sharing one block numbering; each
//   sequence has a block table. Full blocks can be shared between sequences through the prefix
//   cache (reference counts in the BlockPool, hashes in the PrefixCache); a block's per-group rows
//   travel with it.
// - Per-slot tensors: one tensor each, [num_slots, ...shape]; each sequence holds one state slot
//   (a StatePool of num_state_slots ids) valid in all of them. With prefix caching, checkpoint slots
//   keep every per-slot tensor's entry after the last token of a cached block, so that a later
//   sequence reusing that prefix can start from it. One more slot takes the writes of padding rows.
//
// - Host tier (HostTier, num_host_blocks / num_host_slots > 0): a sequence can be swapped out, its
//   blocks' contents (every paged tensor) and its slot's (every per-slot tensor) copied to host
//   blocks and a host slot and its device blocks and slot given back, then swapped in again with
//   exactly those contents in fresh device blocks and a fresh slot. A swapped sequence is in the
//   manager (free_sequence drops it) but holds no device block and no slot. With prefix caching, a
//   cached block evicted from the device is copied to a host block first and indexed there (a
//   second PrefixCache), and a state checkpoint dropped from the device (its block evicted, or the
//   checkpoint itself the least recently used) is copied to a host slot, indexed by its block's
//   prefix hash (CheckpointIndex); a lookup that misses on the device but hits on the host copies
//   them back into fresh device blocks and the sequence's slot.
// - Disk tier (DiskTier, with a host tier, num_disk_blocks / num_disk_slots > 0): what the host
//   tier would drop goes to disk instead, least recently used first: cached prefix blocks and
//   checkpoints it evicts, and whole swapped-out sequences, oldest first, when a swap-out needs
//   their room. A lookup or a swap-in finds them there as well and reads them back (the worker
//   thread reads; the caller waits for the read before it copies the data to the device).
// - Integrity: host and disk entries carry checksums verified when they come back. An entry that
//   fails (corrupted memory, a disk file deleted, truncated or rewritten) is dropped with a
//   warning: a prefix hit is cut before it (hybrid specs: the whole hit, whose state needs it) and
//   a swapped sequence is lost (swap_in reports kLost and the caller recomputes it).
//
// Slot layout: [0, num_state_slots) sequences, then num_checkpoint_slots checkpoints, then the
// padding slot.
//
// Tensor-parallel ranks (engine/tensor_parallel_model.h): with one device per rank, every declared
// tensor exists once per rank, on the rank's device, under the same block numbering and slot ids;
// block_caches(r) is rank r's. Every copy the manager makes (state checkpoints, swaps, tiers) covers
// every rank's tensors, and a host or disk entry holds every rank's bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/block_pool.h"
#include "cache/checkpoint_index.h"
#include "cache/disk_tier.h"
#include "cache/host_tier.h"
#include "cache/prefix_cache.h"
#include "cache/state_pool.h"
#include "model/cache_spec.h"

namespace metrale {

struct CacheConfig {
  int32_t block_size = 16;   // tokens per block
  int32_t num_blocks = 0;    // blocks of every paged tensor (all share the numbering)
  DType activation_dtype = DType::kF32;  // the dtype of tensors declared without one
  // Per-slot tensors only (ignored for specs without them). Slots for running sequences; 0 gives
  // sequences no slot at all (scratch caches for profiling, whose states are never read back).
  int32_t num_state_slots = 0;
  // Prefix-cache checkpoints of the per-slot state (specs with per-slot tensors, prefix caching on).
  int32_t num_checkpoint_slots = 0;
  bool enable_prefix_caching = false;
  // Per-slot state: a prefill checkpoint every this many tokens (rounded up to a multiple of
  // block_size), besides the one at the end of the prompt's last full block.
  int64_t state_checkpoint_interval = 512;
  // Host tier: host copies of whole KV blocks and of state slots for swapped-out sequences (0: none).
  int32_t num_host_blocks = 0;
  int32_t num_host_slots = 0;
  // Device blocks per GPU that stage block copies to the host tier so that they overlap the forward
  // (HostTier::enable_staging; 0: copies on the forward's stream). GPUs only.
  int32_t num_host_staging_blocks = 0;
  // Disk tier: a directory for files of blocks and slots spilled from the host tier (empty: none;
  // it needs a host tier), and how many of each it may hold.
  std::filesystem::path disk_dir{};
  int32_t num_disk_blocks = 0;
  int32_t num_disk_slots = 0;
  // With a disk tier: host blocks kept empty by writing the least recently used cached ones to disk
  // ahead of their eviction (CacheManager::write_back_host_blocks); -1: min(256, host blocks / 8)
  // (a burst of evictions, such as a long prompt's blocks, then finds empty blocks).
  int32_t num_host_write_ahead_blocks = -1;
};

// Swaps since start-up: sequences, and the device blocks and state slots they moved.
struct SwapCounters {
  int64_t sequences_out = 0;
  int64_t sequences_in = 0;
  int64_t blocks_out = 0;
  int64_t blocks_in = 0;
  int64_t slots_out = 0;
  int64_t slots_in = 0;
  // Prefix blocks evicted from the device into the host tier, and host hits copied back.
  int64_t prefix_blocks_out = 0;
  int64_t prefix_blocks_in = 0;
  // Disk tier: swapped sequences moved from the host tier to disk, host prefix blocks spilled to
  // disk and disk hits brought back.
  int64_t sequences_to_disk = 0;
  int64_t prefix_blocks_to_disk = 0;
  // Of those, written from host memory by a disk worker ahead of their eviction (no copy on the
  // engine thread; the others were packed when evicted).
  int64_t prefix_blocks_written_ahead = 0;
  int64_t prefix_blocks_from_disk = 0;
  // Disk hits left unread (their tokens recomputed) because reading a block was measured slower
  // than recomputing it.
  int64_t disk_hits_declined = 0;
  // Waiting sequences whose prefix's disk reads were queued ahead of their admission.
  int64_t prefix_prefetches = 0;
  // State checkpoints dropped from the device and kept in the host tier, and those restored from
  // the host or disk tier on a prefix hit.
  int64_t checkpoints_out = 0;
  int64_t checkpoints_in = 0;
  // Host or disk entries that failed their integrity check (dropped and recomputed).
  int64_t lost_entries = 0;
};

// What swap_in did: brought the sequence back, found no room (nothing changed), or found its
// swapped contents lost (an integrity failure: the manager has dropped it, the caller recomputes).
enum class SwapIn { kDone, kNoRoom, kLost };

class CacheManager {
 public:
  // One BlockCache per spec, in order. Throws kInvalidArgument when a spec cannot be allocated
  // (check_cache_spec).
  CacheManager(std::span<const CacheSpec> specs, const CacheConfig& config, Device device);
  // The same tensors once per rank, rank r's on rank_devices[r] (devices of one kind).
  CacheManager(std::span<const CacheSpec> specs, const CacheConfig& config, std::span<const Device> rank_devices);

  const CacheConfig& config() const { return config_; }
  int32_t block_size() const { return config_.block_size; }
  const BlockPool& pool() const { return pool_; }
  const PrefixCache& prefix_cache() const { return prefix_; }
  std::span<const BlockCache> block_caches() const { return rank_caches_.front(); }
  std::span<const BlockCache> block_caches(int rank) const { return rank_caches_.at(static_cast<size_t>(rank)); }
  int num_ranks() const { return static_cast<int>(rank_caches_.size()); }
  std::span<const CacheSpec> specs() const { return specs_; }  // block_caches()[i] holds specs()[i]
  uint64_t memory_bytes() const { return kv_memory_bytes() + state_memory_bytes(); }
  uint64_t kv_memory_bytes() const;     // every paged tensor (per token and per group)
  uint64_t state_memory_bytes() const;  // every per-slot tensor

  // Blocks needed to hold `tokens` tokens.
  int32_t blocks_for(int64_t tokens) const {
    return static_cast<int32_t>((tokens + config_.block_size - 1) / config_.block_size);
  }

  // ---- Sequences
  struct PrefixMatch {
    int64_t cached_tokens = 0;    // leading tokens whose blocks (and state) the sequence starts with
    bool restored_state = false;  // a state checkpoint was copied into its slot
  };
  // Creates sequence `seq_id` (which must not exist), with its state slot when the specs have
  // per-slot tensors. With `use_prefix_cache` (and prefix caching on) it starts from the longest
  // cached prefix of `tokens`: whole blocks, fewer than tokens.size() tokens (at least one token is
  // left to compute, for its logits), and with per-slot tensors only a length that has a state
  // checkpoint, which is copied into the sequence's slot (queued on the device's stream). Returns
  // nullopt and changes nothing when no state slot is free.
  std::optional<PrefixMatch> begin_sequence(int64_t seq_id, std::span<const int32_t> tokens, bool use_prefix_cache);
  // Grows sequence `seq_id`'s blocks to hold `total_tokens`, creating the sequence (and its state
  // slot) when it does not exist. All or nothing: returns false and changes nothing when too few
  // blocks (or no state slot) are free. Cached free blocks are evicted, least recently used first,
  // only when no empty block is left.
  bool reserve(int64_t seq_id, int64_t total_tokens);
  // Blocks that reserve(seq_id, total_tokens) would have to take from the pool.
  int32_t blocks_needed(int64_t seq_id, int64_t total_tokens) const;
  // Drops the sequence's references to its blocks (cached ones stay cached) and frees its slot;
  // a swapped-out sequence gives back its host blocks and host slot.
  void free_sequence(int64_t seq_id);
  std::span<const int32_t> block_table(int64_t seq_id) const;
  bool has_sequence(int64_t seq_id) const { return sequences_.count(seq_id) != 0; }
  size_t num_sequences() const { return sequences_.size(); }

  // ---- Per-slot state
  // Whether any spec has a per-slot tensor (sequences then hold state slots).
  bool has_recurrent_state() const { return has_slots_; }
  // The sequence's state slot, or -1 (no per-slot tensors, or a scratch cache).
  int32_t state_slot(int64_t seq_id) const;
  // The slot padding rows of a graph batch write to (never read); -1 without per-slot tensors.
  int32_t padding_state_slot() const { return padding_slot_; }
  int32_t num_state_slots() const { return sequence_slots_.num_slots() + checkpoint_slots_.num_slots(); }
  int32_t num_state_slots_used() const { return sequence_slots_.num_used() + checkpoint_slots_.num_used(); }
  int32_t num_checkpoints() const { return checkpoint_slots_.num_used(); }
  // Copies slot `src` into slot `dst` in every per-slot tensor of every block, whatever its dtype
  // (queued on the device's current stream, so it is ordered with the steps around it).
  void copy_state_slot(int32_t dst, int32_t src);

  // ---- Host tier (cache_swap.cpp)
  const HostTier& host_tier() const { return host_; }
  const PrefixCache& host_prefix_cache() const { return host_prefix_; }
  const SwapCounters& swap_counters() const { return swap_counters_; }
  const DiskTier* disk_tier() const { return disk_.get(); }
  // State checkpoints the host tier holds (in host slots no swapped sequence holds).
  int32_t num_host_checkpoints() const { return static_cast<int32_t>(host_checkpoints_.size()); }
  // Whether the host tier can take the sequence's blocks and its slot: now, or (with a disk tier)
  // once older swapped sequences have moved to disk, which swap_out then tries.
  bool can_swap_out(int64_t seq_id) const;
  // Bytes a swap of the sequence moves each way (its blocks of every paged tensor and its slot).
  uint64_t swap_bytes(int64_t seq_id) const;
  // Copies every block of the sequence's table (all paged tensors) and its state slot (all per-slot
  // tensors) to the host tier, then releases its device blocks (cached ones stay cached) and frees
  // its slot. All or nothing for the sequence: returns false and leaves it resident when the host
  // tier cannot take it (older swapped sequences may have moved to disk meanwhile).
  bool swap_out(int64_t seq_id);
  bool is_swapped(int64_t seq_id) const { return swapped_.count(seq_id) != 0; }
  size_t num_swapped() const { return swapped_.size(); }
  // Host blocks the swapped sequence holds (its block table's length when it was swapped out).
  int32_t swapped_blocks(int64_t seq_id) const;
  bool is_swapped_to_disk(int64_t seq_id) const;
  // Whether swap_in followed by reserve(seq_id, total_tokens) would both succeed now.
  bool can_swap_in(int64_t seq_id, int64_t total_tokens) const;
  // Brings a swapped sequence back: fresh device blocks (evicting cached ones if need be) and a
  // fresh slot receive exactly the contents swapped out (read back from disk if it went there), and
  // the tier's blocks and slot are freed. Its blocks are private again (cache_full_blocks
  // re-indexes them). kNoRoom (nothing changed) when too few device blocks or no slot are free;
  // kLost when its contents fail the integrity check: it is then no longer in the manager.
  SwapIn swap_in(int64_t seq_id);
  // Queues the disk reads a later swap_in of this sequence needs (a no-op unless it is on disk),
  // so that they overlap the steps before it.
  void prefetch(int64_t seq_id);
  // Queues the disk reads of the prefix match a waiting sequence (not begun) would make now: its
  // blocks and its checkpoint that only the disk tier holds, while disk hits pay (disk_hits_pay) and
  // at most kMaxPrefetchBytes are held in all. begin_sequence takes the reads whose entries have not
  // been rewritten since, and reads the rest itself. Once per sequence; a no-op without a disk tier.
  void prefetch_prefix(int64_t seq_id, std::span<const int32_t> tokens);
  static constexpr size_t kMaxPrefetchBytes = size_t{1} << 30;
  // Whether disk reads queued for the sequence (prefetch or prefetch_prefix) are still running:
  // admitting it now would wait for them.
  bool reads_pending(int64_t seq_id) const;
  // Checksums host-tier entries whose copies were in flight; the engine calls it after a step,
  // when the device's stream has drained (it synchronizes first).
  void seal_host_tier() { host_.seal_pending(); }
  // With a disk tier (the engine calls it after each step, after seal_host_tier): host blocks whose
  // write-ahead has landed become empty (the disk holds them), and the least recently used cached
  // host blocks start theirs (a disk worker reads the pinned memory itself; the block stays a host
  // hit meanwhile) until num_host_write_ahead_blocks are empty or on their way. An eviction then
  // finds an empty block instead of packing a cached one on the engine thread.
  void write_back_host_blocks();
  // Seconds one prompt token costs to recompute (measured by the engine on prefill steps; 0 while
  // unmeasured). A prefix match reads disk hits only while the disk's measured read rate makes a
  // block cheaper to read than to recompute; every kDiskProbeInterval-th declined match reads them
  // anyway, so that a disk that got faster is noticed.
  void set_recompute_seconds_per_token(double seconds) { recompute_seconds_per_token_ = seconds; }
  static constexpr int32_t kDiskProbeInterval = 32;

  // ---- Prefix cache
  bool prefix_caching() const { return config_.enable_prefix_caching; }
  // After a step: indexes the sequence's full blocks among its first `num_computed` tokens so that
  // later sequences can share them. `tokens` are the sequence's tokens (at least num_computed).
  void cache_full_blocks(int64_t seq_id, std::span<const int32_t> tokens, int64_t num_computed);
  // Specs with per-slot tensors: whether `position` (tokens computed) is a state checkpoint point of a sequence
  // with `num_prompt` prompt tokens: the last block boundary before the prompt's end, and every
  // state_checkpoint_interval tokens before it. Always false without checkpoints. (The last point
  // is strictly before the end so that the same prompt again, whose lookup must leave a token to
  // compute, can use it as well as a longer prompt that extends it.)
  bool is_checkpoint_position(int64_t num_prompt, int64_t position) const;
  // The first checkpoint point after `num_computed`, or -1: prefill chunks end there so that the
  // state after it exists.
  int64_t next_checkpoint_position(int64_t num_prompt, int64_t num_computed) const;
  // Keeps a copy of the sequence's state, which must be the state after its first `position` tokens
  // (a block boundary whose block was cached by cache_full_blocks), with that block. When every
  // checkpoint slot is taken the least recently used checkpoint is dropped.
  void checkpoint_state(int64_t seq_id, int64_t position);

  // Throws kInternal unless every invariant holds: every tensor has its spec's storage shape and
  // dtype; reference counts equal the number of tables holding each block; empty + cached + used ==
  // total; a block is cached exactly when the prefix index holds it; state and checkpoint slots are
  // each owned once; every allocated host block and host slot is held by exactly one swapped
  // sequence, and no sequence is both resident and swapped.
  void check_integrity() const;

 private:
  struct SequenceEntry {
    std::vector<int32_t> blocks;    // the block table
    std::vector<BlockHash> hashes;  // hash chain of the leading full blocks indexed so far
    int32_t state_slot = -1;
  };
  bool needs_state_slot() const { return has_slots_ && sequence_slots_.num_slots() > 0; }
  int64_t last_prompt_checkpoint(int64_t num_prompt) const {
    return (num_prompt - 1) / config_.block_size * config_.block_size;
  }
  // Takes `count` blocks from the pool into `out`, forgetting the blocks (and checkpoints) evicted.
  void allocate_blocks(int32_t count, std::vector<int32_t>& out);
  void drop_checkpoint(int32_t slot);
  void touch_checkpoint(int32_t slot);

  CacheConfig config_;
  Device device_;                // rank 0's (the kind of every rank's)
  std::vector<Device> devices_;  // per rank
  BlockPool pool_;
  PrefixCache prefix_;
  bool has_slots_ = false;  // some spec has a per-slot tensor
  StatePool sequence_slots_;
  StatePool checkpoint_slots_;
  int32_t padding_slot_ = -1;
  std::vector<CacheSpec> specs_;
  std::vector<OwnedTensor> paged_storage_;  // every per-token and per-group tensor
  std::vector<OwnedTensor> slot_storage_;   // every per-slot tensor
  // Per rank, one per spec: views of the storage (which holds rank 0's tensors, then rank 1's, ...).
  std::vector<std::vector<BlockCache>> rank_caches_;
  std::unordered_map<int64_t, SequenceEntry> sequences_;
  struct SwappedEntry {
    std::vector<int32_t> blocks;  // the block table's contents, in order: host blocks, or disk blocks
    int32_t slot = -1;            // the state slot's contents (host or disk slot); -1: it held no slot
    bool on_disk = false;
    uint64_t swapped_at = 0;                   // for moving the oldest to disk first
    std::vector<std::future<DiskRead>> reads;  // prefetch(): the blocks', then the slot's
  };
  // A disk entry's read queued by prefetch_prefix, at the entry's write generation then.
  struct PrefetchedRead {
    int32_t entry = -1;
    uint64_t generation = 0;
    std::future<DiskRead> data;
  };
  struct PrefixPrefetch {
    std::vector<PrefetchedRead> blocks;
    PrefetchedRead slot;
    size_t bytes = 0;
  };
  // Host blocks being written to disk ahead of their eviction: retained (off the LRU list, still
  // indexed as host hits) until `written` is ready.
  struct HostWriteAhead {
    int32_t host_block = -1;
    std::future<void> written;
  };
  std::vector<HostWriteAhead> host_writes_;
  int32_t write_ahead_target_ = 0;
  std::unordered_map<int64_t, PrefixPrefetch> prefix_prefetches_;
  size_t prefetched_bytes_ = 0;  // of every PrefixPrefetch held
  // Removes and returns the sequence's prefetched reads (empty when none).
  PrefixPrefetch take_prefix_prefetch(int64_t seq_id);
  HostTier host_;
  PrefixCache host_prefix_{0, 1};  // hashes of the host tier's cached blocks
  CheckpointIndex host_checkpoints_;
  std::unique_ptr<DiskTier> disk_;
  PrefixCache disk_prefix_{0, 1};  // hashes of the disk tier's cached blocks
  CheckpointIndex disk_checkpoints_;
  std::unordered_map<int64_t, SwappedEntry> swapped_;
  uint64_t swap_clock_ = 0;

  // ---- Tier bookkeeping (cache_tiers.cpp)
  enum class Tier : uint8_t { kDevice, kHost, kDisk };
  // Takes `count` host blocks (ref count 1 each); cached host blocks evicted go to disk. For the
  // swap-out of sequence `swapping`, older swapped sequences move to disk first when too few are free.
  bool take_host_blocks(int32_t count, std::vector<int32_t>& out, std::optional<int64_t> swapping);
  // A host slot, evicting the least recently used host checkpoint when none is free, and for the
  // swap-out of `swapping` then moving an older swapped sequence to disk; -1 when none can be had.
  int32_t take_host_slot(std::optional<int64_t> swapping);
  // Disk ids, evicting cached disk blocks / disk checkpoints; false / -1 when the disk is full of
  // swapped sequences.
  bool take_disk_blocks(int32_t count, std::vector<int32_t>& out);
  int32_t take_disk_slot();
  // Moves what the host tier is about to drop to disk (when there is a disk tier and room).
  void spill_host_block(int32_t host_block);
  void spill_host_checkpoint(int32_t host_slot);
  bool spill_swapped(int64_t seq_id);
  // The oldest swapped sequence still in the host tier, other than `keep` (and with a slot when
  // `with_slot`), or -1.
  int64_t oldest_host_swapped(int64_t keep, bool with_slot) const;
  // Before a cached device block is evicted: keeps a copy in the host tier, indexed by its hash,
  // and its state checkpoint if it has one.
  void offload_evicted_block(int32_t block);
  // Before a device checkpoint slot is dropped: keeps a copy in the host tier.
  void offload_checkpoint(const BlockHash& hash, int32_t device_slot);
  // Drops a lost entry (it failed its integrity check) from its tier, with a warning.
  void drop_lost_block(Tier tier, int32_t block, const std::string& why);
  void drop_lost_checkpoint(Tier tier, int32_t slot, const std::string& why);
  // A prefix match's blocks that another tier holds: entry index, tier and the tier's block.
  struct TierHit {
    size_t index = 0;
    Tier tier = Tier::kHost;
    int32_t block = -1;
  };
  struct CheckpointSource {
    Tier tier = Tier::kDevice;
    int32_t slot = -1;
  };
  // One block of a prefix, looked up in every tier: its hash and the block holding it in each
  // (-1: not there; host and disk are looked up only when the tiers above miss).
  struct PrefixBlock {
    BlockHash hash;
    int32_t device = -1;
    int32_t host = -1;
    int32_t disk = -1;
  };
  PrefixBlock find_prefix_block(const BlockHash& parent, std::span<const int32_t> block_tokens) const;
  // The checkpoint after the prefix `hash` (held by device `block` if >= 0) in any tier.
  CheckpointSource find_checkpoint(int32_t block, const BlockHash& hash) const;
  // Brings a match's tier hits and (from the host or disk) its checkpoint into `entry` (which holds
  // the match's device blocks, retained, and placeholders at the hits): hits are verified and
  // copied into fresh device blocks indexed on the device, the checkpoint into the entry's slot.
  // The match is cut before the first hit lost or without a free device block; with per-slot
  // tensors, where a shorter match has no state, such a cut empties it. Returns whether the state
  // was restored.
  // Disk reads come from `prefetched` where it holds a read of the same entry and generation.
  bool restore_tier_hits(SequenceEntry& entry, std::span<const int32_t> tokens, const std::vector<TierHit>& hits,
                         const CheckpointSource& checkpoint, PrefixPrefetch& prefetched);
  // Reads a swapped sequence's contents back into fresh device blocks and a slot (swap_in's work).
  SwapIn load_swapped(int64_t seq_id, SwappedEntry& swapped, SequenceEntry& entry);
  SwapCounters swap_counters_;
  // Whether this match may read disk hits (set_recompute_seconds_per_token).
  bool disk_hits_pay();
  double recompute_seconds_per_token_ = 0.0;
  int32_t disk_matches_declined_ = 0;  // since the last probe
  void check_host_tier_integrity() const;
  // Waits for the queued work of every rank's device.
  void synchronize_devices() const;
  void check_disk_tier_integrity() const;
  // Per checkpoint slot (index slot - first checkpoint slot): the block it belongs to and when it
  // was last made or used, for LRU eviction among checkpoints.
  std::vector<int32_t> checkpoint_block_;
  std::vector<uint64_t> checkpoint_used_at_;
  uint64_t clock_ = 0;
};

}  // namespace metrale
