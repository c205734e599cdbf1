#include "text/grammar/matcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace metrale::grammar {

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar, std::vector<int32_t> stop_token_ids)
    : grammar_(std::move(grammar)), stop_ids_(std::move(stop_token_ids)) {
  METRALE_CHECK(grammar_ != nullptr, "a matcher needs a grammar");
  if (stop_ids_.empty()) stop_ids_ = grammar_->tokenizer().stop_token_ids();
  std::sort(stop_ids_.begin(), stop_ids_.end());
  start();
}

GrammarMatcher::GrammarMatcher(const GrammarMatcher& other)
    : grammar_(other.grammar_),
      stop_ids_(other.stop_ids_),
      nodes_(other.nodes_),
      node_ids_(other.node_ids_),
      tops_(other.tops_),
      history_(other.history_) {}

GrammarMatcher& GrammarMatcher::operator=(const GrammarMatcher& other) {
  if (this != &other) *this = GrammarMatcher(other);
  return *this;
}

void GrammarMatcher::start() {
  nodes_.clear();
  node_ids_.clear();
  tops_.clear();
  history_.clear();
  prepare_simulator();
  ThreadSet initial;
  simulator_->clear_visited();
  const int32_t thread[3] = {kNoParent, grammar_->rules().root, 0};
  simulator_->close(thread, initial);
  Snapshot snapshot;
  snapshot.offset = 0;
  for (size_t i = 0; i < initial.size(); ++i) tops_.push_back(intern(initial.thread(i)));
  snapshot.count = static_cast<int32_t>(tops_.size());
  snapshot.completed = initial.completed;
  history_.push_back(snapshot);
}

void GrammarMatcher::reset() {
  start();
}

void GrammarMatcher::prepare_simulator() const {
  if (!simulator_) simulator_ = std::make_unique<Simulator>(grammar_->rules(), &nodes_, grammar_->max_stack_depth());
  simulator_->set_nodes(&nodes_);  // a moved matcher's nodes live at a new address
}

int32_t GrammarMatcher::intern(std::span<const int32_t> thread) {
  int32_t node = thread[0];
  for (size_t i = 1; i + 1 < thread.size(); i += 2) {
    const NodeKey key{thread[i], thread[i + 1], node};
    const auto it = node_ids_.find(key);
    if (it != node_ids_.end()) {
      node = it->second;
      continue;
    }
    const int32_t depth = node >= 0 ? nodes_[static_cast<size_t>(node)].depth + 1 : 1;
    nodes_.push_back(StackNode{thread[i], thread[i + 1], node, depth});
    node = static_cast<int32_t>(nodes_.size() - 1);
    node_ids_.emplace(key, node);
  }
  return node;
}

bool GrammarMatcher::is_stop(int32_t token) const {
  return std::binary_search(stop_ids_.begin(), stop_ids_.end(), token);
}

bool GrammarMatcher::advance(std::string_view bytes) {
  prepare_simulator();
  if (levels_.size() < 2) levels_.resize(2);
  ThreadSet* in = &levels_[0];
  ThreadSet* out = &levels_[1];
  in->clear();
  for (int32_t top : current_tops()) {
    const StackNode& node = nodes_[static_cast<size_t>(top)];
    const int32_t thread[3] = {node.parent, node.rule, node.state};
    in->add(thread);
  }
  bool completed = current().completed;
  for (char c : bytes) {
    if (!simulator_->step(*in, static_cast<uint8_t>(c), *out)) return false;
    completed = out->completed;
    std::swap(in, out);
  }
  if (in->empty() && !completed) return false;  // only possible at the nesting bound
  Snapshot snapshot;
  snapshot.offset = static_cast<int32_t>(tops_.size());
  std::vector<int32_t> tops;
  for (size_t i = 0; i < in->size(); ++i) tops.push_back(intern(in->thread(i)));
  std::sort(tops.begin(), tops.end());
  tops.erase(std::unique(tops.begin(), tops.end()), tops.end());
  tops_.insert(tops_.end(), tops.begin(), tops.end());
  snapshot.count = static_cast<int32_t>(tops.size());
  snapshot.completed = completed;
  history_.push_back(snapshot);
  return true;
}

bool GrammarMatcher::accept_token(int32_t token) {
  if (is_terminated()) return false;
  if (is_stop(token)) {
    if (!current().completed) return false;
    Snapshot snapshot = current();
    snapshot.terminated = true;
    history_.push_back(snapshot);
    return true;
  }
  const TokenizerInfo& tokenizer = grammar_->tokenizer();
  const std::string_view bytes = tokenizer.token_bytes(token);
  if (bytes.empty() || (tokenizer.is_special(token) && !grammar_->allows_special(token))) return false;
  return advance(bytes);
}

bool GrammarMatcher::accept_string(std::string_view bytes) {
  if (is_terminated()) return false;
  return advance(bytes);
}

bool GrammarMatcher::is_allowed(int32_t token) const {
  GrammarMatcher copy(*this);
  return copy.accept_token(token);
}

void GrammarMatcher::rollback(int32_t num_tokens) {
  if (num_tokens < 0 || num_tokens > num_accepted()) {
    raise(ErrorCode::kInvalidArgument, "cannot roll a grammar matcher back by {} tokens ({} accepted)", num_tokens,
          num_accepted());
  }
  for (int32_t i = 0; i < num_tokens; ++i) history_.pop_back();
  tops_.resize(static_cast<size_t>(current().offset + current().count));
}

// Walks the position's uncertain remainders from the stack below the rule (`parent`), allowing the
// tokens whose remainder that stack accepts.
void GrammarMatcher::add_uncertain(const PositionMask& mask, int32_t parent, std::span<uint32_t> bitmask) const {
  const PrefixTree& trie = mask.uncertain;
  if (trie.size() == 0 || parent == kNoParent) return;  // nothing may follow the grammar's end
  prepare_simulator();
  if (levels_.size() < static_cast<size_t>(trie.max_depth()) + 1)
    levels_.resize(static_cast<size_t>(trie.max_depth()) + 1);
  ThreadSet& root = levels_[0];
  root.clear();
  simulator_->clear_visited();
  const int32_t thread[1] = {parent};
  simulator_->close(thread, root);
  if (root.empty()) return;
  for (int32_t i = 0; i < trie.size();) {
    const auto depth = static_cast<size_t>(trie.depth[static_cast<size_t>(i)]);
    ThreadSet& level = levels_[depth];
    const bool alive = simulator_->step(levels_[depth - 1], trie.byte[static_cast<size_t>(i)], level);
    if (alive) {
      for (int32_t v = trie.values_offset[static_cast<size_t>(i)]; v < trie.values_offset[static_cast<size_t>(i) + 1];
           ++v) {
        const int32_t token = trie.values[static_cast<size_t>(v)];
        bitmask[static_cast<size_t>(token) >> 5] |= 1u << (token & 31);
      }
    }
    i = level.empty() ? trie.end[static_cast<size_t>(i)] : i + 1;
  }
}

void GrammarMatcher::fill_next_token_bitmask(std::span<uint32_t> bitmask) const {
  const auto words = static_cast<size_t>(bitmask_words());
  METRALE_CHECK(bitmask.size() >= words, "the bitmask has {} words, the vocabulary needs {}", bitmask.size(), words);
  std::memset(bitmask.data(), 0, words * sizeof(uint32_t));
  const auto set = [&](int32_t token) { bitmask[static_cast<size_t>(token) >> 5] |= 1u << (token & 31); };
  const auto set_stop_tokens = [&] {
    for (int32_t token : stop_ids_) {
      if (token >= 0 && token < grammar_->tokenizer().vocab_size()) set(token);
    }
  };
  // Once terminated only stop tokens remain, so that a caller that samples anyway never sees a row
  // with nothing allowed.
  if (is_terminated()) {
    set_stop_tokens();
    return;
  }
  for (int32_t top : current_tops()) {
    const StackNode& node = nodes_[static_cast<size_t>(top)];
    const PositionMask& mask = grammar_->mask_at(node.rule, node.state);
    if (!mask.accepted_bits.empty()) {
      const uint32_t* bits = mask.accepted_bits.data();
      for (size_t w = 0; w < words; ++w) bitmask[w] |= bits[w];
    } else {
      for (int32_t token : mask.accepted_ids) set(token);
    }
    add_uncertain(mask, node.parent, bitmask);
  }
  if (current().completed) set_stop_tokens();
}

int32_t GrammarMatcher::min_remaining_bytes() const {
  if (current().completed || is_terminated()) return 0;
  const auto& completion = grammar_->rules().completion;
  int32_t best = std::numeric_limits<int32_t>::max();
  for (int32_t top : current_tops()) {
    int64_t total = 0;
    for (int32_t n = top; n >= 0; n = nodes_[static_cast<size_t>(n)].parent) {
      const StackNode& node = nodes_[static_cast<size_t>(n)];
      total += completion[static_cast<size_t>(node.rule)][static_cast<size_t>(node.state)];
    }
    best = static_cast<int32_t>(std::min<int64_t>(best, total));
  }
  return best;
}

std::string GrammarMatcher::describe() const {
  std::string out = fmt::format("{} stack(s){}{}:", current().count, current().completed ? ", complete" : "",
                                is_terminated() ? ", terminated" : "");
  for (int32_t top : current_tops()) {
    std::string stack;
    for (int32_t n = top; n >= 0; n = nodes_[static_cast<size_t>(n)].parent) {
      const StackNode& node = nodes_[static_cast<size_t>(n)];
      stack = fmt::format("{}@{}", grammar_->rules().rules[static_cast<size_t>(node.rule)].name, node.state) +
              (stack.empty() ? "" : " > " + stack);
    }
    out += " [" + stack + "]";
  }
  return out;
}

}  // namespace metrale::grammar
