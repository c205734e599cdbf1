// Fault injection, for the tests of failure containment: METRALE_FAULT_INJECT=<site>:<n>[,<site>:<n>...]
// makes the n-th occurrence of each listed site throw an Error (kInternal, "fault injected at ...").
// The engine reads the variable once, when it is built (EngineConfig::fault_injection overrides it).
//
// Sites, counted per engine:
// - forward: a step's trunk forward without drafts, once queued;
// - verify:  a verify step's forward, once queued (its commit is pending);
// - sample:  a step's sampling and acceptance, before any token is taken;
// - commit:  a verify's commit, once queued (beside the MTP chain when one follows);
// - mtp:     a run of the MTP head (the fixed-layout chain once queued, or the eager catch-up);
// - recover: the engine's recovery from a failed step (the engine then can no longer serve).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace metrale {

enum class FaultSite { kForward, kVerify, kSample, kCommit, kMtp, kRecover };
inline constexpr size_t kNumFaultSites = 6;

std::string_view fault_site_name(FaultSite site);  // "forward", "verify", ...

class FaultInjector {
 public:
  FaultInjector() = default;  // disarmed
  // "<site>:<n>[,<site>:<n>...]" (n >= 1); "" disarms. Throws kInvalidArgument naming the bad entry.
  static FaultInjector parse(std::string_view spec);
  // METRALE_FAULT_INJECT (unset: disarmed).
  static FaultInjector from_environment();

  bool armed() const { return !faults_.empty(); }
  std::string describe() const;  // "verify:2,commit:1"
  // Counts one occurrence of `site`; throws when it is an armed one.
  void hit(FaultSite site);

 private:
  std::vector<std::pair<FaultSite, int64_t>> faults_;
  std::array<int64_t, kNumFaultSites> seen_{};
};

}  // namespace metrale
