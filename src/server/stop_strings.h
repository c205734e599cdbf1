// Stop strings over streamed text. Text that could be the start of a stop string is held back until
// the next piece shows whether it is one, so a client never sees a stop string's first characters
// and then has them taken back.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace metrale::server {

class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops);  // empty strings are ignored

  struct Result {
    std::string text;      // safe to emit: everything before a match, or before a possible partial match
    bool matched = false;  // a stop string ended the text (it and everything after it are dropped)
  };
  // Feeds the next piece of text. After a match, further feeds return nothing.
  Result feed(std::string_view text);
  // The end of generation: the text still held back (cut at a stop string it holds; one that
  // starts earlier may have been waiting to complete).
  Result flush();

  bool matched() const { return matched_; }
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;  // the text from the earliest point where a stop string may start
  bool matched_ = false;
};

}  // namespace metrale::server
