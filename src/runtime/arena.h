// A bump allocator for the temporaries of one forward step. reset() at the start of each step
// makes every earlier allocation reusable; tensors from before a reset must not be used after it.
// On the CPU it grows on demand; a fixed capacity (for device memory planned up front) makes an
// allocation past it throw kOutOfMemory.
#pragma once

#include <vector>

#include "runtime/tensor.h"

namespace metrale {

class Arena {
 public:
  Arena(Device device, size_t initial_bytes, bool growable = true);

  Tensor alloc(DType dtype, Shape shape);
  void reset();
  Device device() const { return device_; }
  size_t high_water_bytes() const { return high_water_; }
  size_t capacity_bytes() const;
  // Replaces the memory by one chunk of `bytes` and fixes growth on or off. With growth off,
  // addresses handed out for the same sequence of allocations after each reset() are stable,
  // which CUDA graph replays rely on.
  void reserve(size_t bytes, bool growable);

  // Frees, at the end of its lifetime, everything allocated since it was made: the temporaries of
  // one layer, so that a step needs the workspace of its largest layer rather than of all of them.
  class Scope {
   public:
    explicit Scope(Arena& arena)
        : arena_(arena), chunk_index_(arena.chunk_index_), offset_(arena.offset_), used_(arena.used_) {}
    ~Scope() {
      arena_.chunk_index_ = chunk_index_;
      arena_.offset_ = offset_;
      arena_.used_ = used_;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Arena& arena_;
    size_t chunk_index_, offset_, used_;
  };

 private:
  Device device_;
  bool growable_;
  std::vector<Buffer> chunks_;
  size_t chunk_index_ = 0;
  size_t offset_ = 0;
  size_t used_ = 0;
  size_t high_water_ = 0;
};

}  // namespace metrale
