// CPU causal depthwise conv1d over a ragged batch with per-sequence conv-state slots (fp32 arithmetic).
#include "kernels/causal_conv1d.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

// Channels per parallel task: long enough rows for the inner loops to vectorise, small enough that a
// single-sequence prefill still spreads over the pool.
constexpr int64_t kChannelBlock = 256;

float silu(float v) {
  return v / (1.0f + std::exp(-v));
}

// values <- dtype(values) (a no-op for f32).
void round_in_place(DType dtype, float* values, int64_t count) {
  if (dtype == DType::kF32) return;
  for (int64_t i = 0; i < count; ++i) {
    uint16_t bits = 0;
    convert_from_f32(dtype, &values[i], &bits, 1);
    convert_to_f32(dtype, &bits, &values[i], 1);
  }
}

}  // namespace

void causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& conv_state, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                   const CausalConv1dParams& params) {
  METRALE_CHECK(x.ndim() == 2 && out.ndim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
                "causal_conv1d: x {} out {} must be [T, C] with contiguous channels", x.describe(), out.describe());
  const int64_t tokens = x.size(0), channels = x.size(1);
  METRALE_CHECK(out.size(0) == tokens && out.size(1) == channels, "causal_conv1d: out {} for x {}", out.describe(),
                x.describe());
  METRALE_CHECK(weight.is_contiguous() && weight.size(0) == channels && weight.numel() % channels == 0,
                "causal_conv1d: weight {} for {} channels", weight.describe(), channels);
  const int64_t kernel = weight.numel() / channels;
  const int64_t dilation = params.dilation;
  METRALE_CHECK(kernel >= 1 && dilation >= 1, "causal_conv1d: kernel {} dilation {}", kernel, dilation);
  const int64_t history = (kernel - 1) * dilation;
  const bool with_residual = !params.residual.empty();
  if (with_residual) {
    const Tensor& r = params.residual;
    METRALE_CHECK(r.ndim() == 2 && r.size(0) == tokens && r.size(1) == channels && r.stride(1) == 1,
                  "causal_conv1d: residual {} for x {}", r.describe(), x.describe());
  }
  METRALE_CHECK(conv_state.ndim() == 3 && conv_state.is_contiguous() && conv_state.size(1) == history &&
                    conv_state.size(2) == channels,
                "causal_conv1d: conv_state {} must be [slots, {}, {}]", conv_state.describe(), history, channels);
  const int64_t num_seqs = kv_lens.numel();
  METRALE_CHECK(cu_q.numel() == num_seqs + 1 && state_slots.numel() == num_seqs, "causal_conv1d: cu_q {} slots {}",
                cu_q.describe(), state_slots.describe());
  const auto* cu = cu_q.data_as<const int32_t>();
  const auto* lens = kv_lens.data_as<const int32_t>();
  const auto* slots = state_slots.data_as<const int32_t>();
  METRALE_CHECK(cu[num_seqs] == tokens, "causal_conv1d: cu_q ends at {} for {} rows", cu[num_seqs], tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s];
    METRALE_CHECK(q_len >= 0 && lens[s] >= q_len, "causal_conv1d: sequence {} has q_len {} and kv_len {}", s, q_len,
                  lens[s]);
    METRALE_CHECK(slots[s] >= -1 && slots[s] < conv_state.size(0), "causal_conv1d: state slot {} of {}", slots[s],
                  conv_state.size(0));
    if (params.max_q_len > 0) {
      METRALE_CHECK(q_len <= params.max_q_len, "causal_conv1d: q_len {} above max_q_len {}", q_len, params.max_q_len);
    }
  }

  // weight as [K][C] f32, so that tap j of a channel block is one contiguous run.
  std::vector<float> taps(static_cast<size_t>(kernel * channels));
  {
    std::vector<float> flat(static_cast<size_t>(kernel * channels));
    convert_to_f32(weight.dtype(), weight.data(), flat.data(), flat.size());
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t j = 0; j < kernel; ++j)
        taps[static_cast<size_t>(j * channels + c)] = flat[static_cast<size_t>(c * kernel + j)];
  }

  const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  const DType state_dtype = conv_state.dtype(), act_dtype = out.dtype();
  const size_t state_size = conv_state.element_size();
  cpu_pool().parallel_for(num_seqs * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / blocks, c0 = (task % blocks) * kChannelBlock;
      const int64_t width = std::min(kChannelBlock, channels - c0);
      const int64_t first = cu[s], q_len = cu[s + 1] - cu[s];
      if (q_len == 0) continue;
      // No cached tokens (or no slot): zero history whatever the slot holds.
      const bool fresh = lens[s] == q_len || slots[s] < 0;
      char* slot_base = static_cast<char*>(conv_state.data()) + static_cast<int64_t>(std::max(slots[s], 0)) * history *
                                                                    channels * static_cast<int64_t>(state_size);
      // window [L + 1][width]: the L = (K-1)*d previous inputs (oldest first), then the current row.
      float* window = scratch_a((history + 1) * width);
      float* result = scratch_b(2 * width);
      float* extra = result + width;
      for (int64_t j = 0; j < history; ++j) {
        float* row = window + j * width;
        if (fresh) {
          std::fill_n(row, width, 0.0f);
        } else {
          convert_to_f32(state_dtype, slot_base + (j * channels + c0) * static_cast<int64_t>(state_size), row,
                         static_cast<size_t>(width));
        }
      }
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t t = first + i;
        float* current = window + history * width;
        convert_to_f32(x.dtype(), static_cast<const char*>(row_ptr(x, t)) + c0 * static_cast<int64_t>(x.element_size()),
                       current, static_cast<size_t>(width));
        std::fill_n(result, width, 0.0f);
        for (int64_t j = 0; j < kernel; ++j) {
          const float* tap = taps.data() + j * channels + c0;
          const float* in = window + j * dilation * width;
          for (int64_t c = 0; c < width; ++c) result[c] += tap[c] * in[c];
        }
        // Rounded to the activation dtype after the convolution (unless round_conv is false), then again
        // (by the store) after the activation.
        if (params.silu) {
          if (params.round_conv) round_in_place(act_dtype, result, width);
          for (int64_t c = 0; c < width; ++c) result[c] = silu(result[c]);
        }
        if (with_residual) {
          round_in_place(act_dtype, result, width);
          const Tensor& r = params.residual;
          convert_to_f32(r.dtype(), static_cast<const char*>(row_ptr(r, t)) + c0 * static_cast<int64_t>(r.element_size()),
                         extra, static_cast<size_t>(width));
          for (int64_t c = 0; c < width; ++c) result[c] += extra[c];
        }
        store_f32(act_dtype, result,
                  static_cast<char*>(row_ptr_mut(out, t)) + c0 * static_cast<int64_t>(out.element_size()), width);
        // Shift the window by one row.
        std::copy(window + width, window + (history + 1) * width, window);
      }
      // The window's first L rows are now the last L inputs of the sequence (zero-padded on the left when
      // fewer were seen).
      for (int64_t j = 0; j < history && params.write_state && slots[s] >= 0; ++j) {
        store_f32(state_dtype, window + j * width, slot_base + (j * channels + c0) * static_cast<int64_t>(state_size),
                  width);
      }
    }
  });
}

}  // namespace metrale::kernels::cpu
