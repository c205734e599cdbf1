// .npy write/read: round trips through files whose layout is checked against the NumPy format
// specification (magic, version, little-endian header length, 64-byte alignment), and rejection
// of malformed files with kBadFormat errors that name the file.
#include "core/npy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/strings.h"
#include "core/test_support.h"

namespace metrale {
namespace {

using testing::TempDir;
using testing::throws_error;
using testing::write_bytes;

std::vector<float> random_values(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> values(count);
  for (auto& v : values) v = dist(rng);
  return values;
}

// A version-1.0 .npy file built by hand from the format specification.
std::string npy_file(const std::string& header_dict, std::string_view data, char major = 1) {
  std::string header = header_dict;
  const size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes("\x93NUMPY", 6);
  bytes.push_back(major);
  bytes.push_back(0);
  const size_t length = header.size();
  bytes.push_back(static_cast<char>(length & 0xff));
  bytes.push_back(static_cast<char>((length >> 8) & 0xff));
  if (major != 1) {
    bytes.push_back(0);
    bytes.push_back(0);
  }
  return bytes + header + std::string(data);
}

std::string f32_bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

TEST(Npy, RoundTripKeepsShapeAndBits) {
  TempDir dir;
  const std::vector<std::vector<int64_t>> shapes = {{}, {1}, {7}, {3, 5}, {2, 3, 4}, {2, 1, 3, 1, 2}};
  uint64_t seed = 1;
  for (const auto& shape : shapes) {
    int64_t count = 1;
    for (const int64_t d : shape) count *= d;
    const std::vector<float> values = random_values(static_cast<size_t>(count), seed++);
    const auto path = dir / (std::to_string(seed) + ".npy");
    write_npy_f32(path, values, shape);
    const NpyArray array = read_npy_f32(path);
    EXPECT_EQ(array.shape, shape);
    ASSERT_EQ(array.data.size(), values.size());
    EXPECT_EQ(std::memcmp(array.data.data(), values.data(), values.size() * 4), 0);
  }
}

TEST(Npy, WrittenFileFollowsTheFormat) {
  TempDir dir;
  const std::vector<float> values = random_values(6, 3);
  const std::vector<int64_t> shape = {2, 3};
  write_npy_f32(dir / "x.npy", values, shape);
  const std::string bytes = read_file(dir / "x.npy");
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 6), std::string("\x93NUMPY", 6));
  EXPECT_EQ(bytes[6], 1);
  EXPECT_EQ(bytes[7], 0);
  const size_t header_len =
      static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
  EXPECT_EQ((10 + header_len) % 64, 0u) << "data must start on a 64-byte boundary";
  const std::string header = bytes.substr(10, header_len);
  EXPECT_EQ(header.back(), '\n');
  EXPECT_NE(header.find("'descr': '<f4'"), std::string::npos) << header;
  EXPECT_NE(header.find("'fortran_order': False"), std::string::npos) << header;
  EXPECT_NE(header.find("'shape': (2, 3)"), std::string::npos) << header;
  EXPECT_EQ(bytes.size(), 10 + header_len + 24);
  EXPECT_EQ(bytes.substr(10 + header_len), f32_bytes(values));
}

TEST(Npy, OneDimensionalShapeHasTrailingComma) {
  TempDir dir;
  const std::vector<float> values = random_values(4, 4);
  const std::vector<int64_t> shape = {4};
  write_npy_f32(dir / "x.npy", values, shape);
  EXPECT_NE(read_file(dir / "x.npy").find("'shape': (4,)"), std::string::npos);
}

TEST(Npy, ReadsHandWrittenFiles) {
  TempDir dir;
  // f8 data is narrowed to f32.
  const std::vector<double> doubles = {1.25, -2.5e-3, 3.0e5, -7.0};
  const std::string data(reinterpret_cast<const char*>(doubles.data()), doubles.size() * 8);
  write_bytes(dir / "f8.npy", npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), }", data));
  const NpyArray f8 = read_npy_f32(dir / "f8.npy");
  EXPECT_EQ(f8.shape, (std::vector<int64_t>{2, 2}));
  for (size_t i = 0; i < doubles.size(); ++i) EXPECT_EQ(f8.data[i], static_cast<float>(doubles[i]));
  // Version 2.0 has a 4-byte header length.
  const std::vector<float> values = random_values(3, 5);
  write_bytes(dir / "v2.npy",
              npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", f32_bytes(values), 2));
  const NpyArray v2 = read_npy_f32(dir / "v2.npy");
  EXPECT_EQ(v2.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(v2.data, values);
}

TEST(Npy, MissingFileIsNotFound) {
  TempDir dir;
  const auto path = dir / "absent.npy";
  EXPECT_TRUE(throws_error([&] { read_npy_f32(path); }, ErrorCode::kNotFound, {path.string()}));
}

TEST(Npy, RejectsMalformedFiles) {
  TempDir dir;
  const std::string good_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
  const std::string four = f32_bytes(random_values(4, 6));
  struct Case {
    const char* name;
    std::string bytes;
  };
  std::string bad_version = npy_file(good_dict, four);
  bad_version[6] = 9;
  std::string long_header = npy_file(good_dict, "");
  long_header[8] = static_cast<char>(0xff);  // header length past the end of the file
  long_header[9] = static_cast<char>(0x7f);
  const std::vector<Case> cases = {
      {"empty", ""},
      {"short", std::string("\x93NUM", 4)},
      {"bad_magic", std::string("XNUMPY").append(npy_file(good_dict, four).substr(6))},
      {"bad_version", bad_version},
      {"truncated_header", long_header},
      {"int_dtype", npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }", four)},
      {"big_endian", npy_file("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 2), }", four)},
      {"fortran", npy_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", four)},
      {"no_shape", npy_file("{'descr': '<f4', 'fortran_order': False, }", four)},
      {"short_data", npy_file(good_dict, four.substr(0, 12))},
      {"extra_data", npy_file(good_dict, four + "abcd")},
  };
  for (const auto& c : cases) {
    const auto path = dir / (std::string(c.name) + ".npy");
    write_bytes(path, c.bytes);
    EXPECT_TRUE(throws_error([&] { read_npy_f32(path); }, ErrorCode::kBadFormat, {path.string()})) << c.name;
  }
}

// A shape that is not a list of non-negative integers is a malformed file, reported like the others
// (not as a std::invalid_argument from deep inside the parser, and never accepted).
TEST(Npy, RejectsMalformedShapes) {
  TempDir dir;
  const std::string four = f32_bytes(random_values(4, 7));
  const std::vector<std::pair<const char*, std::string>> cases = {
      {"word", npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", four)},
      {"huge", npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", four)},
      {"negative", npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, -2), }", four)},
  };
  for (const auto& [name, bytes] : cases) {
    const auto path = dir / (std::string(name) + ".npy");
    write_bytes(path, bytes);
    EXPECT_TRUE(throws_error([&] { read_npy_f32(path); }, ErrorCode::kBadFormat, {path.string()})) << name;
  }
}

TEST(Npy, WriteChecksShapeAgainstData) {
  TempDir dir;
  const std::vector<float> values = random_values(5, 8);
  const std::vector<int64_t> shape = {2, 3};
  EXPECT_TRUE(throws_error([&] { write_npy_f32(dir / "x.npy", values, shape); }, ErrorCode::kInternal));
}

TEST(Npy, WriteToMissingDirectoryFails) {
  TempDir dir;
  const std::vector<float> values = random_values(2, 9);
  const std::vector<int64_t> shape = {2};
  const auto path = dir / "no/such/dir/x.npy";
  EXPECT_TRUE(throws_error([&] { write_npy_f32(path, values, shape); }, ErrorCode::kNotFound, {path.string()}));
}

}  // namespace
}  // namespace metrale
