// CopyLane on the CPU device: copies run at once, tickets count up from 1 and are done as given.
// (The GPU side, with a stream of its own and device waits, is tests/cuda/copy_segments_test.cpp.)
#include "runtime/copy_lane.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace metrale {
namespace {

TEST(CopyLane, CpuLaneCopiesAtOnceAndEveryTicketIsDone) {
  CopyLane lane(Device::cpu());
  std::vector<char> a(100, 'a'), b(50, 'b'), out(150, 0);
  const CopySegment segments[] = {{out.data(), a.data(), a.size()}, {out.data() + 100, b.data(), b.size()}};
  const CopyLane::Ticket first = lane.copy_after_current(segments);
  EXPECT_EQ(first, 1u);
  EXPECT_TRUE(lane.done(first));
  EXPECT_EQ(std::memcmp(out.data(), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(out.data() + 100, b.data(), b.size()), 0);
  lane.hold_current_until(first);
  lane.wait(first);
  EXPECT_EQ(lane.copy_after_current({}), 2u);
  lane.wait_all();
  EXPECT_TRUE(lane.done(0));  // no ticket: done
  CopyLane moved = std::move(lane);
  EXPECT_EQ(moved.copy_after_current({}), 3u);
}

}  // namespace
}  // namespace metrale
