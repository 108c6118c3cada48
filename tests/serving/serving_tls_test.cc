// TLS on the serving endpoint, end to end over loopback: a certificate authority and a server
// certificate are made for the test with the openssl command line, the router in miniature
// serves with them, and the C++ client checks the server against the CA. Also what the server
// refuses to load (no key, an unsafe key file, a key of another certificate), what happens to a
// client that does not speak TLS, and to one that never starts its handshake.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/serving/serve_client.h"
#include "runtime/serving/tls_context.h"
#include "tests/serving/mini_router.h"
#include "tests/unit/layer_fixtures.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using namespace moerun::testing;
using moerun::v1::InferRequest;
using moerun::v1::InferResponse;
using std::chrono::milliseconds;
using std::chrono::seconds;
namespace fs = std::filesystem;

// A CA, a server certificate for 127.0.0.1/localhost signed by it, a second CA, and a second
// server key; removed with the object.
class Pki {
 public:
  Pki() {
    char tmpl[] = "/tmp/moerun-tls-test.XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    const std::string d = dir_;
    const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    ok_ = Run("openssl req -x509 " + ec + " -days 2 -subj /CN=moerun-test-ca -keyout " + d +
              "/ca.key -out " + d + "/ca.crt") &&
          Run("openssl req -x509 " + ec + " -days 2 -subj /CN=other-ca -keyout " + d +
              "/other.key -out " + d + "/other.crt") &&
          Run("openssl req " + ec + " -subj /CN=localhost -keyout " + d + "/server.key -out " + d +
              "/server.csr") &&
          WriteFile(d + "/ext", "subjectAltName=IP:127.0.0.1,DNS:localhost\n") &&
          Run("openssl x509 -req -in " + d + "/server.csr -CA " + d + "/ca.crt -CAkey " + d +
              "/ca.key -CAcreateserial -days 2 -extfile " + d + "/ext -out " + d + "/server.crt") &&
          ::chmod((d + "/server.key").c_str(), 0600) == 0 &&
          ::chmod((d + "/other.key").c_str(), 0600) == 0;
  }
  ~Pki() {
    std::error_code e;
    if (std::getenv("KEEP_PKI") == nullptr) fs::remove_all(dir_, e);
  }
  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  TlsServerFiles Files() const { return {Path("server.crt"), Path("server.key"), ""}; }

 private:
  static bool WriteFile(const std::string& path, const std::string& text) {
    std::ofstream out(path);
    out << text;
    out.close();
    return static_cast<bool>(out);
  }
  static bool Run(const std::string& cmd) {
    return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0;
  }
  std::string dir_;
  bool ok_ = false;
};

ServingOptions WithTls(const Pki& pki) {
  ServingOptions so;
  auto t = TlsServerContext::Load(pki.Files());
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (t.ok()) so.framed.tls = *t;
  so.framed.first_frame_timeout = milliseconds(1500);
  return so;
}

ClientOptions TlsClient(const Pki& pki, const std::string& ca = "ca.crt") {
  ClientOptions co;
  co.tls.enabled = true;
  co.tls.ca_file = pki.Path(ca);
  return co;
}

Deadline Soon() { return DeadlineIn(seconds(20)); }

TEST(ServingTlsTest, ContextRefusesBadFiles) {
  Pki pki;
  ASSERT_TRUE(pki.ok()) << "openssl could not make the test certificates";
  EXPECT_TRUE(TlsServerContext::Load(pki.Files()).ok());
  auto no_key = TlsServerContext::Load({pki.Path("server.crt"), "", ""});
  EXPECT_EQ(no_key.status().code(), StatusCode::kInvalidArgument);
  auto missing = TlsServerContext::Load({pki.Path("nope.crt"), pki.Path("server.key"), ""});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  // A key another certificate's: refused, naming both files.
  auto mismatch = TlsServerContext::Load({pki.Path("server.crt"), pki.Path("other.key"), ""});
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("does not match"), std::string::npos)
      << mismatch.status().ToString();
  // Not a certificate at all.
  auto garbage = TlsServerContext::Load({pki.Path("ext"), pki.Path("server.key"), ""});
  EXPECT_EQ(garbage.status().code(), StatusCode::kInvalidArgument);
  // A key file that others may read.
  ASSERT_EQ(::chmod(pki.Path("server.key").c_str(), 0644), 0);
  auto open_key = TlsServerContext::Load(pki.Files());
  ASSERT_FALSE(open_key.ok());
  EXPECT_NE(open_key.status().message().find("chmod 600"), std::string::npos)
      << open_key.status().ToString();
}

TEST(ServingTlsTest, RequestsOverTlsAreAnsweredExactly) {
  Pki pki;
  ASSERT_TRUE(pki.ok());
  MiniRouter r(WithTls(pki));
  const std::vector<float> x = RandomRows(5, r.hidden(), 3);
  const std::vector<float> want = r.Expected(x);
  auto c = ServeConnection::Connect(r.target(), TlsClient(pki));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  // Several requests in flight on the one TLS connection, answered by id.
  for (uint64_t id = 1; id <= 8; ++id) {
    InferRequest q;
    q.set_id(id);
    SetRequestData(&q, x.data(), 5, r.hidden(), v1::F32);
    ASSERT_TRUE((*c)->SendRequest(q, Soon()).ok());
  }
  std::vector<bool> seen(9, false);
  for (int i = 0; i < 8; ++i) {
    InferResponse a;
    ASSERT_TRUE((*c)->Receive(&a, Soon()).ok());
    ASSERT_EQ(a.code(), v1::OK) << a.message();
    ASSERT_GE(a.id(), 1u);
    ASSERT_LE(a.id(), 8u);
    seen[a.id()] = true;
    auto y = ResponseFloats(a);
    ASSERT_TRUE(y.ok());
    ASSERT_EQ(y->size(), want.size());
    EXPECT_EQ(std::memcmp(y->data(), want.data(), want.size() * sizeof(float)), 0);
  }
  for (uint64_t id = 1; id <= 8; ++id) EXPECT_TRUE(seen[id]) << id;
}

TEST(ServingTlsTest, AKeyedRequestOverTls) {
  Pki pki;
  ASSERT_TRUE(pki.ok());
  ServingOptions so = WithTls(pki);
  so.key = "the-serving-key";
  MiniRouter r(so);
  const std::vector<float> x = RandomRows(2, r.hidden(), 4);
  InferRequest q;
  q.set_id(7);
  SetRequestData(&q, x.data(), 2, r.hidden(), v1::F32);
  ClientOptions keyed = TlsClient(pki);
  keyed.key = "the-serving-key";
  auto c = ServeConnection::Connect(r.target(), keyed);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  InferResponse a;
  ASSERT_TRUE((*c)->Call(q, &a, Soon()).ok());
  EXPECT_EQ(a.code(), v1::OK) << a.message();
  auto unkeyed = ServeConnection::Connect(r.target(), TlsClient(pki));
  ASSERT_TRUE(unkeyed.ok());
  InferResponse b;
  ASSERT_TRUE((*unkeyed)->Call(q, &b, Soon()).ok());
  EXPECT_EQ(b.code(), v1::UNAUTHENTICATED);
  EXPECT_EQ(b.id(), 7u);
}

TEST(ServingTlsTest, WrongAuthorityOrPlainClientsFailCleanly) {
  Pki pki;
  ASSERT_TRUE(pki.ok());
  MiniRouter r(WithTls(pki));
  auto wrong = ServeConnection::Connect(r.target(), TlsClient(pki, "other.crt"));
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("certificate"), std::string::npos)
      << wrong.status().ToString();
  // A client without TLS: its frame is no ClientHello; the server closes, the client hears of it
  // well within its deadline.
  auto plain = ServeConnection::Connect(r.target());
  ASSERT_TRUE(plain.ok());
  const std::vector<float> x = RandomRows(1, r.hidden(), 5);
  InferRequest q;
  q.set_id(1);
  SetRequestData(&q, x.data(), 1, r.hidden(), v1::F32);
  InferResponse a;
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = (*plain)->Call(q, &a, Soon());
  EXPECT_FALSE(s.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, seconds(10));
  // One that connects and never starts its handshake is closed after the first-frame timeout.
  auto silent = ServeConnection::Connect(r.target());
  ASSERT_TRUE(silent.ok());
  std::string body;
  const Status closed = (*silent)->ReceiveFrame(&body, Soon());
  EXPECT_EQ(closed.code(), StatusCode::kUnavailable) << closed.ToString();
  // And the server still answers TLS clients.
  auto good = ServeConnection::Connect(r.target(), TlsClient(pki));
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  ASSERT_TRUE((*good)->Call(q, &a, Soon()).ok());
  EXPECT_EQ(a.code(), v1::OK) << a.message();
}

}  // namespace
}  // namespace moerun
