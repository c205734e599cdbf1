// safetensors: write_safetensors + SafetensorsFile round trips (bf16, f16, f32, integers, metadata)
// and the loader's errors on malformed files, each naming the file and, where one is at fault, the
// tensor. Malformed files are written byte by byte here, never through the writer under test.
#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "core/test_support.h"
#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;
using testing::TempDir;
using testing::throws_error;
using testing::write_bytes;

// A safetensors file from a header (JSON text) and a data section, following the format: an 8-byte
// little-endian header length, the header, the data.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header + data;
}

TEST(Safetensors, RoundTripOfEveryStoredDtype) {
  TempDir dir;
  Random rng(901);
  const OwnedTensor bf16 = random_tensor(DType::kBF16, {3, 5}, rng);
  const OwnedTensor f16 = random_tensor(DType::kF16, {7}, rng);
  const OwnedTensor f32 = random_tensor(DType::kF32, {2, 3, 4}, rng);
  std::vector<int32_t> ints = {3, -1, 7, 1 << 30};
  std::vector<int64_t> longs = {-5, 1ll << 40};
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"model.embed_tokens.weight", *bf16},
      {"model.norm.weight", *f16},
      {"lm_head.weight", *f32},
      {"buffers.ids", Tensor(ints.data(), DType::kI32, {2, 2})},
      {"buffers.offsets", Tensor(longs.data(), DType::kI64, {2})},
  };
  write_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});

  // The header is plain JSON in the documented layout.
  const std::string bytes = read_file(dir / "model.safetensors");
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i)
    header_len |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[static_cast<size_t>(i)])) << (8 * i);
  const auto header = nlohmann::json::parse(bytes.substr(8, header_len));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["model.embed_tokens.weight"]["dtype"], "BF16");
  EXPECT_EQ(header["model.norm.weight"]["dtype"], "F16");
  EXPECT_EQ(header["lm_head.weight"]["shape"], nlohmann::json({2, 3, 4}));
  EXPECT_EQ(bytes.size(), 8 + header_len + 30 + 14 + 96 + 16 + 16);

  const SafetensorsFile file(dir / "model.safetensors");
  EXPECT_EQ(file.entries().size(), tensors.size());  // __metadata__ is not a tensor
  EXPECT_FALSE(file.contains("__metadata__"));
  for (const auto& [name, original] : tensors) {
    ASSERT_TRUE(file.contains(name)) << name;
    const Tensor view = file.view(name);
    EXPECT_EQ(view.dtype(), original.dtype()) << name;
    EXPECT_TRUE(view.shape() == original.shape()) << name;
    EXPECT_TRUE(view.device().is_cpu());
    EXPECT_EQ(std::memcmp(view.data(), original.data(), original.nbytes()), 0) << name;
    const SafetensorsEntry& entry = file.entries().at(name);
    EXPECT_EQ(entry.end - entry.begin, original.nbytes()) << name;
    EXPECT_EQ(entry.dtype_name, safetensors_dtype_name(original.dtype()));
  }
  EXPECT_TRUE(throws_error([&] { file.view("missing.weight"); }, ErrorCode::kNotFound,
                           {(dir / "model.safetensors").string(), "missing.weight"}));
}

TEST(Safetensors, EmptyAndScalarTensors) {
  TempDir dir;
  std::vector<float> scalar = {2.5f};
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"empty", Tensor(nullptr, DType::kF32, {0, 4})},
      {"scalar", Tensor(scalar.data(), DType::kF32, Shape{})},
  };
  write_safetensors(dir / "x.safetensors", tensors);
  const SafetensorsFile file(dir / "x.safetensors");
  EXPECT_EQ(file.view("empty").numel(), 0);
  EXPECT_EQ(file.view("scalar").ndim(), 0);
  EXPECT_EQ(*file.view("scalar").data_as<float>(), 2.5f);
}

TEST(Safetensors, HandWrittenFileWithUnalignedHeaderAndUnsortedOffsets) {
  // Other writers do not pad the header and may list entries in any order.
  TempDir dir;
  const std::vector<float> a = {1.5f, -2.0f};
  const std::vector<uint16_t> b = {0x3f80, 0xc000, 0x4040};  // bf16 1, -2, 3
  std::string data(reinterpret_cast<const char*>(b.data()), 6);
  data += std::string(reinterpret_cast<const char*>(a.data()), 8);
  const std::string header =
      R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},"a":{"dtype":"F32","shape":[2],"data_offsets":[6,14]}})";
  write_bytes(dir / "x.safetensors", safetensors_bytes(header, data));
  const SafetensorsFile file(dir / "x.safetensors");
  float a_back[2];
  std::memcpy(a_back, file.view("a").data(), 8);  // the view may be unaligned: copy before reading
  EXPECT_EQ(a_back[0], 1.5f);
  EXPECT_EQ(a_back[1], -2.0f);
  uint16_t b_back[3];
  std::memcpy(b_back, file.view("b").data(), 6);
  EXPECT_EQ(bf16_bits_to_f32(b_back[2]), 3.0f);
}

TEST(Safetensors, WriterLaysTensorsOutAligned) {
  TempDir dir;
  std::vector<uint8_t> bytes = {1, 2, 3};
  std::vector<uint16_t> halves = {1, 2, 3};
  std::vector<int64_t> longs = {7, 8};
  write_safetensors(dir / "x.safetensors", {{"u8", Tensor(bytes.data(), DType::kU8, {3})},
                                            {"f16", Tensor(halves.data(), DType::kF16, {3})},
                                            {"i64", Tensor(longs.data(), DType::kI64, {2})}});
  const SafetensorsFile file(dir / "x.safetensors");
  for (const auto& [name, entry] : file.entries()) {
    EXPECT_EQ(entry.begin % dtype_size(*entry.dtype), 0u) << name;
  }
  EXPECT_EQ(file.view("i64").data_as<int64_t>()[1], 8);
  EXPECT_EQ(file.view("u8").data_as<uint8_t>()[2], 3);
}

TEST(Safetensors, HeaderParserWorksOnBytesInMemory) {
  const std::string bytes = safetensors_bytes(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                                              std::string(16, '\x01'));
  const SafetensorsHeader header =
      parse_safetensors_header(std::as_bytes(std::span(bytes.data(), bytes.size())), "memory");
  EXPECT_EQ(header.data_start, bytes.size() - 16);
  ASSERT_EQ(header.entries.size(), 1u);
  EXPECT_EQ(header.entries.at("w").end, 16u);
}

struct MalformedCase {
  const char* name;
  std::string bytes;
  std::string tensor;  // the tensor the message must name ("" when the file as a whole is broken)
};

std::vector<MalformedCase> malformed_cases() {
  const std::string four_floats(16, '\x01');
  const auto entry = [](const std::string& body) { return R"({"w":)" + body + "}"; };
  std::string huge_length(8, '\0');
  huge_length[7] = 0x10;  // a header length of 2^60
  return {
      {"tiny", "abc", ""},
      {"seven_bytes", std::string(7, '\0'), ""},
      {"header_past_end", safetensors_bytes(std::string(40, ' '), "").substr(0, 20), ""},
      {"huge_header_length", huge_length + "{}", ""},
      {"corrupt_json", safetensors_bytes(R"({"w": {"dtype": "F32", )", four_floats), ""},
      {"header_is_array", safetensors_bytes("[1, 2, 3]", four_floats), ""},
      {"header_is_string", safetensors_bytes(R"("weights")", four_floats), ""},
      {"entry_not_object", safetensors_bytes(entry("[1, 2]"), four_floats), "w"},
      {"missing_dtype", safetensors_bytes(entry(R"({"shape":[4],"data_offsets":[0,16]})"), four_floats), "w"},
      {"missing_shape", safetensors_bytes(entry(R"({"dtype":"F32","data_offsets":[0,16]})"), four_floats), "w"},
      {"missing_offsets", safetensors_bytes(entry(R"({"dtype":"F32","shape":[4]})"), four_floats), "w"},
      {"dtype_not_string", safetensors_bytes(entry(R"({"dtype":4,"shape":[4],"data_offsets":[0,16]})"), four_floats),
       "w"},
      {"unknown_dtype", safetensors_bytes(entry(R"({"dtype":"Q4_K","shape":[4],"data_offsets":[0,16]})"), four_floats),
       "w"},
      {"shape_not_list", safetensors_bytes(entry(R"({"dtype":"F32","shape":4,"data_offsets":[0,16]})"), four_floats),
       "w"},
      {"negative_dim", safetensors_bytes(entry(R"({"dtype":"F32","shape":[-4],"data_offsets":[0,16]})"), four_floats),
       "w"},
      {"fractional_dim",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,16]})"), four_floats), "w"},
      {"offsets_past_end",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[8],"data_offsets":[0,32]})"), four_floats), "w"},
      {"offsets_reversed",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[0],"data_offsets":[16,0]})"), four_floats), "w"},
      {"offsets_one_number",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[4],"data_offsets":[16]})"), four_floats), "w"},
      {"offsets_negative",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[4],"data_offsets":[-1,15]})"), four_floats), "w"},
      {"size_mismatch_shape",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[3],"data_offsets":[0,16]})"), four_floats), "w"},
      {"size_mismatch_dtype",
       safetensors_bytes(entry(R"({"dtype":"BF16","shape":[4],"data_offsets":[0,16]})"), four_floats), "w"},
      {"overlap",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}})",
                         four_floats),
       "b"},
      {"same_bytes_twice",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                         four_floats),
       "b"},
      {"gap", safetensors_bytes(entry(R"({"dtype":"F32","shape":[3],"data_offsets":[4,16]})"), four_floats), "w"},
      {"too_many_dims",
       safetensors_bytes(entry(R"({"dtype":"U8","shape":[1,1,1,1,1,1,1,16],"data_offsets":[0,16]})"), four_floats),
       "w"},
      {"dim_past_int64",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,16]})"), four_floats),
       "w"},
      {"deeply_nested_header", safetensors_bytes(std::string(10000, '[') + std::string(10000, ']'), four_floats), ""},
      {"trailing_bytes", safetensors_bytes(entry(R"({"dtype":"F32","shape":[3],"data_offsets":[0,12]})"), four_floats),
       ""},
      {"shape_overflow",
       safetensors_bytes(entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]})"),
                         four_floats),
       "w"},
  };
}

TEST(Safetensors, MalformedFilesAreBadFormatNamingFileAndTensor) {
  TempDir dir;
  for (const MalformedCase& c : malformed_cases()) {
    const auto path = dir / (std::string(c.name) + ".safetensors");
    write_bytes(path, c.bytes);
    std::vector<std::string> fragments = {path.string()};
    if (!c.tensor.empty()) fragments.push_back("'" + c.tensor + "'");
    EXPECT_TRUE(throws_error([&] { SafetensorsFile file(path); }, ErrorCode::kBadFormat, fragments)) << c.name;
  }
}

TEST(Safetensors, MessagesSayWhatIsWrong) {
  TempDir dir;
  const auto check = [&](const std::string& name, const std::string& bytes, const std::string& fragment) {
    const auto path = dir / name;
    write_bytes(path, bytes);
    EXPECT_TRUE(throws_error([&] { SafetensorsFile file(path); }, ErrorCode::kBadFormat, {path.string(), fragment}))
        << name;
  };
  check("a", "abc", "truncated");
  check("b", safetensors_bytes(std::string(40, ' '), "").substr(0, 20), "truncated");
  check("c", safetensors_bytes(R"({"w": )", ""), "corrupt");
  check("d", safetensors_bytes("[]", ""), "not a JSON object");
  check("e", safetensors_bytes(R"({"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", std::string(16, 'x')),
        "past the end");
  check("f", safetensors_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", std::string(16, 'x')),
        "need 12");
  check("g", safetensors_bytes(R"({"w":{"dtype":"Q4_K","shape":[4],"data_offsets":[0,16]}})", std::string(16, 'x')),
        "Q4_K");
  check("h",
        safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}})",
                          std::string(16, 'x')),
        "overlap those of 'a'");
  check("i", safetensors_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}})", std::string(16, 'x')),
        "that no tensor describes");
  check("j", safetensors_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", std::string(16, 'x')),
        "cover 12 bytes of a data section of 16");
  check("l", safetensors_bytes(std::string(100, '{'), ""), "nested deeper than 8");
}

TEST(Safetensors, KnownButUnsupportedDtypeLoadsButCannotBeViewed) {
  // F64 is valid safetensors, so the file opens; using the tensor is what fails.
  TempDir dir;
  const std::string header = R"({"model.norm.weight":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                             R"("model.other":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})";
  const auto path = dir / "model.safetensors";
  write_bytes(path, safetensors_bytes(header, std::string(20, '\x01')));
  const SafetensorsFile file(path);
  EXPECT_FALSE(file.entries().at("model.norm.weight").dtype.has_value());
  EXPECT_EQ(file.entries().at("model.norm.weight").dtype_name, "F64");
  EXPECT_TRUE(throws_error([&] { file.view("model.norm.weight"); }, ErrorCode::kUnsupported,
                           {path.string(), "'model.norm.weight'", "F64"}));
  EXPECT_NO_THROW(file.view("model.other"));
}

TEST(Safetensors, MissingFileIsNotFound) {
  TempDir dir;
  const auto path = dir / "model.safetensors";
  EXPECT_TRUE(throws_error([&] { SafetensorsFile file(path); }, ErrorCode::kNotFound, {path.string()}));
}

TEST(Safetensors, WriterRejectsNonContiguousTensors) {
  TempDir dir;
  Random rng(902);
  const OwnedTensor t = random_tensor(DType::kF32, {4, 4}, rng);
  EXPECT_TRUE(throws_error(
      [&] {
        write_safetensors(dir / "x.safetensors", {{"t", t->slice(1, 0, 2)}});
      },
      ErrorCode::kInternal, {"contiguous"}));
}

}  // namespace
}  // namespace metrale
