// ServeConnection against a small server thread on a real socket (127.0.0.1, an ephemeral port),
// and the request/response data helpers (F32 exact, BF16 round-to-nearest-even, NaN kept).
#include "runtime/serving/serve_client.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <thread>

#include "base/dtype.h"
#include "runtime/serving/failover_client.h"

namespace moerun {
namespace {

using std::chrono::milliseconds;

// Listens on 127.0.0.1:0 and serves one connection at a time on its own thread.
class TestServer {
 public:
  enum class Mode {
    kEcho,           // answers every InferRequest with an InferResponse of the same id and data
    kReverseAfterN,  // collects n requests, then answers them in reverse order
    kSilent,         // reads, never answers
    kCloseAfterOne,  // reads one frame, then closes the connection
  };

  explicit TestServer(Mode mode, int n = 1) : mode_(mode), n_(n) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(listen_fd_, 8), 0);
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Run(); });
  }
  ~TestServer() {
    stop_ = true;
    thread_.join();
    ::close(listen_fd_);
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int requests() const { return requests_.load(); }

 private:
  bool WaitReadable(int fd) {
    while (!stop_) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 20) > 0) return true;
    }
    return false;
  }

  void Run() {
    while (WaitReadable(listen_fd_)) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      Serve(fd);
      ::close(fd);
    }
  }

  bool SendAll(int fd, const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

  static v1::InferResponse Answer(const v1::InferRequest& req) {
    v1::InferResponse resp;
    resp.set_id(req.id());
    resp.set_code(v1::OK);
    resp.set_dtype(req.dtype());
    *resp.mutable_shape() = req.shape();
    resp.set_data(req.data());
    return resp;
  }

  void Serve(int fd) {
    FrameDecoder decoder;
    std::vector<v1::InferRequest> pending;
    char buf[4096];
    while (WaitReadable(fd)) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return;
      decoder.Feed(buf, static_cast<size_t>(n));
      std::string body;
      for (;;) {
        auto r = decoder.Next(&body);
        if (!r.ok()) return;
        if (!*r) break;
        ++requests_;
        if (mode_ == Mode::kCloseAfterOne) return;
        if (mode_ == Mode::kSilent) continue;
        v1::InferRequest req;
        if (!req.ParseFromString(body)) return;
        pending.push_back(req);
        if (mode_ == Mode::kReverseAfterN && static_cast<int>(pending.size()) < n_) continue;
        std::string out;
        for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
          EXPECT_TRUE(AppendFrame(Answer(*it), &out).ok());
        }
        pending.clear();
        if (!SendAll(fd, out)) return;
      }
    }
  }

  Mode mode_;
  int n_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::thread thread_;
};

v1::InferRequest MakeRequest(uint64_t id, int64_t tokens, int64_t hidden) {
  std::vector<float> x(static_cast<size_t>(tokens * hidden));
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(id) + 0.25f * static_cast<float>(i);
  v1::InferRequest r;
  r.set_id(id);
  SetRequestData(&r, x.data(), tokens, hidden, v1::F32);
  return r;
}

std::unique_ptr<ServeConnection> MustConnect(const std::string& target, ClientOptions o = {}) {
  auto c = ServeConnection::Connect(target, o);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// --- data helpers
// ---------------------------------------------------------------------------------

TEST(ClientDataTest, F32RoundTripIsExact) {
  const float x[6] = {1.0f,        -2.5f,
                      3.14159274f, std::numeric_limits<float>::denorm_min(),
                      -0.0f,       std::numeric_limits<float>::infinity()};
  v1::InferRequest req;
  SetRequestData(&req, x, 2, 3, v1::F32);
  EXPECT_EQ(req.dtype(), v1::F32);
  ASSERT_EQ(req.shape_size(), 2);
  EXPECT_EQ(req.shape(0), 2);
  EXPECT_EQ(req.shape(1), 3);
  ASSERT_EQ(req.data().size(), 24u);
  v1::InferResponse resp;
  resp.set_dtype(req.dtype());
  *resp.mutable_shape() = req.shape();
  resp.set_data(req.data());
  auto back = ResponseFloats(resp);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>((*back)[i]), std::bit_cast<uint32_t>(x[i])) << i;
  }
}

TEST(ClientDataTest, Bf16RoundsToNearestEvenAndKeepsNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float x[8] = {
      1.0f,
      1.0f + 1.0f / 256,  // halfway between 1 and 1+2^-7: ties to even -> 1
      1.0f + 3.0f / 256,  // halfway between 1+2^-7 and 1+2^-6: ties to even -> 1+2^-6
      1.0f + 1.0f / 256 + 1.0f / 65536,  // just above halfway -> up
      -2.0f,
      nan,
      std::bit_cast<float>(0x7f800001u),  // signalling NaN with only a low payload bit
      3.0e38f * 10,                       // inf
  };
  v1::InferRequest req;
  SetRequestData(&req, x, 1, 8, v1::BF16);
  EXPECT_EQ(req.dtype(), v1::BF16);
  ASSERT_EQ(req.data().size(), 16u);
  uint16_t first;
  std::memcpy(&first, req.data().data(), 2);
  EXPECT_EQ(first, 0x3f80);  // little-endian on the wire
  v1::InferResponse resp;
  resp.set_dtype(v1::BF16);
  resp.add_shape(1);
  resp.add_shape(8);
  resp.set_data(req.data());
  auto back = ResponseFloats(resp);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const auto& y = *back;
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[2], 1.0f + 4.0f / 256);
  EXPECT_EQ(y[3], 1.0f + 2.0f / 256);
  EXPECT_EQ(y[4], -2.0f);
  EXPECT_TRUE(std::isnan(y[5]));
  EXPECT_TRUE(std::isnan(y[6]));
  EXPECT_TRUE(std::isinf(y[7]));
  for (int i = 0; i < 8; ++i) {
    if (!std::isnan(x[i])) {
      EXPECT_EQ(y[i], Bf16ToF32(F32ToBf16(x[i]))) << i;
    }
  }
}

TEST(ClientDataTest, ResponseFloatsChecksTheAnswer) {
  v1::InferResponse resp;
  resp.set_id(7);
  resp.set_dtype(v1::F32);
  resp.add_shape(2);
  resp.add_shape(3);
  resp.set_data(std::string(20, '\0'));
  auto r = ResponseFloats(resp);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find("needs 24"), std::string::npos) << r.status().message();

  resp.set_data(std::string(24, '\0'));
  resp.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(ResponseFloats(resp).status().code(), StatusCode::kCorrupt);

  resp.set_dtype(v1::F32);
  resp.set_code(v1::OVERLOADED);
  resp.set_message("queue full");
  r = ResponseFloats(resp);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message(), "server: overloaded: queue full");
  EXPECT_EQ(ErrorCodeKind(v1::DEADLINE_EXCEEDED), "deadline_exceeded");
  EXPECT_EQ(ErrorCodeKind(static_cast<v1::ErrorCode>(77)), "code_77");
}

// --- the connection
// -------------------------------------------------------------------------------

TEST(ServeConnectionTest, CallEchoes) {
  TestServer server(TestServer::Mode::kEcho);
  auto conn = MustConnect(server.address());
  ASSERT_NE(conn, nullptr);
  const v1::InferRequest req = MakeRequest(5, 3, 4);
  v1::InferResponse resp;
  ASSERT_TRUE(conn->Call(req, &resp, DeadlineIn(milliseconds(5000))).ok());
  EXPECT_EQ(resp.id(), 5u);
  EXPECT_EQ(resp.data(), req.data());
  auto y = ResponseFloats(resp);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ((*y)[1], 5.25f);
}

TEST(ServeConnectionTest, PipelinesTenRequestsAnsweredOutOfOrder) {
  TestServer server(TestServer::Mode::kReverseAfterN, 10);
  auto conn = MustConnect(server.address());
  ASSERT_NE(conn, nullptr);
  std::vector<v1::InferRequest> sent;
  for (uint64_t id = 1; id <= 10; ++id) {
    sent.push_back(MakeRequest(id, static_cast<int64_t>(id), 8));
    ASSERT_TRUE(conn->Send(sent.back(), DeadlineIn(milliseconds(5000))).ok());
  }
  std::vector<uint64_t> order;
  for (int i = 0; i < 10; ++i) {
    v1::InferResponse resp;
    const Status st = conn->Receive(&resp, DeadlineIn(milliseconds(5000)));
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_GE(resp.id(), 1u);
    ASSERT_LE(resp.id(), 10u);
    EXPECT_EQ(resp.data(), sent[resp.id() - 1].data());
    EXPECT_EQ(resp.shape(0), static_cast<int64_t>(resp.id()));
    order.push_back(resp.id());
  }
  EXPECT_EQ(order, (std::vector<uint64_t>{10, 9, 8, 7, 6, 5, 4, 3, 2, 1}));
}

TEST(ServeConnectionTest, FrameSentInPiecesWithSendRawAndSendParts) {
  TestServer server(TestServer::Mode::kEcho);
  auto conn = MustConnect(server.address());
  ASSERT_NE(conn, nullptr);
  auto frame = EncodeFrame(MakeRequest(9, 2, 2));
  ASSERT_TRUE(frame.ok());
  ASSERT_TRUE(conn->SendRaw(frame->data(), 3, DeadlineIn(milliseconds(5000))).ok());
  std::this_thread::sleep_for(milliseconds(20));
  ASSERT_TRUE(
      conn->SendRaw(frame->data() + 3, frame->size() - 3, DeadlineIn(milliseconds(5000))).ok());
  v1::InferResponse resp;
  ASSERT_TRUE(conn->Receive(&resp, DeadlineIn(milliseconds(5000))).ok());
  EXPECT_EQ(resp.id(), 9u);

  const std::string_view f(*frame);
  const std::string_view parts[] = {f.substr(0, 1), f.substr(1, 6), {}, f.substr(7)};
  ASSERT_TRUE(conn->SendParts(parts, DeadlineIn(milliseconds(5000))).ok());
  ASSERT_TRUE(conn->Receive(&resp, DeadlineIn(milliseconds(5000))).ok());
  EXPECT_EQ(resp.id(), 9u);
}

TEST(ServeConnectionTest, SilentServerHitsTheDeadlinePromptly) {
  TestServer server(TestServer::Mode::kSilent);
  auto conn = MustConnect(server.address());
  ASSERT_NE(conn, nullptr);
  ASSERT_TRUE(conn->Send(MakeRequest(1, 1, 4), DeadlineIn(milliseconds(5000))).ok());
  v1::InferResponse resp;
  const auto t0 = SteadyClock::now();
  const Status st = conn->Receive(&resp, DeadlineIn(milliseconds(150)));
  const double ms = std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count();
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  // The deadline is the feature: not before it (140: the clock's rounding), and well within
  // 6x it, a margin no loaded machine closes.
  EXPECT_GE(ms, 140);
  EXPECT_LT(ms, 1000);
  // A deadline does not break the connection.
  EXPECT_EQ(conn->Receive(&resp, DeadlineIn(milliseconds(10))).code(),
            StatusCode::kDeadlineExceeded);
  // A deadline in the past fails at once.
  EXPECT_EQ(conn->Receive(&resp, SteadyClock::now() - milliseconds(1)).code(),
            StatusCode::kDeadlineExceeded);
}

TEST(ServeConnectionTest, ServerClosingIsUnavailable) {
  TestServer server(TestServer::Mode::kCloseAfterOne);
  auto conn = MustConnect(server.address());
  ASSERT_NE(conn, nullptr);
  ASSERT_TRUE(conn->Send(MakeRequest(1, 1, 4), DeadlineIn(milliseconds(5000))).ok());
  v1::InferResponse resp;
  const Status st = conn->Receive(&resp, DeadlineIn(milliseconds(5000)));
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("connection closed by the server"), std::string::npos)
      << st.message();
  // Sticky: the next Receive says the same at once.
  EXPECT_EQ(conn->Receive(&resp, DeadlineIn(milliseconds(5000))).code(), StatusCode::kUnavailable);
}

TEST(ServeConnectionTest, AnswerOverTheClientLimitIsCorrupt) {
  TestServer server(TestServer::Mode::kEcho);
  ClientOptions o;
  o.max_frame_bytes = 256;
  auto conn = MustConnect(server.address(), o);
  ASSERT_NE(conn, nullptr);
  v1::InferResponse resp;
  const Status st = conn->Call(MakeRequest(1, 16, 8), &resp, DeadlineIn(milliseconds(5000)));
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
  EXPECT_NE(st.message().find("over the limit of 256"), std::string::npos) << st.message();
}

// A port that was just free: bind, read it, close.
std::string ClosedPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}

TEST(ServeConnectionTest, ConnectToAClosedPortFails) {
  const std::string target = ClosedPort();
  ClientOptions o;
  o.connect_timeout = milliseconds(2000);
  auto c = ServeConnection::Connect(target, o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().ToString();
  EXPECT_NE(c.status().message().find(target), std::string::npos) << c.status().message();
}

TEST(ServeConnectionTest, BadAddressesAreInvalidArguments) {
  for (const char* bad :
       {"localhost", "127.0.0.1:", "127.0.0.1:99999", "::1:80", "[::1]80", ":80"}) {
    auto c = ServeConnection::Connect(bad);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument)
        << bad << ": " << c.status().ToString();
  }
}

// --- FailoverClient: several routers of one job
// ------------------------------------------------------------------

TEST(FailoverClientTest, ParseTargetsChecksEveryAddress) {
  auto one = ParseTargets("127.0.0.1:5000");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(*one, std::vector<std::string>{"127.0.0.1:5000"});
  auto two = ParseTargets("10.0.0.1:5000,[::1]:6000");
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(two->size(), 2u);
  for (const char* bad :
       {"", ",", "127.0.0.1:5000,", "127.0.0.1:5000,,127.0.0.1:6000", "127.0.0.1:5000,localhost"}) {
    auto r = ParseTargets(bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

// The router that takes the request closes the connection (it died): the request is sent once
// more to the next router, which answers it.
TEST(FailoverClientTest, ARequestWhoseRouterDiesIsAnsweredByTheNext) {
  TestServer dying(TestServer::Mode::kCloseAfterOne);
  TestServer alive(TestServer::Mode::kEcho);
  FailoverClient client({dying.address(), alive.address()});
  const v1::InferRequest req = MakeRequest(7, 2, 4);
  v1::InferResponse resp;
  const Status s = client.Call(req, &resp, DeadlineIn(milliseconds(5000)));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(resp.id(), 7u);
  EXPECT_EQ(resp.data(), req.data());
  EXPECT_EQ(dying.requests(), 1);
  EXPECT_EQ(alive.requests(), 1);
  EXPECT_EQ(client.retried(), 1u);
  EXPECT_EQ(client.failovers(), 1u);
  EXPECT_EQ(client.target(), alive.address());
  // The next request stays with the router that answers.
  ASSERT_TRUE(client.Call(MakeRequest(8, 1, 4), &resp, DeadlineIn(milliseconds(5000))).ok());
  EXPECT_EQ(alive.requests(), 2);
  EXPECT_EQ(client.retried(), 1u);
}

TEST(FailoverClientTest, ARouterThatRefusesIsSkippedAtConnect) {
  TestServer alive(TestServer::Mode::kEcho);
  FailoverClient client({ClosedPort(), alive.address()});
  ASSERT_TRUE(client.Connect().ok());
  EXPECT_EQ(client.target(), alive.address());
  v1::InferResponse resp;
  EXPECT_TRUE(client.Call(MakeRequest(1, 1, 4), &resp, DeadlineIn(milliseconds(5000))).ok());
  EXPECT_EQ(client.retried(), 0u);
}

// Retried once, not more: two routers that both die with the request give its error.
TEST(FailoverClientTest, RetriedOnceOnly) {
  TestServer a(TestServer::Mode::kCloseAfterOne);
  TestServer b(TestServer::Mode::kCloseAfterOne);
  FailoverClient client({a.address(), b.address()});
  v1::InferResponse resp;
  const Status s = client.Call(MakeRequest(3, 1, 4), &resp, DeadlineIn(milliseconds(5000)));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_EQ(a.requests() + b.requests(), 2);
  EXPECT_EQ(client.retried(), 1u);
  EXPECT_FALSE(client.connected());
}

// A deadline is the caller's: not retried elsewhere (the router may still be computing it).
TEST(FailoverClientTest, ADeadlineIsNotRetried) {
  TestServer silent(TestServer::Mode::kSilent);
  TestServer alive(TestServer::Mode::kEcho);
  FailoverClient client({silent.address(), alive.address()});
  v1::InferResponse resp;
  const Status s = client.Call(MakeRequest(4, 1, 4), &resp, DeadlineIn(milliseconds(150)));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_EQ(alive.requests(), 0);
  EXPECT_EQ(client.retried(), 0u);
}

TEST(FailoverClientTest, NoRouterAnsweringNamesEveryOneTried) {
  const std::string a = ClosedPort(), b = ClosedPort();
  FailoverOptions o;
  o.client.connect_timeout = milliseconds(2000);
  FailoverClient client({a, b}, 0, o);
  const Status s = client.Connect();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("no router answers"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(a), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(b), std::string::npos) << s.message();
}

}  // namespace
}  // namespace moerun
