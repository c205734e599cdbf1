#include "text/grammar/simulator.h"

#include <algorithm>

namespace metrale::grammar {

bool ThreadSet::contains(std::span<const int32_t> thread) const {
  for (size_t i = 0; i < size(); ++i) {
    const std::span<const int32_t> other = this->thread(i);
    if (other.size() == thread.size() && std::equal(other.begin(), other.end(), thread.begin())) return true;
  }
  return false;
}

void Simulator::push_work(std::span<const int32_t> thread) {
  work_data_.insert(work_data_.end(), thread.begin(), thread.end());
  work_offsets_.push_back(static_cast<int32_t>(work_data_.size()));
}

void Simulator::close(std::span<const int32_t> thread, ThreadSet& out) {
  work_data_.clear();
  work_offsets_.assign(1, 0);
  push_work(thread);
  while (work_offsets_.size() > 1) {
    const auto begin = static_cast<size_t>(work_offsets_[work_offsets_.size() - 2]);
    current_.assign(work_data_.begin() + static_cast<std::ptrdiff_t>(begin), work_data_.end());
    work_data_.resize(begin);
    work_offsets_.pop_back();
    if (visited_.contains(current_)) continue;
    visited_.add(current_);
    if (current_.size() == 1) {
      // No local frame: pop into the base.
      const int32_t base = current_[0];
      if (base == kBoundary) {
        out.exited = true;
      } else if (base == kNoParent) {
        out.completed = true;
      } else {
        const StackNode& node = (*nodes_)[static_cast<size_t>(base)];
        const int32_t next[3] = {node.parent, node.rule, node.state};
        push_work(next);
      }
      continue;
    }
    const size_t top = current_.size() - 2;
    const RuleAutomaton& dfa = rules_.rules[static_cast<size_t>(current_[top])];
    const int32_t state = current_[top + 1];
    if (dfa.has_bytes(state)) out.add_unique(current_);
    const auto depth = base_depth(current_[0]) + static_cast<int32_t>(current_.size() / 2);
    if (dfa.has_refs(state) && depth < max_depth_) {
      for (const RefEdge& ref : dfa.refs_of(state)) {
        // Return to ref.target once the referenced rule ends.
        const size_t size = current_.size();
        current_[top + 1] = ref.target;
        current_.push_back(ref.rule);
        current_.push_back(0);
        push_work(current_);
        current_.resize(size);
        current_[top + 1] = state;
      }
    }
    if (dfa.is_final(state)) push_work(std::span<const int32_t>(current_).first(top));
  }
}

bool Simulator::step(const ThreadSet& in, uint8_t byte, ThreadSet& out) {
  out.clear();
  visited_.clear();
  bool moved = false;
  for (size_t i = 0; i < in.size(); ++i) {
    const std::span<const int32_t> thread = in.thread(i);
    const size_t top = thread.size() - 2;
    const int32_t next = rules_.rules[static_cast<size_t>(thread[top])].step(thread[top + 1], byte);
    if (next < 0) continue;
    moved = true;
    moved_.assign(thread.begin(), thread.end());
    moved_[top + 1] = next;
    close(moved_, out);
  }
  return moved;
}

}  // namespace metrale::grammar
