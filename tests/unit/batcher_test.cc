#include "runtime/serving/batcher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/layer_fixtures.h"

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
  b.Run([&](int layer, const float* x, int64_t t, float* out, auto,
            auto) { return AddLayer(layer, x, t, out, hidden, &sizes); },
        [] { return false; }, [] {});
  EXPECT_EQ(done.calls.load(), 6);
  EXPECT_EQ(sizes, (std::vector<int64_t>{6, 6, 6}));  // 3 + 3 fit in 8; a third would not
  for (int r = 0; r < 6; ++r) {
    for (float v : outs[r]) EXPECT_EQ(v, static_cast<float>(r + 7));
  }
}

TEST(BatcherTest, ALoneRequestIsServedAtOnceWhateverMaxWait) {
  BatcherOptions o;
  o.max_batch_tokens = 1000;
  o.max_wait_us = 60'000'000;  // a minute: a batcher that waited for batch-mates would hang here
  Batcher b(o, 2);
  std::vector<float> x(2, 1.0f), out(2);
  Done done;
  std::atomic<bool> stop{false};
  std::vector<int64_t> sizes;
  std::thread runner([&] {
    b.Run([&](int layer, const float* in, int64_t t, float* y, auto,
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

// What each request's callback saw, in the order the callbacks ran.
struct Order {
  std::vector<int> ids;
  std::vector<BatchInfo> infos;
};
struct OrderSlot {
  Order* order;
  int id;
  static void Callback(void* ctx, const Status& s, const BatchInfo& info) {
    auto* o = static_cast<OrderSlot*>(ctx);
    o->order->ids.push_back(s.ok() ? o->id : -o->id - 1);
    o->order->infos.push_back(info);
  }
};

// A request that arrives while a batch runs joins it (the layer asks the stream between its
// microbatches), and each request is answered as soon as its rows are final, before the batch
// ends; one of another layer waits for the next batch.
TEST(BatcherTest, ArrivalsJoinTheRunningBatchAndRowsAreAnsweredAsSoonAsFinal) {
  BatcherOptions o;
  o.max_batch_tokens = 64;
  o.max_wait_us = 60'000'000;
  Batcher b(o, 2);
  std::vector<std::vector<float>> xs(4), outs(4);
  for (int i = 0; i < 4; ++i) {
    xs[i].assign(2 * 2, static_cast<float>(10 * (i + 1)));
    outs[i].assign(xs[i].size(), -1.0f);
  }
  Order order;
  std::vector<OrderSlot> slots;
  for (int i = 0; i < 4; ++i) slots.push_back(OrderSlot{&order, i});
  const int layers[4] = {5, 5, 6, 5};
  auto submit = [&](int i) {
    ASSERT_TRUE(b.Submit(BatchRequest{layers[i], xs[i].data(), outs[i].data(), 2,
                                      &OrderSlot::Callback, &slots[i]})
                    .ok());
  };
  submit(0);
  bool arrived = false;  // stop once the arrivals are in: what is queued then still runs
  std::vector<std::pair<int, int64_t>> calls;  // (layer, tokens at the start)
  b.Run(
      [&](int layer, const float* x, int64_t t, float* y, auto, BatchStream* stream) {
        calls.emplace_back(layer, t);
        if (calls.size() > 1) {  // the later batches: layer 6's, then request 3's
          for (int64_t i = 0; i < t * 2; ++i) y[i] = x[i] + 1;
          return Status::Ok();
        }
        // Microbatch 1 goes out; 1, 2 (another layer) and 3 arrive meanwhile.
        submit(1);
        submit(2);
        submit(3);
        arrived = true;
        auto deadline = std::chrono::steady_clock::time_point::min();
        int64_t grown = stream->Extend(t, &deadline);
        EXPECT_EQ(grown, 4);  // request 1 joined; 2 is another layer and 3 is behind it
        EXPECT_EQ(stream->tokens(), 4);
        for (int64_t i = 0; i < grown * 2; ++i) y[i] = x[i] + 1;
        stream->Done(2,
                     BatchTiming{});  // request 0's rows are final: answered now, inside the batch
        EXPECT_EQ(order.ids, (std::vector<int>{0}));
        stream->Done(2, BatchTiming{});  // again: nothing answered twice
        EXPECT_EQ(order.ids.size(), 1u);
        return Status::Ok();
      },
      [&] { return arrived; }, [] {});
  // Request 1 was answered at the end of its batch; 2 and 3 each in a batch of their own layer
  // (arrival order kept: 3 waited behind 2).
  EXPECT_EQ(order.ids, (std::vector<int>{0, 1, 2, 3}));
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[0], std::make_pair(5, int64_t{2}));
  EXPECT_EQ(calls[1], std::make_pair(6, int64_t{2}));
  EXPECT_EQ(calls[2].first, 5);
  EXPECT_EQ(order.infos[1].batch_tokens, 4);
  for (int i = 0; i < 4; ++i) {
    for (float v : outs[i]) EXPECT_EQ(v, static_cast<float>(10 * (i + 1) + 1)) << i;
  }
  EXPECT_EQ(b.stats().batches, 3u);
  EXPECT_EQ(b.stats().tokens, 8u);
}

// max_wait_us caps the growth: 0 takes no newcomers; max_batch_tokens bounds it too.
TEST(BatcherTest, GrowthStopsAtMaxWaitAndAtMaxBatchTokens) {
  for (const int64_t wait_us : {int64_t{0}, int64_t{60'000'000}}) {
    BatcherOptions o;
    o.max_batch_tokens = 5;
    o.max_wait_us = wait_us;
    Batcher b(o, 1);
    std::vector<float> x(16, 1.0f), out(16);
    Done done;
    ASSERT_TRUE(b.Submit(BatchRequest{0, x.data(), out.data(), 2, &Done::Callback, &done}).ok());
    std::vector<int64_t> grown;
    b.Run(
        [&](int, const float* in, int64_t t, float* y, auto, BatchStream* stream) {
          if (grown.empty()) {
            for (int i = 0; i < 3; ++i) {
              EXPECT_TRUE(b.Submit(BatchRequest{0, x.data(), out.data() + 2 + 2 * i, 2,
                                                &Done::Callback, &done})
                              .ok());
            }
          }
          auto d = std::chrono::steady_clock::time_point::min();
          grown.push_back(stream->Extend(t, &d));
          for (int64_t i = 0; i < grown.back(); ++i) y[i] = in[i];
          return Status::Ok();
        },
        [&] { return !grown.empty(); }, [] {});
    EXPECT_EQ(done.calls.load(), 4);
    if (wait_us == 0) {
      EXPECT_EQ(grown.front(), 2) << "max_wait_us 0 takes no newcomers";
    } else {
      EXPECT_EQ(grown.front(), 4) << "2 + 2 fit in 5, a third would not";
    }
  }
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
      [&](int layer, const float* in, int64_t t, float* y, auto, auto) {
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
  b.Run([](int, const float*, int64_t, float*, auto,
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
    b.Run([&](int layer, const float* in, int64_t t, float* y, auto,
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
      [&](int, const float* in, int64_t t, float* y, std::chrono::steady_clock::time_point d,
          BatchStream*) {
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

// A deadline the layer cannot meet (less time than its fastest batch lately) is answered at
// once: refused by Submit, or, queued behind a batch, dropped when batches are taken; never
// dispatched. The floor is per layer: another layer without batches yet takes any deadline.
TEST(BatcherTest, ADeadlineShorterThanTheLayersFastestBatchIsAnsweredAtOnce) {
  BatcherOptions o;
  o.max_batch_tokens = 100;
  o.max_wait_us = 0;
  Batcher b(o, 1);
  std::vector<float> x(8, 1.0f), out(8);
  std::atomic<int> forwards{0};
  std::atomic<bool> stop{false};
  std::thread runner([&] {
    b.Run(
        [&](int, const float* in, int64_t t, float* y, auto, auto) {
          ++forwards;
          std::this_thread::sleep_for(std::chrono::milliseconds(60));
          for (int64_t i = 0; i < t; ++i) y[i] = in[i];
          return Status::Ok();
        },
        [&] { return stop.load(); }, [] {});
  });
  const auto wait_calls = [](const Done& d, int n) {
    for (int i = 0; i < 1000 && d.calls.load() < n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  Done first;
  ASSERT_TRUE(b.Submit(BatchRequest{0, x.data(), out.data(), 1, &Done::Callback, &first}).ok());
  wait_calls(first, 1);
  ASSERT_EQ(first.calls.load(), 1);
  ASSERT_EQ(forwards.load(), 1);  // layer 0's floor is now >= 60 ms

  Done refused;
  BatchRequest quick{0, x.data() + 1, out.data() + 1, 1, &Done::Callback, &refused};
  quick.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
  const Status s = b.Submit(quick);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("cannot be met"), std::string::npos) << s.ToString();
  EXPECT_EQ(refused.calls.load(), 0);  // refused by Submit: the caller answers it
  EXPECT_EQ(b.stats().too_short, 1u);

  // Another layer has no floor yet: the same deadline is taken (and computed, late).
  Done other;
  BatchRequest other_layer{1, x.data() + 2, out.data() + 2, 1, &Done::Callback, &other};
  other_layer.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
  ASSERT_TRUE(b.Submit(other_layer).ok());
  wait_calls(other, 1);
  EXPECT_EQ(forwards.load(), 2);

  // Queued behind a batch of 60 ms with 80 ms left: when the batch ends, less than the floor is
  // left, so it is answered without being computed.
  Done behind, queued;
  ASSERT_TRUE(
      b.Submit(BatchRequest{0, x.data() + 3, out.data() + 3, 1, &Done::Callback, &behind}).ok());
  for (int i = 0; i < 1000 && forwards.load() < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  BatchRequest tight{0, x.data() + 4, out.data() + 4, 1, &Done::Callback, &queued};
  tight.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(80);
  ASSERT_TRUE(b.Submit(tight).ok());
  wait_calls(queued, 1);
  wait_calls(behind, 1);
  EXPECT_EQ(queued.failed.load(), 1);
  EXPECT_EQ(behind.failed.load(), 0);
  EXPECT_EQ(forwards.load(), 3);  // the tight one was never dispatched
  EXPECT_EQ(b.stats().expired, 1u);
  stop = true;
  b.Stop();
  runner.join();
}

// What each request's callback got, by request.
struct Answers {
  std::vector<StatusCode> codes;
  std::vector<std::string> messages;
  explicit Answers(size_t n) : codes(n, StatusCode::kInternal), messages(n) {}
};
struct AnswerSlot {
  Answers* answers;
  size_t i;
  static void Callback(void* ctx, const Status& s, const BatchInfo&) {
    auto* a = static_cast<AnswerSlot*>(ctx);
    a->answers->codes[a->i] = s.code();
    a->answers->messages[a->i] = s.message();
  }
};

bool AllValuesFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// forward: out = x * x, which overflows F32 to Inf for |x| > ~1.8e19.
Status Square(const float* x, int64_t tokens, float* out, int64_t hidden) {
  for (int64_t i = 0; i < tokens * hidden; ++i) out[i] = x[i] * x[i];
  return Status::Ok();
}

TEST(BatcherTest, ARequestWhoseOutputIsNotFiniteIsRefusedAloneItsBatchMatesAreAnswered) {
  const int64_t hidden = 4;
  BatcherOptions o;
  o.max_batch_tokens = 64;
  o.max_wait_us = 1000000;
  Batcher b(o, hidden);
  // 0: ordinary; 1: one value of 1e20 (its square overflows); 2: ordinary, BF16 out;
  // 3: 1.8439e19 squares to 3.4e38, finite in F32 but Inf once rounded to BF16; 4: ordinary.
  std::vector<std::vector<float>> xs(5, std::vector<float>(2 * hidden, 3.0f));
  xs[1][5] = 1e20f;
  xs[3][2] = 1.8439e19f;
  std::vector<std::vector<float>> outs(5, std::vector<float>(2 * hidden, -1.0f));
  std::vector<uint16_t> bf16_out(2 * hidden), bf16_big(2 * hidden);
  Answers answers(5);
  std::vector<AnswerSlot> slots;
  for (size_t i = 0; i < 5; ++i) slots.push_back(AnswerSlot{&answers, i});
  ASSERT_TRUE(std::isfinite(xs[3][2] * xs[3][2]));
  ASSERT_FALSE(std::isfinite(Bf16ToF32(F32ToBf16(xs[3][2] * xs[3][2]))));
  for (size_t i = 0; i < 5; ++i) {
    BatchRequest r{0, xs[i].data(), outs[i].data(), 2, &AnswerSlot::Callback, &slots[i]};
    if (i == 2) r.out = bf16_out.data();
    if (i == 3) r.out = bf16_big.data();
    if (i == 2 || i == 3) r.out_type = DType::kBF16;
    ASSERT_TRUE(b.Submit(r).ok());
  }
  b.Stop();
  int batches = 0;
  b.Run(
      [&](int, const float* x, int64_t t, float* out, auto, auto) {
        ++batches;
        return Square(x, t, out, hidden);
      },
      [] { return false; }, [] {});
  EXPECT_EQ(batches, 1);  // all five in one batch
  EXPECT_EQ(answers.codes[0], StatusCode::kOk);
  EXPECT_EQ(answers.codes[2], StatusCode::kOk);
  EXPECT_EQ(answers.codes[4], StatusCode::kOk);
  for (size_t i : {size_t{0}, size_t{4}}) {
    for (float v : outs[i]) EXPECT_EQ(v, 9.0f);
  }
  for (uint16_t v : bf16_out) EXPECT_EQ(Bf16ToF32(v), 9.0f);
  EXPECT_EQ(answers.codes[1], StatusCode::kInvalidArgument);
  EXPECT_NE(answers.messages[1].find("output is not finite"), std::string::npos)
      << answers.messages[1];
  EXPECT_NE(answers.messages[1].find("|x| up to 1e+20"), std::string::npos) << answers.messages[1];
  EXPECT_EQ(answers.codes[3], StatusCode::kInvalidArgument) << "BF16 rounding to Inf";
  EXPECT_NE(answers.messages[3].find("|x| up to 1.8e+19"), std::string::npos)
      << answers.messages[3];
  EXPECT_EQ(b.stats().nonfinite, 2u);
  EXPECT_EQ(b.stats().requests, 5u);
}

TEST(BatcherTest, AFailedForwardFailsTheBatchAsBeforeWithoutANonFiniteCount) {
  BatcherOptions o;
  o.max_wait_us = 0;
  Batcher b(o, 2);
  std::vector<float> x(2, 1.0f), out(2, -1.0f);
  Answers answers(1);
  AnswerSlot slot{&answers, 0};
  ASSERT_TRUE(
      b.Submit(BatchRequest{0, x.data(), out.data(), 1, &AnswerSlot::Callback, &slot}).ok());
  b.Stop();
  b.Run(
      [](int, const float*, int64_t, float* y, auto, auto) {
        y[0] = NAN;  // not looked at: the forward failed
        return Status::Unavailable("expert rank 2 does not answer");
      },
      [] { return false; }, [] {});
  EXPECT_EQ(answers.codes[0], StatusCode::kUnavailable);
  EXPECT_EQ(b.stats().nonfinite, 0u);
}

// The real layer behind the batcher: a request with values of 1e20 makes the experts overflow;
// it gets kInvalidArgument naming the cause, and the requests batched with it get bitwise what
// the layer computes for them alone.
TEST(BatcherTest, HugeInputsThroughTheRealLayerAreRefusedAndTheirBatchMatesAreExact) {
  using namespace moerun::testing;
  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(1);
  MoeLayer layer(LoadFixture("deepseek_v3", k), k, &pool);
  const int64_t h = layer.weights().spec.hidden;
  std::vector<std::vector<float>> xs = {RandomRows(3, h, 1), RandomRows(2, h, 2),
                                        RandomRows(4, h, 3)};
  for (float& v : xs[1]) v *= 1e20f;
  xs[1][0] = 1e20f;
  // The premise: the layer alone overflows on the scaled request, not on the others.
  std::vector<std::vector<float>> alone;
  for (const auto& x : xs) {
    alone.emplace_back(x.size());
    ASSERT_TRUE(
        layer.Forward(x.data(), static_cast<int64_t>(x.size()) / h, alone.back().data()).ok());
  }
  ASSERT_TRUE(AllValuesFinite(alone[0]));
  ASSERT_FALSE(AllValuesFinite(alone[1]));
  ASSERT_TRUE(AllValuesFinite(alone[2]));

  BatcherOptions o;
  o.max_batch_tokens = 64;
  o.max_wait_us = 1000000;
  Batcher b(o, h);
  std::vector<std::vector<float>> outs;
  for (const auto& x : xs) outs.emplace_back(x.size(), -1.0f);
  Answers answers(3);
  std::vector<AnswerSlot> slots;
  for (size_t i = 0; i < 3; ++i) slots.push_back(AnswerSlot{&answers, i});
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(b.Submit(BatchRequest{0, xs[i].data(), outs[i].data(),
                                      static_cast<int64_t>(xs[i].size()) / h, &AnswerSlot::Callback,
                                      &slots[i]})
                    .ok());
  }
  b.Stop();
  int batches = 0;
  b.Run(
      [&](int, const float* x, int64_t t, float* y, auto, auto) {
        ++batches;
        return layer.Forward(x, t, y);
      },
      [] { return false; }, [] {});
  EXPECT_EQ(batches, 1);
  EXPECT_EQ(answers.codes[1], StatusCode::kInvalidArgument);
  EXPECT_NE(answers.messages[1].find("output is not finite for this input (|x| up to 1e+20)"),
            std::string::npos)
      << answers.messages[1];
  for (size_t i : {size_t{0}, size_t{2}}) {
    EXPECT_EQ(answers.codes[i], StatusCode::kOk) << answers.messages[i];
    EXPECT_EQ(std::memcmp(outs[i].data(), alone[i].data(), alone[i].size() * sizeof(float)), 0);
  }
}

}  // namespace
}  // namespace moerun
