// Tensor parallelism: how a model is split over the ranks of a group, and which part of a stored
// weight one rank reads.
//
// Every rank builds the whole model from the same checkpoint with its own TensorParallel. A block
// that can be split reads only its rank's part of each weight (TensorSlice) and computes a partial
// site output whose sum over the ranks is the output (`output_is_partial`, layer.h): attention and
// linear-attention heads, MLP and expert columns. A block that cannot be split for this group size
// (heads that do not divide, a block without a split) reads its weights whole and computes the whole
// output on every rank; the model's result is the same either way. The layer stack all-reduces the
// partial outputs through the group's Communicator (one all-reduce per split mixer and per split
// feed-forward).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "runtime/tensor.h"

namespace metrale {

class Communicator;

struct IndexRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

struct TensorParallel {
  int rank = 0;
  int size = 1;
  Communicator* communicator = nullptr;  // this rank's handle of the group; null when size == 1

  bool active() const { return size > 1; }
  // This rank's share [rank * count / size, (rank + 1) * count / size) of `count` units split
  // evenly, or nullopt when `count` is not a multiple of the group size.
  std::optional<IndexRange> even_share(int64_t count) const;
  // even_share() when the group has more than one rank, else nullopt: the share of a block that
  // splits, or nullopt for a block that stays whole.
  std::optional<IndexRange> split_share(int64_t count) const {
    return active() ? even_share(count) : std::nullopt;
  }
  // The heads this rank computes of a grouped layout: `heads` query heads over `groups` key/value
  // heads (heads % groups == 0; query head j reads group j / (heads / groups)). The query heads split
  // evenly; the groups split evenly too, or, with fewer groups than ranks (size % groups == 0), each
  // rank keeps the one group its query heads read. nullopt when neither holds.
  struct GroupedHeads {
    IndexRange heads, groups;
  };
  std::optional<GroupedHeads> grouped_heads(int64_t heads, int64_t groups) const;
  // Throws kInvalidArgument unless 0 <= rank < size and a group of more than one rank has a
  // communicator of that size.
  void check() const;
};

// The part of a stored tensor one rank reads: indices along `row_dim` (in the order they land in
// the destination; empty: every index in order) and a column range of the last dimension. A 1-D
// tensor takes rows only. The destination is contiguous with shape shape_of(full).
struct TensorSlice {
  int row_dim = 0;
  std::vector<int64_t> rows;
  int64_t col_begin = 0, col_end = -1;  // -1: to the last column

  static TensorSlice of_rows(std::vector<int64_t> rows, int row_dim = 0);
  static TensorSlice of_columns(int64_t begin, int64_t end);
  bool whole() const { return rows.empty() && col_begin == 0 && col_end < 0; }
  // The sliced shape; throws kInvalidArgument for an index or a range outside `full`.
  Shape shape_of(const Shape& full) const;
  // The source row of destination row `r` (rows.empty(): r).
  int64_t source_row(int64_t r) const { return rows.empty() ? r : rows[static_cast<size_t>(r)]; }
};

// Appends [range.begin, range.end) to `rows`.
void append_rows(std::vector<int64_t>& rows, IndexRange range);
// The rows of `count` consecutive units of `unit_rows` rows each, from unit `first` on, offset by
// `base`: the rows of a run of heads in a projection laid out head by head.
IndexRange unit_rows(int64_t base, int64_t first, int64_t count, int64_t unit_rows);
// The row slice of the units [units.begin, units.end) of `unit_size` rows each, in each of `parts`
// stacked blocks of `part_size` rows: a run of heads of a projection laid out head by head (of each
// part of a concatenation such as [Q; K; V]).
TensorSlice unit_slice(const IndexRange& units, int64_t unit_size, int parts = 1, int64_t part_size = 0);

// Copies `slice` of the contiguous host tensor `source` into `destination`: contiguous host bytes
// of slice.shape_of(source.shape()) elements of source's dtype.
void copy_slice(const Tensor& source, const TensorSlice& slice, void* destination);

}  // namespace metrale
