// DiskTier: files on a local disk for KV blocks and recurrent-state slots spilled from the host
// tier (--high-speed-swap DIR, bounded by --swap-disk-space).
//
// One file per entry in a directory of its own under DIR (made at start, removed at shutdown):
// `block-<id>.kv` holds a block's bytes of every paged tensor, packed in the CacheManager's tensor
// order (HostTier::pack_block), and `slot-<id>.state` a slot's bytes of every per-slot tensor. Ids
// are the tier's own: a BlockPool for blocks (used: held by a swapped-out sequence; cached: a
// prefix block on the LRU list; empty) and a StatePool for slots, exactly as in the host tier.
//
// I/O runs on kWorkers worker threads, each fed by a FIFO queue, so the engine thread never waits
// on a write; an entry's jobs always go to the same worker (by its id), so a read queued after a
// write of the same entry sees what was written, and a prefix hit's reads of consecutive blocks
// run on all the workers at once. A write takes the bytes
// (already copied out of host memory, which may be reused at once); a read returns a future the
// caller waits on before it uses the data. Every entry carries the XXH3-64 checksum of its bytes,
// taken by the worker as it writes them and kept in memory: a read that finds the file missing, short or
// with other bytes reports the entry lost, and the caller drops it and recomputes. Nothing here
// throws on a disk error after start-up; it logs and reports the entry lost.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cache/block_pool.h"
#include "cache/state_pool.h"

namespace metrale {

// XXH3-64 of `bytes`: the checksum every tier keeps of its entries.
uint64_t entry_checksum(const void* bytes, size_t size);

// What a read brings back: the entry's bytes, or why it is lost.
struct DiskRead {
  bool ok = false;
  std::vector<std::byte> bytes;
  std::string error;  // !ok: "block-12.kv: missing", "...: checksum mismatch", ...
};

class DiskTier {
 public:
  static constexpr size_t kWorkers = 4;

  // Files for `num_blocks` entries of `block_bytes` and `num_slots` of `slot_bytes` in a new
  // directory under `parent` (created if need be). Throws kInvalidArgument naming the path when it
  // cannot be made or written.
  DiskTier(const std::filesystem::path& parent, size_t block_bytes, size_t slot_bytes, int32_t num_blocks,
           int32_t num_slots);
  ~DiskTier();  // drains the queue, joins the worker, removes the directory
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  const std::filesystem::path& directory() const { return dir_; }
  size_t block_bytes() const { return block_bytes_; }
  size_t slot_bytes() const { return slot_bytes_; }
  uint64_t capacity_bytes() const;
  int32_t num_blocks() const { return blocks_.num_blocks(); }
  int32_t num_slots() const { return slots_.num_slots(); }
  BlockPool& block_pool() { return blocks_; }
  const BlockPool& block_pool() const { return blocks_; }
  StatePool& slot_pool() { return slots_; }
  const StatePool& slot_pool() const { return slots_; }
  std::filesystem::path block_path(int32_t block) const;
  std::filesystem::path slot_path(int32_t slot) const;

  // Queues writing `bytes` (block_bytes / slot_bytes of them) as the entry; its checksum is kept.
  void write_block(int32_t block, std::vector<std::byte> bytes);
  void write_slot(int32_t slot, std::vector<std::byte> bytes);
  // The same from the caller's memory, `pieces` in order (block_bytes in all), read by the worker
  // itself: the memory must stay unchanged until the future is ready (the entry is then written,
  // or its write failed and a read will report it lost).
  std::future<void> write_block_in_place(int32_t block, std::vector<std::span<const std::byte>> pieces);
  // Queues reading the entry back; the future holds its bytes once they are read and verified.
  std::future<DiskRead> read_block(int32_t block);
  std::future<DiskRead> read_slot(int32_t slot);
  // How many writes the entry has been queued: a read queued at generation g holds the bytes of
  // that generation's write, so a read made ahead of time is still good while this has not moved.
  uint64_t block_generation(int32_t block) const { return block_generations_.at(static_cast<size_t>(block)); }
  uint64_t slot_generation(int32_t slot) const { return slot_generations_.at(static_cast<size_t>(slot)); }
  // Waits until every queued job has run (tests; shutdown).
  void drain() const;
  // Bytes written and read since start-up, and the seconds the workers spent on them (summed).
  uint64_t bytes_written() const;
  uint64_t bytes_read() const;
  double io_seconds() const;
  // Bytes per second of the reads that came back whole (file read and checksum; one worker's rate
  // times the workers, as a hit's reads spread over them), 0 before the first: what a disk hit
  // costs against recomputing its tokens.
  double read_bytes_per_second() const;

 private:
  struct Job {
    std::function<void()> run;
  };
  struct Worker {
    std::deque<Job> queue;  // under mutex_
    bool busy = false;      // under mutex_
    std::thread thread;
  };
  size_t worker_of_block(int32_t block) const;
  size_t worker_of_slot(int32_t slot) const;
  void enqueue(size_t worker, std::function<void()> run);
  bool idle_locked() const;
  void worker_loop(size_t index);
  // Writes the pieces, in order, as the file's bytes.
  void write_file(const std::filesystem::path& path, std::span<const std::span<const std::byte>> pieces);
  DiskRead read_file(const std::filesystem::path& path, size_t size, uint64_t checksum);  // timed
  DiskRead read_and_check(const std::filesystem::path& path, size_t size, uint64_t checksum);

  std::filesystem::path dir_;
  size_t block_bytes_ = 0;
  size_t slot_bytes_ = 0;
  BlockPool blocks_;
  StatePool slots_;
  // Checksums of what each entry holds, set and read only by the entry's worker (its write and read jobs).
  std::vector<uint64_t> block_checksums_;
  std::vector<uint64_t> slot_checksums_;
  // Writes queued per entry (the engine thread's, as every call above).
  std::vector<uint64_t> block_generations_;
  std::vector<uint64_t> slot_generations_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  mutable std::condition_variable idle_;
  bool stopping_ = false;
  uint64_t bytes_written_ = 0;  // under mutex_
  uint64_t bytes_read_ = 0;
  double io_seconds_ = 0.0;
  double read_seconds_ = 0.0;       // reads that came back whole
  uint64_t checked_bytes_read_ = 0;
  std::vector<Worker> workers_ = std::vector<Worker>(kWorkers);  // last: started after everything above
};

}  // namespace metrale
