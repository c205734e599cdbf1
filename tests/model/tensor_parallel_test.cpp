// Tensor parallelism on the CPU (model/tensor_parallel.h): every golden checkpoint built at TP = 2
// and 4, with ranks as threads over an InProcessGroup, gives the logits of TP = 1 within 1e-5
// (relative L2) over chunked prefills and decode steps of two sequences, every rank the same bits;
// the blocks that split do split (the ranks all-reduce, and hold a share of the caches). Plus the
// slicing arithmetic the ranks load their weights with.
#include "model/tensor_parallel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "common/step_runner.h"
#include "core/error.h"
#include "model/registry.h"
#include "runtime/communicator.h"

namespace metrale {
namespace {

using testing::ForwardRunner;

// --- Slices and shares ----------------------------------------------------------------------------

TEST(TensorSlice, CopiesRowsInTheirOrderAndColumnRanges) {
  // [2, 3, 4] of 0..23: rows along dim 1 in the order {2, 0}, columns [1, 3).
  std::vector<float> values(24);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  const Tensor source(values.data(), DType::kF32, {2, 3, 4});
  TensorSlice slice = TensorSlice::of_rows({2, 0}, 1);
  slice.col_begin = 1;
  slice.col_end = 3;
  ASSERT_EQ(slice.shape_of(source.shape()), (Shape{2, 2, 2}));
  std::vector<float> out(8);
  copy_slice(source, slice, out.data());
  EXPECT_EQ(out, (std::vector<float>{9, 10, 1, 2, 21, 22, 13, 14}));
  // A 1-D tensor takes rows only.
  const Tensor vector(values.data(), DType::kF32, {6});
  std::vector<float> picked(2);
  copy_slice(vector, TensorSlice::of_rows({5, 1}), picked.data());
  EXPECT_EQ(picked, (std::vector<float>{5, 1}));
  EXPECT_THROW(TensorSlice::of_rows({3}).shape_of(Shape{3, 4}), Error);
  EXPECT_THROW(TensorSlice::of_columns(2, 5).shape_of(Shape{3, 4}), Error);
  EXPECT_THROW(TensorSlice::of_columns(0, 1).shape_of(Shape{3}), Error);
}

TEST(TensorParallel, GroupedHeadsSplitOrKeepOneGroupPerRank) {
  const auto heads = [](int rank, int size, int64_t queries, int64_t groups) {
    return TensorParallel{rank, size, nullptr}.grouped_heads(queries, groups);
  };
  // 8 query heads over 4 groups at 2 ranks: both split.
  auto share = heads(1, 2, 8, 4);
  ASSERT_TRUE(share);
  EXPECT_EQ(share->heads.begin, 4);
  EXPECT_EQ(share->heads.end, 8);
  EXPECT_EQ(share->groups.begin, 2);
  EXPECT_EQ(share->groups.end, 4);
  // 8 over 2 groups at 4 ranks: rank 3's heads 6, 7 read group 1, which it keeps.
  share = heads(3, 4, 8, 2);
  ASSERT_TRUE(share);
  EXPECT_EQ(share->heads.begin, 6);
  EXPECT_EQ(share->groups.begin, 1);
  EXPECT_EQ(share->groups.end, 2);
  // Heads that do not split, and groups that neither split nor divide the ranks.
  EXPECT_FALSE(heads(0, 4, 6, 2));
  EXPECT_FALSE(heads(0, 4, 12, 3));
  EXPECT_EQ(TensorParallel{}.even_share(7)->size(), 7);
  EXPECT_FALSE((TensorParallel{0, 2, nullptr}.even_share(7)));
  EXPECT_THROW((TensorParallel{0, 2, nullptr}.check()), Error);
  EXPECT_THROW((TensorParallel{2, 2, nullptr}.check()), Error);
}

// --- Golden checkpoints at TP = 1, 2, 4 -----------------------------------------------------------

const std::filesystem::path kGoldens = std::filesystem::path(METRALE_TEST_DATA_DIR) / "goldens";

std::vector<std::string> golden_cases() {
  std::vector<std::string> names;
  if (std::filesystem::is_directory(kGoldens)) {
    for (const auto& entry : std::filesystem::directory_iterator(kGoldens))
      if (std::filesystem::exists(entry.path() / "model" / "config.json")) names.push_back(entry.path().filename());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<int32_t> golden_tokens(const std::string& name) {
  std::ifstream file(kGoldens / name / "input_ids.json");
  std::vector<int32_t> ids;
  for (const auto& id : nlohmann::json::parse(file)) ids.push_back(id.get<int32_t>());
  return ids;
}

// A rank's handle that counts the all-reduces passing through it.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void all_reduce_sum(const Tensor& tensor) override {
    ++all_reduces;
    inner_.all_reduce_sum(tensor);
  }
  void all_gather(const Tensor& in, const Tensor& out) override { inner_.all_gather(in, out); }
  void barrier() override { inner_.barrier(); }
  void abort(const std::string& reason) override { inner_.abort(reason); }

  std::atomic<int64_t> all_reduces{0};

 private:
  Communicator& inner_;
};

using testing::relative_l2;
using testing::StepLogits;

StepLogits run_steps(Model& model, const std::vector<int32_t>& tokens) {
  return testing::run_two_sequence_steps(model, tokens, /*block_size=*/4, /*num_blocks=*/128);
}

uint64_t cache_bytes(const Model& model) {
  const std::vector<CacheSpec> specs = model.cache_specs();
  return paged_bytes_per_block(specs, 4, DType::kF32) + slot_bytes_per_slot(specs, DType::kF32);
}

class TensorParallelGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(TensorParallelGolden, RanksGiveTheLogitsOfOneRank) {
  const std::filesystem::path dir = kGoldens / GetParam() / "model";
  const std::vector<int32_t> tokens = golden_tokens(GetParam());
  ASSERT_FALSE(tokens.empty());
  const std::unique_ptr<Model> whole = load_model(dir, Device::cpu());
  const StepLogits expected = run_steps(*whole, tokens);
  for (const int size : {2, 4}) {
    SCOPED_TRACE("TP = " + std::to_string(size));
    InProcessGroup group(size);
    std::vector<std::unique_ptr<CountingCommunicator>> handles;
    std::vector<std::unique_ptr<Model>> ranks;
    for (int r = 0; r < size; ++r) {
      handles.push_back(std::make_unique<CountingCommunicator>(group.communicator(r)));
      LoadOptions options;
      options.tensor_parallel = {r, size, handles.back().get()};
      ranks.push_back(load_model(dir, Device::cpu(), options));
    }
    std::vector<StepLogits> results(static_cast<size_t>(size));
    std::vector<std::string> failures(static_cast<size_t>(size));
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        try {
          results[static_cast<size_t>(r)] = run_steps(*ranks[static_cast<size_t>(r)], tokens);
        } catch (const std::exception& e) {
          failures[static_cast<size_t>(r)] = e.what();
          handles[static_cast<size_t>(r)]->abort(e.what());
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (int r = 0; r < size; ++r) ASSERT_EQ(failures[static_cast<size_t>(r)], "") << "rank " << r;
    const double relative = relative_l2(results[0], expected);
    EXPECT_LE(relative, 1e-5);
    RecordProperty("rel_l2_tp" + std::to_string(size), fmt::format("{:.3e}", relative));
    for (int r = 1; r < size; ++r) EXPECT_EQ(results[static_cast<size_t>(r)], results[0]) << "rank " << r;
    // Something split: the ranks summed partial outputs (every rank the same number of times).
    EXPECT_GT(handles[0]->all_reduces.load(), 0);
    for (int r = 1; r < size; ++r)
      EXPECT_EQ(handles[static_cast<size_t>(r)]->all_reduces.load(), handles[0]->all_reduces.load());
    RecordProperty("all_reduces_tp" + std::to_string(size), std::to_string(handles[0]->all_reduces.load()));
    RecordProperty("cache_bytes_tp" + std::to_string(size), std::to_string(cache_bytes(*ranks[0])));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, TensorParallelGolden, ::testing::ValuesIn(golden_cases()),
                         [](const auto& param_info) { return param_info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TensorParallelGolden);

TEST(TensorParallelGolden, CasesExist) {
  EXPECT_GE(golden_cases().size(), 9u) << "no golden cases under " << kGoldens;
}

// Rank 1 of 2 and the whole model of golden `name`, measured by `bytes(model)`.
template <typename Bytes>
std::pair<uint64_t, uint64_t> rank_and_whole(const char* name, Bytes bytes) {
  const std::filesystem::path dir = kGoldens / name / "model";
  EXPECT_TRUE(std::filesystem::exists(dir)) << dir;
  InProcessGroup group(2);
  LoadOptions options;
  options.tensor_parallel = {1, 2, &group.communicator(1)};
  return {bytes(*load_model(dir, Device::cpu(), options)), bytes(*load_model(dir, Device::cpu()))};
}

TEST(TensorParallelGolden, AttentionAndLinearAttentionCachesSplit) {
  // qwen3_tied: 2 KV heads split over 2 ranks; qwen3_5: 4 GDN value heads over 2 key heads split too.
  for (const char* name : {"qwen3_tied", "qwen3_5"}) {
    SCOPED_TRACE(name);
    const auto [rank, whole] = rank_and_whole(name, cache_bytes);
    EXPECT_EQ(rank * 2, whole);
  }
}

TEST(TensorParallelGolden, KdaStateSplits) {
  // glm5_next: 2 KDA heads over 2 ranks, one head's conv channels and state each (the DSA latent and
  // index caches, per token, stay whole: every rank caches every token's latent). Both layouts:
  // separate q/k/v convs (hub).
  for (const char* name : {"glm5_next", "glm5_next_softplus_hub"}) {
    SCOPED_TRACE(name);
    const auto [rank, whole] = rank_and_whole(
        name, [](const Model& model) { return slot_bytes_per_slot(model.cache_specs(), DType::kF32); });
    ASSERT_GT(whole, 0u);
    EXPECT_EQ(rank * 2, whole);
  }
}

}  // namespace
}  // namespace metrale
