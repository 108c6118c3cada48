// The serving key (ServingOptions::key, InferRequest.key) over real sockets: a keyed endpoint
// refuses a request without the key, or with a wrong one, with UNAUTHENTICATED and the request's
// id before any other check, answers one that carries it exactly as the layer computes, and keeps
// the connection; the C++ clients send the key of their options; the codec's check alone.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "runtime/layer/moe_layer.h"
#include "runtime/serving/control_auth.h"
#include "runtime/serving/failover_client.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/infer_codec.h"
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

constexpr char kKey[] = "k3y-0f-the-serving-path-7f1c9a";

// A router in miniature (tests/serving/mini_router.h) whose endpoint requires `key` (none: "").
class Server : public MiniRouter {
 public:
  explicit Server(std::string key) : MiniRouter(Keyed(std::move(key))) {}

 private:
  static ServingOptions Keyed(std::string key) {
    ServingOptions so;
    so.key = std::move(key);
    return so;
  }
};

std::unique_ptr<ServeConnection> Connect(const Server& s, const std::string& key = "") {
  ClientOptions o;
  o.key = key;
  auto c = ServeConnection::Connect(s.target(), o);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(*c) : nullptr;
}

InferRequest Request(uint64_t id, const std::vector<float>& x, int64_t hidden) {
  InferRequest r;
  r.set_id(id);
  SetRequestData(&r, x.data(), static_cast<int64_t>(x.size()) / hidden, hidden, v1::F32);
  return r;
}

Deadline Soon() { return DeadlineIn(std::chrono::seconds(20)); }

void ExpectExact(Server& s, const InferResponse& resp, const std::vector<float>& x, uint64_t id) {
  ASSERT_EQ(resp.code(), v1::OK) << resp.message();
  EXPECT_EQ(resp.id(), id);
  auto y = ResponseFloats(resp);
  ASSERT_TRUE(y.ok()) << y.status().ToString();
  const auto want = s.Expected(x);
  ASSERT_EQ(y->size(), want.size());
  EXPECT_EQ(std::memcmp(y->data(), want.data(), want.size() * 4), 0);
}

TEST(ServingKeyTest, RefusesNoKeyAndAWrongKeyWithTheRequestsIdAndAnswersTheRightOne) {
  Server s(kKey);
  auto c = Connect(s);
  ASSERT_NE(c, nullptr);
  const auto x = RandomRows(3, s.hidden(), 5);
  InferResponse resp;
  // No key.
  ASSERT_TRUE(c->Call(Request(41, x, s.hidden()), &resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::UNAUTHENTICATED);
  EXPECT_EQ(resp.id(), 41u);
  EXPECT_NE(resp.message().find("requires a key"), std::string::npos) << resp.message();
  EXPECT_TRUE(resp.data().empty());
  // A wrong key, one a byte short, one a byte longer: the same refusal, nothing computed.
  for (const std::string& wrong :
       {std::string("nope"), std::string(kKey).substr(1), std::string(kKey) + "x"}) {
    InferRequest r = Request(42, x, s.hidden());
    r.set_key(wrong);
    ASSERT_TRUE(c->Call(r, &resp, Soon()).ok());
    EXPECT_EQ(resp.code(), v1::UNAUTHENTICATED) << wrong;
    EXPECT_EQ(resp.id(), 42u);
    EXPECT_EQ(resp.message(), "wrong key (InferRequest.key)");
  }
  // The right key in the request, on the same connection (a refusal does not close it).
  InferRequest r = Request(43, x, s.hidden());
  r.set_key(kKey);
  ASSERT_TRUE(c->Call(r, &resp, Soon()).ok());
  ExpectExact(s, resp, x, 43);
  // Refusals are counted by code.
  const std::string text = s.metrics().Render();
  EXPECT_NE(text.find("moerun_requests_total{code=\"unauthenticated\"} 4"), std::string::npos)
      << text;
}

TEST(ServingKeyTest, TheKeyIsCheckedBeforeAnythingElse) {
  Server s(kKey);
  auto c = Connect(s);
  ASSERT_NE(c, nullptr);
  // A bad shape and an unserved layer: without the key they say nothing of the model.
  InferRequest r;
  r.set_id(7);
  r.set_layer(99);
  r.set_dtype(v1::F32);
  r.add_shape(1);
  r.add_shape(s.hidden() + 1);
  InferResponse resp;
  ASSERT_TRUE(c->Call(r, &resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::UNAUTHENTICATED);
  EXPECT_EQ(resp.id(), 7u);
  EXPECT_EQ(resp.message().find(std::to_string(s.hidden())), std::string::npos);
  // With the key the same request gets its own error.
  r.set_key(kKey);
  ASSERT_TRUE(c->Call(r, &resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::INVALID_ARGUMENT) << resp.message();
}

TEST(ServingKeyTest, ClientsSendTheKeyOfTheirOptions) {
  Server s(kKey);
  const auto x = RandomRows(2, s.hidden(), 9);
  InferResponse resp;
  auto c = Connect(s, kKey);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Call(Request(1, x, s.hidden()), &resp, Soon()).ok());
  ExpectExact(s, resp, x, 1);
  // A key of the request's own is not overridden.
  InferRequest own = Request(2, x, s.hidden());
  own.set_key("wrong");
  ASSERT_TRUE(c->Call(own, &resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::UNAUTHENTICATED);

  FailoverOptions fo;
  fo.client.key = kKey;
  FailoverClient fc({s.target()}, 0, fo);
  ASSERT_TRUE(fc.Call(Request(3, x, s.hidden()), &resp, Soon()).ok());
  ExpectExact(s, resp, x, 3);
  FailoverClient keyless({s.target()});
  ASSERT_TRUE(keyless.Call(Request(4, x, s.hidden()), &resp, Soon()).ok());
  EXPECT_EQ(resp.code(), v1::UNAUTHENTICATED);
  EXPECT_EQ(resp.id(), 4u);
}

TEST(ServingKeyTest, AnUnkeyedServerIgnoresAKey) {
  Server s("");
  const auto x = RandomRows(1, s.hidden(), 3);
  InferRequest r = Request(5, x, s.hidden());
  r.set_key("anything");
  auto c = Connect(s);
  ASSERT_NE(c, nullptr);
  InferResponse resp;
  ASSERT_TRUE(c->Call(r, &resp, Soon()).ok());
  ExpectExact(s, resp, x, 5);
}

TEST(ServingKeyCodecTest, KeyFieldAppendedSetsTheKeyAndTheParserChecksIt) {
  ServedModel m;
  m.layers = {0};
  m.hidden = 4;
  const std::vector<float> x = {1, 2, 3, 4};
  InferRequest r = Request(11, x, 4);
  const std::string plain = r.SerializeAsString();
  const std::string keyed = plain + EncodeKeyField(kKey);
  InferRequest back;
  ASSERT_TRUE(back.ParseFromString(keyed));
  EXPECT_EQ(back.key(), kKey);
  // A key of 200 bytes: its length takes two varint bytes.
  const std::string long_key(200, 'k');
  ASSERT_TRUE(back.ParseFromString(plain + EncodeKeyField(long_key)));
  EXPECT_EQ(back.key(), long_key);

  ParsedRequest out;
  RequestError err;
  EXPECT_TRUE(ParseInferRequest(plain, m, &out, &err));  // no key required
  EXPECT_FALSE(ParseInferRequest(plain, m, &out, &err, kKey));
  EXPECT_EQ(err.code, v1::UNAUTHENTICATED);
  EXPECT_EQ(err.id, 11u);
  EXPECT_TRUE(ParseInferRequest(keyed, m, &out, &err, kKey)) << err.message;
  EXPECT_EQ(out.key, kKey);
  EXPECT_EQ(out.tokens, 1);
  EXPECT_FALSE(ParseInferRequest(plain + EncodeKeyField(long_key), m, &out, &err, kKey));
  EXPECT_EQ(err.code, v1::UNAUTHENTICATED);
  // The last key wins, as in Protobuf.
  EXPECT_TRUE(
      ParseInferRequest(plain + EncodeKeyField("x") + EncodeKeyField(kKey), m, &out, &err, kKey));
}

// The key file is read as the control token is: its first line; refused when its group or
// others may read it.
TEST(ServingKeyFileTest, ModeIsChecked) {
  const std::string path = ::testing::TempDir() + "/serving_key_" + std::to_string(::getpid());
  {
    std::ofstream f(path);
    f << "  " << kKey << "  \nsecond line\n";
  }
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  auto key = ReadTokenFile(path);
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  EXPECT_EQ(*key, kKey);
  // 0640 by its owner (this process, root or not): no Kubernetes Secret exception applies.
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  auto refused = ReadTokenFile(path);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("0640"), std::string::npos)
      << refused.status().message();
  std::remove(path.c_str());
}

// The key file re-read when it changes (ServingOptions::key_file), over real sockets: the new key
// is required at once, the old one accepted for the grace period and then refused; a rewritten
// file that others may read is refused and the current key stays.
TEST(ServingKeyFileTest, ARotatedKeyTakesEffectAndTheOldOneHasAGracePeriod) {
  TempDir dir;
  const std::string path = dir.File("serving.key");
  const auto write = [&](const std::string& key, mode_t mode) {
    WriteFile(path + ".new", key + "\n");
    ASSERT_EQ(::chmod((path + ".new").c_str(), mode), 0);
    ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);  // as a Secret is replaced
  };
  write("old-key-1", 0600);
  ServingOptions so;
  so.key = "old-key-1";
  so.key_file = path;
  so.key_grace = std::chrono::seconds(2);
  MiniRouter s(so);
  auto c = ServeConnection::Connect(s.target());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const auto x = RandomRows(2, s.hidden(), 4);
  uint64_t id = 0;
  const auto call = [&](const std::string& key) {
    InferRequest r = Request(++id, x, s.hidden());
    r.set_key(key);
    InferResponse resp;
    EXPECT_TRUE((*c)->Call(r, &resp, Soon()).ok());
    EXPECT_EQ(resp.id(), id);
    return resp.code();
  };
  EXPECT_EQ(call("old-key-1"), v1::OK);
  EXPECT_EQ(call("new-key-22"), v1::UNAUTHENTICATED);
  write("new-key-22", 0600);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // looked at once a second
  EXPECT_EQ(call("new-key-22"), v1::OK);                         // taken at once
  const auto changed = std::chrono::steady_clock::now();
  EXPECT_EQ(call("old-key-1"), v1::OK);  // within the grace period
  EXPECT_EQ(call("wrong"), v1::UNAUTHENTICATED);
  EXPECT_EQ(call(""), v1::UNAUTHENTICATED);
  std::this_thread::sleep_until(changed + std::chrono::milliseconds(2100));
  EXPECT_EQ(call("old-key-1"), v1::UNAUTHENTICATED);  // the grace period is over
  EXPECT_EQ(call("new-key-22"), v1::OK);
  // A rewrite that others may read: refused, the current key stays.
  write("third-key-333", 0644);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(call("third-key-333"), v1::UNAUTHENTICATED);
  EXPECT_EQ(call("new-key-22"), v1::OK);
  // Fixed (mode 600): taken.
  write("third-key-333", 0600);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(call("third-key-333"), v1::OK);
}

// The serving endpoint's refusal log: its own scope and credential in both kinds of line.
TEST(ServingKeyLogTest, LinesNameServingAndTheKey) {
  AuthFailureLog log(std::chrono::seconds(10), 4096, "serving", "key");
  EXPECT_EQ(log.Record("10.0.0.7", "no key"),
            "serving: refused a request with no key from 10.0.0.7 (further refusals are "
            "summarised every 10 s)");
  for (int i = 0; i < 1500; ++i) EXPECT_EQ(log.Record("10.0.0.7", "a wrong key"), "");
  EXPECT_EQ(log.Record("10.0.0.8", "a wrong key"), "");
  EXPECT_EQ(log.TakeSummary(),
            "serving: 1,501 requests with a wrong or no key from 2 addresses in the last 10 s "
            "(most: 10.0.0.7, 1,500)");
  EXPECT_EQ(log.TakeSummary(), "");  // a quiet interval
}

}  // namespace
}  // namespace moerun
