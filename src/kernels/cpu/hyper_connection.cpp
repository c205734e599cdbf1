// CPU hyper-connection pieces (kernels/hyper_connection.h): fp32 arithmetic with the reference's
// rounding points in the activation dtype (no-ops for f32, the CPU path).
#include "kernels/hyper_connection.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/linear.h"

namespace metrale::kernels::cpu {
namespace {

const char* element(const Tensor& x, int64_t row, int64_t col) {
  return static_cast<const char*>(row_ptr(x, row)) + col * static_cast<int64_t>(x.element_size());
}
char* element_mut(const Tensor& x, int64_t row, int64_t col) {
  return static_cast<char*>(row_ptr_mut(x, row)) + col * static_cast<int64_t>(x.element_size());
}

void check_rows(const Tensor& t, int64_t rows, int64_t width, const char* what) {
  METRALE_CHECK(t.ndim() == 2 && t.size(0) == rows && t.size(1) == width && (width <= 1 || t.stride(1) == 1),
                "{}: {} must be [{}, {}] with a contiguous last dim", what, t.describe(), rows, width);
}

}  // namespace

void hc_norm(const Tensor& residual, const Tensor& update_a, const Tensor& update_b, const Tensor& weight,
             const Tensor& normed, const HcParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_CHECK(streams >= 1 && residual.ndim() == 2 && residual.size(1) % streams == 0, "hc_norm: residual {}",
                residual.describe());
  const int64_t tokens = residual.size(0), width = residual.size(1), hidden = width / streams;
  check_rows(residual, tokens, width, "hc_norm residual");
  switch (params.update) {
    case HcUpdate::kNone:
      break;
    case HcUpdate::kAdd:
      check_rows(update_a, tokens, width, "hc_norm add");
      break;
    case HcUpdate::kInject:
      check_rows(update_a, tokens, hidden, "hc_norm block output");
      check_rows(update_b, tokens, streams, "hc_norm injection weights");
      break;
    case HcUpdate::kBroadcast:
      check_rows(update_a, tokens, hidden, "hc_norm embedding");
      break;
  }
  const bool norm = !normed.empty();
  if (norm) check_rows(normed, tokens, width, "hc_norm normed");
  METRALE_CHECK(!norm || weight.numel() == width, "hc_norm: weight {} for width {}", weight.describe(), width);
  std::vector<float> w(static_cast<size_t>(norm ? width : 0));
  if (norm) convert_to_f32(weight.dtype(), weight.data(), w.data(), w.size());
  const DType act = residual.dtype();
  cpu_pool().parallel_for(tokens * streams, 8, [&](int64_t begin, int64_t end) {
    float* r = scratch_a(2 * hidden);
    float* a = r + hidden;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / streams, n = item % streams, c0 = n * hidden;
      convert_to_f32(act, element(residual, t, c0), r, static_cast<size_t>(hidden));
      switch (params.update) {
        case HcUpdate::kNone:
          break;
        case HcUpdate::kAdd:
          convert_to_f32(update_a.dtype(), element(update_a, t, c0), a, static_cast<size_t>(hidden));
          for (int64_t c = 0; c < hidden; ++c) r[c] = round_as(act, r[c] + a[c]);
          break;
        case HcUpdate::kInject: {
          convert_to_f32(update_a.dtype(), element(update_a, t, 0), a, static_cast<size_t>(hidden));
          const float beta = load_as_f32(update_b.dtype(), element(update_b, t, n), 0);
          for (int64_t c = 0; c < hidden; ++c) r[c] = round_as(act, r[c] + round_as(act, beta * a[c]));
          break;
        }
        case HcUpdate::kBroadcast:
          convert_to_f32(update_a.dtype(), element(update_a, t, 0), r, static_cast<size_t>(hidden));
          break;
      }
      if (params.update != HcUpdate::kNone) store_f32(act, r, element_mut(residual, t, c0), hidden);
      if (!norm) continue;
      double sum = 0.0;
      for (int64_t c = 0; c < hidden; ++c) sum += static_cast<double>(r[c]) * r[c];
      const float inv = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(hidden)) + params.eps);
      for (int64_t c = 0; c < hidden; ++c) a[c] = r[c] * inv * (1.0f + w[static_cast<size_t>(c0 + c)]);
      store_f32(normed.dtype(), a, element_mut(normed, t, c0), hidden);
    }
  });
}

void hc_gates(const Tensor& down, const Tensor& inject, const Tensor& act_out, const Tensor& beta,
              const HcParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_CHECK(streams >= 1 && down.ndim() == 2, "hc_gates: down {}", down.describe());
  const int64_t tokens = down.size(0), rank = down.size(1);
  check_rows(down, tokens, rank, "hc_gates down");
  check_rows(act_out, tokens, rank, "hc_gates act");
  const bool with_beta = !beta.empty();
  METRALE_CHECK(with_beta == !inject.empty(), "hc_gates: inject and beta go together");
  if (with_beta) {
    check_rows(inject, tokens, streams, "hc_gates inject");
    check_rows(beta, tokens, streams, "hc_gates beta");
  }
  const DType act = act_out.dtype();
  const auto n = static_cast<float>(streams);
  cpu_pool().parallel_for(tokens, 4, [&](int64_t begin, int64_t end) {
    float* row = scratch_a(rank + streams);
    for (int64_t t = begin; t < end; ++t) {
      convert_to_f32(down.dtype(), element(down, t, 0), row, static_cast<size_t>(rank));
      for (int64_t i = 0; i < rank; ++i) {
        const float scaled = round_as(act, row[i] / n);
        row[i] = scaled * sigmoid_f32(scaled);
      }
      store_f32(act, row, element_mut(act_out, t, 0), rank);
      if (!with_beta) continue;
      float* b = row + rank;
      convert_to_f32(inject.dtype(), element(inject, t, 0), b, static_cast<size_t>(streams));
      for (int64_t i = 0; i < streams; ++i) b[i] = 2.0f * round_as(act, sigmoid_f32(round_as(act, b[i] / n)));
      store_f32(beta.dtype(), b, element_mut(beta, t, 0), streams);
    }
  });
}

void hc_mix(const Tensor& up, const Tensor& normed, const Tensor& x, const HcParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_CHECK(streams >= 1 && x.ndim() == 2, "hc_mix: x {}", x.describe());
  const int64_t tokens = x.size(0), hidden = x.size(1), width = streams * hidden;
  check_rows(up, tokens, width, "hc_mix up");
  check_rows(normed, tokens, width, "hc_mix normed");
  check_rows(x, tokens, hidden, "hc_mix x");
  const DType act = x.dtype();
  cpu_pool().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    float* buffer = scratch_a(3 * hidden);
    float* m = buffer;
    float* r = buffer + hidden;
    float* sum = buffer + 2 * hidden;
    for (int64_t t = begin; t < end; ++t) {
      std::fill_n(sum, hidden, 0.0f);
      for (int64_t n = 0; n < streams; ++n) {
        convert_to_f32(up.dtype(), element(up, t, n * hidden), m, static_cast<size_t>(hidden));
        convert_to_f32(normed.dtype(), element(normed, t, n * hidden), r, static_cast<size_t>(hidden));
        for (int64_t c = 0; c < hidden; ++c) sum[c] += round_as(act, round_as(act, sigmoid_f32(m[c])) * r[c]);
      }
      for (int64_t c = 0; c < hidden; ++c) sum[c] /= static_cast<float>(streams);
      store_f32(act, sum, element_mut(x, t, 0), hidden);
    }
  });
}

void hc_gates_up_mix(const Tensor& down, const Tensor& inject, const Tensor& w_up, const Tensor& normed,
                     const Tensor& act, const Tensor& beta, const Tensor& up, const Tensor& x, const HcParams& params) {
  cpu::hc_gates(down, inject, act, beta, params);
  cpu::linear(act, w_up, up, false);
  cpu::hc_mix(up, normed, x, params);
}

}  // namespace metrale::kernels::cpu
