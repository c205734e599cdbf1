#include "text/bpe.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "text/byte_level.h"
#include "text/json_util.h"
#include "text/utf8.h"

namespace metrale::text {

// ---------------------------------------------------------------------------------------------
// MergeTable

MergeTable::MergeTable(size_t expected_merges) {
  // Keep the load factor at or below one half.
  const size_t capacity = std::bit_ceil(std::max<size_t>(16, expected_merges * 2));
  slots_.assign(capacity, Slot{kEmpty, {0, 0}});
  mask_ = capacity - 1;
}

void MergeTable::grow() {
  std::vector<Slot> old = std::move(slots_);
  const size_t capacity = std::max<size_t>(16, old.size() * 2);
  slots_.assign(capacity, Slot{kEmpty, {0, 0}});
  mask_ = capacity - 1;
  size_ = 0;
  for (const Slot& slot : old) {
    if (slot.key == kEmpty) continue;
    size_t index = slot_of(slot.key);
    while (slots_[index].key != kEmpty) index = (index + 1) & mask_;
    slots_[index] = slot;
    ++size_;
  }
}

void MergeTable::insert(int32_t left, int32_t right, Merge merge) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  const uint64_t key = pack(left, right);
  size_t index = slot_of(key);
  while (slots_[index].key != kEmpty && slots_[index].key != key) index = (index + 1) & mask_;
  if (slots_[index].key == kEmpty) ++size_;
  slots_[index] = Slot{key, merge};
}

// ---------------------------------------------------------------------------------------------
// The merge loop

namespace {

constexpr uint32_t kNoMerge = std::numeric_limits<uint32_t>::max();
constexpr int32_t kNone = -1;

// Words up to this many symbols use the rescanning strategy: a linear scan over a small array of
// ranks beats heap maintenance there.
constexpr size_t kScanLimit = 48;

// The symbols of a word as a doubly linked list over an array; a merged-away symbol has id kNone.
struct SymbolList {
  std::vector<int32_t> id;
  std::vector<int32_t> prev;
  std::vector<int32_t> next;

  void assign(std::span<const int32_t> symbols) {
    const auto n = static_cast<int32_t>(symbols.size());
    id.assign(symbols.begin(), symbols.end());
    prev.resize(symbols.size());
    next.resize(symbols.size());
    for (int32_t i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : kNone;
    }
  }
  // Merges symbol `at` with its successor into `merged_id`.
  void merge(int32_t at, int32_t merged_id) {
    const int32_t removed = next[at];
    id[at] = merged_id;
    id[removed] = kNone;
    next[at] = next[removed];
    if (next[removed] != kNone) prev[next[removed]] = at;
  }
  void collect(std::vector<int32_t>& out) const {
    out.clear();
    for (const int32_t symbol : id) {
      if (symbol != kNone) out.push_back(symbol);
    }
  }
};

struct MergeScratch {
  SymbolList list;
  std::vector<uint32_t> rank;        // rank of the pair (i, next[i]); kNoMerge if none
  std::vector<int32_t> merged_id;    // what that pair merges into
  struct Candidate {
    uint32_t rank;
    int32_t position;
    int32_t left;
    int32_t right;
    int32_t merged_id;
  };
  std::vector<Candidate> heap;
};

MergeScratch& merge_scratch() {
  thread_local MergeScratch scratch;
  return scratch;
}

void merge_by_scan(const MergeTable& merges, MergeScratch& scratch) {
  SymbolList& list = scratch.list;
  const size_t n = list.id.size();
  auto& rank = scratch.rank;
  auto& merged_id = scratch.merged_id;
  rank.assign(n, kNoMerge);
  merged_id.resize(n);
  const auto update = [&](int32_t at) {
    rank[at] = kNoMerge;
    if (list.next[at] == kNone) return;
    if (const MergeTable::Merge* m = merges.find(list.id[at], list.id[list.next[at]])) {
      rank[at] = m->rank;
      merged_id[at] = m->merged_id;
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) update(static_cast<int32_t>(i));
  while (true) {
    // Strict '<' keeps the leftmost of equal ranks. Merged-away symbols hold kNoMerge.
    uint32_t best_rank = kNoMerge;
    int32_t best = kNone;
    for (size_t i = 0; i + 1 < n; ++i) {
      if (rank[i] < best_rank) {
        best_rank = rank[i];
        best = static_cast<int32_t>(i);
      }
    }
    if (best == kNone) break;
    rank[list.next[best]] = kNoMerge;
    list.merge(best, merged_id[best]);
    update(best);
    if (list.prev[best] != kNone) update(list.prev[best]);
  }
}

void merge_by_heap(const MergeTable& merges, MergeScratch& scratch) {
  using Candidate = MergeScratch::Candidate;
  SymbolList& list = scratch.list;
  auto& heap = scratch.heap;
  heap.clear();
  // std::*_heap build a max-heap: "less" means a later merge (higher rank, then further right).
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
  };
  const auto push = [&](int32_t at) {
    const int32_t right = list.next[at];
    if (right == kNone) return;
    if (const MergeTable::Merge* m = merges.find(list.id[at], list.id[right])) {
      heap.push_back({m->rank, at, list.id[at], list.id[right], m->merged_id});
      std::push_heap(heap.begin(), heap.end(), later);
    }
  };
  for (size_t i = 0; i + 1 < list.id.size(); ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate top = heap.back();
    heap.pop_back();
    // A candidate is stale once either symbol of its pair has changed; pairs only ever grow, so
    // checking both ids is exact.
    const int32_t right = list.next[top.position];
    if (list.id[top.position] != top.left || right == kNone || list.id[right] != top.right) continue;
    list.merge(top.position, top.merged_id);
    if (list.prev[top.position] != kNone) push(list.prev[top.position]);
    push(top.position);
  }
}

}  // namespace

void apply_merges(const MergeTable& merges, std::vector<int32_t>& symbols, MergeStrategy strategy) {
  if (symbols.size() < 2) return;
  if (strategy == MergeStrategy::kAuto) {
    strategy = symbols.size() <= kScanLimit ? MergeStrategy::kScan : MergeStrategy::kHeap;
  }
  MergeScratch& scratch = merge_scratch();
  scratch.list.assign(symbols);
  if (strategy == MergeStrategy::kScan) {
    merge_by_scan(merges, scratch);
  } else {
    merge_by_heap(merges, scratch);
  }
  scratch.list.collect(symbols);
}

// ---------------------------------------------------------------------------------------------
// WordCache

namespace {

constexpr uint64_t kVersionMask = 0xFFFFFFFFull;

uint64_t mix(uint64_t x) {
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return x;
}

}  // namespace

WordCache::WordCache(size_t slot_count)
    : slots_(std::make_unique<Slot[]>(std::bit_ceil(std::max<size_t>(slot_count, 1)))),
      mask_(std::bit_ceil(std::max<size_t>(slot_count, 1)) - 1) {}

uint64_t WordCache::hash(std::string_view word) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ word.size();
  size_t i = 0;
  for (; i + 8 <= word.size(); i += 8) {
    uint64_t chunk;
    std::memcpy(&chunk, word.data() + i, 8);
    h = mix(h ^ chunk);
  }
  if (i < word.size()) {
    uint64_t chunk = 0;
    std::memcpy(&chunk, word.data() + i, word.size() - i);
    h = mix(h ^ chunk);
  }
  return mix(h + 0x632BE59BD9B4E019ull);
}

bool WordCache::lookup(std::string_view word, uint64_t hash, std::vector<int32_t>& ids) const {
  const Slot& slot = slots_[hash & mask_];
  const uint64_t meta = slot.words[0].load(std::memory_order_acquire);
  const size_t word_size = (meta >> 32) & 0xFF;
  const size_t id_count = (meta >> 40) & 0xFF;
  if ((meta & 1) != 0 || id_count == 0 || word_size != word.size()) return false;
  if (slot.words[1].load(std::memory_order_relaxed) != hash) return false;
  uint64_t payload[kWordsPerSlot - 2];
  for (size_t k = 0; k < kWordsPerSlot - 2; ++k) payload[k] = slot.words[k + 2].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (slot.words[0].load(std::memory_order_relaxed) != meta) return false;  // a writer got in
  if (std::memcmp(payload, word.data(), word.size()) != 0) return false;
  int32_t cached[kMaxIds];
  std::memcpy(cached, payload + 3, sizeof cached);
  ids.insert(ids.end(), cached, cached + id_count);
  return true;
}

void WordCache::insert(std::string_view word, uint64_t hash, std::span<const int32_t> ids) {
  if (word.size() > kMaxWordBytes || ids.empty() || ids.size() > kMaxIds) return;
  Slot& slot = slots_[hash & mask_];
  uint64_t meta = slot.words[0].load(std::memory_order_relaxed);
  if ((meta & 1) != 0) return;
  const uint64_t version = meta & kVersionMask;
  // Take the slot by making its version odd; a concurrent writer makes this fail and we skip.
  if (!slot.words[0].compare_exchange_strong(meta, (meta & ~kVersionMask) | ((version + 1) & kVersionMask),
                                             std::memory_order_relaxed)) {
    return;
  }
  std::atomic_thread_fence(std::memory_order_release);
  uint64_t payload[kWordsPerSlot - 2] = {};
  std::memcpy(payload, word.data(), word.size());
  std::memcpy(payload + 3, ids.data(), ids.size_bytes());
  slot.words[1].store(hash, std::memory_order_relaxed);
  for (size_t k = 0; k < kWordsPerSlot - 2; ++k) slot.words[k + 2].store(payload[k], std::memory_order_relaxed);
  const uint64_t published = ((version + 2) & kVersionMask) | (uint64_t{word.size()} << 32) | (uint64_t{ids.size()} << 40);
  slot.words[0].store(published, std::memory_order_release);
}

// ---------------------------------------------------------------------------------------------
// BpeModel

namespace {

// The model's merges in file order, from either layout: [["a", "b"], ...] (tokenizers >= 0.20)
// or the legacy ["a b", ...], where a "#version" line is not a merge and takes no rank.
std::vector<std::pair<std::string, std::string>> parse_merges(const json::Json::array_t& entries) {
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(entries.size());
  for (const json::Json& entry : entries) {
    if (entry.is_array()) {
      const auto& pair = entry.get_ref<const json::Json::array_t&>();
      if (pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string()) {
        raise(ErrorCode::kBadFormat, "model.merges[{}]: expected a pair of strings", merges.size());
      }
      merges.emplace_back(pair[0].get<std::string>(), pair[1].get<std::string>());
    } else if (entry.is_string()) {
      const std::string& line = entry.get_ref<const std::string&>();
      if (line.starts_with("#version")) continue;
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        raise(ErrorCode::kBadFormat, "model.merges[{}]: '{}' is not two tokens separated by one space", merges.size(),
              line);
      }
      merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    } else {
      raise(ErrorCode::kBadFormat, "model.merges[{}]: expected a pair of strings or an \"a b\" string", merges.size());
    }
  }
  return merges;
}

}  // namespace

BpeModel BpeModel::from_json(const json::Json& model, bool enable_cache) {
  json::object(model, "\"model\"");
  if (const auto type = json::string(model, "type"); type && *type != "BPE") {
    raise(ErrorCode::kUnsupported, "model type '{}' is not supported (only BPE)", *type);
  }
  if (const json::Json* dropout = json::member(model, "dropout")) {
    if (!dropout->is_number()) raise(ErrorCode::kBadFormat, "model.dropout must be a number or null");
    if (dropout->get<double>() != 0.0) raise(ErrorCode::kUnsupported, "BPE dropout is not supported (it makes encoding random)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const auto affix = json::string(model, key); affix && !affix->empty()) {
      raise(ErrorCode::kUnsupported, "model.{} '{}' is not supported by byte-level BPE", key, *affix);
    }
  }

  const json::Json* vocab_json = json::member(model, "vocab");
  if (vocab_json == nullptr) raise(ErrorCode::kBadFormat, "model.vocab is missing");
  const auto& vocab_entries = json::object(*vocab_json, "model.vocab");
  TokenIdMap vocab;
  vocab.reserve(vocab_entries.size());
  // Ids index the decoding tables: they must stay below 2^24 (the largest vocabularies in use hold
  // a few hundred thousand tokens), or one stray id would size the tables at gigabytes.
  constexpr int64_t kMaxId = (int64_t{1} << 24) - 1;
  for (const auto& [token, id] : vocab_entries) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxId) {
      raise(ErrorCode::kBadFormat, "model.vocab: the id of '{}' must be an integer in [0, 2^24)", token);
    }
    vocab.insert_or_assign(token, static_cast<int32_t>(id.get<int64_t>()));
  }

  const json::Json* merges_json = json::member(model, "merges");
  if (merges_json == nullptr) raise(ErrorCode::kBadFormat, "model.merges is missing");
  const auto merges = parse_merges(json::array(*merges_json, "model.merges"));

  BpeOptions options;
  options.unk_token = json::string(model, "unk_token");
  options.fuse_unk = json::boolean(model, "fuse_unk", false);
  options.byte_fallback = json::boolean(model, "byte_fallback", false);
  options.ignore_merges = json::boolean(model, "ignore_merges", false);
  options.cache = enable_cache;
  return BpeModel(std::move(vocab), merges, std::move(options));
}

BpeModel::BpeModel(TokenIdMap vocab, std::span<const std::pair<std::string, std::string>> merges, BpeOptions options)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab_) max_id = std::max(max_id, id);
  tokens_by_id_.resize(static_cast<size_t>(max_id + 1));
  has_id_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : vocab_) {
    tokens_by_id_[id] = token;
    has_id_[id] = true;
  }

  merges_ = MergeTable(merges.size());
  std::string merged;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const auto find = [&](const std::string& token) {
      const auto it = vocab_.find(token);
      if (it == vocab_.end()) {
        raise(ErrorCode::kBadFormat, "model.merges[{}] '{} {}': '{}' is not in the vocab", rank, left, right, token);
      }
      return it->second;
    };
    const int32_t left_id = find(left);
    const int32_t right_id = find(right);
    merged.assign(left).append(right);
    merges_.insert(left_id, right_id, {static_cast<uint32_t>(rank), find(merged)});
  }

  if (options_.unk_token) {
    const auto it = vocab_.find(*options_.unk_token);
    if (it == vocab_.end()) raise(ErrorCode::kBadFormat, "model.unk_token '{}' is not in the vocab", *options_.unk_token);
    unk_id_ = it->second;
  }
  for (int byte = 0; byte < 256; ++byte) {
    ByteSymbols& symbols = byte_symbols_[byte];
    symbols = ByteSymbols{ByteKind::kDropped, 0, {kNone, kNone}};
    std::string character;
    append_utf8(character, byte_level_char(static_cast<uint8_t>(byte)));
    if (const auto it = vocab_.find(character); it != vocab_.end()) {
      symbols = ByteSymbols{ByteKind::kCharacter, 1, {it->second, kNone}};
      continue;
    }
    if (options_.byte_fallback) {
      // HF looks up <0xXX> for each UTF-8 byte of the alphabet character, not of the input byte.
      ByteSymbols fallback{ByteKind::kFallback, static_cast<uint8_t>(character.size()), {kNone, kNone}};
      bool complete = true;
      for (size_t k = 0; k < character.size() && complete; ++k) {
        const auto it = vocab_.find(fmt::format("<0x{:02X}>", static_cast<uint8_t>(character[k])));
        complete = it != vocab_.end();
        if (complete) fallback.ids[k] = it->second;
      }
      if (complete) {
        symbols = fallback;
        continue;
      }
    }
    if (unk_id_) symbols.kind = ByteKind::kUnknown;
  }

  if (options_.ignore_merges) {
    for (const auto& [token, id] : vocab_) {
      if (auto raw = byte_level_decode(token)) raw_vocab_.insert_or_assign(std::move(*raw), id);
    }
  }
  // One slot per two vocab entries, at most 64Ki slots (4 MiB): enough for the working set of
  // distinct words in typical traffic.
  if (options_.cache) cache_ = std::make_unique<WordCache>(std::clamp<size_t>(vocab_.size() / 2, 64, 65536));
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const {
  symbols.clear();
  // Mirrors HF's merge_word: a pending unknown is emitted before the next known character, after
  // any byte-fallback symbols, and consecutive unknowns fuse when fuse_unk is set.
  bool pending_unknown = false;
  for (const char c : word) {
    const ByteSymbols& byte = byte_symbols_[static_cast<uint8_t>(c)];
    switch (byte.kind) {
      case ByteKind::kCharacter:
        if (pending_unknown) symbols.push_back(*unk_id_);
        pending_unknown = false;
        symbols.push_back(byte.ids[0]);
        break;
      case ByteKind::kFallback:
        symbols.insert(symbols.end(), byte.ids, byte.ids + byte.count);
        break;
      case ByteKind::kUnknown:
        if (pending_unknown && !options_.fuse_unk) symbols.push_back(*unk_id_);
        pending_unknown = true;
        break;
      case ByteKind::kDropped:
        break;
    }
  }
  if (pending_unknown) symbols.push_back(*unk_id_);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (const auto it = raw_vocab_.find(word); it != raw_vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  const bool cacheable = cache_ != nullptr && word.size() <= WordCache::kMaxWordBytes;
  uint64_t hash = 0;
  if (cacheable) {
    hash = WordCache::hash(word);
    if (cache_->lookup(word, hash, ids)) return;
  }
  thread_local std::vector<int32_t> symbols;
  initial_symbols(word, symbols);
  apply_merges(merges_, symbols);
  if (cacheable) cache_->insert(word, hash, symbols);
  ids.insert(ids.end(), symbols.begin(), symbols.end());
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_by_id_.size() || !has_id_[id]) return nullptr;
  return &tokens_by_id_[id];
}

}  // namespace metrale::text
