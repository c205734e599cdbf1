#include "model/cache_spec.h"

#include "core/checked_math.h"
#include "core/error.h"

namespace metrale {

std::string_view cache_indexing_name(CacheIndexing indexing) {
  switch (indexing) {
    case CacheIndexing::kPerToken:
      return "per token";
    case CacheIndexing::kPerGroup:
      return "per group";
    case CacheIndexing::kPerSlot:
      return "per slot";
  }
  return "?";
}

CacheTensorSpec CacheTensorSpec::per_token(std::string name, std::vector<int64_t> shape, std::optional<DType> dtype) {
  return {std::move(name), CacheIndexing::kPerToken, std::move(shape), dtype, 1};
}

CacheTensorSpec CacheTensorSpec::per_group(std::string name, int64_t group_size, std::vector<int64_t> shape,
                                           std::optional<DType> dtype) {
  return {std::move(name), CacheIndexing::kPerGroup, std::move(shape), dtype, group_size};
}

CacheTensorSpec CacheTensorSpec::per_slot(std::string name, std::vector<int64_t> shape, std::optional<DType> dtype) {
  return {std::move(name), CacheIndexing::kPerSlot, std::move(shape), dtype, 1};
}

uint64_t CacheTensorSpec::elements_per_unit() const {
  uint64_t elements = 1;
  for (const int64_t dim : shape)
    elements = checked_mul<uint64_t>(elements, static_cast<uint64_t>(dim), "cache tensor '" + name + "' elements");
  return elements;
}

int64_t CacheTensorSpec::rows_per_block(int64_t block_size) const {
  switch (indexing) {
    case CacheIndexing::kPerToken:
      return block_size;
    case CacheIndexing::kPerGroup:
      return block_size / group_size;
    case CacheIndexing::kPerSlot:
      return 0;
  }
  return 0;
}

Shape CacheTensorSpec::storage_shape(int64_t num_blocks, int64_t block_size, int64_t num_slots) const {
  std::vector<int64_t> dims;
  if (paged()) {
    dims = {num_blocks, rows_per_block(block_size)};
  } else {
    dims = {num_slots};
  }
  dims.insert(dims.end(), shape.begin(), shape.end());
  return Shape(std::span<const int64_t>(dims));
}

bool CacheSpec::has_paged() const {
  for (const auto& tensor : tensors)
    if (tensor.paged()) return true;
  return false;
}

bool CacheSpec::has_slots() const {
  for (const auto& tensor : tensors)
    if (!tensor.paged()) return true;
  return false;
}

void check_cache_spec(const CacheSpec& spec, int64_t block_size, std::string_view owner) {
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const CacheTensorSpec& tensor = spec.tensors[i];
    const auto fail = [&](std::string_view why) {
      raise(ErrorCode::kInvalidArgument, "{}: cache tensor {} '{}' ({}): {}", owner, i, tensor.name,
            cache_indexing_name(tensor.indexing), why);
    };
    if (tensor.name.empty()) fail("has no name");
    for (size_t j = 0; j < i; ++j)
      if (spec.tensors[j].name == tensor.name) fail("the name is used twice");
    const int leading = tensor.paged() ? 2 : 1;
    if (static_cast<int>(tensor.shape.size()) + leading > Shape::kMaxDims) {
      fail(fmt::format("{} dims per unit do not fit a tensor of at most {} dims", tensor.shape.size(),
                       Shape::kMaxDims));
    }
    for (const int64_t dim : tensor.shape)
      if (dim <= 0) fail(fmt::format("dimension {} is not positive", dim));
    if (tensor.indexing == CacheIndexing::kPerGroup) {
      if (tensor.group_size <= 0 || block_size % tensor.group_size != 0) {
        fail(fmt::format("group size {} does not divide the block size {}", tensor.group_size, block_size));
      }
    } else if (tensor.group_size != 1) {
      fail(fmt::format("group size {} given to a tensor that is not per group", tensor.group_size));
    }
  }
}

uint64_t paged_bytes_per_block(std::span<const CacheSpec> specs, int64_t block_size, DType activation) {
  uint64_t bytes = 0;
  for (const auto& spec : specs) {
    for (const auto& tensor : spec.tensors) {
      if (!tensor.paged()) continue;
      bytes = checked_add(bytes,
                          checked_product<uint64_t>("bytes per KV block", ErrorCode::kInvalidArgument,
                                                    static_cast<uint64_t>(tensor.rows_per_block(block_size)),
                                                    tensor.elements_per_unit(), dtype_size(tensor.dtype_or(activation))),
                          "bytes per KV block");
    }
  }
  return bytes;
}

uint64_t slot_bytes_per_slot(std::span<const CacheSpec> specs, DType activation) {
  uint64_t bytes = 0;
  for (const auto& spec : specs) {
    for (const auto& tensor : spec.tensors) {
      if (tensor.paged()) continue;
      bytes = checked_add(bytes,
                          checked_mul<uint64_t>(tensor.elements_per_unit(), dtype_size(tensor.dtype_or(activation)),
                                                "bytes per state slot"),
                          "bytes per state slot");
    }
  }
  return bytes;
}

}  // namespace metrale
