#include "serving/batcher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace moerun {
namespace {

struct Done {
  std::atomic<int> calls{0};
  std::atomic<int> failed{0};
  static void Callback(void* ctx, const Status& s, const BatchInfo&) {
    auto* d = static_cast<Done*>(ctx);
    if (!s.ok()) ++d->failed;
    ++d->calls;
  }
};

// forward: out = x + layer (so each request can check it got its own rows back).
Status AddLayer(int layer, const float* x, int64_t tokens, float* out, int64_t hidden,
                std::vector<int64_t>* sizes) {
  sizes->push_back(tokens);
  for (int64_t i = 0; i < tokens * hidden; ++i) out[i] = x[i] + static_cast<float>(layer);
  return Status::Ok();
}

TEST(BatcherTest, MergesUpToMaxTokensAndReturnsEachRequestItsRows) {
  const int64_t hidden = 4;
  BatcherOptions o;
  o.max_batch_tokens = 8;
  o.max_wait_us = 1000000;  // only size closes a batch here (or stopping)
  Batcher b(o, hidden);
  std::vector<std::vector<float>> xs, outs;
  Done done;
  for (int r = 0; r < 6; ++r) {
    xs.emplace_back(static_cast<size_t>(3 * hidden), static_cast<float>(r));
    outs.emplace_back(static_cast<size_t>(3 * hidden), -1.0f);
  }
  for (int r = 0; r < 6; ++r) {
    ASSERT_TRUE(
        b.Submit(BatchRequest{7, xs[r].data(), outs[r].data(), 3, &Done::Callback, &done}).ok());
  }
  std::vector<int64_t> sizes;
  b.Stop();
  b.Run([&](int layer, const float* x, int64_t t, float* out,
            auto) { return AddLayer(layer, x, t, out, hidden, &sizes); },
        [] { return false; }, [] {});
  EXPECT_EQ(done.calls.load(), 6);
  EXPECT_EQ(sizes, (std::vector<int64_t>{6, 6, 6}));  // 3 + 3 fit in 8; a third would not
  for (int r = 0; r < 6; ++r) {
    for (float v : outs[r]) EXPECT_EQ(v, static_cast<float>(r + 7));
  }
}

TEST(BatcherTest, SendsAPartialBatchAfterMaxWait) {
  BatcherOptions o;
  o.max_batch_tokens = 1000;
  o.max_wait_us = 2000;
  Batcher b(o, 2);
  std::vector<float> x(2, 1.0f), out(2);
  Done done;
  std::atomic<bool> stop{false};
  std::vector<int64_t> sizes;
  std::thread runner([&] {
    b.Run([&](int layer, const float* in, int64_t t, float* y,
              auto) { return AddLayer(layer, in, t, y, 2, &sizes); },
          [&] { return stop.load(); }, [] {});
  });
  ASSERT_TRUE(b.Submit(BatchRequest{0, x.data(), out.data(), 1, &Done::Callback, &done}).ok());
  for (int i = 0; i < 200 && done.calls.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(done.calls.load(), 1);  // served without more requests arriving
  stop = true;
  runner.join();
}

TEST(BatcherTest, LayersAreNotMixedAndOrderIsKept) {
  BatcherOptions o;
  o.max_batch_tokens = 100;
  Batcher b(o, 1);
  std::vector<float> x(1, 0.0f);
  std::vector<std::vector<float>> outs(4, std::vector<float>(1));
  Done done;
  const int layers[4] = {1, 1, 2, 1};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(
        b.Submit(BatchRequest{layers[i], x.data(), outs[i].data(), 1, &Done::Callback, &done})
            .ok());
  }
  std::vector<int> seen;
  b.Stop();
  b.Run(
      [&](int layer, const float* in, int64_t t, float* y, auto) {
        seen.push_back(layer);
        for (int64_t i = 0; i < t; ++i) y[i] = in[i] + static_cast<float>(layer);
        return Status::Ok();
      },
      [] { return false; }, [] {});
  EXPECT_EQ(seen, (std::vector<int>{1, 2, 1}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(outs[i][0], static_cast<float>(layers[i]));
}

TEST(BatcherTest, BoundedQueueRefusesAndStoppedRefuses) {
  BatcherOptions o;
  o.max_queue_tokens = 5;
  o.max_queue_requests = 2;
  Batcher b(o, 1);
  std::vector<float> x(8), out(8);
  Done done;
  EXPECT_TRUE(b.Submit(BatchRequest{0, x.data(), out.data(), 3, &Done::Callback, &done}).ok());
  EXPECT_EQ(b.Submit(BatchRequest{0, x.data(), out.data(), 3, &Done::Callback, &done}).code(),
            StatusCode::kResourceExhausted);
  EXPECT_TRUE(b.Submit(BatchRequest{0, x.data(), out.data(), 2, &Done::Callback, &done}).ok());
  EXPECT_EQ(b.Submit(BatchRequest{0, x.data(), out.data(), 0, &Done::Callback, &done}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(b.stats().refused, 1u);
  b.Stop();
  EXPECT_EQ(b.Submit(BatchRequest{0, x.data(), out.data(), 1, &Done::Callback, &done}).code(),
            StatusCode::kUnavailable);
  // An error from forward reaches every request of the batch.
  b.Run([](int, const float*, int64_t, float*,
           auto) { return Status::Unavailable("rank 2 is gone"); },
        [] { return false; }, [] {});
  EXPECT_EQ(done.failed.load(), 2);
}

TEST(BatcherTest, ManySubmittersOneRunner) {
  BatcherOptions o;
  o.max_batch_tokens = 64;
  o.max_wait_us = 200;
  Batcher b(o, 2);
  constexpr int kThreads = 4, kPer = 200;
  std::vector<std::vector<float>> xs(kThreads * kPer), outs(kThreads * kPer);
  Done done;
  std::atomic<bool> stop{false};
  std::vector<int64_t> sizes;
  std::thread runner([&] {
    b.Run([&](int layer, const float* in, int64_t t, float* y,
              auto) { return AddLayer(layer, in, t, y, 2, &sizes); },
          [&] { return stop.load(); }, [] {});
  });
  std::vector<std::thread> subs;
  for (int t = 0; t < kThreads; ++t) {
    subs.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        const int id = t * kPer + i;
        xs[id].assign(2 * (1 + id % 5), static_cast<float>(id));
        outs[id].assign(xs[id].size(), 0.0f);
        while (!b.Submit(BatchRequest{0, xs[id].data(), outs[id].data(), 1 + id % 5,
                                      &Done::Callback, &done})
                    .ok()) {
          std::this_thread::yield();
        }
      }
    });
  }
  for (auto& s : subs) s.join();
  while (done.calls.load() < kThreads * kPer)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  stop = true;
  runner.join();
  for (int id = 0; id < kThreads * kPer; ++id) {
    for (float v : outs[id]) ASSERT_EQ(v, static_cast<float>(id));
  }
  for (int64_t s : sizes) EXPECT_LE(s, 64);
}

}  // namespace
}  // namespace moerun

namespace moerun {
namespace {

TEST(BatcherTest, ExpiredRequestsAreAnsweredWithoutComputingAndTheLatestDeadlineReachesForward) {
  BatcherOptions o;
  o.max_batch_tokens = 100;
  o.max_wait_us = 0;
  Batcher b(o, 1);
  std::vector<float> x(4, 1.0f), out(4);
  Done done;
  const auto now = std::chrono::steady_clock::now();
  BatchRequest late{0, x.data(), out.data(), 1, &Done::Callback, &done};
  late.deadline = now - std::chrono::milliseconds(1);
  BatchRequest live{0, x.data() + 1, out.data() + 1, 1, &Done::Callback, &done};
  live.deadline = now + std::chrono::hours(1);
  ASSERT_TRUE(b.Submit(late).ok());
  ASSERT_TRUE(b.Submit(live).ok());
  b.Stop();
  std::vector<int64_t> sizes;
  std::chrono::steady_clock::time_point seen{};
  int idles = 0;
  b.Run(
      [&](int, const float* in, int64_t t, float* y, std::chrono::steady_clock::time_point d) {
        sizes.push_back(t);
        seen = d;
        for (int64_t i = 0; i < t; ++i) y[i] = in[i];
        return Status::Ok();
      },
      [] { return false; }, [&] { ++idles; });
  EXPECT_EQ(done.calls.load(), 2);
  EXPECT_EQ(done.failed.load(), 1);  // the late one
  EXPECT_EQ(sizes, (std::vector<int64_t>{1}));
  EXPECT_EQ(seen, live.deadline);
  EXPECT_EQ(b.stats().expired, 1u);
  EXPECT_GE(idles, 1);
}

}  // namespace
}  // namespace moerun
