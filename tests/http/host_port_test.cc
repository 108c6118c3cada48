#include "runtime/serving/host_port.h"

#include <gtest/gtest.h>

namespace moerun {
namespace {

TEST(HostPortTest, ParsesTheThreeForms) {
  auto a = ParseHostPort("127.0.0.1:8080");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 8080);
  auto b = ParseHostPort("node-3.cluster.local:9000");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->host, "node-3.cluster.local");
  EXPECT_EQ(b->port, 9000);
  auto c = ParseHostPort("[::1]:65535");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->host, "::1");
  EXPECT_EQ(c->port, 65535);
  auto d = ParseHostPort(":0");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->host, "0.0.0.0");
  EXPECT_EQ(d->port, 0);
  auto e = ParseHostPort("[fe80::1%eth0]:80");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->host, "fe80::1%eth0");
}

TEST(HostPortTest, RejectsBadTextNamingIt) {
  for (const char* bad : {"", "localhost", "localhost:", ":", "host:65536", "host:99999999",
                          "host:-1", "host:80x", "host: 80", "::1:80", "[::1]", "[::1]80", "[]:80",
                          "[::1:80", "ho st:80", "[1.2.3.4]:80", "host:+80"}) {
    auto r = ParseHostPort(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(r.status().message().find(std::string("\"") + bad + "\""), std::string::npos)
          << r.status().message();
    }
  }
}

TEST(HostPortTest, PortOffsetAndFormat) {
  HostPort hp = WithPortOffset({"10.0.0.1", 9100}, 3);
  EXPECT_EQ(hp.host, "10.0.0.1");
  EXPECT_EQ(hp.port, 9103);
  EXPECT_EQ(FormatHostPort(hp), "10.0.0.1:9103");
  EXPECT_EQ(FormatHostPort({"::1", 80}), "[::1]:80");
}

}  // namespace
}  // namespace moerun
