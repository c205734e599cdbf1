#include "model/weight_prefetch.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

namespace metrale {
namespace {

// Brings `size` bytes at `data` (inside a read-only mapping) into memory.
void populate(const std::byte* data, size_t size) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + size;
#ifdef MADV_POPULATE_READ
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ) == 0) return;
#endif
  // Older kernels: read one byte of every page (the mapping faults it in).
  uint8_t sink = 0;
  for (uintptr_t address = std::max(begin, reinterpret_cast<uintptr_t>(data)); address < end; address += page)
    sink = static_cast<uint8_t>(sink ^ *reinterpret_cast<const volatile uint8_t*>(address));
  static_cast<void>(sink);
}

}  // namespace

WeightPrefetcher::WeightPrefetcher(std::vector<std::span<const std::byte>> ranges, int32_t threads) {
  for (const auto& range : ranges)
    for (size_t offset = 0; offset < range.size(); offset += kChunkBytes)
      chunks_.push_back({range.data() + offset, std::min(kChunkBytes, range.size() - offset)});
  if (threads <= 0) threads = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::min({threads, kMaxThreads, static_cast<int32_t>(chunks_.size())});
  for (int32_t i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

WeightPrefetcher::~WeightPrefetcher() {
  stop();
}

void WeightPrefetcher::run() {
  while (!stopping_.load(std::memory_order_relaxed)) {
    const size_t index = next_.fetch_add(1, std::memory_order_relaxed);
    if (index >= chunks_.size()) return;
    populate(chunks_[index].data, chunks_[index].size);
    bytes_done_.fetch_add(chunks_[index].size, std::memory_order_relaxed);
  }
}

void WeightPrefetcher::stop() {
  stopping_.store(true, std::memory_order_relaxed);
  wait();
}

void WeightPrefetcher::wait() {
  for (auto& thread : threads_)
    if (thread.joinable()) thread.join();
}

}  // namespace metrale
