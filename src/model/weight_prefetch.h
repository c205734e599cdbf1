// WeightPrefetcher: a pool of threads that brings a checkpoint's tensor bytes into memory while an
// architecture builds the model from them. The builder reads tensors one at a time on one thread
// (copying each to the GPU, or using it in place on the CPU); without the pool, every page it
// touches is a fault it waits on, one after the other. The pool populates the mappings' pages
// (MADV_POPULATE_READ, or a read of every page where the kernel lacks it) in chunks, in the order
// the files store them, on up to `threads` threads at once, so the builder mostly finds them
// resident. It reads nothing the mapping would not; stopping it early (a load error, a build that
// finished first) leaves only pages resident.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <thread>
#include <vector>

namespace metrale {

class WeightPrefetcher {
 public:
  // `ranges`: the mapped bytes to bring in (each file's tensor data); `threads` <= 0: the
  // hardware's concurrency, at most kMaxThreads.
  WeightPrefetcher(std::vector<std::span<const std::byte>> ranges, int32_t threads);
  ~WeightPrefetcher();  // stop()
  WeightPrefetcher(const WeightPrefetcher&) = delete;
  WeightPrefetcher& operator=(const WeightPrefetcher&) = delete;

  static constexpr int32_t kMaxThreads = 32;
  static constexpr size_t kChunkBytes = 32ull << 20;

  int32_t num_threads() const { return static_cast<int32_t>(threads_.size()); }
  // Bytes populated so far.
  uint64_t bytes_done() const { return bytes_done_.load(std::memory_order_relaxed); }
  // Finishes the chunk each thread is on and joins them.
  void stop();
  // Waits until every chunk is populated (tests, benchmarks).
  void wait();

 private:
  struct Chunk {
    const std::byte* data;
    size_t size;
  };
  void run();

  std::vector<Chunk> chunks_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> bytes_done_{0};
  std::vector<std::thread> threads_;
};

}  // namespace metrale
