// NumPy .npy files (format 1.0, little-endian, C order). Used for reference logits in tests and for
// `metrale score --out`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace metrale {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;  // f4 arrays are read as is; f8 (`<f8`) arrays are narrowed to f32
};

void write_npy_f32(const std::filesystem::path& path, std::span<const float> data, std::span<const int64_t> shape);
NpyArray read_npy_f32(const std::filesystem::path& path);

}  // namespace metrale
