// Fixture files a test reads from the repository (models/demo, tests/goldens): tracked in git, so a
// missing one is a broken checkout, and the test fails naming it instead of passing having checked
// nothing. Tests of optional, separately fetched files (git-ignored) GTEST_SKIP with the reason
// instead.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>

namespace metrale::testing {

// Success when every path exists; use as ASSERT_TRUE(fixtures_present({...})) at the top of a test.
inline ::testing::AssertionResult fixtures_present(std::initializer_list<std::filesystem::path> paths) {
  for (const auto& path : paths) {
    if (!std::filesystem::exists(path)) {
      return ::testing::AssertionFailure() << "fixture missing: " << path.string()
                                           << " (tracked in the repository: the checkout is incomplete)";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace metrale::testing
