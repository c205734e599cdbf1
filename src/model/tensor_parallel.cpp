#include "model/tensor_parallel.h"

#include <cstring>
#include <string>

#include "core/error.h"
#include "runtime/communicator.h"

namespace metrale {

std::optional<IndexRange> TensorParallel::even_share(int64_t count) const {
  if (count < 0 || count % size != 0) return std::nullopt;
  const int64_t share = count / size;
  return IndexRange{rank * share, (rank + 1) * share};
}

std::optional<TensorParallel::GroupedHeads> TensorParallel::grouped_heads(int64_t heads, int64_t groups) const {
  const std::optional<IndexRange> own_heads = even_share(heads);
  if (!own_heads || groups <= 0 || heads % groups != 0) return std::nullopt;
  if (const std::optional<IndexRange> own_groups = even_share(groups)) return GroupedHeads{*own_heads, *own_groups};
  if (size % groups != 0) return std::nullopt;
  const int64_t group = own_heads->begin / (heads / groups);
  return GroupedHeads{*own_heads, {group, group + 1}};
}

void TensorParallel::check() const {
  if (size < 1 || rank < 0 || rank >= size) {
    raise(ErrorCode::kInvalidArgument, "tensor parallel rank {} of a group of {}", rank, size);
  }
  if (size > 1 && (communicator == nullptr || communicator->size() != size || communicator->rank() != rank)) {
    raise(ErrorCode::kInvalidArgument, "tensor parallel rank {} of {}: {}", rank, size,
          communicator == nullptr
              ? std::string("no communicator")
              : fmt::format("the communicator is rank {} of {}", communicator->rank(), communicator->size()));
  }
}

TensorSlice TensorSlice::of_rows(std::vector<int64_t> rows, int row_dim) {
  TensorSlice slice;
  slice.row_dim = row_dim;
  slice.rows = std::move(rows);
  return slice;
}

TensorSlice TensorSlice::of_columns(int64_t begin, int64_t end) {
  TensorSlice slice;
  slice.col_begin = begin;
  slice.col_end = end;
  return slice;
}

Shape TensorSlice::shape_of(const Shape& full) const {
  const int ndim = full.ndim();
  if (row_dim < 0 || row_dim >= ndim) {
    raise(ErrorCode::kInvalidArgument, "slice rows along dim {} of a tensor {}", row_dim, full.to_string());
  }
  Shape shape = full;
  if (!rows.empty()) {
    for (const int64_t row : rows) {
      if (row < 0 || row >= full[row_dim]) {
        raise(ErrorCode::kInvalidArgument, "slice row {} of dim {} of a tensor {}", row, row_dim, full.to_string());
      }
    }
    shape[row_dim] = static_cast<int64_t>(rows.size());
  }
  if (col_begin != 0 || col_end >= 0) {
    const int64_t columns = full[ndim - 1];
    const int64_t end = col_end < 0 ? columns : col_end;
    if (ndim < 2 || row_dim == ndim - 1 || col_begin < 0 || col_begin > end || end > columns) {
      raise(ErrorCode::kInvalidArgument, "slice columns [{}, {}) of a tensor {} (rows along dim {})", col_begin, end,
            full.to_string(), row_dim);
    }
    shape[ndim - 1] = end - col_begin;
  }
  return shape;
}

void append_rows(std::vector<int64_t>& rows, IndexRange range) {
  for (int64_t r = range.begin; r < range.end; ++r) rows.push_back(r);
}

IndexRange unit_rows(int64_t base, int64_t first, int64_t count, int64_t unit_rows) {
  return {base + first * unit_rows, base + (first + count) * unit_rows};
}

TensorSlice unit_slice(const IndexRange& units, int64_t unit_size, int parts, int64_t part_size) {
  std::vector<int64_t> rows;
  for (int part = 0; part < parts; ++part)
    append_rows(rows, unit_rows(part * part_size, units.begin, units.size(), unit_size));
  return TensorSlice::of_rows(std::move(rows));
}

void copy_slice(const Tensor& source, const TensorSlice& slice, void* destination) {
  METRALE_CHECK(source.is_contiguous() && source.device().is_cpu(), "copy_slice of {}", source.describe());
  const Shape& full = source.shape();
  const Shape shape = slice.shape_of(full);
  const int ndim = full.ndim();
  const size_t element = source.element_size();
  // [outer, rows, middle, columns]: the dims before row_dim, row_dim, those between it and the last,
  // and the last (folded into middle when the rows are the last dim).
  int64_t outer = 1, middle = 1;
  for (int d = 0; d < slice.row_dim; ++d) outer *= full[d];
  const bool rows_last = slice.row_dim == ndim - 1;
  for (int d = slice.row_dim + 1; d < ndim - (rows_last ? 0 : 1); ++d) middle *= full[d];
  const int64_t columns = rows_last ? 1 : full[ndim - 1];
  const int64_t col_begin = rows_last ? 0 : slice.col_begin;
  const int64_t run = rows_last ? 1 : shape[ndim - 1];  // columns copied per (outer, row, middle)
  const int64_t source_rows = full[slice.row_dim], rows = shape[slice.row_dim];
  const auto* from = static_cast<const char*>(source.data());
  auto* to = static_cast<char*>(destination);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = slice.source_row(r);
      const char* source_row = from + ((o * source_rows + row) * middle * columns) * static_cast<int64_t>(element);
      for (int64_t m = 0; m < middle; ++m) {
        std::memcpy(to, source_row + (m * columns + col_begin) * static_cast<int64_t>(element),
                    static_cast<size_t>(run) * element);
        to += static_cast<size_t>(run) * element;
      }
    }
  }
}

}  // namespace metrale
