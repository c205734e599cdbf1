// Shape, Tensor views (reshape, slice, select, strides, contiguity), Buffer, OwnedTensor,
// copy_tensor and check_tensor. Views are checked by reading elements through element_ptr and
// comparing with the value stored at the position computed independently from the row-major index.
#include "runtime/tensor.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "core/test_support.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using testing::throws_error;

// A [2, 3, 4] f32 tensor whose element at (i, j, k) holds the value 100 i + 10 j + k + 0.5, so every
// element identifies its own position.
struct Labelled {
  std::vector<float> storage;
  Tensor tensor;
  Labelled() : storage(24) {
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        for (int k = 0; k < 4; ++k) storage[static_cast<size_t>(i * 12 + j * 4 + k)] = label(i, j, k);
    tensor = Tensor(storage.data(), DType::kF32, {2, 3, 4});
  }
  static float label(int64_t i, int64_t j, int64_t k) { return static_cast<float>(100 * i + 10 * j + k) + 0.5f; }
};

float at(const Tensor& t, std::initializer_list<int64_t> index) {
  const std::vector<int64_t> idx(index);
  return *static_cast<const float*>(t.element_ptr(idx));
}

TEST(Shape, BasicsAndLimits) {
  const Shape shape{2, 3, 4};
  EXPECT_EQ(shape.ndim(), 3);
  EXPECT_EQ(shape.numel(), 24);
  EXPECT_EQ(shape[1], 3);
  EXPECT_EQ(shape.to_string(), "[2, 3, 4]");
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_EQ(Shape{}.to_string(), "[]");
  EXPECT_EQ((Shape{5, 0}).numel(), 0);
  EXPECT_TRUE((Shape{2, 3}) == (Shape{2, 3}));
  EXPECT_FALSE((Shape{2, 3}) == (Shape{3, 2}));
  EXPECT_FALSE((Shape{2, 3}) == (Shape{2, 3, 1}));
  const std::vector<int64_t> dims = {1, 2, 3};
  EXPECT_TRUE(Shape(std::span<const int64_t>(dims)) == (Shape{1, 2, 3}));
  EXPECT_TRUE(throws_error([] { Shape too_many{1, 2, 3, 4, 5, 6, 7}; }, ErrorCode::kUnsupported));
  EXPECT_NO_THROW((Shape{1, 2, 3, 4, 5, 6}));
}

TEST(Shape, ContiguousStrides) {
  EXPECT_TRUE(contiguous_strides({2, 3, 4}) == (Shape{12, 4, 1}));
  EXPECT_TRUE(contiguous_strides({7}) == (Shape{1}));
  EXPECT_TRUE(contiguous_strides({5, 1, 2}) == (Shape{2, 2, 1}));
}

TEST(Tensor, ContiguousViewBasics) {
  Labelled l;
  const Tensor& t = l.tensor;
  EXPECT_EQ(t.ndim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.element_size(), 4u);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(-2), 4);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_EQ(t.describe(), "f32[2, 3, 4] on cpu");
  EXPECT_EQ(at(t, {1, 2, 3}), Labelled::label(1, 2, 3));
  EXPECT_FALSE(Tensor().defined() && !Tensor().empty());
  EXPECT_TRUE(Tensor().empty());
}

TEST(Tensor, ReshapeKeepsMemoryOrder) {
  Labelled l;
  const Tensor flat = l.tensor.reshape({6, 4});
  EXPECT_EQ(flat.data(), l.tensor.data());
  EXPECT_TRUE(flat.strides() == (Shape{4, 1}));
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(at(flat, {r, k}), Labelled::label(r / 3, r % 3, k));
  const Tensor line = l.tensor.reshape({24});
  EXPECT_EQ(at(line, {17}), Labelled::label(1, 1, 1));
  EXPECT_TRUE(throws_error([&] { l.tensor.reshape({5, 5}); }, ErrorCode::kInternal, {"[5, 5]"}));
}

TEST(Tensor, SliceOfTheLastDimIsStridedAndNotContiguous) {
  Labelled l;
  const Tensor view = l.tensor.slice(2, 1, 3);  // [2, 3, 2]
  EXPECT_TRUE(view.shape() == (Shape{2, 3, 2}));
  EXPECT_TRUE(view.strides() == (Shape{12, 4, 1}));
  EXPECT_FALSE(view.is_contiguous());
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 2; ++k) EXPECT_EQ(at(view, {i, j, k}), Labelled::label(i, j, k + 1));
  EXPECT_TRUE(throws_error([&] { view.reshape({12}); }, ErrorCode::kInternal, {"non-contiguous"}));
}

TEST(Tensor, SliceOfTheFirstDimStaysContiguous) {
  Labelled l;
  const Tensor view = l.tensor.slice(0, 1, 2);
  EXPECT_TRUE(view.is_contiguous());
  EXPECT_EQ(view.data(), static_cast<void*>(l.storage.data() + 12));
  const Tensor middle = l.tensor.slice(1, 1, 2);  // [2, 1, 4]: strides 12, 4, 1 -> not contiguous
  EXPECT_FALSE(middle.is_contiguous());
  const Tensor row_piece = l.tensor.slice(0, 1, 2).slice(1, 1, 2);  // [1, 1, 4]: size-1 dims do not matter
  EXPECT_TRUE(row_piece.is_contiguous());
  EXPECT_EQ(at(row_piece, {0, 0, 2}), Labelled::label(1, 1, 2));
  const Tensor negative_dim = l.tensor.slice(-1, 0, 1);
  EXPECT_TRUE(negative_dim.shape() == (Shape{2, 3, 1}));
  EXPECT_TRUE(l.tensor.slice(1, 2, 2).numel() == 0);
}

TEST(Tensor, SelectDropsTheDimension) {
  Labelled l;
  const Tensor middle = l.tensor.select(1, 2);  // [2, 4] with strides [12, 1]
  EXPECT_TRUE(middle.shape() == (Shape{2, 4}));
  EXPECT_TRUE(middle.strides() == (Shape{12, 1}));
  EXPECT_FALSE(middle.is_contiguous());
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(at(middle, {i, k}), Labelled::label(i, 2, k));
  const Tensor last = l.tensor.select(-1, 3);  // [2, 3] with strides [12, 4]
  EXPECT_TRUE(last.strides() == (Shape{12, 4}));
  EXPECT_EQ(at(last, {1, 1}), Labelled::label(1, 1, 3));
  const Tensor row = l.tensor.row(1);
  EXPECT_TRUE(row.is_contiguous());
  EXPECT_EQ(at(row, {2, 0}), Labelled::label(1, 2, 0));
  // Views compose: a slice of a select of a slice.
  const Tensor nested = l.tensor.slice(2, 1, 4).select(0, 1).slice(0, 1, 3);  // [2, 3]
  EXPECT_TRUE(nested.shape() == (Shape{2, 3}));
  for (int64_t j = 0; j < 2; ++j)
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(at(nested, {j, k}), Labelled::label(1, j + 1, k + 1));
  const Tensor scalar = l.tensor.select(0, 1).select(0, 0).select(0, 2);
  EXPECT_EQ(scalar.ndim(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(*scalar.data_as<float>(), Labelled::label(1, 0, 2));
}

TEST(Tensor, OutOfRangeViewsAreInternalErrors) {
  Labelled l;
  EXPECT_TRUE(throws_error([&] { l.tensor.slice(0, 1, 3); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error([&] { l.tensor.slice(1, 2, 1); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error([&] { l.tensor.slice(1, -1, 1); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error([&] { l.tensor.select(2, 4); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error([&] { l.tensor.select(0, -1); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error([&] { l.tensor.size(3); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error([&] { l.tensor.stride(-4); }, ErrorCode::kInternal));
  const std::vector<int64_t> short_index = {0, 0};
  EXPECT_TRUE(throws_error([&] { l.tensor.element_ptr(short_index); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error(
      [&] {
        Tensor(l.storage.data(), DType::kF32, {2, 3}, {3}, Device::cpu());
      },
      ErrorCode::kInternal));
}

TEST(Tensor, ElementSizeFollowsDtype) {
  std::vector<uint16_t> storage(12);
  const Tensor t(storage.data(), DType::kBF16, {3, 4});
  EXPECT_EQ(t.nbytes(), 24u);
  const Tensor s = t.slice(1, 2, 4);
  EXPECT_EQ(s.data(), static_cast<void*>(storage.data() + 2));
  const std::vector<int64_t> index = {2, 1};
  EXPECT_EQ(s.element_ptr(index), static_cast<void*>(storage.data() + 2 * 4 + 2 + 1));
}

TEST(Buffer, AllocatesAlignedRoundedMemory) {
  Buffer buffer(Device::cpu(), 100);
  EXPECT_EQ(buffer.size(), 128u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % Buffer::kAlignment, 0u);
  std::memset(buffer.data(), 0x5a, buffer.size());  // the whole rounded size is usable
  buffer.zero();
  const auto* bytes = static_cast<const unsigned char*>(buffer.data());
  for (size_t i = 0; i < buffer.size(); ++i) ASSERT_EQ(bytes[i], 0);
  Buffer moved(std::move(buffer));
  EXPECT_TRUE(buffer.empty());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(moved.size(), 128u);
  Buffer empty(Device::cpu(), 0);
  EXPECT_TRUE(empty.empty());
}

TEST(Buffer, CudaWithoutBackendIsUnsupported) {
  if (cuda_available()) GTEST_SKIP() << "this process has a CUDA backend";
  EXPECT_TRUE(throws_error([] { Buffer buffer(Device::cuda(0), 64); }, ErrorCode::kUnsupported, {"CUDA"}));
  EXPECT_EQ(default_device(), Device::cpu());
}

TEST(Device, Parse) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cuda(2).to_string(), "cuda:2");
  for (const char* bad : {"tpu", "cuda:", "cuda:-1", "cuda:1,2", "cuda:x", "CPU"}) {
    EXPECT_TRUE(throws_error([&] { parse_device(bad); }, ErrorCode::kInvalidArgument)) << bad;
  }
}

TEST(OwnedTensor, OwnsAContiguousAlignedView) {
  OwnedTensor owned(DType::kF32, {3, 5});
  EXPECT_TRUE(owned->shape() == (Shape{3, 5}));
  EXPECT_TRUE(owned->is_contiguous());
  EXPECT_EQ(owned->data(), owned.buffer.data());
  EXPECT_GE(owned.buffer.size(), owned->nbytes());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(owned->data()) % Buffer::kAlignment, 0u);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < owned->numel(); ++i) owned->data_as<float>()[i] = dist(rng);
  const float first = owned->data_as<float>()[0];
  OwnedTensor moved = std::move(owned);
  EXPECT_EQ(moved->data_as<float>()[0], first);
  EXPECT_EQ(moved->data(), moved.buffer.data());
}

TEST(CopyTensor, CopiesAndChecksArguments) {
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> src(12), dst(12, std::nanf(""));
  for (auto& v : src) v = dist(rng);
  const Tensor s(src.data(), DType::kF32, {3, 4});
  const Tensor d(dst.data(), DType::kF32, {3, 4});
  copy_tensor(d, s);
  EXPECT_EQ(dst, src);

  std::vector<float> other(12);
  EXPECT_TRUE(throws_error(
      [&] {
        copy_tensor(Tensor(other.data(), DType::kF32, {4, 3}), s);
      },
      ErrorCode::kInternal, {"[4, 3]", "[3, 4]"}));
  EXPECT_TRUE(throws_error([&] { copy_tensor(Tensor(other.data(), DType::kI32, {3, 4}), s); }, ErrorCode::kInternal));
  EXPECT_TRUE(
      throws_error([&] { copy_tensor(d.slice(1, 0, 2), s.slice(1, 2, 4)); }, ErrorCode::kInternal, {"non-contiguous"}));
}

TEST(CheckTensor, NamesWhatIsWrong) {
  std::vector<float> storage(6);
  const Tensor t(storage.data(), DType::kF32, {2, 3});
  EXPECT_NO_THROW(check_tensor(t, DType::kF32, {2, 3}, "logits"));
  EXPECT_TRUE(throws_error(
      [&] {
        check_tensor(t, DType::kF32, {3, 2}, "logits");
      },
      ErrorCode::kInternal, {"logits", "f32[3, 2]", "f32[2, 3]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        check_tensor(t, DType::kBF16, {2, 3}, "hidden");
      },
      ErrorCode::kInternal, {"hidden", "bf16"}));
}

}  // namespace
}  // namespace metrale
