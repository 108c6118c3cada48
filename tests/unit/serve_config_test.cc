#include "launch/serve_config.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tests/unit/test_util.h"

namespace moerun {
namespace {

TEST(ServeConfigTest, ShippedConfigsParse) {
  for (const char* name :
       {"tiny", "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "gpt-oss-20b", "step-3.5-flash"}) {
    auto c = LoadServeConfig(testing::DataDir() + "/../../configs/" + name + ".yaml");
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().ToString();
  }
  auto tiny = LoadServeConfig(testing::DataDir() + "/../../configs/tiny.yaml");
  EXPECT_NE(tiny->model.find("tests/data/hf-moe/deepseek_v3"), std::string::npos);
  EXPECT_EQ(tiny->ranks, 4);
  EXPECT_EQ(tiny->placement, "round_robin");
  auto q = LoadServeConfig(testing::DataDir() + "/../../configs/qwen3-30b-a3b.yaml");
  EXPECT_EQ(q->preset, "qwen3-30b-a3b");
  EXPECT_EQ(q->dtype, "bf16");
  EXPECT_EQ(q->layers, std::vector<int>{-1});
}

// The whole-model decode configs: every MoE layer, the experts' intermediate size scaled.
TEST(ServeConfigTest, DecodeConfigsParse) {
  for (const char* name : {"deepseek-v3-decode", "qwen3-30b-a3b-decode", "gpt-oss-20b-decode"}) {
    auto c = LoadServeConfig(testing::DataDir() + "/../../configs/" + name + ".yaml");
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().ToString();
    EXPECT_EQ(c->layers, std::vector<int>{-1}) << name;
    EXPECT_GT(c->experts, 0) << name;
  }
}

TEST(ServeConfigTest, PresetIntermediate) {
  auto c = ParseServeConfig("preset: {name: deepseek-v3, experts: 16, intermediate: 256}\n",
                            "c.yaml", "");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->intermediate, 256);
  for (const char* bad : {"preset: {name: deepseek-v3, intermediate: 100}\n",
                          "preset: {name: deepseek-v3, intermediate: 4096}\n",
                          "preset: {name: qwen3-30b-a3b, intermediate: 800}\n"}) {
    auto e = ParseServeConfig(bad, "c.yaml", "");
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.status().message().find("c.yaml: \"preset\": intermediate"), std::string::npos)
        << e.status().message();
    EXPECT_NE(e.status().message().find("multiple of 32"), std::string::npos)
        << e.status().message();
  }
  auto neg = ParseServeConfig("preset: {name: deepseek-v3, intermediate: -1}\n", "c.yaml", "");
  ASSERT_FALSE(neg.ok());
  EXPECT_NE(neg.status().message().find("intermediate"), std::string::npos);
}

TEST(ServeConfigTest, EveryKey) {
  auto c = ParseServeConfig(R"(
model: m
layers: [3, 5]
transport: inproc
ranks: 3
routers: 2
placement: p.json
microbatch_tokens: 16
deadline_ms: 1234
startup_timeout_s: 99
threads: 2
isa: avx2
log_level: debug
batching: {max_batch_tokens: 8, max_wait_us: 9, max_queue_tokens: 10, max_queue_requests: 11}
)",
                            "c.yaml", "/base");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->model, "/base/m");
  EXPECT_EQ(c->placement, "/base/p.json");
  EXPECT_EQ(c->layers, (std::vector<int>{3, 5}));
  EXPECT_EQ(c->routers, 2);
  EXPECT_EQ(c->deadline_ms, 1234);
  EXPECT_EQ(c->batching.max_queue_requests, 11);
}

TEST(ServeConfigTest, ServingKeys) {
  auto c = ParseServeConfig(
      "model: m\nserving:\n  listen: 127.0.0.1:7000\n  metrics_listen: :9000\n"
      "  token_file: tok\n  max_frame_bytes: 4096\n  max_inflight_per_connection: 3\n"
      "  default_deadline_ms: 250\n  probe_interval_ms: 10\n",
      "c.yaml", "/etc/moerun");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->serving.listen, "127.0.0.1:7000");
  EXPECT_EQ(c->serving.metrics_listen, ":9000");
  EXPECT_EQ(c->serving.control_listen, "127.0.0.1:5800");  // default kept
  EXPECT_EQ(c->serving.token_file, "/etc/moerun/tok");     // relative to the config
  EXPECT_EQ(c->serving.max_frame_bytes, 4096);
  EXPECT_EQ(c->serving.max_inflight_per_connection, 3);
  EXPECT_EQ(c->serving.default_deadline_ms, 250);
  EXPECT_EQ(c->serving.probe_interval_ms, 10);
}

TEST(ServeConfigTest, ServingKeyFile) {
  auto d = ParseServeConfig("model: m\n", "c.yaml", "/etc/moerun");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->serving.key_file, "");  // no key required by default
  auto c = ParseServeConfig("model: m\nserving: {key_file: keys/serving.key}\n", "c.yaml",
                            "/etc/moerun");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->serving.key_file, "/etc/moerun/keys/serving.key");  // relative to the config
  auto bad = ParseServeConfig("model: m\nserving: {key_file: [a]}\n", "c.yaml", "");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("key_file"), std::string::npos) << bad.status().message();
}

TEST(ServeConfigTest, HttpEndpointKeys) {
  auto d = ParseServeConfig("model: m\n", "c.yaml", "");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->serving.http_idle_timeout_ms, 10000);  // the HTTP server's defaults
  EXPECT_EQ(d->serving.http_max_connections, 512);
  auto c = ParseServeConfig(
      "model: m\nserving: {http_idle_timeout_ms: 2500, http_max_connections: 64}\n", "c.yaml", "");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->serving.http_idle_timeout_ms, 2500);
  EXPECT_EQ(c->serving.http_max_connections, 64);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{http_idle_timeout_ms: 0}", "\"http_idle_timeout_ms\" must be in"},
      {"{http_max_connections: 0}", "\"http_max_connections\" must be in"},
      {"{http_max_connections: 100000}", "\"http_max_connections\" must be in"},
  };
  for (const auto& [serving, want] : bad) {
    auto e = ParseServeConfig("model: m\nserving: " + serving + "\n", "c.yaml", "");
    ASSERT_FALSE(e.ok()) << serving;
    EXPECT_NE(e.status().message().find(want), std::string::npos) << e.status().message();
  }
}

TEST(ServeConfigTest, TlsAndPerAddressKeys) {
  auto d = ParseServeConfig("model: m\n", "c.yaml", "");
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->serving.tls.enabled());
  EXPECT_EQ(d->serving.max_connections_per_address, 0);
  // Relative paths are the config file's folder's.
  auto c = ParseServeConfig(
      "model: m\nserving:\n  max_connections_per_address: 32\n  tls: {cert_file: s.crt, "
      "key_file: /k/s.key, client_ca_file: ca.crt, ca_file: ca.crt}\n",
      "/etc/moerun/c.yaml", "/etc/moerun");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->serving.tls.enabled());
  EXPECT_EQ(c->serving.tls.cert_file, "/etc/moerun/s.crt");
  EXPECT_EQ(c->serving.tls.key_file, "/k/s.key");
  EXPECT_EQ(c->serving.tls.client_ca_file, "/etc/moerun/ca.crt");
  EXPECT_EQ(c->serving.tls_ca_file, "/etc/moerun/ca.crt");
  EXPECT_EQ(c->serving.max_connections_per_address, 32);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{tls: {cert_file: a.crt}}", "needs both cert_file and key_file"},
      {"{tls: {key_file: a.key}}", "needs both cert_file and key_file"},
      {"{tls: {cert: a.crt}}", "unknown key \"cert\""},
      {"{max_connections_per_address: -1}", "\"max_connections_per_address\" must be in"},
  };
  for (const auto& [serving, want] : bad) {
    auto e = ParseServeConfig("model: m\nserving: " + serving + "\n", "c.yaml", "");
    ASSERT_FALSE(e.ok()) << serving;
    EXPECT_NE(e.status().message().find(want), std::string::npos) << e.status().message();
  }
}

TEST(ServeConfigTest, RebalanceKeys) {
  auto d = ParseServeConfig("model: m\n", "c.yaml", "");
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->rebalance.automatic);
  EXPECT_EQ(d->rebalance.throttle_mib_s, 0.0);
  auto c = ParseServeConfig(
      "model: m\nrebalance: {throttle_mib_s: 64, auto: true, interval_s: 30, min_gain: 0.2,\n"
      "  redundant: 2, policy: eplb-global, min_assignments: 10}\n",
      "c.yaml", "");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rebalance.throttle_mib_s, 64.0);
  EXPECT_TRUE(c->rebalance.automatic);
  EXPECT_EQ(c->rebalance.interval_s, 30);
  EXPECT_EQ(c->rebalance.min_gain, 0.2);
  EXPECT_EQ(c->rebalance.redundant, 2);
  EXPECT_EQ(c->rebalance.policy, "eplb-global");
  EXPECT_EQ(c->rebalance.min_assignments, 10);
}

TEST(ServeConfigTest, ErrorsNameTheKey) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"model: a\npreset: b\n", "exactly one"},
      {"layers: [0]\n", "exactly one"},
      {"model: a\ncolour: red\n", "unknown key \"colour\""},
      {"model: a\nranks: 0\n", "\"ranks\" must be in"},
      {"model: a\nranks: many\n", "\"ranks\" must be a number"},
      {"model: a\ntransport: tcp\n", "transport"},
      {"model: a\nlayers: [-1]\n", "layers"},
      {"model: a\nlayers: {a: 1}\n", "layers"},
      {"model: a\nbatching: {max_batch_tokens: 0}\n", "max_batch_tokens"},
      {"model: a\nbatching: {speed: 1}\n", "unknown key \"speed\""},
      {"preset: {name: x, colour: 1}\n", "unknown key \"colour\""},
      {"model: [a\n", "not valid YAML"},
      {"- a\n- b\n", "mapping"},
      {"model: a\nserving: {port: 1}\n", "unknown key \"port\""},
      {"model: a\nserving: {max_frame_bytes: 1}\n", "max_frame_bytes"},
      {"model: a\nserving: {listen: [1]}\n", "\"listen\" must be a string"},
      {"model: a\nrebalance: {policy: best}\n", "\"policy\" must be default"},
      {"model: a\nrebalance: {min_gain: 2}\n", "\"min_gain\" must be in"},
      {"model: a\nrebalance: {interval_s: 0}\n", "\"interval_s\" must be in"},
      {"model: a\nrebalance: {every: 1}\n", "unknown key \"every\""},
      {"model: a\nlog_level: verbose\n", "log_level: unknown log level 'verbose'"},
  };
  for (const auto& [text, want] : bad) {
    auto c = ParseServeConfig(text, "c.yaml", "");
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_NE(c.status().message().find(want), std::string::npos)
        << text << " -> " << c.status().message();
  }
  EXPECT_EQ(LoadServeConfig("/nonexistent.yaml").status().code(), StatusCode::kNotFound);
}

// Every endpoint listens on loopback unless the config names an address; an address of every
// interface gets a warning naming the endpoint and how to restrict it.
TEST(ServeConfigTest, EndpointsListenOnLoopbackByDefaultAndAllInterfacesAreWarnedOf) {
  auto c = ParseServeConfig("model: m\n", "c.yaml", "");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->serving.listen, "127.0.0.1:5700");
  EXPECT_EQ(c->serving.metrics_listen, "127.0.0.1:9700");
  EXPECT_EQ(c->serving.control_listen, "127.0.0.1:5800");
  for (const char* one :
       {"127.0.0.1:5700", "10.1.2.3:5700", "[::1]:5700", "node7:5700", "[fe80::1%eth0]:9700"}) {
    EXPECT_EQ(AllInterfacesWarning("the serving endpoint", one, "serving.listen", "--listen"), "")
        << one;
  }
  for (const char* all : {"0.0.0.0:5700", ":5700", "[::]:5700", "[::0]:9700"}) {
    const std::string w =
        AllInterfacesWarning("the serving endpoint", all, "serving.listen", "--listen");
    EXPECT_NE(w.find(std::string("the serving endpoint listens on every network interface (") +
                     all + ")"),
              std::string::npos)
        << w;
    EXPECT_NE(w.find("set serving.listen (or --listen)"), std::string::npos) << w;
  }
}

}  // namespace
}  // namespace moerun

namespace moerun {
namespace {

TEST(ServeConfigTest, Tracing) {
  auto c = ParseServeConfig(
      "preset: {name: deepseek-v3, experts: 16}\n"
      "tracing: {endpoint: 'http://otel:4318', sample: 0.05, slow_ms: 250, queue_spans: 4096}\n",
      "c.yaml", "");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->tracing.endpoint, "http://otel:4318");
  EXPECT_DOUBLE_EQ(c->tracing.sample, 0.05);
  EXPECT_EQ(c->tracing.slow_ms, 250);
  EXPECT_EQ(c->tracing.queue_spans, 4096);
  for (const char* bad : {"tracing: {endpoint: 'https://otel:4318'}\n",
                          "tracing: {endpoint: otel}\n", "tracing: {sample: 2}\n",
                          "tracing: {queue_spans: 1}\n", "tracing: {endpont: 'http://o:1'}\n"}) {
    auto e = ParseServeConfig(std::string("preset: {name: deepseek-v3}\n") + bad, "c.yaml", "");
    EXPECT_FALSE(e.ok()) << bad;
    if (!e.ok()) {
      EXPECT_NE(e.status().message().find("tracing"), std::string::npos) << bad;
    }
  }
}

TEST(ServeConfigTest, NodesAndDispatch) {
  auto c = ParseServeConfig(
      "preset: {name: deepseek-v3, experts: 16}\n"
      "nodes: {hostA: [0, 1, 2], hostB: [3, 4, 5]}\n"
      "dispatch: {prefer_node: true, spill: 2.5}\n",
      "c.yaml", "");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->nodes.size(), 6u);
  EXPECT_EQ(c->nodes.at(0), "hostA");
  EXPECT_EQ(c->nodes.at(5), "hostB");
  EXPECT_TRUE(c->dispatch.prefer_node);
  EXPECT_DOUBLE_EQ(c->dispatch.spill, 2.5);
  auto d = ParseServeConfig("preset: {name: deepseek-v3}\n", "c.yaml", "");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->nodes.empty());
  EXPECT_FALSE(d->dispatch.prefer_node);
  for (const char* bad :
       {"nodes: [0, 1]\n", "nodes: {a: [0, 1], b: [1]}\n", "nodes: {a: []}\n", "nodes: {a: [-1]}\n",
        "nodes: {a: [x]}\n", "nodes: {a: 3}\n", "dispatch: {prefer_node: maybe}\n",
        "dispatch: {spill: -1}\n", "dispatch: {spil: 1}\n"}) {
    auto e = ParseServeConfig(std::string("preset: {name: deepseek-v3}\n") + bad, "c.yaml", "");
    EXPECT_FALSE(e.ok()) << bad;
    if (!e.ok()) {
      const std::string& m = e.status().message();
      EXPECT_TRUE(m.find("nodes") != std::string::npos || m.find("dispatch") != std::string::npos)
          << bad << ": " << m;
    }
  }
}

// Ranks with threads, kernels or a memory budget of their own; bad maps refused naming the key.
TEST(ServeConfigTest, RankMaps) {
  auto c = ParseServeConfig(
      "preset: {name: deepseek-v3, experts: 16}\n"
      "rank_threads: {2: 2, 3: 4}\n"
      "rank_isa: {1: scalar}\n"
      "expert_memory_mib: 512\n"
      "rank_expert_memory_mib: {4: 20}\n",
      "c.yaml", "");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rank_threads, (std::map<int, int>{{2, 2}, {3, 4}}));
  EXPECT_EQ(c->rank_isa, (std::map<int, std::string>{{1, "scalar"}}));
  EXPECT_EQ(c->expert_memory_mib, 512);
  EXPECT_EQ(c->rank_expert_memory_mib, (std::map<int, int64_t>{{4, 20}}));
  for (const auto& [bad, key] : std::vector<std::pair<std::string, std::string>>{
           {"rank_threads: [1, 2]\n", "rank_threads"},
           {"rank_threads: {1: 0}\n", "rank_threads"},
           {"rank_threads: {-1: 2}\n", "rank_threads"},
           {"rank_threads: {1: many}\n", "rank_threads"},
           {"rank_isa: {1: sse}\n", "rank_isa"},
           {"rank_expert_memory_mib: {1: 0}\n", "rank_expert_memory_mib"},
           {"rank_expert_memory_mib: {x: 5}\n", "rank_expert_memory_mib"},
           {"expert_memory_mib: -1\n", "expert_memory_mib"}}) {
    auto e = ParseServeConfig("preset: {name: deepseek-v3}\n" + bad, "c.yaml", "");
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.status().message().find(key), std::string::npos)
        << bad << ": " << e.status().message();
  }
}

}  // namespace
}  // namespace moerun
