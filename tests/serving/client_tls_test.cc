// The client side of TLS (ClientOptions::tls, runtime/serving/tls_client.h) against a real TLS
// server: a small echo server in this test (OpenSSL, blocking, one thread per connection) with a CA
// and a server certificate (subjectAltName IP:127.0.0.1, DNS:localhost) made by the openssl command
// at the start. Checked: frames round trip over TLS (by address and by name, small and large,
// SendRequest's gathered parts), a wrong CA and a wrong name fail the handshake with one clear
// line, a missing CA file is a bad argument, a plain client of the TLS server and a TLS client
// of a plain server fail within their deadlines, one thread sending many frames while another
// receives them, Shutdown waking a blocked Receive, and a client certificate (mTLS).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/serving/frame.h"
#include "runtime/serving/serve_client.h"

namespace moerun {
namespace {

using v1::InferRequest;

// The certificates, made once for the whole test program.
class Certs {
 public:
  static const Certs& Get() {
    static const Certs certs;
    return certs;
  }
  bool ok() const { return ok_; }
  std::string File(const std::string& name) const { return dir_ + "/" + name; }

 private:
  Certs() {
    char tmpl[] = "/tmp/moerun-tls-test-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return;
    dir_ = tmpl;
    std::ofstream(File("server.ext")) << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    std::ofstream(File("client.ext")) << "extendedKeyUsage=clientAuth\n";
    const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string ca_ext =
        " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign";
    const std::string d = dir_ + "/";
    const std::vector<std::string> steps = {
        "openssl req -x509" + ec + " -keyout " + d + "ca.key -out " + d + "ca.crt -days 2" +
            " -subj /CN=moerun-test-ca" + ca_ext,
        "openssl req -x509" + ec + " -keyout " + d + "other.key -out " + d + "other.crt -days 2" +
            " -subj /CN=moerun-other-ca" + ca_ext,
        "openssl req" + ec + " -keyout " + d + "server.key -out " + d + "server.csr" +
            " -subj /CN=localhost",
        "openssl x509 -req -in " + d + "server.csr -CA " + d + "ca.crt -CAkey " + d +
            "ca.key -CAcreateserial -out " + d + "server.crt -days 2 -extfile " + d + "server.ext",
        "openssl req" + ec + " -keyout " + d + "client.key -out " + d + "client.csr" +
            " -subj /CN=moerun-client",
        "openssl x509 -req -in " + d + "client.csr -CA " + d + "ca.crt -CAkey " + d +
            "ca.key -CAcreateserial -out " + d + "client.crt -days 2 -extfile " + d + "client.ext",
    };
    for (const std::string& s : steps) {
      if (std::system((s + " >" + d + "openssl.log 2>&1").c_str()) != 0) return;
    }
    ok_ = true;
  }
  ~Certs() {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  std::string dir_;
  bool ok_ = false;
};

// A blocking echo server on 127.0.0.1: every byte a client sends comes back (so every frame
// comes back as it was sent). With `tls` over TLS with the server certificate, else plain
// TCP; with `client_ca` it requires a client certificate signed by it.
class EchoServer {
 public:
  explicit EchoServer(bool tls, const std::string& client_ca = "") : tls_(tls) {
    const Certs& c = Certs::Get();
    if (tls_) {
      ctx_ = SSL_CTX_new(TLS_server_method());
      SSL_CTX_use_certificate_chain_file(ctx_, c.File("server.crt").c_str());
      SSL_CTX_use_PrivateKey_file(ctx_, c.File("server.key").c_str(), SSL_FILETYPE_PEM);
      if (!client_ca.empty()) {
        SSL_CTX_load_verify_locations(ctx_, client_ca.c_str(), nullptr);
        SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
      }
    }
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listen_fd_, 16) != 0 ||
        ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ADD_FAILURE() << "cannot listen";
      return;
    }
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }

  ~EchoServer() {
    stop_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (std::thread& t : conns_) t.join();
    ::close(listen_fd_);
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
  }

  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  int handshakes_failed() const { return failed_.load(); }

 private:
  void AcceptLoop() {
    while (!stop_) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      timeval tv{10, 0};  // a silent client does not keep a thread forever
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(fd);
      conns_.emplace_back([this, fd] { Serve(fd); });
    }
  }

  void Serve(int fd) {
    // OpenSSL writes with write(2): a client gone raises SIGPIPE, held pending on this thread
    // only (the clients' threads keep it: a client must never raise it).
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    std::vector<char> buf(64 << 10);
    if (!tls_) {
      for (;;) {
        const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
        if (n <= 0) break;
        for (ssize_t off = 0; off < n;) {
          const ssize_t w =
              ::send(fd, buf.data() + off, static_cast<size_t>(n - off), MSG_NOSIGNAL);
          if (w <= 0) break;
          off += w;
        }
      }
    } else {
      SSL* ssl = SSL_new(ctx_);
      SSL_set_fd(ssl, fd);
      if (SSL_accept(ssl) != 1) {
        ++failed_;
      } else {
        for (;;) {
          size_t n = 0;
          if (SSL_read_ex(ssl, buf.data(), buf.size(), &n) != 1) break;
          size_t written = 0;
          if (SSL_write_ex(ssl, buf.data(), n, &written) != 1) break;
        }
        SSL_shutdown(ssl);
      }
      SSL_free(ssl);
      ERR_clear_error();
    }
    ::shutdown(fd, SHUT_RDWR);
  }

  bool tls_;
  SSL_CTX* ctx_ = nullptr;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> failed_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;  // closed by the destructor after the threads end
  std::vector<std::thread> conns_;

 public:
  EchoServer(const EchoServer&) = delete;
  EchoServer& operator=(const EchoServer&) = delete;
};

ClientOptions Tls(const std::string& ca_file, const std::string& server_name = "") {
  ClientOptions o;
  o.connect_timeout = std::chrono::milliseconds(5000);
  o.tls.enabled = true;
  o.tls.ca_file = ca_file;
  o.tls.server_name = server_name;
  return o;
}

InferRequest Request(uint64_t id, size_t data_bytes) {
  InferRequest r;
  r.set_id(id);
  r.add_shape(1);
  r.add_shape(static_cast<int64_t>(data_bytes / 4));
  std::string data(data_bytes, '\0');
  std::mt19937 rng(static_cast<uint32_t>(id));
  for (char& ch : data) ch = static_cast<char>(rng());
  r.set_data(std::move(data));
  return r;
}

class ClientTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Certs::Get().ok()) GTEST_SKIP() << "the openssl command could not make certificates";
  }
  std::string Ca() const { return Certs::Get().File("ca.crt"); }
};

TEST_F(ClientTlsTest, FramesRoundTripByAddressAndByName) {
  EchoServer server(true);
  for (const std::string& target :
       {server.target(), "localhost:" + std::to_string(server.port())}) {
    SCOPED_TRACE(target);
    ClientOptions o = Tls(Ca());
    o.key = "the-serving-key";
    auto c = ServeConnection::Connect(target, o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE((*c)->tls());
    EXPECT_EQ((*c)->TlsDescription().rfind("TLSv1.", 0), 0u) << (*c)->TlsDescription();
    const auto deadline = DeadlineIn(std::chrono::seconds(10));
    for (size_t bytes : {size_t{0}, size_t{40}, size_t{20000}, size_t{100000}}) {
      const InferRequest req = Request(bytes + 1, bytes);
      ASSERT_TRUE((*c)->Send(req, deadline).ok());
      InferRequest back;
      const Status st = (*c)->Receive(&back, deadline);
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(back.SerializeAsString(), req.SerializeAsString());
      // SendRequest: header, body and the key field gathered from three parts.
      ASSERT_TRUE((*c)->SendRequest(req, deadline).ok());
      ASSERT_TRUE((*c)->Receive(&back, deadline).ok());
      EXPECT_EQ(back.key(), "the-serving-key");
      back.clear_key();
      EXPECT_EQ(back.SerializeAsString(), req.SerializeAsString());
    }
    // A frame in two raw writes arrives as one.
    const std::string frame = *EncodeFrame(Request(7, 64));
    ASSERT_TRUE((*c)->SendRaw(frame.data(), 3, deadline).ok());
    ASSERT_TRUE((*c)->SendRaw(frame.data() + 3, frame.size() - 3, deadline).ok());
    std::string body;
    ASSERT_TRUE((*c)->ReceiveFrame(&body, deadline).ok());
    EXPECT_EQ(body, frame.substr(kFrameHeaderBytes));
  }
}

TEST_F(ClientTlsTest, WrongCaFailsTheHandshakeWithOneClearLine) {
  EchoServer server(true);
  auto c = ServeConnection::Connect(server.target(), Tls(Certs::Get().File("other.crt")));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  const std::string& m = c.status().message();
  EXPECT_EQ(m.find("connect to " + server.target() +
                   ": TLS handshake failed: certificate verify "
                   "failed ("),
            0u)
      << m;
  EXPECT_EQ(m.find('\n'), std::string::npos);
  // No CA given: the system store, which does not know the test CA either.
  auto sys = ServeConnection::Connect(server.target(), Tls(""));
  ASSERT_FALSE(sys.ok());
  EXPECT_NE(sys.status().message().find("certificate verify failed"), std::string::npos)
      << sys.status().message();
}

TEST_F(ClientTlsTest, WrongNameOrAddressFailsTheHandshake) {
  EchoServer server(true);
  auto name = ServeConnection::Connect(server.target(), Tls(Ca(), "wrong.example"));
  ASSERT_FALSE(name.ok());
  EXPECT_NE(name.status().message().find("TLS handshake failed: certificate verify failed "
                                         "(hostname mismatch)"),
            std::string::npos)
      << name.status().message();
  auto ip = ServeConnection::Connect(server.target(), Tls(Ca(), "10.1.2.3"));
  ASSERT_FALSE(ip.ok());
  EXPECT_NE(ip.status().message().find("(IP address mismatch)"), std::string::npos)
      << ip.status().message();
  // The right name given for an address target.
  auto right = ServeConnection::Connect(server.target(), Tls(Ca(), "localhost"));
  EXPECT_TRUE(right.ok()) << right.status().ToString();
}

TEST_F(ClientTlsTest, UnreadableCaFileIsABadArgument) {
  EchoServer server(true);
  auto c = ServeConnection::Connect(server.target(), Tls(Certs::Get().File("missing.crt")));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().ToString();
  EXPECT_NE(c.status().message().find("missing.crt"), std::string::npos);
}

TEST_F(ClientTlsTest, PlainClientOfTlsServerFailsWithinItsDeadline) {
  EchoServer server(true);
  auto c = ServeConnection::Connect(server.target());
  ASSERT_TRUE(c.ok()) << c.status().ToString();  // TCP is all it checks
  const auto t0 = SteadyClock::now();
  const auto deadline = t0 + std::chrono::seconds(3);
  ASSERT_TRUE((*c)->Send(Request(1, 64), deadline).ok());
  InferRequest back;
  const Status st = (*c)->Receive(&back, deadline);
  EXPECT_FALSE(st.ok());
  // Within its deadline (3 s), with a 3x margin for a loaded machine; at once in fact (below).
  EXPECT_LT(SteadyClock::now() - t0, std::chrono::seconds(9)) << st.ToString();
  // The server refused the bytes as a handshake, at once (an alert or the end of the stream).
  EXPECT_NE(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
}

TEST_F(ClientTlsTest, TlsClientOfPlainServerFailsWithinConnectTimeout) {
  EchoServer server(false);  // echoes the ClientHello: not a ServerHello
  ClientOptions o = Tls(Ca());
  o.connect_timeout = std::chrono::milliseconds(2000);
  const auto t0 = SteadyClock::now();
  auto c = ServeConnection::Connect(server.target(), o);
  ASSERT_FALSE(c.ok());
  // Within the connect timeout (2 s), with a 3x margin for a loaded machine.
  EXPECT_LT(SteadyClock::now() - t0, std::chrono::milliseconds(6000));
  EXPECT_NE(c.status().message().find("connect to " + server.target() + ": TLS handshake failed"),
            std::string::npos)
      << c.status().message();
}

TEST_F(ClientTlsTest, OneThreadSendsWhileAnotherReceives) {
  EchoServer server(true);
  auto c = ServeConnection::Connect(server.target(), Tls(Ca()));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ServeConnection* conn = c->get();
  constexpr int kFrames = 600;
  const auto size_of = [](int i) { return static_cast<size_t>((i * 7919) % 200000); };
  const auto deadline = DeadlineIn(std::chrono::seconds(60));
  Status send_status;
  std::thread sender([&] {
    for (int i = 0; i < kFrames && send_status.ok(); ++i) {
      send_status = i % 2 == 0 ? conn->Send(Request(i, size_of(i)), deadline)
                               : conn->SendRequest(Request(i, size_of(i)), deadline);
    }
  });
  int received = 0;
  for (int i = 0; i < kFrames; ++i) {
    InferRequest back;
    const Status st = conn->Receive(&back, deadline);
    if (!st.ok()) {
      ADD_FAILURE() << "frame " << i << ": " << st.ToString();
      break;
    }
    const InferRequest want = Request(i, size_of(i));
    if (back.SerializeAsString() != want.SerializeAsString()) {
      ADD_FAILURE() << "frame " << i << " differs";
      break;
    }
    ++received;
  }
  if (received < kFrames) conn->Shutdown();  // frees the sender
  sender.join();
  EXPECT_TRUE(send_status.ok()) << send_status.ToString();
  EXPECT_EQ(received, kFrames);
}

TEST_F(ClientTlsTest, ShutdownWakesABlockedReceive) {
  EchoServer server(true);
  auto c = ServeConnection::Connect(server.target(), Tls(Ca()));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Status st;
  const auto t0 = SteadyClock::now();
  std::thread receiver([&] {
    InferRequest m;
    st = (*c)->Receive(&m, DeadlineIn(std::chrono::seconds(20)));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  (*c)->Shutdown();
  receiver.join();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_LT(SteadyClock::now() - t0, std::chrono::seconds(5));
}

TEST_F(ClientTlsTest, ClientCertificateForMutualTls) {
  EchoServer server(true, Ca());
  ClientOptions with = Tls(Ca());
  with.tls.cert_file = Certs::Get().File("client.crt");
  with.tls.key_file = Certs::Get().File("client.key");
  auto c = ServeConnection::Connect(server.target(), with);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const auto deadline = DeadlineIn(std::chrono::seconds(10));
  ASSERT_TRUE((*c)->Send(Request(3, 1000), deadline).ok());
  InferRequest back;
  ASSERT_TRUE((*c)->Receive(&back, deadline).ok());
  EXPECT_EQ(back.id(), 3u);

  // Without one: refused (TLS 1.3 sends the refusal after the client's handshake is done, so
  // it may show on the first read instead).
  auto without = ServeConnection::Connect(server.target(), Tls(Ca()));
  if (without.ok()) {
    Status st = (*without)->Send(Request(4, 10), deadline);
    if (st.ok()) st = (*without)->Receive(&back, deadline);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  }
  // cert_file without key_file: a bad argument.
  ClientOptions half = Tls(Ca());
  half.tls.cert_file = Certs::Get().File("client.crt");
  auto h = ServeConnection::Connect(server.target(), half);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moerun
