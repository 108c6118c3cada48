// Cheap denial of service against the endpoints, over real loopback sockets and real servers:
// headers that announce large frames and send nothing more, silent connections, floods of
// keep-alive HTTP connections, and silent or unauthenticated control connections. In each, a
// verified client (or a health probe, or an authenticated moectl request) must keep being
// answered. No assertion depends on timing beyond generous deadlines: counts and order only.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "moerun/v1/control.pb.h"
#include "runtime/layer/moe_layer.h"
#include "runtime/serving/control_endpoint.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/framed_server.h"
#include "runtime/serving/http_server.h"
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
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

// Enough descriptors for a flood and its server in one process.
bool RaiseFdLimit(rlim_t want) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return false;
  if (rl.rlim_cur < want) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, want);
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  return getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur >= want;
}

// A blocking loopback connection (the fd), or -1.
int RawConnect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The same from a given local address (127.0.0.0/8 is all loopback on Linux: another "host").
int RawConnectFrom(uint16_t port, const char* from) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in local{};
  local.sin_family = AF_INET;
  ::inet_pton(AF_INET, from, &local.sin_addr);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const void* p, size_t n) {
  const char* b = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// True once the server closed the connection (EOF or reset) before `until`; bytes the server
// sent before closing are read and dropped.
bool ClosedBy(int fd, Clock::time_point until) {
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k <= 0) return true;
  }
}

// Still open now: nothing to read, no EOF.
bool OpenNow(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

struct Fds {
  std::vector<int> fds;
  ~Fds() {
    for (int fd : fds) ::close(fd);
  }
};

Deadline Soon() { return DeadlineIn(seconds(30)); }

// A router in miniature (tests/serving/mini_router.h) with a verified request of 2 tokens.
class Server : public MiniRouter {
 public:
  explicit Server(ServingOptions so = {}, milliseconds slow = milliseconds(0))
      : MiniRouter(std::move(so), BatcherOptions{}, slow),
        x_(RandomRows(2, hidden(), 7)),
        want_(Expected(x_)) {}

  InferRequest Request(uint64_t id) const {
    InferRequest r;
    r.set_id(id);
    SetRequestData(&r, x_.data(), 2, hidden(), v1::F32);
    return r;
  }
  // One verified call on `c`: OK, the request's id, the layer's exact answer.
  bool Verified(ServeConnection& c, uint64_t id, std::string* why) {
    InferResponse resp;
    const Status s = c.Call(Request(id), &resp, Soon());
    if (!s.ok()) return *why = s.ToString(), false;
    if (resp.code() != v1::OK) return *why = resp.message(), false;
    if (resp.id() != id) return *why = "wrong id", false;
    auto y = ResponseFloats(resp);
    if (!y.ok() || y->size() != want_.size() ||
        std::memcmp(y->data(), want_.data(), want_.size() * 4) != 0) {
      return *why = "wrong answer", false;
    }
    return true;
  }
  // A verified call on a new connection.
  bool VerifiedFresh(uint64_t id, std::string* why) {
    auto c = ServeConnection::Connect(target());
    if (!c.ok()) return *why = c.status().ToString(), false;
    return Verified(**c, id, why);
  }

 private:
  std::vector<float> x_, want_;
};

// Connections that send only a header announcing 64 MiB (the largest frame) hold nothing: with
// the default 1 GiB budget, 16 of them used to shut every client out for the frame timeout.
TEST(EndpointDosTest, HeaderOnlyConnectionsDoNotShutOutAVerifiedClient) {
  ASSERT_TRUE(RaiseFdLimit(1024));
  Server s;
  auto client = ServeConnection::Connect(s.target());
  ASSERT_TRUE(client.ok());
  Fds flood;
  uint8_t hdr[4];
  PutFrameLength(64u << 20, hdr);
  for (int i = 0; i < 64; ++i) {
    const int fd = RawConnect(s.port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, hdr, 4));
    flood.fds.push_back(fd);
  }
  std::string why;
  for (uint64_t id = 1; id <= 40; ++id) {
    ASSERT_TRUE(s.Verified(**client, id, &why)) << id << ": " << why;
    ASSERT_TRUE(s.VerifiedFresh(1000 + id, &why)) << id << ": " << why;
  }
  // The flood is still there (its frames have not timed out): it held no budget.
  int open = 0;
  for (int fd : flood.fds) open += OpenNow(fd);
  EXPECT_EQ(open, 64);
}

// A frame over the byte budget is dropped as it arrives; the refusal carries its id, and the
// connection stays usable.
TEST(EndpointDosTest, AFrameOverTheBudgetIsRefusedWithItsId) {
  ServingOptions so;
  so.framed.max_buffered_bytes = 4 << 20;  // 2 MiB per peer address
  Server s(so);
  auto c = ServeConnection::Connect(s.target());
  ASSERT_TRUE(c.ok());
  InferRequest big;
  big.set_id(777);
  big.mutable_data()->assign(3 << 20, 'x');  // refused before it is parsed
  ASSERT_TRUE((*c)->Send(big, Soon()).ok());
  InferResponse resp;
  ASSERT_TRUE((*c)->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::OVERLOADED) << resp.message();
  EXPECT_EQ(resp.id(), 777u);
  std::string why;
  EXPECT_TRUE(s.Verified(**c, 778, &why)) << why;
  // Under the budget, the same size is taken (and refused only for its content).
  ServingOptions roomy;
  roomy.framed.max_buffered_bytes = 16 << 20;
  Server r(roomy);
  auto d = ServeConnection::Connect(r.target());
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->Send(big, Soon()).ok());
  ASSERT_TRUE((*d)->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::INVALID_ARGUMENT) << resp.message();
  EXPECT_EQ(resp.id(), 777u);
}

// One peer address cannot take the whole budget: another's large frame still fits.
TEST(EndpointDosTest, OneAddressCannotTakeTheWholeBudget) {
  ServingOptions so;
  so.framed.max_buffered_bytes = 8 << 20;  // 4 MiB per peer address
  Server s(so);
  uint8_t hdr[4];
  PutFrameLength(3u << 20, hdr);
  const std::string part(2 << 20, 'y');
  Fds flood;  // 3 frames of 3 MiB cut at 2 MiB: 6 MiB sent, at most 4 MiB held
  for (int i = 0; i < 3; ++i) {
    const int fd = RawConnectFrom(s.port(), "127.0.0.2");
    ASSERT_GE(fd, 0);
    flood.fds.push_back(fd);
    ASSERT_TRUE(SendAll(fd, hdr, 4));
    ASSERT_TRUE(SendAll(fd, part.data(), part.size()));
  }
  auto c = ServeConnection::Connect(s.target());
  ASSERT_TRUE(c.ok());
  InferRequest big;
  big.set_id(5);
  big.mutable_data()->assign(3 << 20, 'x');
  ASSERT_TRUE((*c)->Send(big, Soon()).ok());
  InferResponse resp;
  ASSERT_TRUE((*c)->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::INVALID_ARGUMENT) << resp.message();  // taken, then checked
  EXPECT_EQ(resp.id(), 5u);
  std::string why;
  EXPECT_TRUE(s.Verified(**c, 6, &why)) << why;
}

// A frame cut short by a silent client: FRAME_TIMEOUT with the id its first bytes carry.
TEST(EndpointDosTest, AFrameTimeoutCarriesTheRequestsId) {
  ServingOptions so;
  so.framed.frame_timeout = milliseconds(300);
  Server s(so);
  const std::string frame = EncodeFrame(s.Request(4242)).value();
  auto c = ServeConnection::Connect(s.target());
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->SendRaw(frame.data(), 4 + 16, Soon()).ok());
  InferResponse resp;
  ASSERT_TRUE((*c)->Receive(&resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::FRAME_TIMEOUT) << resp.message();
  EXPECT_EQ(resp.id(), 4242u);
  EXPECT_TRUE(ClosedBy((*c)->fd(), Clock::now() + seconds(20)));
}

// Silent connections are closed after the first-frame timeout, idle ones after the idle timeout;
// one waiting for a slow answer is not idle.
TEST(EndpointDosTest, SilentAndIdleConnectionsAreClosed) {
  ASSERT_TRUE(RaiseFdLimit(1024));
  ServingOptions so;
  so.framed.first_frame_timeout = milliseconds(300);
  so.framed.idle_timeout = milliseconds(400);
  Server s(so, milliseconds(1200));  // every batch takes 1.2 s: longer than the idle timeout
  Fds silent;
  for (int i = 0; i < 100; ++i) {
    silent.fds.push_back(RawConnect(s.port()));
    ASSERT_GE(silent.fds.back(), 0);
  }
  auto c = ServeConnection::Connect(s.target());
  ASSERT_TRUE(c.ok());
  std::string why;
  ASSERT_TRUE(s.Verified(**c, 1, &why)) << why;  // answered after 1.2 s, not closed meanwhile
  const auto until = Clock::now() + seconds(30);
  int closed = 0;
  for (int fd : silent.fds) closed += ClosedBy(fd, until);
  EXPECT_EQ(closed, 100);
  EXPECT_TRUE(ClosedBy((*c)->fd(), until));  // idle after its answer
  ASSERT_TRUE(s.VerifiedFresh(2, &why)) << why;
}

// At the connection cap, silent connections make room for new ones (oldest first): a flood that
// keeps reconnecting never locks clients out, and a client's idle connection is kept.
TEST(EndpointDosTest, SilentConnectionsDoNotFillTheCap) {
  ASSERT_TRUE(RaiseFdLimit(1024));
  ServingOptions so;
  so.framed.max_connections = 64;
  so.framed.first_frame_timeout = seconds(60);  // only making room frees them here
  Server s(so);
  auto client = ServeConnection::Connect(s.target());
  ASSERT_TRUE(client.ok());
  std::string why;
  ASSERT_TRUE(s.Verified(**client, 1, &why)) << why;
  Fds first;
  for (int i = 0; i < 64; ++i) {
    first.fds.push_back(RawConnect(s.port()));
    ASSERT_GE(first.fds.back(), 0);
  }
  // The cap is full of silent connections; a new client is still answered, and the oldest
  // silent connection was closed for it.
  ASSERT_TRUE(s.VerifiedFresh(2, &why)) << why;
  EXPECT_TRUE(ClosedBy(first.fds[0], Clock::now() + seconds(20)));
  // A flood that reconnects all the time, beside the client.
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread flood([&] {
    std::vector<int> ring(100, -1);
    for (size_t i = 0; !stop.load(); i = (i + 1) % ring.size()) {
      if (ring[i] >= 0) ::close(ring[i]);
      ring[i] = RawConnect(s.port());
      if (ring[i] >= 0) ++opened;
    }
    for (int fd : ring) {
      if (fd >= 0) ::close(fd);
    }
  });
  int ok_kept = 0, ok_fresh = 0;
  for (uint64_t id = 10; id < 40; ++id) {
    ok_kept += s.Verified(**client, id, &why);
    ok_fresh += s.VerifiedFresh(1000 + id, &why);
  }
  stop = true;
  flood.join();
  EXPECT_GT(opened.load(), 100);
  EXPECT_EQ(ok_kept, 30) << why;  // the client's own connection is never the one closed
  EXPECT_GE(ok_fresh, 27) << why;
}

// A full endpoint makes room at the address holding the most connections: one silent
// connection of 127.0.0.1 (the oldest), then silent ones of 127.0.0.2 fill the cap; a new client
// of 127.0.0.1 pushes out one of 127.0.0.2's, not 127.0.0.1's older one.
TEST(EndpointDosTest, AFullEndpointMakesRoomAtTheBusiestAddress) {
  ASSERT_TRUE(RaiseFdLimit(1024));
  ServingOptions so;
  so.framed.max_connections = 8;
  so.framed.first_frame_timeout = seconds(60);
  Server s(so);
  Fds own, flood;
  own.fds.push_back(RawConnect(s.port()));
  ASSERT_GE(own.fds[0], 0);
  for (int i = 0; i < 7; ++i) {
    flood.fds.push_back(RawConnectFrom(s.port(), "127.0.0.2"));
    ASSERT_GE(flood.fds.back(), 0);
  }
  std::string why;
  ASSERT_TRUE(s.VerifiedFresh(1, &why)) << why;
  // One of the flood's connections (its oldest) was closed; 127.0.0.1's is still open.
  EXPECT_TRUE(ClosedBy(flood.fds[0], Clock::now() + seconds(20)));
  EXPECT_TRUE(OpenNow(own.fds[0]));
}

// max_connections_per_peer: an address at its cap pushes out its own oldest waiting connection
// for a new one, and is refused (OVERLOADED naming the address) when none of its connections can
// go; other addresses are not affected.
TEST(EndpointDosTest, OneAddressIsHeldToItsOwnCap) {
  ASSERT_TRUE(RaiseFdLimit(1024));
  ServingOptions so;
  so.framed.max_connections = 64;
  so.framed.max_connections_per_peer = 4;
  so.framed.first_frame_timeout = seconds(60);
  Server s(so, milliseconds(1500));
  Fds flood;
  for (int i = 0; i < 4; ++i) {
    flood.fds.push_back(RawConnectFrom(s.port(), "127.0.0.3"));
    ASSERT_GE(flood.fds.back(), 0);
  }
  // A fifth from the same address: the oldest of its four goes.
  flood.fds.push_back(RawConnectFrom(s.port(), "127.0.0.3"));
  ASSERT_GE(flood.fds.back(), 0);
  EXPECT_TRUE(ClosedBy(flood.fds[0], Clock::now() + seconds(20)));
  // Four connections of 127.0.0.1 that each wait for an answer (the batcher is slow: none may
  // be closed) fill its cap; a fifth is refused with a reason, and 127.0.0.3 is unaffected.
  std::vector<std::unique_ptr<ServeConnection>> busy;
  for (uint64_t id = 1; id <= 4; ++id) {
    auto c = ServeConnection::Connect(s.target());
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE((*c)->SendRequest(s.Request(id), Soon()).ok());
    busy.push_back(std::move(*c));
  }
  std::this_thread::sleep_for(milliseconds(300));  // the server holds the four requests
  auto refused = ServeConnection::Connect(s.target());
  ASSERT_TRUE(refused.ok());
  InferResponse r;
  const Status st = (*refused)->Receive(&r, Soon());
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(r.code(), v1::OVERLOADED);
  EXPECT_NE(r.message().find("too many connections from 127.0.0.1"), std::string::npos)
      << r.message();
  const int other = RawConnectFrom(s.port(), "127.0.0.4");
  ASSERT_GE(other, 0);
  EXPECT_TRUE(OpenNow(other));
  ::close(other);
  for (auto& c : busy) {  // each is answered
    InferResponse a;
    ASSERT_TRUE(c->Receive(&a, Soon()).ok());
    EXPECT_EQ(a.code(), v1::OK) << a.message();
  }
}

// HTTP: 512 keep-alive connections (the cap), then as many that send nothing, then as many
// that send half a header: /health keeps answering on new connections.
TEST(EndpointDosTest, KeepAliveAndSilentHttpConnectionsDoNotBlockHealth) {
  ASSERT_TRUE(RaiseFdLimit(4096));
  std::map<std::string, HttpHandler> routes;
  routes["/health/live"] = [] { return HttpReply{200, "text/plain", "live\n"}; };
  routes["/metrics"] = [] { return HttpReply{200, "text/plain", "m 1\n"}; };
  auto srv = HttpServer::Start(HostPort{"127.0.0.1", 0}, routes, "dos test http");
  ASSERT_TRUE(srv.ok()) << srv.status().ToString();
  const uint16_t port = (*srv)->port();
  const auto probe = [port](std::string* got) {
    const int fd = RawConnect(port);
    if (fd < 0) return false;
    const std::string req = "GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    bool ok = SendAll(fd, req.data(), req.size());
    got->clear();
    char buf[1024];
    const auto until = Clock::now() + seconds(20);
    while (ok && Clock::now() < until) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 1000) <= 0) continue;
      const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
      if (k <= 0) break;
      got->append(buf, static_cast<size_t>(k));
    }
    ::close(fd);
    return got->rfind("HTTP/1.1 200", 0) == 0 && got->find("live") != std::string::npos;
  };
  std::string got;
  ASSERT_TRUE(probe(&got)) << got;
  Fds keep;
  const std::string metrics = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  for (int i = 0; i < 512; ++i) {
    const int fd = RawConnect(port);
    ASSERT_GE(fd, 0);
    keep.fds.push_back(fd);
    ASSERT_TRUE(SendAll(fd, metrics.data(), metrics.size()));
  }
  int answered = 0;
  for (int fd : keep.fds) {
    char buf[512];
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20000) > 0 && ::recv(fd, buf, sizeof buf, 0) > 0) ++answered;
  }
  EXPECT_EQ(answered, 512);
  int probes = 0;
  for (int i = 0; i < 20; ++i) probes += probe(&got);
  EXPECT_EQ(probes, 20) << got;
  Fds silent, partial;
  for (int i = 0; i < 512; ++i) {
    silent.fds.push_back(RawConnect(port));
    ASSERT_GE(silent.fds.back(), 0);
  }
  probes = 0;
  for (int i = 0; i < 20; ++i) probes += probe(&got);
  EXPECT_EQ(probes, 20) << got;
  const std::string half = "GET /metrics HTTP/1.1\r\nHost: ";
  for (int i = 0; i < 512; ++i) {
    partial.fds.push_back(RawConnect(port));
    ASSERT_GE(partial.fds.back(), 0);
    SendAll(partial.fds.back(), half.data(), half.size());
  }
  probes = 0;
  for (int i = 0; i < 20; ++i) probes += probe(&got);
  EXPECT_EQ(probes, 20) << got;
}

// HTTP: a connection that sends nothing, and a kept-alive one that goes silent, are closed after
// the idle timeout; a header that never completes after the read timeout.
TEST(EndpointDosTest, HttpIdleAndHeaderTimeouts) {
  HttpServerOptions o;
  o.idle_timeout = milliseconds(300);
  o.read_timeout = milliseconds(600);
  std::map<std::string, HttpHandler> routes;
  routes["/metrics"] = [] { return HttpReply{200, "text/plain", "m 1\n"}; };
  auto srv = HttpServer::Start(HostPort{"127.0.0.1", 0}, routes, "dos test http", o);
  ASSERT_TRUE(srv.ok());
  Fds fds;
  const int silent = RawConnect((*srv)->port());
  const int kept = RawConnect((*srv)->port());
  const int slow = RawConnect((*srv)->port());
  fds.fds = {silent, kept, slow};
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(SendAll(kept, req.data(), req.size()));
  ASSERT_TRUE(SendAll(slow, req.data(), 10));
  const auto until = Clock::now() + seconds(30);
  EXPECT_TRUE(ClosedBy(silent, until));
  EXPECT_TRUE(ClosedBy(kept, until));  // after its answer (read and dropped here)
  EXPECT_TRUE(ClosedBy(slow, until));
}

// The control endpoint, flooded by silent connections and by unauthenticated ones that keep
// sending wrong tokens, still answers authenticated requests, on new connections and on one
// kept open (an authenticated connection is never closed to make room).
TEST(EndpointDosTest, ControlFloodsDoNotLockOutAuthenticatedRequests) {
  ASSERT_TRUE(RaiseFdLimit(1024));
  MetricsRegistry metrics;
  ControlProvider provider;
  provider.status = [] {
    v1::StatusResponse st;
    st.set_num_ranks(4);
    return st;
  };
  provider.placement = [] { return v1::PlacementResponse{}; };
  provider.stats = [] { return v1::StatsResponse{}; };
  FramedServerOptions co;
  co.listen = HostPort{"127.0.0.1", 0};
  co.name = "dos test control";
  co.max_connections = 64;
  co.first_frame_timeout = seconds(60);  // only making room frees them here
  auto ep = ControlEndpoint::Start(co, "s3cret-token", provider, &metrics);
  ASSERT_TRUE(ep.ok()) << ep.status().ToString();
  const std::string target = "127.0.0.1:" + std::to_string((*ep)->port());
  const auto status = [&](ServeConnection& c, const std::string& token, v1::ControlResponse* r) {
    v1::ControlRequest req;
    req.set_token(token);
    req.mutable_status();
    if (!c.Send(req, Soon()).ok()) return false;
    return c.Receive(r, Soon()).ok();
  };
  const auto fresh_ok = [&] {
    auto c = ServeConnection::Connect(target);
    v1::ControlResponse r;
    return c.ok() && status(**c, "s3cret-token", &r) && r.code() == v1::OK &&
           r.status().num_ranks() == 4;
  };
  auto kept = ServeConnection::Connect(target);
  ASSERT_TRUE(kept.ok());
  v1::ControlResponse r;
  ASSERT_TRUE(status(**kept, "s3cret-token", &r));
  ASSERT_EQ(r.code(), v1::OK);
  // 64 silent connections (the whole cap).
  Fds silent;
  for (int i = 0; i < 64; ++i) {
    silent.fds.push_back(RawConnect((*ep)->port()));
    ASSERT_GE(silent.fds.back(), 0);
  }
  int ok = 0;
  for (int i = 0; i < 10; ++i) ok += fresh_ok();
  EXPECT_EQ(ok, 10);
  // 64 connections from another address that send wrong tokens (and read no answer).
  v1::ControlRequest bad;
  bad.set_token("wrong");
  bad.mutable_status();
  const std::string bad_frame = EncodeFrame(bad).value();
  Fds wrong;
  for (int i = 0; i < 64; ++i) {
    const int fd = RawConnectFrom((*ep)->port(), "127.0.0.2");
    if (fd < 0) continue;
    SendAll(fd, bad_frame.data(), bad_frame.size());
    SendAll(fd, bad_frame.data(), bad_frame.size());
    wrong.fds.push_back(fd);
  }
  EXPECT_GT(wrong.fds.size(), 0u);
  ok = 0;
  for (int i = 0; i < 10; ++i) ok += fresh_ok();
  EXPECT_EQ(ok, 10);
  // A reconnecting flood from the other address (silent, or one wrong token each) beside
  // authenticated requests.
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread flood([&] {
    std::vector<int> ring(80, -1);
    for (size_t i = 0; !stop.load(); i = (i + 1) % ring.size()) {
      if (ring[i] >= 0) ::close(ring[i]);
      ring[i] = RawConnectFrom((*ep)->port(), "127.0.0.2");
      if (ring[i] < 0) continue;
      ++opened;
      if (i % 2 == 0) SendAll(ring[i], bad_frame.data(), bad_frame.size());
    }
    for (int fd : ring) {
      if (fd >= 0) ::close(fd);
    }
  });
  // Requests until the flood has opened 500 connections (at least 20 rounds, at most 60 s).
  int kept_ok = 0, rounds = 0;
  ok = 0;
  const auto until = Clock::now() + seconds(60);
  while ((rounds < 20 || opened.load() < 500) && Clock::now() < until) {
    kept_ok += status(**kept, "s3cret-token", &r) && r.code() == v1::OK;
    ok += fresh_ok();
    ++rounds;
  }
  stop = true;
  flood.join();
  EXPECT_GE(opened.load(), 500);
  EXPECT_EQ(kept_ok, rounds);
  EXPECT_GE(ok * 10, rounds * 9) << ok << " of " << rounds;
  (*ep)->Stop();
}

// An IPv6 listen address is printed bracketed, so that its port stays apart: the listening line
// and the error of a port already taken ("[::1]:PORT", never "::1:PORT").
TEST(EndpointDosTest, IpV6AddressesArePrintedBracketed) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::default_logger()->sinks().push_back(sink);
  FramedHandlers h;
  h.on_frame = [](const std::shared_ptr<FramedConnection>&, PooledBuffer, BudgetLease) {};
  h.error_frame = [](v1::ErrorCode, const std::string&, uint64_t) { return std::string(); };
  FramedServerOptions o;
  o.name = "v6 test";
  o.listen = HostPort{"::1", 0};
  auto first = FramedServer::Start(o, h);
  if (!first.ok()) {
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
    GTEST_SKIP() << "no IPv6 loopback here: " << first.status().ToString();
  }
  const std::string where = "[::1]:" + std::to_string((*first)->port());
  o.listen.port = (*first)->port();
  auto second = FramedServer::Start(o, h);
  spdlog::default_logger()->flush();
  auto& sinks = spdlog::default_logger()->sinks();
  sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot listen on " + where), std::string::npos)
      << second.status().ToString();
  EXPECT_NE(out.str().find("v6 test listening on " + where), std::string::npos) << out.str();
  (*first)->Stop();
}

}  // namespace
}  // namespace moerun
