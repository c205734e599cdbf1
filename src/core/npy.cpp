#include "core/npy.h"

#include <charconv>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>

#include "core/error.h"
#include "core/strings.h"

namespace metrale {

void write_npy_f32(const std::filesystem::path& path, std::span<const float> data, std::span<const int64_t> shape) {
  const int64_t count = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  METRALE_CHECK(count == static_cast<int64_t>(data.size()), "npy shape does not match data size");
  std::string shape_text = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    shape_text += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) shape_text += ",";
    if (i + 1 < shape.size()) shape_text += " ";
  }
  shape_text += ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text + ", }";
  // Magic (6) + version (2) + header length (2) + header must be a multiple of 64, ending in '\n'.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) raise(ErrorCode::kNotFound, "cannot write {}", path.string());
  out.write("\x93NUMPY\x01\x00", 8);
  const uint16_t header_len = static_cast<uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(header_len & 0xff), static_cast<char>(header_len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size_bytes()));
  if (!out) raise(ErrorCode::kInternal, "failed writing {}", path.string());
}

NpyArray read_npy_f32(const std::filesystem::path& path) {
  const std::string bytes = read_file(path);
  auto bad = [&](std::string_view why) -> Error {
    return Error(ErrorCode::kBadFormat, path.string() + ": not a supported .npy file: " + std::string(why));
  };
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) throw bad("bad magic");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw bad("truncated");
    header_len = 0;
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    header_start = 12;
  } else {
    throw bad("unknown version");
  }
  if (header_start + header_len > bytes.size()) throw bad("truncated header");
  const std::string header = bytes.substr(header_start, header_len);
  const bool is_f4 = header.find("'<f4'") != std::string::npos;
  const bool is_f8 = header.find("'<f8'") != std::string::npos;
  if (!is_f4 && !is_f8) throw bad("dtype must be <f4 or <f8");
  if (header.find("'fortran_order': False") == std::string::npos) throw bad("fortran order");
  const size_t open = header.find('(', header.find("'shape'"));
  const size_t close = header.find(')', open);
  if (open == std::string::npos || close == std::string::npos) throw bad("no shape");
  NpyArray array;
  int64_t count = 1;
  for (const auto& part : split(header.substr(open + 1, close - open - 1), ',')) {
    const std::string item = trim(part);
    if (item.empty()) continue;
    int64_t dim = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), dim);
    if (error != std::errc() || end != item.data() + item.size() || dim < 0) throw bad("bad shape");
    if (dim != 0 && count > (int64_t{1} << 40) / dim) throw bad("shape too large");
    count *= dim;
    array.shape.push_back(dim);
  }
  const size_t data_start = header_start + header_len;
  const size_t element = is_f4 ? 4 : 8;
  if (bytes.size() - data_start != static_cast<size_t>(count) * element) throw bad("data size does not match shape");
  array.data.resize(static_cast<size_t>(count));
  if (is_f4) {
    std::memcpy(array.data.data(), bytes.data() + data_start, array.data.size() * 4);
  } else {
    for (int64_t i = 0; i < count; ++i) {
      double value;
      std::memcpy(&value, bytes.data() + data_start + static_cast<size_t>(i) * 8, 8);
      array.data[static_cast<size_t>(i)] = static_cast<float>(value);
    }
  }
  return array;
}

}  // namespace metrale
