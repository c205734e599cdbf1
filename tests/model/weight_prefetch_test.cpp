// WeightPrefetcher: the pool populates every byte of the ranges it is given, on as many threads as
// there are chunks at most, and stops early without touching the rest.
#include "model/weight_prefetch.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/mapped_file.h"

namespace metrale {
namespace {

std::filesystem::path write_file(const std::string& name, size_t bytes) {
  const auto path = std::filesystem::temp_directory_path() / ("metrale_prefetch_" + name);
  std::ofstream file(path, std::ios::binary);
  std::vector<char> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(i * 7);
  file.write(data.data(), static_cast<std::streamsize>(data.size()));
  return path;
}

TEST(WeightPrefetcher, PopulatesEveryChunkOfEveryRange) {
  const size_t big = 2 * WeightPrefetcher::kChunkBytes + 12345;
  const MappedFile first(write_file("a", big)), second(write_file("b", 4096));
  std::vector<std::span<const std::byte>> ranges = {first.bytes().subspan(100), second.bytes()};
  WeightPrefetcher prefetcher(ranges, 8);
  EXPECT_EQ(prefetcher.num_threads(), 4);  // 3 chunks of the first range, 1 of the second
  prefetcher.wait();
  EXPECT_EQ(prefetcher.bytes_done(), big - 100 + 4096);
}

TEST(WeightPrefetcher, HardwareConcurrencyByDefaultAndStopsEarly) {
  const MappedFile file(write_file("c", 3 * WeightPrefetcher::kChunkBytes));
  WeightPrefetcher prefetcher({file.bytes()}, 0);
  EXPECT_GE(prefetcher.num_threads(), 1);
  EXPECT_LE(prefetcher.num_threads(), 3);
  prefetcher.stop();
  EXPECT_LE(prefetcher.bytes_done(), file.size());
  WeightPrefetcher nothing({}, 4);
  EXPECT_EQ(nothing.num_threads(), 0);
}

}  // namespace
}  // namespace metrale
