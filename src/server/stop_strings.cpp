#include "server/stop_strings.h"

#include <algorithm>

namespace metrale::server {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) {
  for (std::string& stop : stops) {
    if (!stop.empty()) stops_.push_back(std::move(stop));
  }
}

namespace {

// Where the earliest complete stop string starts in `text` (npos: none).
size_t earliest_match(const std::vector<std::string>& stops, std::string_view text) {
  size_t match = std::string::npos;
  for (const std::string& stop : stops) match = std::min(match, text.find(stop));
  return match;
}

// Where the longest suffix of `text` that is a proper prefix of a stop string starts (npos: none):
// a stop string may begin there and end in text still to come.
size_t earliest_partial(const std::vector<std::string>& stops, std::string_view text) {
  size_t hold = 0;
  for (const std::string& stop : stops) {
    const size_t longest = std::min(stop.size() - 1, text.size());
    for (size_t length = longest; length > hold; --length) {
      if (text.substr(text.size() - length) == std::string_view(stop).substr(0, length)) {
        hold = length;
        break;
      }
    }
  }
  return hold == 0 ? std::string::npos : text.size() - hold;
}

}  // namespace

StopStringMatcher::Result StopStringMatcher::feed(std::string_view text) {
  Result result;
  if (matched_) return result;
  if (stops_.empty()) {
    result.text = text;
    return result;
  }
  std::string buffer = std::move(held_);
  held_.clear();
  buffer.append(text);
  const size_t match = earliest_match(stops_, buffer);
  const size_t partial = earliest_partial(stops_, buffer);
  // A complete match decides only when no stop string that starts earlier can still complete.
  if (match != std::string::npos && (partial == std::string::npos || match <= partial)) {
    matched_ = true;
    buffer.resize(match);
    result.text = std::move(buffer);
    result.matched = true;
    return result;
  }
  // Hold back from the earliest possible start. Both texts are valid UTF-8 and the held part
  // starts where a stop string starts, so the cut falls on a character boundary.
  const size_t cut = std::min(match, partial);
  if (cut != std::string::npos) {
    held_ = buffer.substr(cut);
    buffer.resize(cut);
  }
  result.text = std::move(buffer);
  return result;
}

StopStringMatcher::Result StopStringMatcher::flush() {
  Result result;
  if (matched_) return result;
  // Nothing more comes: a complete match in the held text decides; partial ones are just text.
  std::string rest = std::move(held_);
  held_.clear();
  const size_t match = earliest_match(stops_, rest);
  if (match != std::string::npos) {
    matched_ = true;
    rest.resize(match);
    result.matched = true;
  }
  result.text = std::move(rest);
  return result;
}

}  // namespace metrale::server
