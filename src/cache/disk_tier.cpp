#include "cache/disk_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "core/log.h"

namespace metrale {

uint64_t entry_checksum(const void* bytes, size_t size) {
  return XXH3_64bits(bytes, size);
}

namespace {

// A file descriptor that closes itself.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

std::filesystem::path unique_directory(const std::filesystem::path& parent) {
  static std::atomic<uint64_t> counter{0};
  return parent / fmt::format("metrale-swap-{}-{}", static_cast<long>(::getpid()), counter.fetch_add(1));
}

}  // namespace

DiskTier::DiskTier(const std::filesystem::path& parent, size_t block_bytes, size_t slot_bytes, int32_t num_blocks,
                   int32_t num_slots)
    : block_bytes_(block_bytes),
      slot_bytes_(slot_bytes),
      blocks_(std::max(num_blocks, 0)),
      slots_(0, std::max(num_slots, 0)),
      block_checksums_(static_cast<size_t>(std::max(num_blocks, 0)), 0),
      slot_checksums_(static_cast<size_t>(std::max(num_slots, 0)), 0),
      block_generations_(static_cast<size_t>(std::max(num_blocks, 0)), 0),
      slot_generations_(static_cast<size_t>(std::max(num_slots, 0)), 0) {
  if (num_blocks < 0 || num_slots < 0)
    raise(ErrorCode::kInvalidArgument, "negative disk tier size ({} blocks, {} slots)", num_blocks, num_slots);
  std::error_code error;
  std::filesystem::create_directories(parent, error);
  if (error || !std::filesystem::is_directory(parent))
    raise(ErrorCode::kInvalidArgument, "--high-speed-swap {}: not a directory that can be made ({})", parent.string(),
          error ? error.message() : "exists as a file");
  dir_ = unique_directory(parent);
  if (!std::filesystem::create_directory(dir_, error) || error)
    raise(ErrorCode::kInvalidArgument, "--high-speed-swap: cannot create {} ({})", dir_.string(),
          error ? error.message() : "exists");
  // A probe write: a read-only or full disk fails here, at start-up, not in the middle of serving.
  const std::filesystem::path probe = dir_ / "probe";
  {
    FileDescriptor fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600));
    const char byte = 0;
    if (fd.get() < 0 || ::write(fd.get(), &byte, 1) != 1)
      raise(ErrorCode::kInvalidArgument, "--high-speed-swap: cannot write in {} ({})", dir_.string(),
            std::strerror(errno));
  }
  std::filesystem::remove(probe, error);
  for (size_t w = 0; w < workers_.size(); ++w) workers_[w].thread = std::thread([this, w] { worker_loop(w); });
}

DiskTier::~DiskTier() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (Worker& worker : workers_)
    if (worker.thread.joinable()) worker.thread.join();
  std::error_code error;
  std::filesystem::remove_all(dir_, error);
  if (error) METRALE_LOG_WARN("disk tier: could not remove {}: {}", dir_.string(), error.message());
}

uint64_t DiskTier::capacity_bytes() const {
  return block_bytes_ * static_cast<uint64_t>(num_blocks()) + slot_bytes_ * static_cast<uint64_t>(num_slots());
}

std::filesystem::path DiskTier::block_path(int32_t block) const {
  return dir_ / fmt::format("block-{}.kv", block);
}
std::filesystem::path DiskTier::slot_path(int32_t slot) const {
  return dir_ / fmt::format("slot-{}.state", slot);
}

size_t DiskTier::worker_of_block(int32_t block) const {
  return static_cast<size_t>(block) % workers_.size();
}

size_t DiskTier::worker_of_slot(int32_t slot) const {
  return (static_cast<size_t>(slot) + workers_.size() / 2) % workers_.size();
}

void DiskTier::enqueue(size_t worker, std::function<void()> run) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    workers_[worker].queue.push_back({std::move(run)});
  }
  wake_.notify_all();  // one condition for every worker: it wakes the one whose queue grew
}

bool DiskTier::idle_locked() const {
  for (const Worker& worker : workers_)
    if (worker.busy || !worker.queue.empty()) return false;
  return true;
}

void DiskTier::worker_loop(size_t index) {
  Worker& self = workers_[index];
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !self.queue.empty(); });
    if (self.queue.empty()) break;  // stopping, and every job queued here has run
    Job job = std::move(self.queue.front());
    self.queue.pop_front();
    self.busy = true;
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    job.run();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    lock.lock();
    io_seconds_ += seconds;
    self.busy = false;
    if (idle_locked()) idle_.notify_all();
  }
  idle_.notify_all();
}

void DiskTier::drain() const {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [&] { return idle_locked(); });
}

uint64_t DiskTier::bytes_written() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_written_;
}

uint64_t DiskTier::bytes_read() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_read_;
}

double DiskTier::read_bytes_per_second() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Each worker's rate times the workers: a match's reads spread over all of them.
  return read_seconds_ > 0.0
             ? static_cast<double>(checked_bytes_read_) * static_cast<double>(workers_.size()) / read_seconds_
             : 0.0;
}

double DiskTier::io_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return io_seconds_;
}

void DiskTier::write_file(const std::filesystem::path& path, std::span<const std::span<const std::byte>> pieces) {
  FileDescriptor fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600));
  size_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  // pwritev of the pieces not yet written (1024 at a time: Linux's IOV_MAX), resumed after a
  // short write.
  constexpr size_t kMaxVectors = 1024;
  std::vector<iovec> vectors;
  size_t done = 0, piece = 0, piece_done = 0;
  while (fd.get() >= 0 && done < total) {
    vectors.clear();
    for (size_t p = piece; p < pieces.size() && vectors.size() < kMaxVectors; ++p) {
      const size_t skip = p == piece ? piece_done : 0;
      vectors.push_back({const_cast<std::byte*>(pieces[p].data() + skip), pieces[p].size() - skip});
    }
    const ssize_t written =
        ::pwritev(fd.get(), vectors.data(), static_cast<int>(vectors.size()), static_cast<off_t>(done));
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) break;
    done += static_cast<size_t>(written);
    for (auto left = static_cast<size_t>(written); left > 0 && piece < pieces.size();) {
      const size_t take = std::min(left, pieces[piece].size() - piece_done);
      left -= take;
      piece_done += take;
      if (piece_done == pieces[piece].size()) {
        ++piece;
        piece_done = 0;
      }
    }
  }
  // A failed write leaves a short or missing file, which the read reports lost.
  if (done < total) {
    METRALE_LOG_WARN("disk tier: writing {} failed after {} of {} bytes ({}); the entry will be recomputed",
                     path.string(), done, total, std::strerror(errno));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  bytes_written_ += done;
}

DiskRead DiskTier::read_file(const std::filesystem::path& path, size_t size, uint64_t checksum) {
  const auto start = std::chrono::steady_clock::now();
  DiskRead result = read_and_check(path, size, checksum);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (result.ok) {
    std::lock_guard<std::mutex> lock(mutex_);
    read_seconds_ += seconds;
    checked_bytes_read_ += size;
  }
  return result;
}

DiskRead DiskTier::read_and_check(const std::filesystem::path& path, size_t size, uint64_t checksum) {
  DiskRead result;
  const std::string name = path.filename().string();
  FileDescriptor fd(::open(path.c_str(), O_RDONLY));
  if (fd.get() < 0) {
    result.error = fmt::format("{}: {}", name, std::strerror(errno));
    return result;
  }
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0 || static_cast<size_t>(info.st_size) != size) {
    result.error = fmt::format("{}: {} bytes, expected {}", name, static_cast<long long>(info.st_size), size);
    return result;
  }
  result.bytes.resize(size);
  size_t done = 0;
  while (done < size) {
    const ssize_t got = ::pread(fd.get(), result.bytes.data() + done, size - done, static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    done += static_cast<size_t>(got);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_read_ += done;
  }
  if (done < size) {
    result.error = fmt::format("{}: read {} of {} bytes", name, done, size);
    result.bytes.clear();
    return result;
  }
  if (entry_checksum(result.bytes.data(), size) != checksum) {
    result.error = fmt::format("{}: checksum mismatch", name);
    result.bytes.clear();
    return result;
  }
  result.ok = true;
  return result;
}

void DiskTier::write_block(int32_t block, std::vector<std::byte> bytes) {
  METRALE_CHECK(block >= 0 && block < num_blocks() && bytes.size() == block_bytes_, "disk block {} write of {} bytes",
                block, bytes.size());
  // Hashed on the worker (~150 us for a Qwen3-8B block, off the engine thread); a later read of the
  // entry runs after this job and takes the checksum there.
  ++block_generations_[static_cast<size_t>(block)];
  enqueue(worker_of_block(block), [this, block, path = block_path(block), data = std::move(bytes)] {
    block_checksums_[static_cast<size_t>(block)] = entry_checksum(data.data(), data.size());
    const std::span<const std::byte> whole(data);
    write_file(path, std::span(&whole, 1));
  });
}

std::future<void> DiskTier::write_block_in_place(int32_t block, std::vector<std::span<const std::byte>> pieces) {
  size_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  METRALE_CHECK(block >= 0 && block < num_blocks() && total == block_bytes_, "disk block {} write of {} bytes", block,
                total);
  ++block_generations_[static_cast<size_t>(block)];
  auto written = std::make_shared<std::promise<void>>();
  std::future<void> future = written->get_future();
  enqueue(worker_of_block(block), [this, block, written, path = block_path(block), parts = std::move(pieces)] {
    // The checksum of the pieces as one entry: XXH3's streaming state gives the same 64 bits.
    const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(), XXH3_freeState);
    METRALE_CHECK(state != nullptr, "XXH3_createState failed");
    XXH3_64bits_reset(state.get());
    for (const auto& part : parts) XXH3_64bits_update(state.get(), part.data(), part.size());
    block_checksums_[static_cast<size_t>(block)] = XXH3_64bits_digest(state.get());
    write_file(path, parts);
    written->set_value();
  });
  return future;
}

void DiskTier::write_slot(int32_t slot, std::vector<std::byte> bytes) {
  METRALE_CHECK(slots_.contains(slot) && bytes.size() == slot_bytes_, "disk slot {} write of {} bytes", slot,
                bytes.size());
  ++slot_generations_[static_cast<size_t>(slot)];
  enqueue(worker_of_slot(slot), [this, slot, path = slot_path(slot), data = std::move(bytes)] {
    slot_checksums_[static_cast<size_t>(slot)] = entry_checksum(data.data(), data.size());
    const std::span<const std::byte> whole(data);
    write_file(path, std::span(&whole, 1));
  });
}

std::future<DiskRead> DiskTier::read_block(int32_t block) {
  METRALE_CHECK(block >= 0 && block < num_blocks(), "disk block {} out of range", block);
  auto promise = std::make_shared<std::promise<DiskRead>>();
  std::future<DiskRead> future = promise->get_future();
  enqueue(worker_of_block(block), [this, promise, block, path = block_path(block)] {
    promise->set_value(read_file(path, block_bytes_, block_checksums_[static_cast<size_t>(block)]));
  });
  return future;
}

std::future<DiskRead> DiskTier::read_slot(int32_t slot) {
  METRALE_CHECK(slots_.contains(slot), "disk slot {} out of range", slot);
  auto promise = std::make_shared<std::promise<DiskRead>>();
  std::future<DiskRead> future = promise->get_future();
  enqueue(worker_of_slot(slot), [this, promise, slot, path = slot_path(slot)] {
    promise->set_value(read_file(path, slot_bytes_, slot_checksums_[static_cast<size_t>(slot)]));
  });
  return future;
}

}  // namespace metrale
