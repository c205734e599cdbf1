// HostTier: host-memory copies of whole KV blocks and of recurrent-state slots, the room a
// preempted sequence (or, later, an evicted prefix) is kept in instead of being recomputed.
//
// The tier mirrors the device cache's layout: one host area per paged tensor of the CacheManager,
// [num_blocks, bytes of one device block] (every row of every per-token and per-group tensor of a
// block travels with it), and one per per-slot tensor, [num_slots, bytes of one slot]. A host block
// or slot id is valid in every area at once, as device block and slot ids are. Host memory is
// pinned when the device is a GPU (copies are then true asynchronous DMA) and plain memory on the
// CPU device. The tier owns ids and bytes only; what a host block holds is the CacheManager's
// business. Host block ids live in a BlockPool: used (held by a swapped-out sequence), cached (a
// prefix block evicted from the device, on an LRU list, evicted in turn when a swap or a newer
// evicted block needs room), or empty.
//
// Copies are queued on the device's current stream, the stream the forward runs on, so a copy out
// runs after the step that wrote the block and a copy back in runs before the step that reads it,
// without waiting on the host. With staging (enable_staging, GPUs only) a block's copy out is split
// so that it overlaps the forward: a device-to-device copy into a ring of staging blocks on the
// current stream (~2 us for a Qwen3-8B block), after which the forward may overwrite the block, and
// the copy to host memory from there on a stream of its own (a CopyLane, ~44 us at PCIe speed).
// A staging block is reused once its copy out has run (the current stream waits for it on the
// device if need be), a load of an entry whose copy out is still on the lane waits for it on the
// device, and the entry is sealed once its ticket is done. State slots take the direct path.
//
// Integrity: every entry stored is sealed with an XXH3-64 fingerprint of its bytes once its copy
// has landed (at once on the CPU device; on a GPU by seal_pending, which the engine calls after each
// step, when the stream is idle, and which the disk spill calls first). A load verifies a sealed
// entry first; an entry still unsealed is in flight on the stream and is loaded unverified. The
// fingerprint reads the first 128 bytes of every 4 KiB of each area's unit and its last 128 (1/32
// of the bytes): enough to tell an entry overwritten, misplaced or half-copied, the failures that
// bookkeeping and copies can cause; a bit flipped in between is ECC memory's business. (The disk
// tier hashes every byte: files can be truncated or edited.) The host reads an entry's bytes
// itself only for the disk tier, after sealing it: packed, or in place by a disk worker
// (block_pieces) while the caller keeps the block from reuse.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cache/block_pool.h"
#include "cache/state_pool.h"
#include "runtime/buffer.h"
#include "runtime/copy_lane.h"
#include "runtime/tensor.h"

namespace metrale {

class HostTier {
 public:
  HostTier() = default;
  // `block_bytes[i]`: bytes of one block of paged tensor i; `slot_bytes[j]`: bytes of one slot of
  // per-slot tensor j. Host memory for `num_blocks` blocks and `num_slots` slots of all of them.
  HostTier(Device device, std::vector<size_t> block_bytes, std::vector<size_t> slot_bytes, int32_t num_blocks,
           int32_t num_slots);
  // The device tensors live on `devices` (tensor-parallel ranks: devices of one kind); seal_pending
  // waits for all of them.
  HostTier(std::span<const Device> devices, std::vector<size_t> block_bytes, std::vector<size_t> slot_bytes,
           int32_t num_blocks, int32_t num_slots);

  int32_t num_blocks() const { return blocks_.num_blocks(); }
  int32_t num_free_blocks() const { return blocks_.num_free(); }  // empty + cached
  int32_t num_used_blocks() const { return blocks_.num_used(); }  // held by swapped sequences
  int32_t num_cached_blocks() const { return blocks_.num_cached(); }  // prefix blocks
  const BlockPool& block_pool() const { return blocks_; }
  BlockPool& block_pool() { return blocks_; }
  // Stages block copies out through `num_staging` device blocks per GPU of `paged` (the device
  // cache's paged tensors, as store_block takes them); a no-op on the CPU device or for 0.
  void enable_staging(std::span<const OwnedTensor> paged, int32_t num_staging);
  int32_t num_staging_blocks() const { return lanes_.empty() ? 0 : lanes_.front().num_slots; }
  int32_t num_slots() const { return slots_.num_slots(); }
  int32_t num_free_slots() const { return slots_.num_free(); }
  int32_t num_used_slots() const { return slots_.num_used(); }
  // Whether the host block holds something (a swapped sequence's or a cached prefix block).
  bool holds_block(int32_t block) const {
    return block >= 0 && block < num_blocks() && (blocks_.ref_count(block) > 0 || blocks_.is_cached(block));
  }
  bool is_slot_allocated(int32_t slot) const { return slots_.contains(slot) && slots_.is_allocated(slot); }
  uint64_t memory_bytes() const;

  // A free host slot id, or -1 when none is free. (Blocks: block_pool().allocate / release.)
  int32_t allocate_slot() { return slots_.allocate(); }
  void free_slot(int32_t slot) { slots_.free(slot); }

  // `paged[i]` is paged tensor i of the device cache ([num_blocks, rows, ...], contiguous), in the
  // order of block_bytes. Copies device block `block` of each into host block `host_block`, or back.
  void store_block(std::span<const OwnedTensor> paged, int32_t block, int32_t host_block);
  void load_block(std::span<const OwnedTensor> paged, int32_t host_block, int32_t block);
  // The same for state slots: `slots[j]` is per-slot tensor j ([num_slots, ...], contiguous).
  void store_slot(std::span<const OwnedTensor> slots, int32_t slot, int32_t host_slot);
  void load_slot(std::span<const OwnedTensor> slots, int32_t host_slot, int32_t slot);

  // Bytes of one block of every paged tensor / one slot of every per-slot tensor, packed in order:
  // the size of a disk tier entry.
  size_t packed_block_bytes() const;
  size_t packed_slot_bytes() const;
  // Checksums every stored entry whose copy has landed (synchronizing the current streams first;
  // an entry still on a copy lane stays pending).
  void seal_pending();
  // Whether the entry holds the bytes it was sealed with (an unsealed entry is taken as it is).
  bool verify_block(int32_t host_block) const;
  bool verify_slot(int32_t host_slot) const;
  // Host block `host_block`'s bytes of paged tensor `area` (for tests and diagnostics).
  std::span<std::byte> block_bytes(size_t area, int32_t host_block);
  // The entry's bytes, packed (sealed first: they are read on the host).
  std::vector<std::byte> pack_block(int32_t host_block);
  std::vector<std::byte> pack_slot(int32_t host_slot);
  // The entry's bytes in place, one span per area in packing order (sealed first): what pack_block
  // would copy, for a writer that reads them itself while the block is kept from reuse.
  std::vector<std::span<const std::byte>> block_pieces(int32_t host_block);
  // Queues copies of packed bytes (a disk tier entry) into device block `block` / slot `slot`. The
  // bytes are plain host memory the caller keeps until it has synchronized the device.
  void load_packed_block(std::span<const OwnedTensor> paged, std::span<const std::byte> packed, int32_t block) const;
  void load_packed_slot(std::span<const OwnedTensor> slots, std::span<const std::byte> packed, int32_t slot) const;

 private:
  // Host memory of one area: pinned for a GPU device, plain for the CPU device.
  struct Area {
    Buffer plain;
    PinnedBuffer pinned;
    size_t unit_bytes = 0;  // one block or one slot
    std::byte* data() const;
  };
  void copy_unit(std::span<const OwnedTensor> device_tensors, std::vector<Area>& areas, int32_t device_index,
                 int32_t host_index, bool to_host);
  void copy_packed(std::span<const OwnedTensor> device_tensors, const std::vector<Area>& areas,
                   std::span<const std::byte> packed, int32_t device_index) const;
  static constexpr size_t kSealStrideBytes = 4096;
  static constexpr size_t kSealSampleBytes = 128;
  // Per entry: XXH3-64 of its sampled bytes across every area, and whether that is taken (sealed).
  struct Seals {
    std::vector<uint64_t> checksum;
    std::vector<uint8_t> sealed;
    std::vector<int32_t> pending;          // stored, not sealed yet
    std::vector<CopyLane::Ticket> ticket;  // [entry * lanes + lane]: its copy out on each lane (blocks)
  };
  // One GPU's staging ring and lane: `num_slots` units of the device's share of a block, the areas'
  // offsets inside a unit (npos: another GPU's tensor), the ticket of each unit's last copy out.
  struct Lane {
    Device device;
    Buffer staging;
    int32_t num_slots = 0;
    size_t unit_bytes = 0;
    std::vector<size_t> area_offset;
    std::vector<CopyLane::Ticket> slot_ticket;
    int32_t next_slot = 0;
    CopyLane lane;  // last: destroyed (and drained) before the staging memory and the host areas
  };
  void store_block_staged(std::span<const OwnedTensor> paged, int32_t block, int32_t host_block);
  // Device unit `device_index` of `tensor` (checked against the area's unit size).
  static std::byte* device_unit(const Tensor& tensor, const Area& area, int32_t device_index);
  CopyLane::Ticket& ticket_of(Seals& seals, int32_t host_index, size_t lane) {
    return seals.ticket[static_cast<size_t>(host_index) * lanes_.size() + lane];
  }
  const CopyLane::Ticket& ticket_of(const Seals& seals, int32_t host_index, size_t lane) const {
    return seals.ticket[static_cast<size_t>(host_index) * lanes_.size() + lane];
  }
  bool lanes_done(const Seals& seals, int32_t host_index);
  uint64_t checksum_of(const std::vector<Area>& areas, int32_t host_index) const;
  void mark_stored(Seals& seals, const std::vector<Area>& areas, int32_t host_index);
  bool verify(const Seals& seals, const std::vector<Area>& areas, int32_t host_index) const;
  std::vector<std::span<const std::byte>> pieces(Seals& seals, const std::vector<Area>& areas, int32_t host_index);
  std::vector<std::byte> pack(Seals& seals, const std::vector<Area>& areas, int32_t host_index);

  Device device_;
  std::vector<Device> devices_;  // every device the tensors live on (device_ is the first)
  std::vector<Area> block_areas_;  // per paged tensor
  std::vector<Area> slot_areas_;   // per per-slot tensor
  Seals block_seals_;
  Seals slot_seals_;
  BlockPool blocks_{0};            // host block ids [0, num_blocks)
  StatePool slots_;                // host slot ids [0, num_slots)
  std::vector<Lane> lanes_;        // last: drained before the areas are freed
};

}  // namespace metrale
