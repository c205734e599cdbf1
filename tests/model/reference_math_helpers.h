// The double-precision pieces that the reference forwards of model_helpers.cpp (qwen3, qwen3_moe),
// hybrid_helpers.cpp (qwen3_next, qwen3_5, qwen3_5_moe) and qwen4_reference_helpers.cpp share, written from shared/arch/qwen.md:
// weights are the bf16-exact floats of TinyWeights, activations are doubles, one sequence at
// positions 0..T-1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/model_helpers.h"

namespace metrale::testing::reference {

using Matrix = std::vector<std::vector<double>>;  // [rows][cols]

const std::vector<float>& param(const TinyWeights& weights, const std::string& key);

// y = x W^T with W [out, in] row-major.
std::vector<double> matvec(const std::vector<float>& w, const std::vector<double>& x, int64_t out);

double sigmoid(double v);
double silu(double v);

// RMSNorm over `width` values at `begin`, scaled by weight_offset + w: qwen3's norms scale by w
// (offset 0), the hybrids' zero-centred norms by 1 + w (offset 1, qwen.md §3.1).
void rms_norm_in_place(std::vector<double>& x, size_t begin, size_t width, const std::vector<float>& w, double eps,
                       double weight_offset);

// Rotate-half RoPE on the first `rotary` channels of the head at `begin` (channel j pairs with
// j + rotary/2, inv_freq_j = theta^(-2j/rotary)); the other channels pass through. qwen3 rotates the
// whole head, the hybrids a fraction of it (qwen.md §3.2).
void rope_in_place(std::vector<double>& x, size_t begin, size_t rotary, int64_t position, double theta);

// Causal GQA softmax attention of row `t`: q [T][heads * d] against k, v [T][kv_heads * d] of rows
// up to t (the last `window` of them when window > 0), scaled by 1/sqrt(d). Returns [heads * d].
std::vector<double> causal_attention(const Matrix& q, const Matrix& k, const Matrix& v, size_t t, size_t heads,
                                     size_t kv_heads, size_t d, int window);

std::vector<double> swiglu(const std::vector<float>& gate, const std::vector<float>& up, const std::vector<float>& down,
                           const std::vector<double>& x, int64_t inter);
// The dense SwiGLU MLP of the layer with key prefix `p`.
std::vector<double> dense_mlp(const TinySpec& spec, const TinyWeights& weights, const std::string& p,
                              const std::vector<double>& x);
// Softmax router over spec.num_experts, top-k (divided by the selected probabilities' sum when
// `renormalise`), weighted sum of the SwiGLU experts.
std::vector<double> routed_experts(const TinySpec& spec, const TinyWeights& weights, const std::string& p,
                                   const std::vector<double>& x, bool renormalise);

// The output gate of the Gated DeltaNet's RMSNorm: silu(z) (Qwen3-Next, Qwen3.5) or sigmoid(z)
// (qwen4_exp's output_gate_type "sigmoid").
enum class GdnOutputGate { kSilu, kSigmoid };
// Gated DeltaNet (qwen.md §6: split projections in_proj_qkv/z/b/a, causal conv, L2-normalised q/k,
// delta rule, gated RMSNorm) of the layer with key prefix `p` over one sequence from zero state,
// token by token. Returns [T][hidden].
Matrix gated_delta_net(const TinySpec& spec, const TinyWeights& weights, const std::string& p, const Matrix& xs,
                       GdnOutputGate gate);

// The embedding rows of `tokens`, [T][hidden].
Matrix embed(const TinySpec& spec, const TinyWeights& weights, const std::vector<int32_t>& tokens);
// The final norm (with `norm_weight_offset` as in rms_norm_in_place) and the LM head (tied or not).
Matrix output_logits(const TinySpec& spec, const TinyWeights& weights, const Matrix& hidden, double norm_weight_offset);

}  // namespace metrale::testing::reference
