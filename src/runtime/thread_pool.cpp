#include "runtime/thread_pool.h"

#include <algorithm>
#include <memory>

namespace metrale {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_chunks() {
  while (true) {
    int64_t chunk;
    {
      std::lock_guard lock(mutex_);
      if (next_chunk_ >= num_chunks_) return;
      chunk = next_chunk_++;
    }
    const int64_t begin = chunk * chunk_;
    const int64_t end = std::min(total_, begin + chunk_);
    try {
      (*body_)(begin, end);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    if (++chunks_done_ == num_chunks_) work_done_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_chunks();
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  // Floor, not ceiling: every range then holds at least `grain` items.
  const int64_t max_chunks = std::min<int64_t>(std::max<int64_t>(1, n / grain), int64_t{num_threads()} * 4);
  {
    std::unique_lock lock(mutex_);
    if (busy_ || workers_.empty() || max_chunks <= 1) {
      lock.unlock();
      body(0, n);
      return;
    }
    busy_ = true;
    body_ = &body;
    total_ = n;
    chunk_ = (n + max_chunks - 1) / max_chunks;
    num_chunks_ = (n + chunk_ - 1) / chunk_;
    next_chunk_ = 0;
    chunks_done_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  work_ready_.notify_all();
  run_chunks();
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    work_done_.wait(lock, [&] { return chunks_done_ == num_chunks_; });
    busy_ = false;
    body_ = nullptr;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

namespace {
std::unique_ptr<ThreadPool>& pool_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
int& requested_threads() {
  static int threads = 0;
  return threads;
}
}  // namespace

ThreadPool& cpu_pool() {
  auto& pool = pool_slot();
  if (!pool) pool = std::make_unique<ThreadPool>(requested_threads());
  return *pool;
}

void set_cpu_threads(int threads) {
  requested_threads() = threads;
  pool_slot().reset();
}

}  // namespace metrale
