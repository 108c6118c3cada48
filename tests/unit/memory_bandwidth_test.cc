// The read kernels of moebench's memory floor (launch/moebench/memory_bandwidth.h) against a plain
// scalar sum over the same words, and the floor-fault rule (launch/moebench/floor.h). Correctness
// only: no timing is asserted.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "base/thread_pool.h"
#include "experts/cpu/isa.h"
#include "launch/moebench/floor.h"
#include "launch/moebench/memory_bandwidth.h"

namespace moerun::bench {
namespace {

// Distinct, full-width words (a splitmix64 stream), so a word skipped, repeated or misplaced
// changes the sum.
std::vector<uint64_t> BandwidthTestWords(size_t n, uint64_t seed) {
  std::vector<uint64_t> w(n);
  uint64_t s = seed;
  for (uint64_t& v : w) {
    s += 0x9e3779b97f4a7c15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    v = z ^ (z >> 31);
  }
  return w;
}

// The reference: one add per word, in order (wrapping).
uint64_t PlainSum(const uint64_t* w, size_t n) {
  uint64_t s = 0;
  for (size_t i = 0; i < n; ++i) s += w[i];
  return s;
}

// Every variant this CPU runs, on lengths around the kernels' blocks (4 streams x 8-word lines =
// 32 words) and at unaligned starts, equals the plain sum.
TEST(MemoryBandwidthTest, EveryKernelSumsEveryWordOnce) {
  const std::vector<uint64_t> words = BandwidthTestWords(70000, 7);
  for (Isa isa : SupportedIsas()) {
    SCOPED_TRACE(IsaName(isa));
    for (size_t start : {size_t{0}, size_t{1}, size_t{3}}) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{257},
                       size_t{4096}, size_t{65531}}) {
        EXPECT_EQ(ReadSum(isa, words.data() + start, n), PlainSum(words.data() + start, n))
            << "start " << start << " n " << n;
      }
    }
  }
}

// Negative control: the same check sees one changed word (in a stream's middle and in the tail).
TEST(MemoryBandwidthTest, OneChangedWordChangesTheSum) {
  std::vector<uint64_t> words = BandwidthTestWords(4099, 11);
  for (Isa isa : SupportedIsas()) {
    const uint64_t before = ReadSum(isa, words.data(), words.size());
    for (size_t at : {size_t{2050}, size_t{4098}}) {
      words[at] += 1;
      EXPECT_EQ(ReadSum(isa, words.data(), words.size()), before + 1) << IsaName(isa) << " " << at;
      words[at] -= 1;
    }
  }
}

// A pass over several tasks (2 MiB each, the last one short) on a pool reads every byte once.
TEST(MemoryBandwidthTest, ReadAllCoversTheBufferOnce) {
  const size_t n = (size_t{5} << 20) / sizeof(uint64_t) + 13;  // 2.5 tasks and a bit
  const std::vector<uint64_t> words = BandwidthTestWords(n, 3);
  const uint64_t want = PlainSum(words.data(), n);
  ThreadPool pool(3);
  for (Isa isa : SupportedIsas()) {
    const ReadPass pass = ReadAll(&pool, isa, words.data(), n);
    EXPECT_EQ(pass.sum, want) << IsaName(isa);
    EXPECT_EQ(pass.bytes, n * sizeof(uint64_t)) << IsaName(isa);
  }
}

// A small measurement reports every variant the CPU runs, on the pool's threads, with the best
// one's rate; the rates' values are not checked (timing).
TEST(MemoryBandwidthTest, MeasureReportsEveryVariant) {
  ThreadPool pool(2);
  const ReadBandwidth bw = MeasureReadBandwidth(&pool, size_t{4} << 20, 2);
  const std::vector<Isa> isas = SupportedIsas();
  ASSERT_EQ(bw.variants.size(), isas.size());
  double best = 0;
  for (size_t i = 0; i < isas.size(); ++i) {
    EXPECT_EQ(bw.variants[i].isa, isas[i]);
    EXPECT_GT(bw.variants[i].bytes_per_s, 0.0);
    best = std::max(best, bw.variants[i].bytes_per_s);
  }
  EXPECT_EQ(bw.bytes_per_s, best);
  EXPECT_EQ(bw.threads, 2);
  EXPECT_EQ(bw.buffer_bytes, size_t{4} << 20);
  EXPECT_TRUE(bw.sums_agree);
  EXPECT_GE(DefaultReadBufferBytes(), size_t{512} << 20);
}

TEST(FloorFaultTest, BelowPointNineFiveIsAFault) {
  EXPECT_TRUE(IsFloorFault(0.0));
  EXPECT_TRUE(IsFloorFault(0.69));
  EXPECT_TRUE(IsFloorFault(0.9499));
  EXPECT_TRUE(IsFloorFault(std::nan("")));
  EXPECT_FALSE(IsFloorFault(0.95));
  EXPECT_FALSE(IsFloorFault(0.99));
  EXPECT_FALSE(IsFloorFault(1.7));
  EXPECT_FALSE(IsFloorFault(std::numeric_limits<double>::infinity()));
}

TEST(FloorFaultTest, ReasonNamesTheRatioAndTheRates) {
  EXPECT_EQ(FloorFaultReason(0.62, true, 17.1, 10.59),
            "x_floor 0.62 < 0.95: the layer read its weights at 17.1 GB/s, faster than the "
            "floor's measured memory read bandwidth 10.6 GB/s: the floor under-reads this machine");
  EXPECT_EQ(FloorFaultReason(0.8, false, 125.0, 100.0),
            "x_floor 0.80 < 0.95: the layer ran at 125.0 GFLOP/s, faster than the floor's "
            "measured compute rate 100.0 GFLOP/s: the floor under-rates this machine");
}

}  // namespace
}  // namespace moerun::bench
