#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include "runtime/layer/moe_layer.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/serve_client.h"
#include "runtime/serving/serving_endpoint.h"
#include "tests/serving/mini_router.h"
#include "tests/unit/layer_fixtures.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using namespace moerun::testing;
using moerun::v1::InferRequest;
using moerun::v1::InferResponse;

using Server = MiniRouter;  // tests/serving/mini_router.h

std::unique_ptr<ServeConnection> Connect(const Server& s) {
  auto c = ServeConnection::Connect(s.target());
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(*c) : nullptr;
}

InferRequest Request(uint64_t id, const std::vector<float>& x, int64_t hidden,
                     v1::DType dtype = v1::F32) {
  InferRequest r;
  r.set_id(id);
  SetRequestData(&r, x.data(), static_cast<int64_t>(x.size()) / hidden, hidden, dtype);
  return r;
}

Deadline Soon() { return DeadlineIn(std::chrono::seconds(20)); }

// A valid request still gets its exact answer (the server kept serving).
void ExpectServes(Server& s, uint64_t id = 99) {
  auto c = Connect(s);
  ASSERT_NE(c, nullptr);
  const auto x = RandomRows(3, s.hidden(), static_cast<uint32_t>(id));
  InferResponse resp;
  ASSERT_TRUE(c->Call(Request(id, x, s.hidden()), &resp, Soon()).ok());
  ASSERT_EQ(resp.code(), v1::OK) << resp.message();
  EXPECT_EQ(resp.id(), id);
  auto y = ResponseFloats(resp);
  ASSERT_TRUE(y.ok());
  const auto want = s.Expected(x);
  EXPECT_EQ(std::memcmp(y->data(), want.data(), want.size() * 4), 0);
}

TEST(ServingTest, AnswersBitwiseAsTheLayerInF32AndBf16) {
  Server s;
  ExpectServes(s, 1);
  auto c = Connect(s);
  const auto x = RandomRows(5, s.hidden(), 7);
  InferResponse resp;
  ASSERT_TRUE(c->Call(Request(2, x, s.hidden(), v1::BF16), &resp, Soon()).ok());
  ASSERT_EQ(resp.code(), v1::OK) << resp.message();
  EXPECT_EQ(resp.dtype(), v1::BF16);
  auto y = ResponseFloats(resp);
  ASSERT_TRUE(y.ok());
  std::vector<float> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = Bf16ToF32(F32ToBf16(x[i]));
  const auto want = s.Expected(xb);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ((*y)[i], Bf16ToF32(F32ToBf16(want[i])));
}

TEST(ServingTest, ManyRequestsInFlightOnOneConnection) {
  Server s;
  auto c = Connect(s);
  std::vector<std::vector<float>> xs;
  for (uint64_t id = 1; id <= 20; ++id) {
    xs.push_back(RandomRows(1 + id % 4, s.hidden(), static_cast<uint32_t>(id)));
    ASSERT_TRUE(c->Send(Request(id, xs.back(), s.hidden()), Soon()).ok());
  }
  std::vector<bool> seen(21, false);
  for (int i = 0; i < 20; ++i) {
    InferResponse resp;
    ASSERT_TRUE(c->Receive(&resp, Soon()).ok());
    ASSERT_EQ(resp.code(), v1::OK) << resp.message();
    ASSERT_GE(resp.id(), 1u);
    ASSERT_LE(resp.id(), 20u);
    EXPECT_FALSE(seen[resp.id()]);
    seen[resp.id()] = true;
    auto y = ResponseFloats(resp);
    const auto want = s.Expected(xs[resp.id() - 1]);
    ASSERT_EQ(std::memcmp(y->data(), want.data(), want.size() * 4), 0);
  }
}

TEST(ServingTest, BadContentGetsInvalidArgumentAndTheConnectionStaysUsable) {
  Server s;
  auto c = Connect(s);
  const auto x = RandomRows(2, s.hidden(), 3);
  struct Case {
    const char* what;
    InferRequest req;
    const char* needle;
  };
  std::vector<Case> cases;
  {
    InferRequest r = Request(10, x, s.hidden());
    r.set_shape(1, s.hidden() + 1);
    cases.push_back({"wrong hidden", r, "hidden size"});
  }
  {
    InferRequest r = Request(11, x, s.hidden());
    r.set_dtype(static_cast<v1::DType>(7));
    cases.push_back({"unknown dtype", r, "dtype"});
  }
  {
    InferRequest r = Request(12, x, s.hidden());
    r.mutable_data()->resize(r.data().size() - 4);
    cases.push_back({"short data", r, "bytes"});
  }
  {
    std::vector<float> bad = x;
    bad[s.hidden() + 3] = std::nanf("");
    cases.push_back({"NaN", Request(13, bad, s.hidden()), "not finite at token 1, column 3"});
  }
  {
    std::vector<float> bad = x;
    bad[0] = INFINITY;
    cases.push_back({"Inf", Request(14, bad, s.hidden()), "not finite"});
  }
  {
    InferRequest r = Request(15, x, s.hidden());
    r.set_layer(5);
    cases.push_back({"layer", r, "layer 5 is not served"});
  }
  {
    InferRequest r = Request(16, x, s.hidden());
    r.clear_shape();
    r.add_shape(2);
    cases.push_back({"1-D shape", r, "shape"});
  }
  {
    InferRequest r;
    r.set_id(17);
    r.set_dtype(v1::F32);
    r.add_shape(0);
    r.add_shape(s.hidden());
    cases.push_back({"zero tokens", r, "tokens must be"});
  }
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    InferResponse resp;
    ASSERT_TRUE(c->Call(k.req, &resp, Soon()).ok());
    EXPECT_EQ(resp.code(), v1::INVALID_ARGUMENT);
    EXPECT_NE(resp.message().find(k.needle), std::string::npos) << resp.message();
  }
  // A frame whose body is not a valid message: MALFORMED_FRAME, then the connection still works.
  const std::string junk = "\xff\xff\xff\xff\x0f garbage";
  uint8_t hdr[4];
  PutFrameLength(static_cast<uint32_t>(junk.size()), hdr);
  ASSERT_TRUE(c->SendRaw(hdr, 4, Soon()).ok());
  ASSERT_TRUE(c->SendRaw(junk.data(), junk.size(), Soon()).ok());
  InferResponse resp;
  ASSERT_TRUE(c->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::MALFORMED_FRAME) << resp.message();
  ASSERT_TRUE(c->Call(Request(18, x, s.hidden()), &resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::OK) << resp.message();
}

TEST(ServingTest, OversizedFrameIsRefusedBeforeItsBodyAndTheConnectionClosed) {
  ServingOptions so;
  so.framed.max_frame_bytes = 1 << 20;
  Server s(so);
  auto c = Connect(s);
  uint8_t hdr[4];
  PutFrameLength((1u << 20) + 1, hdr);
  ASSERT_TRUE(c->SendRaw(hdr, 4, Soon()).ok());  // no body follows: the answer must not wait
  InferResponse resp;
  ASSERT_TRUE(c->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::FRAME_TOO_LARGE);
  EXPECT_NE(resp.message().find("over the limit"), std::string::npos) << resp.message();
  EXPECT_EQ(c->Receive(&resp, Soon()).code(), StatusCode::kUnavailable);  // closed
  // Random garbage reads as a huge length: the same answer.
  auto g = Connect(s);
  const char garbage[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(g->SendRaw(garbage, sizeof garbage - 1, Soon()).ok());
  ASSERT_TRUE(g->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::FRAME_TOO_LARGE);
  ExpectServes(s);
}

TEST(ServingTest, TruncatedFramesAndSlowClientsDoNotHoldTheServer) {
  ServingOptions so;
  so.framed.frame_timeout = std::chrono::milliseconds(600);
  Server s(so);
  // A frame cut short by a client that goes away.
  {
    auto c = Connect(s);
    uint8_t hdr[4];
    PutFrameLength(1000, hdr);
    ASSERT_TRUE(c->SendRaw(hdr, 4, Soon()).ok());
    ASSERT_TRUE(c->SendRaw("abcdefgh", 8, Soon()).ok());
    c->Close();
  }
  // One byte at a time, too slowly: FRAME_TIMEOUT, closed; others are served meanwhile.
  auto slow = Connect(s);
  const auto x = RandomRows(1, s.hidden(), 5);
  const std::string frame = EncodeFrame(Request(1, x, s.hidden())).value();
  std::atomic<bool> done{false};
  std::thread other([&] {
    while (!done.load()) {
      ExpectServes(s, 5);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  Status sent;
  for (size_t i = 0; i < frame.size() && sent.ok(); ++i) {
    sent = slow->SendRaw(frame.data() + i, 1, Soon());
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(3)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    pollfd p{slow->fd(), POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) break;  // the server answered
  }
  InferResponse resp;
  ASSERT_TRUE(slow->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::FRAME_TIMEOUT) << resp.message();
  // By the frame timeout (600 ms), with a 5x margin for a loaded machine.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  done = true;
  other.join();
  ExpectServes(s);
}

TEST(ServingTest, AThousandConcurrentConnections) {
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  if (rl.rlim_cur < 2200) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, 4096);
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (rl.rlim_cur < 2200) GTEST_SKIP() << "needs 2200 file descriptors, have " << rl.rlim_cur;
  Server s;
  const int n = 1000;
  std::vector<std::unique_ptr<ServeConnection>> conns;
  for (int i = 0; i < n; ++i) {
    conns.push_back(Connect(s));
    ASSERT_NE(conns.back(), nullptr) << i;
  }
  const auto x = RandomRows(1, s.hidden(), 11);
  const auto want = s.Expected(x);
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(conns[i]->Send(Request(static_cast<uint64_t>(i + 1), x, s.hidden()), Soon()).ok());
  }
  int ok = 0;
  for (int i = 0; i < n; ++i) {
    InferResponse resp;
    ASSERT_TRUE(conns[i]->Receive(&resp, Soon()).ok()) << i;
    ASSERT_EQ(resp.code(), v1::OK) << resp.message();
    ASSERT_EQ(resp.id(), static_cast<uint64_t>(i + 1));
    auto y = ResponseFloats(resp);
    ok += std::memcmp(y->data(), want.data(), want.size() * 4) == 0;
  }
  EXPECT_EQ(ok, n);
}

TEST(ServingTest, DeadlinesHoldWhileTheLayerIsSlowAndFullQueuesSayOverloaded) {
  BatcherOptions bo;
  bo.max_queue_requests = 2;
  bo.max_batch_tokens = 1;
  Server s({}, bo, std::chrono::milliseconds(400));
  auto c = Connect(s);
  const auto x = RandomRows(1, s.hidden(), 9);
  // One runs (slowly), two wait, the rest find the queue full.
  for (uint64_t id = 1; id <= 5; ++id) {
    InferRequest r = Request(id, x, s.hidden());
    r.set_deadline_ms(id == 3 ? 100 : 10000);
    ASSERT_TRUE(c->Send(r, Soon()).ok());
    // The first is taken by the (slow) layer before the others arrive.
    if (id == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // Request 3 is answered by its deadline (100 ms), not when the slow batch ahead of it comes
  // back (request 1, 400 ms in the layer): so its answer comes before request 1's. An order, not
  // a time: the layer's 400 ms are 4x the deadline, a margin no loaded machine closes.
  int ok = 0, overloaded = 0, late = 0;
  bool first_answered = false;
  for (int i = 0; i < 5; ++i) {
    InferResponse resp;
    ASSERT_TRUE(c->Receive(&resp, Soon()).ok());
    if (resp.code() == v1::OK) ++ok;
    if (resp.code() == v1::OVERLOADED) ++overloaded;
    if (resp.id() == 1u) first_answered = true;
    if (resp.code() == v1::DEADLINE_EXCEEDED) {
      ++late;
      EXPECT_EQ(resp.id(), 3u);
      EXPECT_FALSE(first_answered) << "the late request waited for the slow batch ahead of it";
    }
  }
  EXPECT_EQ(late, 1);
  EXPECT_GE(overloaded, 1);
  EXPECT_EQ(ok + overloaded + late, 5);
  const std::string text = s.metrics().Render();
  EXPECT_NE(text.find("moerun_requests_total{code=\"overloaded\"}"), std::string::npos);
}

TEST(ServingTest, AClientThatClosesItsSendingSideStillGetsItsAnswers) {
  Server s({}, {}, std::chrono::milliseconds(200));  // the answers come after the half close
  auto c = Connect(s);
  const auto x = RandomRows(2, s.hidden(), 21);
  for (uint64_t id = 1; id <= 3; ++id)
    ASSERT_TRUE(c->Send(Request(id, x, s.hidden()), Soon()).ok());
  ASSERT_EQ(::shutdown(c->fd(), SHUT_WR), 0);
  for (int i = 0; i < 3; ++i) {
    InferResponse resp;
    ASSERT_TRUE(c->Receive(&resp, Soon()).ok()) << i;
    EXPECT_EQ(resp.code(), v1::OK) << resp.message();
  }
  InferResponse resp;
  EXPECT_EQ(c->Receive(&resp, Soon()).code(), StatusCode::kUnavailable);  // then closed
}

TEST(ServingTest, AClientThatStopsReadingIsClosedAndOthersAreServed) {
  ServingOptions so;
  so.framed.write_timeout = std::chrono::milliseconds(500);
  Server s(so);
  auto c = Connect(s);
  const auto x = RandomRows(4096, s.hidden(), 31);  // 1 MiB answers
  for (uint64_t id = 1; id <= 12; ++id)
    ASSERT_TRUE(c->Send(Request(id, x, s.hidden()), Soon()).ok());
  // Nothing is read: the socket buffers fill, the server's write stalls, it gives up on us.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  ExpectServes(s);
  Status st;
  for (int i = 0; i < 13 && st.ok(); ++i) {
    InferResponse resp;
    st = c->Receive(&resp, Soon());
  }
  EXPECT_FALSE(st.ok());  // closed before all 12 answers were delivered
}

TEST(ServingTest, DrainRefusesNewRequests) {
  Server s;
  auto c = Connect(s);
  const auto x = RandomRows(1, s.hidden(), 2);
  InferResponse resp;
  ASSERT_TRUE(c->Call(Request(3, x, s.hidden()), &resp, Soon()).ok());  // accepted before
  ASSERT_EQ(resp.code(), v1::OK);
  s.endpoint().BeginDrain();
  ASSERT_TRUE(c->Call(Request(4, x, s.hidden()), &resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::UNAVAILABLE);
  EXPECT_NE(resp.message().find("draining"), std::string::npos);
}

// Finite inputs so large that the layer overflows: never an OK answer with NaN or Inf rows. The
// request is refused INVALID_ARGUMENT naming the cause; the requests batched with it (sent
// together, one batch: the batcher waits 200 ms) are answered exactly.
TEST(ServingTest, HugeFiniteInputsAreRefusedAndTheirBatchMatesAnswered) {
  BatcherOptions bo;
  bo.max_wait_us = 200000;
  Server s({}, bo);
  auto c = Connect(s);
  const auto a = RandomRows(3, s.hidden(), 41);
  const auto b = RandomRows(2, s.hidden(), 42);
  auto huge = RandomRows(2, s.hidden(), 43);
  for (float& v : huge) v *= 1e20f;
  huge[0] = 1e20f;
  ASSERT_TRUE(c->Send(Request(1, a, s.hidden()), Soon()).ok());
  ASSERT_TRUE(c->Send(Request(2, huge, s.hidden()), Soon()).ok());
  ASSERT_TRUE(c->Send(Request(3, huge, s.hidden(), v1::BF16), Soon()).ok());
  ASSERT_TRUE(c->Send(Request(4, b, s.hidden()), Soon()).ok());
  for (int i = 0; i < 4; ++i) {
    InferResponse resp;
    ASSERT_TRUE(c->Receive(&resp, Soon()).ok());
    if (resp.id() == 2 || resp.id() == 3) {
      EXPECT_EQ(resp.code(), v1::INVALID_ARGUMENT) << resp.id();
      EXPECT_NE(resp.message().find("output is not finite for this input (|x| up to 1e+20)"),
                std::string::npos)
          << resp.message();
      EXPECT_EQ(resp.data().size(), 0u);
      continue;
    }
    ASSERT_EQ(resp.code(), v1::OK) << resp.message();
    auto y = ResponseFloats(resp);
    ASSERT_TRUE(y.ok());
    const auto want = s.Expected(resp.id() == 1 ? a : b);
    ASSERT_EQ(y->size(), want.size());
    EXPECT_EQ(std::memcmp(y->data(), want.data(), want.size() * 4), 0) << resp.id();
  }
  ExpectServes(s);  // and the server serves on
}

}  // namespace
}  // namespace moerun
