// The BPE model of a byte-level tokenizer.json: vocabulary, ranked merges and the merge loop.
//
// Invariant: merging always applies the lowest-ranked merge among the adjacent pairs of the word,
// leftmost first on ties, until none applies. That is the order HF tokenizers' priority queue
// produces (rank, then position), so the result is identical whatever strategy computes it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace metrale::text {

// Transparent hashing so that maps keyed by std::string can be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
using TokenIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// (left id, right id) -> (rank, merged id), an open-addressing table with linear probing: the
// lookup in the innermost loop of BPE, so it avoids std::unordered_map's node chasing.
class MergeTable {
 public:
  struct Merge {
    uint32_t rank;
    int32_t merged_id;
  };

  MergeTable() = default;
  explicit MergeTable(size_t expected_merges);

  // Inserts or replaces (a later duplicate pair wins, as in HF).
  void insert(int32_t left, int32_t right, Merge merge);
  const Merge* find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    for (size_t index = slot_of(key);; index = (index + 1) & mask_) {
      const Slot& slot = slots_[index];
      if (slot.key == key) return &slot.merge;
      if (slot.key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are non-negative: no real key is all ones
  struct Slot {
    uint64_t key;
    Merge merge;
  };
  static uint64_t pack(int32_t left, int32_t right) {
    return (uint64_t{static_cast<uint32_t>(left)} << 32) | static_cast<uint32_t>(right);
  }
  size_t slot_of(uint64_t key) const {
    uint64_t h = key ^ (key >> 29);
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return static_cast<size_t>(h) & mask_;
  }
  void grow();

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// How the merge loop finds the next merge. Both give the same result (see the file comment):
// kScan rescans a rank per adjacent pair, best for short words; kHeap keeps a priority queue,
// O(n log n) for long ones. kAuto picks by length.
enum class MergeStrategy { kAuto, kScan, kHeap };

// Applies `merges` to the symbol ids in `symbols` (in place; the vector shrinks to the result).
void apply_merges(const MergeTable& merges, std::vector<int32_t>& symbols, MergeStrategy strategy = MergeStrategy::kAuto);

// A bounded, lock-free cache of pre-token -> ids, shared by all threads that encode with one
// tokenizer. Direct-mapped: a new word evicts whatever hashed to its slot. Each slot is a seqlock
// of atomic words, so readers never block and a torn read is detected and treated as a miss.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 24;
  static constexpr size_t kMaxIds = 6;

  explicit WordCache(size_t slot_count);  // rounded up to a power of two

  // Appends the cached ids of `word` to `ids` and returns true on a hit.
  bool lookup(std::string_view word, uint64_t hash, std::vector<int32_t>& ids) const;
  // Caches `ids` for `word` unless it is too long or another thread is writing the same slot.
  void insert(std::string_view word, uint64_t hash, std::span<const int32_t> ids);

  static uint64_t hash(std::string_view word);

 private:
  // word 0: version (low 32 bits, odd while written) | word size << 32 | id count << 40;
  // word 1: the full hash; words 2-4: the word's bytes; words 5-7: the ids.
  static constexpr size_t kWordsPerSlot = 8;
  struct alignas(64) Slot {
    std::atomic<uint64_t> words[kWordsPerSlot];
  };
  std::unique_ptr<Slot[]> slots_;
  size_t mask_;
};

struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  bool cache = true;  // the word cache does not change results; tests turn it off
};

class BpeModel {
 public:
  // Builds the model from the "model" object of tokenizer.json (vocab, merges as [a, b] pairs or
  // "a b" strings, unk_token, fuse_unk, byte_fallback, ignore_merges). Throws kBadFormat when
  // malformed (a merge naming a token missing from the vocab) and kUnsupported for options a
  // byte-level tokenizer does not use (dropout, continuing_subword_prefix, end_of_word_suffix).
  static BpeModel from_json(const nlohmann::json& model, bool enable_cache = true);

  BpeModel() = default;  // an empty model
  BpeModel(TokenIdMap vocab, std::span<const std::pair<std::string, std::string>> merges, BpeOptions options);
  BpeModel(BpeModel&&) noexcept = default;
  BpeModel& operator=(BpeModel&&) noexcept = default;

  // Appends the ids of one pre-token, given as raw bytes: each byte starts as the vocab entry of
  // its byte-level alphabet character. Thread-safe.
  void encode_word(std::string_view word, std::vector<int32_t>& ids) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The vocab string of `id`, or nullptr when the vocab has no such id.
  const std::string* id_to_token(int32_t id) const;
  // The number of vocab entries (HF's BPE::get_vocab_size; ids need not be contiguous).
  size_t vocab_count() const { return vocab_.size(); }
  int32_t max_id() const { return static_cast<int32_t>(tokens_by_id_.size()) - 1; }
  const MergeTable& merges() const { return merges_; }

 private:
  // The initial symbols of one input byte: its alphabet character's vocab id; else, under
  // byte_fallback, the <0xXX> ids of the character's UTF-8 bytes; else the unknown token; else
  // nothing (HF drops characters it cannot represent).
  enum class ByteKind : uint8_t { kCharacter, kFallback, kUnknown, kDropped };
  struct ByteSymbols {
    ByteKind kind;
    uint8_t count;  // ids used: 1 for kCharacter, 1-2 for kFallback
    int32_t ids[2];
  };
  void initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const;

  TokenIdMap vocab_;
  std::vector<std::string> tokens_by_id_;  // "" where no vocab entry has that id
  std::vector<bool> has_id_;
  MergeTable merges_;
  BpeOptions options_;
  std::optional<int32_t> unk_id_;
  ByteSymbols byte_symbols_[256] = {};
  TokenIdMap raw_vocab_;  // raw bytes -> id, only built for ignore_merges
  std::unique_ptr<WordCache> cache_;
};

}  // namespace metrale::text
