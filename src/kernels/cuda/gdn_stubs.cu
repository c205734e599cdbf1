// Placeholders for the Gated DeltaNet CUDA kernels until their implementations land: each raises
// kUnsupported so that a CUDA build links and a GDN model on the GPU fails with a clear message.
#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"
#include "kernels/gated_rms_norm.h"

namespace metrale::kernels {
namespace cuda {

namespace {
[[noreturn]] void not_yet(const char* op) {
  raise_message(ErrorCode::kUnsupported, std::string("CUDA kernel ") + op + " is not implemented yet");
}
}  // namespace

void causal_conv1d(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                   const Tensor&, const CausalConv1dParams&) {
  not_yet("causal_conv1d");
}
void gdn_gates(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  not_yet("gdn_gates");
}
void gated_delta_rule_chunked(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&, const Tensor&, const Tensor&, const GatedDeltaRuleParams&) {
  not_yet("gated_delta_rule_chunked");
}
void gated_delta_rule_recurrent(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const GatedDeltaRuleParams&) {
  not_yet("gated_delta_rule_recurrent");
}
void gated_rms_norm(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float) { not_yet("gated_rms_norm"); }

}  // namespace cuda

size_t gated_delta_rule_workspace_bytes(Device device, int64_t, int64_t, int64_t, int64_t, int64_t) {
  (void)device;
  return 0;
}

}  // namespace metrale::kernels
