// ThreadPool::parallel_for: coverage of every index exactly once over many (threads, n, grain)
// combinations, the documented range sizes, exception propagation, nested and concurrent calls.
#include "runtime/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/test_support.h"

namespace metrale {
namespace {

struct Range {
  int64_t begin, end;
  bool operator<(const Range& other) const { return begin < other.begin; }
};

// Runs one parallel_for and returns the ranges it handed out, sorted by start.
std::vector<Range> record_ranges(ThreadPool& pool, int64_t n, int64_t grain, std::vector<std::atomic<int>>& hits) {
  std::mutex mutex;
  std::vector<Range> ranges;
  pool.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
    std::lock_guard lock(mutex);
    ranges.push_back({begin, end});
  });
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  const int64_t sizes[] = {1, 2, 3, 5, 7, 8, 9, 16, 31, 64, 100, 257, 1000, 4099};
  const int64_t grains[] = {0, 1, 2, 3, 7, 16, 64, 1000, 5000};
  for (const int threads : {1, 2, 3, 4, 7}) {
    ThreadPool pool(threads);
    ASSERT_EQ(pool.num_threads(), threads);
    for (const int64_t n : sizes) {
      for (const int64_t grain : grains) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        const std::vector<Range> ranges = record_ranges(pool, n, grain, hits);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1)
              << "threads " << threads << " n " << n << " grain " << grain << " index " << i;
        }
        // The ranges are disjoint, ordered and tile [0, n).
        ASSERT_FALSE(ranges.empty());
        EXPECT_EQ(ranges.front().begin, 0);
        EXPECT_EQ(ranges.back().end, n);
        for (size_t r = 0; r + 1 < ranges.size(); ++r) EXPECT_EQ(ranges[r].end, ranges[r + 1].begin);
      }
    }
  }
}

// thread_pool.h: "Ranges hold at least `grain` items (except the last)". Kernels pick grains so that
// a range amortises its per-range setup (scratch buffers, weight conversion).
TEST(ThreadPool, RangesHoldAtLeastGrainItemsExceptTheLast) {
  for (const int threads : {2, 4}) {
    ThreadPool pool(threads);
    for (int64_t n = 1; n <= 80; ++n) {
      for (const int64_t grain : {1, 2, 3, 4, 5, 8, 13}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        const std::vector<Range> ranges = record_ranges(pool, n, grain, hits);
        for (size_t r = 0; r + 1 < ranges.size(); ++r) {
          ASSERT_GE(ranges[r].end - ranges[r].begin, grain)
              << "threads " << threads << " n " << n << " grain " << grain << ": range [" << ranges[r].begin << ", "
              << ranges[r].end << ") of " << ranges.size();
        }
      }
    }
  }
}

TEST(ThreadPool, NonPositiveCountsDoNothing) {
  ThreadPool pool(3);
  int calls = 0;
  pool.parallel_for(0, 1, [&](int64_t, int64_t) { ++calls; });
  pool.parallel_for(-5, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ThreadPool, PropagatesExceptionsAndStaysUsable) {
  ThreadPool pool(4);
  for (int round = 0; round < 20; ++round) {
    const int64_t bad_index = 37 + round;
    try {
      pool.parallel_for(200, 1, [&](int64_t begin, int64_t end) {
        if (begin <= bad_index && bad_index < end) raise(ErrorCode::kInvalidArgument, "bad index {}", bad_index);
      });
      FAIL() << "the exception was swallowed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_EQ(std::string(e.what()), "bad index " + std::to_string(bad_index));
    }
    // The pool still covers every index after a failed job.
    std::vector<std::atomic<int>> hits(300);
    record_ranges(pool, 300, 1, hits);
    for (const auto& hit : hits) ASSERT_EQ(hit.load(), 1);
  }
  // Non-metrale exceptions pass through unchanged too.
  EXPECT_THROW(pool.parallel_for(64, 1, [](int64_t, int64_t) { throw std::out_of_range("x"); }), std::out_of_range);
}

TEST(ThreadPool, NestedCallsRunSeriallyOnTheCallingThread) {
  ThreadPool pool(4);
  const int64_t outer = 16, inner = 50;
  std::vector<std::atomic<int>> hits(static_cast<size_t>(outer * inner));
  std::atomic<int> inner_calls{0}, wrong_thread{0}, wrong_range{0};
  pool.parallel_for(outer, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const auto caller = std::this_thread::get_id();
      pool.parallel_for(inner, 1, [&](int64_t b, int64_t e) {
        inner_calls.fetch_add(1);
        if (std::this_thread::get_id() != caller) wrong_thread.fetch_add(1);
        if (b != 0 || e != inner) wrong_range.fetch_add(1);
        for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(o * inner + i)].fetch_add(1);
      });
    }
  });
  EXPECT_EQ(inner_calls.load(), outer) << "each nested call runs as one serial range";
  EXPECT_EQ(wrong_thread.load(), 0);
  EXPECT_EQ(wrong_range.load(), 0);
  for (const auto& hit : hits) ASSERT_EQ(hit.load(), 1);
}

TEST(ThreadPool, ConcurrentCallersBothComplete) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> a(5000), b(5000);
  std::thread other([&] {
    for (int r = 0; r < 20; ++r)
      pool.parallel_for(250, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) a[static_cast<size_t>(r * 250 + i)].fetch_add(1);
      });
  });
  for (int r = 0; r < 20; ++r)
    pool.parallel_for(250, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) b[static_cast<size_t>(r * 250 + i)].fetch_add(1);
    });
  other.join();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].load(), 1);
    ASSERT_EQ(b[i].load(), 1);
  }
}

TEST(ThreadPool, ProcessPoolFollowsSetCpuThreads) {
  set_cpu_threads(3);
  EXPECT_EQ(cpu_pool().num_threads(), 3);
  std::vector<std::atomic<int>> hits(1000);
  record_ranges(cpu_pool(), 1000, 7, hits);
  for (const auto& hit : hits) ASSERT_EQ(hit.load(), 1);
  set_cpu_threads(1);
  EXPECT_EQ(cpu_pool().num_threads(), 1);
  set_cpu_threads(0);
  EXPECT_GE(cpu_pool().num_threads(), 1);
}

// The system refuses the fourth thread: the constructor must fail with the count, after stopping
// and joining the three it started (a leaked joinable std::thread would terminate the process, a
// worker never told to stop would keep the test from ending).
TEST(ThreadPool, ThreadCreationFailureStopsTheStartedWorkersAndSaysHowMany) {
  std::atomic<int> started = 0;
  std::atomic<int> finished = 0;
  const ThreadPool::ThreadStarter refuse_fourth = [&](std::function<void()> body) {
    if (started == 3) throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
    ++started;
    return std::thread([body = std::move(body), &finished] {
      body();
      ++finished;
    });
  };
  EXPECT_TRUE(testing::throws_error([&] { ThreadPool pool(8, refuse_fourth); }, ErrorCode::kUnavailable,
                                    {"cannot start CPU thread 5 of 8", "4 running"}));
  EXPECT_EQ(started.load(), 3);
  EXPECT_EQ(finished.load(), 3);
}

TEST(ThreadPool, ThreadCountIsBounded) {
  EXPECT_TRUE(testing::throws_error([] { ThreadPool pool(ThreadPool::kMaxThreads + 1); }, ErrorCode::kInvalidArgument,
                                    {"beyond the limit"}));
  EXPECT_GE(machine_cpu_count(), 1);
}

}  // namespace
}  // namespace metrale
