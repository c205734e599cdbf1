// Test support shared by every floor's tests (header-only, so any tests/<floor> executable can use
// it): a temporary directory that removes itself, raw file writing, and an assertion that a callable
// throws metrale::Error with a given code and message fragments.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace metrale::testing {

// A fresh directory under the system temp dir, unique per call (ctest runs tests in parallel
// processes), removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "metrale_test_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

// Succeeds when `body` throws metrale::Error with `code` and a message containing every fragment.
// Any other outcome (no throw, another exception type, another code) fails with the message.
inline ::testing::AssertionResult throws_error(const std::function<void()>& body, ErrorCode code,
                                               const std::vector<std::string>& fragments = {}) {
  try {
    body();
  } catch (const Error& e) {
    const std::string message = e.what();
    if (e.code() != code) {
      return ::testing::AssertionFailure()
             << "error code " << error_code_name(e.code()) << ", expected " << error_code_name(code) << ": " << message;
    }
    for (const auto& fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks '" << fragment << "': " << message;
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-metrale exception: " << e.what();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw something that is not a std::exception";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace metrale::testing
