// Running bytes through the rule automata with a stack (internal to the grammar engine). A thread is
// a stack of (rule, state) frames: some local ones on top of a persistent base, a matcher's
// StackNode (shared by every thread above it). Nondeterminism (alternative rules, optional parts
// that start alike) is a set of threads.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "text/grammar/automaton.h"

namespace metrale::grammar {

// A frame of a matcher's persistent stack; `depth` counts the frames from the bottom (1 for a node
// whose parent is kNoParent).
struct StackNode {
  RuleId rule = -1;
  int32_t state = -1;
  int32_t parent = -1;
  int32_t depth = 0;
};

// Bases that are not nodes. Popping the last frame above kNoParent completes the grammar; popping the
// last frame above kBoundary "exits": the precomputation of a position stops there, since what comes
// next depends on the stack below.
inline constexpr int32_t kNoParent = -1;
inline constexpr int32_t kBoundary = -2;

// Threads stored flat: thread i is data[offsets[i], offsets[i + 1]) = {base, rule0, state0, rule1,
// state1, ...} with the top frame last.
class ThreadSet {
 public:
  void clear() {
    data_.clear();
    offsets_.assign(1, 0);
    exited = false;
    completed = false;
  }
  size_t size() const { return offsets_.size() - 1; }
  bool empty() const { return size() == 0; }
  std::span<const int32_t> thread(size_t i) const {
    return std::span<const int32_t>(data_).subspan(static_cast<size_t>(offsets_[i]),
                                                   static_cast<size_t>(offsets_[i + 1] - offsets_[i]));
  }
  bool contains(std::span<const int32_t> thread) const;
  void add(std::span<const int32_t> thread) {
    data_.insert(data_.end(), thread.begin(), thread.end());
    offsets_.push_back(static_cast<int32_t>(data_.size()));
  }
  void add_unique(std::span<const int32_t> thread) {
    if (!contains(thread)) add(thread);
  }

  bool exited = false;     // some thread popped past kBoundary
  bool completed = false;  // some thread popped past kNoParent

 private:
  std::vector<int32_t> data_;
  std::vector<int32_t> offsets_{0};
};

class Simulator {
 public:
  Simulator(const CompiledRules& rules, const std::vector<StackNode>* nodes, int32_t max_depth)
      : rules_(rules), nodes_(nodes), max_depth_(max_depth) {}

  // Adds to `out` every thread with a byte edge on top reachable from `thread` without consuming a
  // byte (pushing referenced rules, popping finished ones), and sets out.exited / out.completed.
  // A thread with no local frames starts by popping into its base. Threads visited since the last
  // clear_visited() (or step()) are not visited again.
  void close(std::span<const int32_t> thread, ThreadSet& out);
  void clear_visited() { visited_.clear(); }
  // The persistent nodes that thread bases name (they move with their owner).
  void set_nodes(const std::vector<StackNode>* nodes) { nodes_ = nodes; }

  // out = the closure of every thread of `in` moved on `byte`. Returns whether any thread moved (the
  // byte is acceptable even if every moved thread then exited or completed).
  bool step(const ThreadSet& in, uint8_t byte, ThreadSet& out);

 private:
  int32_t base_depth(int32_t base) const { return base >= 0 ? (*nodes_)[static_cast<size_t>(base)].depth : 0; }
  void push_work(std::span<const int32_t> thread);

  const CompiledRules& rules_;
  const std::vector<StackNode>* nodes_;
  int32_t max_depth_;
  ThreadSet visited_;
  std::vector<int32_t> work_data_;
  std::vector<int32_t> work_offsets_;
  std::vector<int32_t> current_;
  std::vector<int32_t> moved_;
};

}  // namespace metrale::grammar
