#include "runtime/thread_pool.h"

#include <algorithm>
#include <exception>
#include <memory>

#include "core/error.h"

namespace metrale {

int machine_cpu_count() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

ThreadPool::ThreadPool(int threads, const ThreadStarter& start_thread) {
  if (threads <= 0) threads = machine_cpu_count();
  if (threads > kMaxThreads)
    raise(ErrorCode::kInvalidArgument, "a CPU thread pool of {} threads is beyond the limit of {}", threads, kMaxThreads);
  workers_.reserve(static_cast<size_t>(threads - 1));
  for (int i = 1; i < threads; ++i) {
    try {
      if (start_thread) workers_.push_back(start_thread([this] { worker_loop(); }));
      else workers_.emplace_back([this] { worker_loop(); });
    } catch (const std::exception& e) {
      // The destructor does not run for a constructor that throws: stop the started workers here,
      // or their std::thread objects would terminate the process (or they would wait forever).
      const size_t started = workers_.size();
      stop_workers();
      raise(ErrorCode::kUnavailable, "cannot start CPU thread {} of {} ({} running): {}", started + 2, threads,
            started + 1, e.what());
    }
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() noexcept {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
  workers_.clear();
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
  pool_slot() = std::make_unique<ThreadPool>(threads);
}

}  // namespace metrale
