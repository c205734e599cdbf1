#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_depth.h"

namespace metrale {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit is 100 MB
constexpr size_t kMaxHeaderDepth = 8;

std::optional<DType> parse_dtype(const std::string& name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "I64") return DType::kI64;
  if (name == "I32") return DType::kI32;
  if (name == "I16") return DType::kI16;
  if (name == "I8") return DType::kI8;
  if (name == "U8") return DType::kU8;
  if (name == "BOOL") return DType::kBool;
  return std::nullopt;
}

// Element size of dtypes metrale cannot compute with but must still validate.
uint64_t element_bytes(const std::string& name) {
  if (name == "F64" || name == "I64" || name == "U64") return 8;
  if (name == "F32" || name == "I32" || name == "U32") return 4;
  if (name == "F16" || name == "BF16" || name == "I16" || name == "U16") return 2;
  if (name == "F8_E4M3" || name == "F8_E5M2" || name == "I8" || name == "U8" || name == "BOOL" ||
      name == "F8_E8M0")
    return 1;
  return 0;
}

}  // namespace

std::string safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

namespace {

// One header entry, validated on its own: dtype, shape and byte size.
SafetensorsEntry parse_entry(const std::string& name, const nlohmann::json& info, uint64_t data_size,
                             std::string_view where) {
  const auto bad = [&](const std::string& why) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}': {}", where, name, why);
  };
  if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
    bad("entry needs dtype, shape and data_offsets");
  if (!info["dtype"].is_string()) bad("dtype is not a string");
  SafetensorsEntry entry;
  entry.dtype_name = info["dtype"].get<std::string>();
  entry.dtype = parse_dtype(entry.dtype_name);
  const uint64_t element = element_bytes(entry.dtype_name);
  if (element == 0) bad("unknown dtype '" + entry.dtype_name + "'");
  if (!info["shape"].is_array()) bad("shape is not a list");
  if (info["shape"].size() > static_cast<size_t>(Shape::kMaxDims))
    bad(fmt::format("shape has {} dimensions, more than the {} metrale supports", info["shape"].size(), Shape::kMaxDims));
  uint64_t count = 1;
  for (const auto& dim : info["shape"]) {
    if (!dim.is_number_unsigned()) bad("shape has a negative or non-integer dimension");
    const auto size = dim.get<uint64_t>();
    if (size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) bad("shape has a dimension past 2^63");
    entry.shape.push_back(static_cast<int64_t>(size));
    if (size != 0 && count > (1ull << 62) / size) bad("shape overflows");
    count *= size;
  }
  const auto& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
    bad("data_offsets must be two non-negative integers");
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.begin > entry.end) bad("data_offsets are reversed");
  if (entry.end > data_size) {
    bad(fmt::format("data_offsets [{}, {}) run past the end of the file (data section of {} bytes)", entry.begin,
                    entry.end, data_size));
  }
  if (count > (1ull << 62) / element || entry.end - entry.begin != count * element) {
    bad(fmt::format("data_offsets cover {} bytes but shape and dtype need {}", entry.end - entry.begin, count * element));
  }
  return entry;
}

// The offsets, sorted, must tile [0, data_size): what the reference loader checks, so that no two
// tensors share bytes (a file whose weights alias would load and produce garbage).
void check_tiling(const std::map<std::string, SafetensorsEntry>& entries, uint64_t data_size, std::string_view where) {
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> order;
  order.reserve(entries.size());
  for (const auto& [name, entry] : entries) order.emplace_back(&name, &entry);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second->begin, a.second->end) < std::tie(b.second->begin, b.second->end);
  });
  uint64_t expected = 0;
  const std::string* previous = nullptr;
  for (const auto& [name, entry] : order) {
    if (entry->begin < expected) {
      raise(ErrorCode::kBadFormat, "{}: tensor '{}': data_offsets [{}, {}) overlap those of '{}', which end at {}",
            where, *name, entry->begin, entry->end, *previous, expected);
    }
    if (entry->begin > expected) {
      raise(ErrorCode::kBadFormat, "{}: tensor '{}': data_offsets start at {}, leaving bytes [{}, {}) that no tensor "
            "describes", where, *name, entry->begin, expected, entry->begin);
    }
    expected = entry->end;
    previous = name;
  }
  if (expected != data_size) {
    raise(ErrorCode::kBadFormat, "{}: the tensors cover {} bytes of a data section of {} bytes", where, expected,
          data_size);
  }
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> bytes, std::string_view where) {
  if (bytes.size() < 8) raise(ErrorCode::kBadFormat, "{}: truncated safetensors file ({} bytes, no header)", where, bytes.size());
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[static_cast<size_t>(i)])) << (8 * i);
  if (header_len > kMaxHeaderBytes) raise(ErrorCode::kBadFormat, "{}: corrupt safetensors header length {}", where, header_len);
  if (header_len > bytes.size() - 8) {
    raise(ErrorCode::kBadFormat, "{}: truncated safetensors file: header of {} bytes but only {} follow", where,
          header_len, bytes.size() - 8);
  }
  SafetensorsHeader result;
  result.data_start = 8 + header_len;
  const uint64_t data_size = bytes.size() - result.data_start;
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, header_len);
  // {name: {dtype, shape: [...], data_offsets: [...]}, __metadata__: {...}} nests 3 deep.
  if (json_nests_deeper_than(text, kMaxHeaderDepth))
    raise(ErrorCode::kBadFormat, "{}: corrupt safetensors header: nested deeper than {}", where, kMaxHeaderDepth);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCode::kBadFormat, "{}: corrupt safetensors header: {}", where, e.what());
  }
  if (!header.is_object()) raise(ErrorCode::kBadFormat, "{}: corrupt safetensors header: not a JSON object", where);
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    result.entries.emplace(name, parse_entry(name, info, data_size, where));
  }
  check_tiling(result.entries, data_size, where);
  return result;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : file_(path) {
  SafetensorsHeader header = parse_safetensors_header(file_.bytes(), path.string());
  data_start_ = header.data_start;
  entries_ = std::move(header.entries);
}

Tensor SafetensorsFile::view(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) raise(ErrorCode::kNotFound, "{}: no tensor '{}'", path().string(), name);
  const SafetensorsEntry& entry = it->second;
  if (!entry.dtype) {
    raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}, which metrale does not support (use bf16, f16 or f32)",
          path().string(), name, entry.dtype_name);
  }
  void* data = const_cast<std::byte*>(file_.bytes().data() + data_start_ + entry.begin);
  return Tensor(data, *entry.dtype, Shape(std::span<const int64_t>(entry.shape)), Device::cpu());
}

void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // The data is laid out by element size, largest first (stable otherwise), as the reference writer
  // does: every tensor then starts at a multiple of its element size.
  std::vector<const std::pair<std::string, Tensor>*> layout;
  for (const auto& named : tensors) layout.push_back(&named);
  std::stable_sort(layout.begin(), layout.end(), [](const auto* a, const auto* b) {
    return dtype_size(a->second.dtype()) > dtype_size(b->second.dtype());
  });
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto* named : layout) {
    const auto& [name, tensor] = *named;
    METRALE_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(), "write_safetensors: {} must be a contiguous CPU tensor", name);
    const uint64_t bytes = tensor.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(tensor.dtype())},
                    {"shape", std::vector<int64_t>(tensor.shape().dims().begin(), tensor.shape().dims().end())},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data section
  std::ofstream out(path, std::ios::binary);
  if (!out) raise(ErrorCode::kNotFound, "cannot write {}", path.string());
  const uint64_t header_len = text.size();
  char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<char>((header_len >> (8 * i)) & 0xff);
  out.write(len_bytes, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto* named : layout) {
    const Tensor& tensor = named->second;
    out.write(static_cast<const char*>(tensor.data()), static_cast<std::streamsize>(tensor.nbytes()));
  }
  if (!out) raise(ErrorCode::kInternal, "failed writing {}", path.string());
}

}  // namespace metrale
