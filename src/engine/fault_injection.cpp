#include "engine/fault_injection.h"

#include <cstdlib>

#include "core/error.h"
#include "core/strings.h"

namespace metrale {
namespace {

constexpr std::array<FaultSite, kNumFaultSites> kSites = {FaultSite::kForward, FaultSite::kVerify, FaultSite::kSample,
                                                          FaultSite::kCommit,  FaultSite::kMtp,    FaultSite::kRecover};

}  // namespace

std::string_view fault_site_name(FaultSite site) {
  switch (site) {
    case FaultSite::kForward: return "forward";
    case FaultSite::kVerify: return "verify";
    case FaultSite::kSample: return "sample";
    case FaultSite::kCommit: return "commit";
    case FaultSite::kMtp: return "mtp";
    case FaultSite::kRecover: return "recover";
  }
  return "";
}

FaultInjector FaultInjector::parse(std::string_view spec) {
  FaultInjector injector;
  for (const std::string& raw : split(spec, ',')) {
    const std::string entry = trim(raw);
    if (entry.empty()) continue;
    const size_t colon = entry.find(':');
    const std::string name = trim(entry.substr(0, colon));
    const FaultSite* site = nullptr;
    for (const FaultSite& candidate : kSites)
      if (fault_site_name(candidate) == name) site = &candidate;
    if (site == nullptr || colon == std::string::npos) {
      raise(ErrorCode::kInvalidArgument,
            "fault injection '{}': expected <site>:<n> with site forward, verify, sample, commit, mtp or recover",
            entry);
    }
    const std::vector<int64_t> count = parse_int_list(entry.substr(colon + 1), "fault injection occurrence");
    if (count.size() != 1 || count[0] < 1)
      raise(ErrorCode::kInvalidArgument, "fault injection '{}': the occurrence must be one integer >= 1", entry);
    injector.faults_.emplace_back(*site, count[0]);
  }
  return injector;
}

FaultInjector FaultInjector::from_environment() {
  const char* spec = std::getenv("METRALE_FAULT_INJECT");
  return spec == nullptr ? FaultInjector() : parse(spec);
}

std::string FaultInjector::describe() const {
  std::string text;
  for (const auto& [site, occurrence] : faults_) {
    if (!text.empty()) text += ',';
    text += fmt::format("{}:{}", fault_site_name(site), occurrence);
  }
  return text;
}

void FaultInjector::hit(FaultSite site) {
  const int64_t occurrence = ++seen_[static_cast<size_t>(site)];
  for (const auto& [armed, at] : faults_) {
    if (armed == site && at == occurrence) {
      raise(ErrorCode::kInternal, "fault injected at {} (occurrence {}, METRALE_FAULT_INJECT)", fault_site_name(site),
            occurrence);
    }
  }
}

}  // namespace metrale
