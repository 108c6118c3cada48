// Frame buffers are reused: once the pool has held buffers as large as the frames, taking and
// giving them back allocates nothing; idle buffers beyond the pool's limit are freed.
#include "runtime/serving/buffer_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

namespace moerun {
namespace {

TEST(BufferPoolTest, BuffersAreReusedOnceLargeEnough) {
  BufferPool pool;
  for (int round = 0; round < 3; ++round) {
    std::vector<PooledBuffer> held;
    for (size_t n : {100u, 5000u, 64u, 4096u}) {
      held.push_back(pool.Take(n));
      ASSERT_EQ(held.back().size(), n);
      std::memset(held.back().data(), round, n);  // writable over its whole size
    }
  }
  const size_t made = pool.allocations();
  EXPECT_LE(made, 8u);
  for (int i = 0; i < 100; ++i) {
    PooledBuffer a = pool.Take(5000), b = pool.Take(4096), c = pool.Take(1);
  }
  EXPECT_EQ(pool.allocations(), made);  // steady state: nothing new
  { PooledBuffer big = pool.Take(1 << 20); }
  EXPECT_EQ(pool.allocations(), made + 1);  // a larger frame grows one buffer, once
  { PooledBuffer big = pool.Take(1 << 20); }
  EXPECT_EQ(pool.allocations(), made + 1);
}

TEST(BufferPoolTest, MovesAndReleases) {
  BufferPool pool;
  PooledBuffer a = pool.Take(10);
  char* p = a.data();
  PooledBuffer b = std::move(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(b.data(), p);
  b.Release();
  b.Release();  // idempotent
  EXPECT_TRUE(b.empty());
  PooledBuffer c = pool.Take(10);
  EXPECT_EQ(c.data(), p);  // the same memory came back
}

TEST(BufferPoolTest, IdleBuffersBeyondTheLimitAreFreed) {
  BufferPool pool(8 << 10);                                         // 8 KiB of idle buffers at most
  { PooledBuffer a = pool.Take(6 << 10), b = pool.Take(6 << 10); }  // only one fits back
  const size_t made = pool.allocations();
  PooledBuffer a = pool.Take(6 << 10);
  PooledBuffer b = pool.Take(6 << 10);
  EXPECT_EQ(pool.allocations(), made + 1);
}

// Frees beyond the pool add up; every trim_after_bytes of them the allocator's free memory is
// given back (counted), and the pool still keeps what fits.
TEST(BufferPoolTest, FreesBeyondThePoolTrimTheAllocator) {
  BufferPool pool(8 << 10, 16 << 10);  // 8 KiB kept, a trim per 16 KiB freed beyond it
  {
    std::vector<PooledBuffer> burst;
    for (int i = 0; i < 9; ++i) burst.push_back(pool.Take(4 << 10));
  }  // 2 kept (8 KiB), 7 freed (28 KiB): one trim, 12 KiB towards the next
  EXPECT_EQ(pool.idle_bytes(), size_t{8} << 10);
  EXPECT_EQ(pool.trims(), 1u);
  {
    std::vector<PooledBuffer> burst;
    for (int i = 0; i < 3; ++i) burst.push_back(pool.Take(4 << 10));
  }  // 2 back in the pool, 1 freed: 16 KiB since the last trim
  EXPECT_EQ(pool.trims(), 2u);
  // Within the pool nothing is freed, nothing trimmed.
  for (int i = 0; i < 100; ++i) PooledBuffer b = pool.Take(4 << 10);
  EXPECT_EQ(pool.trims(), 2u);
  TrimFreeMemory();  // callable alone
}

// The default pool keeps 8 MiB of idle buffers, not more.
TEST(BufferPoolTest, TheDefaultPoolKeepsAtMost8MiB) {
  BufferPool pool;
  {
    std::vector<PooledBuffer> burst;
    for (int i = 0; i < 64; ++i) burst.push_back(pool.Take(1 << 20));
  }
  EXPECT_EQ(pool.idle_bytes(), size_t{8} << 20);
  EXPECT_GE(pool.trims(), 1u);  // 56 MiB freed beyond it
}

TEST(BufferPoolTest, ManyThreadsTakeAndGive) {
  BufferPool pool;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      for (int i = 0; i < 2000; ++i) {
        PooledBuffer b = pool.Take(static_cast<size_t>(64 + (i * 7 + t) % 512));
        b.data()[0] = static_cast<char>(t);
        b.data()[b.size() - 1] = static_cast<char>(i);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(pool.allocations(), 64u);
}

}  // namespace
}  // namespace moerun
