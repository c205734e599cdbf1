// core/random.h: the stateless SplitMix64 step against a conventional stateful SplitMix64 written
// here (Vigna's splitmix64.c) and its published first outputs, and the sampler's uniform_for.
#include "core/random.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace metrale {
namespace {

// The reference generator: state += golden gamma, then the mix of the new state.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

 private:
  uint64_t state_;
};

TEST(SplitMix64, PublishedOutputsForStateZero) {
  EXPECT_EQ(rng::splitmix64_at(0, 0), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(rng::splitmix64_at(0, 1), 0x6e789e6aa1b965f4ULL);
}

TEST(SplitMix64, IndexedOutputEqualsTheStatefulStream) {
  std::mt19937_64 seeds(1601);
  for (int trial = 0; trial < 50; ++trial) {
    const uint64_t state = trial == 0 ? ~0ULL : seeds();  // include the wrap-around state
    SplitMix64 reference(state);
    for (uint64_t i = 0; i < 200; ++i) ASSERT_EQ(rng::splitmix64_at(state, i), reference.next()) << state << " " << i;
  }
}

TEST(UniformFor, IsTheTop24BitsOfTheKeyedStream) {
  std::mt19937_64 seeds(1602);
  for (int trial = 0; trial < 50; ++trial) {
    const uint64_t seed = seeds();
    const uint64_t key = SplitMix64(seed).next();
    SplitMix64 stream(key);
    for (uint64_t step = 0; step < 100; ++step) {
      const uint64_t bits = stream.next();
      const float u = rng::uniform_for(seed, step);
      ASSERT_EQ(static_cast<double>(u), std::ldexp(static_cast<double>(bits >> 40), -24)) << seed << " " << step;
      ASSERT_GE(u, 0.0f);
      ASSERT_LE(u, 1.0f - std::ldexp(1.0f, -24));
    }
  }
}

TEST(UniformFor, NeighbouringSeedsAndStepsAreUncorrelatedAndUniform) {
  // Mean and a 10-bin histogram over consecutive seeds (the worst case for a weak key derivation).
  const int n = 100000;
  double sum = 0.0;
  int bins[10] = {};
  for (int i = 0; i < n; ++i) {
    const float u = rng::uniform_for(static_cast<uint64_t>(i), 0);
    sum += u;
    ++bins[static_cast<int>(u * 10.0f)];
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  for (const int count : bins) EXPECT_NEAR(count, n / 10, 600);  // ~6 standard deviations
  EXPECT_NE(rng::uniform_for(1, 0), rng::uniform_for(2, 0));
  EXPECT_NE(rng::uniform_for(1, 0), rng::uniform_for(1, 1));
}

}  // namespace
}  // namespace metrale
