// A fixed pool of worker threads for the CPU kernels. parallel_for splits [0, n) into contiguous
// ranges; the calling thread takes part and returns when every range is done. One parallel_for runs
// at a time per pool (the engine thread is the only caller); nested calls run serially.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace metrale {

class ThreadPool {
 public:
  static constexpr int kMaxThreads = 1024;
  // Starts one worker thread running `body`; the default is std::thread (tests inject failures).
  using ThreadStarter = std::function<std::thread(std::function<void()> body)>;

  // threads = total workers including the caller; 0 means hardware concurrency. Throws
  // kInvalidArgument beyond kMaxThreads, and kUnavailable (naming how many threads started) when the
  // system refuses a thread; the workers already started are stopped and joined first.
  explicit ThreadPool(int threads = 0, const ThreadStarter& start_thread = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls body(begin, end) over disjoint ranges covering [0, n). Ranges hold at least `grain` items
  // (except the last). Exceptions from the body are rethrown in the caller (the first one wins).
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

 private:
  void worker_loop();
  void run_chunks();
  void stop_workers() noexcept;

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  bool busy_ = false;

  // The job in flight (valid while busy_).
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t total_ = 0;
  int64_t chunk_ = 0;
  int64_t next_chunk_ = 0;
  int64_t num_chunks_ = 0;
  int64_t chunks_done_ = 0;
  std::exception_ptr error_;
};

// The process-wide pool used by the CPU kernels. set_cpu_threads must be called before first use to
// take effect (e.g. from --threads); afterwards it recreates the pool. It builds the pool at once,
// so an impossible thread count fails there (with the errors of the constructor) and not in a kernel.
ThreadPool& cpu_pool();
void set_cpu_threads(int threads);

// The CPUs this process may run on (hardware concurrency, at least 1).
int machine_cpu_count();

}  // namespace metrale
