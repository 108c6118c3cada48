#include "base/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

namespace moerun {
namespace {

TEST(MetricsTest, RendersCountersAndGaugesGolden) {
  MetricsRegistry r;
  Counter* a = r.AddCounter("moerun_requests_total", "Requests served.", {{"code", "200"}});
  Counter* b = r.AddCounter("moerun_requests_total", "Requests served.", {{"code", "404"}});
  Gauge* g = r.AddGauge("moerun_temperature", "A gauge.\nSecond line \\ backslash.");
  r.AddCallbackGauge("moerun_queue_depth", "Queued tokens.", [] { return 7.0; }, {{"rank", "3"}});
  a->Inc();
  a->Inc(41);
  b->Inc();
  g->Set(2.5);
  g->Add(-0.25);
  EXPECT_EQ(a->value(), 42u);
  EXPECT_EQ(g->value(), 2.25);
  EXPECT_EQ(r.Render(),
            "# HELP moerun_requests_total Requests served.\n"
            "# TYPE moerun_requests_total counter\n"
            "moerun_requests_total{code=\"200\"} 42\n"
            "moerun_requests_total{code=\"404\"} 1\n"
            "# HELP moerun_temperature A gauge.\\nSecond line \\\\ backslash.\n"
            "# TYPE moerun_temperature gauge\n"
            "moerun_temperature 2.25\n"
            "# HELP moerun_queue_depth Queued tokens.\n"
            "# TYPE moerun_queue_depth gauge\n"
            "moerun_queue_depth{rank=\"3\"} 7\n");
}

TEST(MetricsTest, SameNameAndLabelsReturnSameObject) {
  MetricsRegistry r;
  Counter* a = r.AddCounter("moerun_x_total", "x", {{"a", "1"}, {"b", "2"}});
  EXPECT_EQ(a, r.AddCounter("moerun_x_total", "x", {{"a", "1"}, {"b", "2"}}));
  EXPECT_NE(a, r.AddCounter("moerun_x_total", "x", {{"a", "1"}, {"b", "3"}}));
  Gauge* g = r.AddGauge("moerun_g", "g");
  EXPECT_EQ(g, r.AddGauge("moerun_g", "g"));
  Histogram* h = r.AddHistogram("moerun_h_seconds", "h", {1, 2});
  EXPECT_EQ(h, r.AddHistogram("moerun_h_seconds", "h", {1, 2}));
  // One HELP/TYPE per family however many series.
  std::string text = r.Render();
  size_t n = 0;
  for (size_t p = text.find("# TYPE moerun_x_total"); p != std::string::npos;
       p = text.find("# TYPE moerun_x_total", p + 1)) {
    ++n;
  }
  EXPECT_EQ(n, 1u);
}

TEST(MetricsTest, HistogramBucketsAreCumulative) {
  MetricsRegistry r;
  Histogram* h =
      r.AddHistogram("moerun_latency_seconds", "Latency.", {0.001, 0.5, 1, 2.5}, {{"op", "fwd"}});
  for (double v : {0.0005, 0.001, 0.2, 0.7, 1.0, 3.0, 100.0}) h->Observe(v);
  EXPECT_EQ(h->count(), 7u);
  EXPECT_DOUBLE_EQ(h->sum(), 0.0005 + 0.001 + 0.2 + 0.7 + 1.0 + 3.0 + 100.0);
  std::string text = r.Render();
  std::string want_buckets =
      "# HELP moerun_latency_seconds Latency.\n"
      "# TYPE moerun_latency_seconds histogram\n"
      "moerun_latency_seconds_bucket{op=\"fwd\",le=\"0.001\"} 2\n"
      "moerun_latency_seconds_bucket{op=\"fwd\",le=\"0.5\"} 3\n"
      "moerun_latency_seconds_bucket{op=\"fwd\",le=\"1\"} 5\n"
      "moerun_latency_seconds_bucket{op=\"fwd\",le=\"2.5\"} 5\n"
      "moerun_latency_seconds_bucket{op=\"fwd\",le=\"+Inf\"} 7\n"
      "moerun_latency_seconds_sum{op=\"fwd\"} ";
  ASSERT_EQ(text.substr(0, want_buckets.size()), want_buckets);
  EXPECT_NE(text.find("\nmoerun_latency_seconds_count{op=\"fwd\"} 7\n"), std::string::npos);
}

TEST(MetricsTest, HistogramWithoutLabelsAndIntegerSum) {
  MetricsRegistry r;
  Histogram* h = r.AddHistogram("moerun_tokens", "Tokens per batch.", {8, 64});
  h->Observe(8);
  h->Observe(100);
  EXPECT_EQ(r.Render(),
            "# HELP moerun_tokens Tokens per batch.\n"
            "# TYPE moerun_tokens histogram\n"
            "moerun_tokens_bucket{le=\"8\"} 1\n"
            "moerun_tokens_bucket{le=\"64\"} 1\n"
            "moerun_tokens_bucket{le=\"+Inf\"} 2\n"
            "moerun_tokens_sum 108\n"
            "moerun_tokens_count 2\n");
}

TEST(MetricsTest, EscapesLabelValues) {
  MetricsRegistry r;
  r.AddGauge("moerun_info", "Build.", {{"path", "C:\\dir"}, {"quote", "say \"hi\"\nbye"}})->Set(1);
  EXPECT_EQ(r.Render(),
            "# HELP moerun_info Build.\n"
            "# TYPE moerun_info gauge\n"
            "moerun_info{path=\"C:\\\\dir\",quote=\"say \\\"hi\\\"\\nbye\"} 1\n");
}

TEST(MetricsTest, FormatsNumbers) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(-0.0), "0");
  EXPECT_EQ(FormatMetricValue(3), "3");
  EXPECT_EQ(FormatMetricValue(-17), "-17");
  EXPECT_EQ(FormatMetricValue(1e15), "1000000000000000");
  EXPECT_EQ(FormatMetricValue(9007199254740991.0), "9007199254740991");
  EXPECT_EQ(FormatMetricValue(0.1), "0.1");
  EXPECT_EQ(FormatMetricValue(2.25), "2.25");
  EXPECT_EQ(std::stod(FormatMetricValue(1e300)), 1e300);
  EXPECT_EQ(std::stod(FormatMetricValue(1.0 / 3)), 1.0 / 3);
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatMetricValue(-std::numeric_limits<double>::infinity()), "-Inf");
  MetricsRegistry r;
  r.AddGauge("moerun_big", "b")->Set(123456789012.0);
  r.AddCallbackGauge("moerun_nan", "n", [] { return std::nan(""); });
  r.AddCallbackGauge("moerun_throws", "t", []() -> double { throw std::runtime_error("x"); });
  std::string text = r.Render();
  EXPECT_NE(text.find("\nmoerun_big 123456789012\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nmoerun_nan NaN\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nmoerun_throws NaN\n"), std::string::npos) << text;
}

TEST(MetricsTest, InvalidRegistrationsThrow) {
  MetricsRegistry r;
  EXPECT_THROW(r.AddGauge("requests", "no prefix"), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("", "empty"), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("moerun_bad-name", "dash"), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("moerun_bad name", "space"), std::invalid_argument);
  EXPECT_THROW(r.AddCounter("moerun_requests", "no _total"), std::invalid_argument);
  EXPECT_THROW(r.AddCounter("moerun_x_total", "h", {{"1abc", "v"}}), std::invalid_argument);
  EXPECT_THROW(r.AddCounter("moerun_x_total", "h", {{"__name", "v"}}), std::invalid_argument);
  EXPECT_THROW(r.AddCounter("moerun_x_total", "h", {{"a-b", "v"}}), std::invalid_argument);
  EXPECT_THROW(r.AddCounter("moerun_x_total", "h", {{"a", "1"}, {"a", "2"}}),
               std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("moerun_h", "h", {1, 1}), std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("moerun_h", "h", {2, 1}), std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("moerun_h", "h", {1, std::numeric_limits<double>::infinity()}),
               std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("moerun_h", "h", {std::nan("")}), std::invalid_argument);
  EXPECT_THROW(r.AddHistogram("moerun_h", "h", {1}, {{"le", "x"}}), std::invalid_argument);
  r.AddGauge("moerun_g", "g");
  EXPECT_THROW(r.AddHistogram("moerun_g", "g", {1}), std::invalid_argument);  // type clash
  EXPECT_THROW(r.AddGauge("moerun_g", "other help"), std::invalid_argument);
  r.AddHistogram("moerun_h", "h", {1, 2});
  EXPECT_THROW(r.AddHistogram("moerun_h", "h", {1, 3}, {{"a", "b"}}), std::invalid_argument);
  r.AddCallbackGauge("moerun_cb", "c", [] { return 1.0; });
  EXPECT_THROW(r.AddCallbackGauge("moerun_cb", "c", [] { return 2.0; }), std::invalid_argument);
  EXPECT_THROW(r.AddGauge("moerun_cb", "c"), std::invalid_argument);
  EXPECT_THROW(r.AddCallbackGauge("moerun_cb2", "c", nullptr), std::invalid_argument);
  // Nothing half-registered by the failures: only the valid families render.
  std::string text = r.Render();
  EXPECT_EQ(text.find("moerun_requests "), std::string::npos);
  EXPECT_EQ(text.find("moerun_cb2"), std::string::npos);
}

TEST(MetricsTest, ConcurrentUpdatesAreExact) {
  MetricsRegistry r;
  Counter* c = r.AddCounter("moerun_ops_total", "ops");
  Gauge* g = r.AddGauge("moerun_level", "level");
  Histogram* h = r.AddHistogram("moerun_op_seconds", "latency", LatencyBuckets());
  constexpr int kThreads = 4;
  constexpr int kIters = 100000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Registration from many threads returns the same objects.
      Counter* mine = r.AddCounter("moerun_ops_total", "ops");
      for (int i = 0; i < kIters; ++i) {
        mine->Inc();
        g->Add(1.0);
        h->Observe(t == 0 ? 0.5 : 1.0);  // sums of halves stay exact in any order
      }
    });
  }
  std::string during = r.Render();  // rendering concurrently is safe
  for (auto& th : threads) th.join();
  EXPECT_FALSE(during.empty());
  EXPECT_EQ(c->value(), uint64_t{kThreads} * kIters);
  EXPECT_EQ(g->value(), double{kThreads} * kIters);
  EXPECT_EQ(h->count(), uint64_t{kThreads} * kIters);
  size_t half = 0;
  while (h->bounds()[half] != 0.5) ++half;
  EXPECT_EQ(h->bucket_count(half), uint64_t{kIters});
  EXPECT_EQ(h->sum(), (kThreads - 1) * kIters + kIters * 0.5);
  std::string text = r.Render();
  EXPECT_NE(text.find("moerun_ops_total 400000\n"), std::string::npos);
  EXPECT_NE(text.find("moerun_op_seconds_bucket{le=\"+Inf\"} 400000\n"), std::string::npos);
  EXPECT_NE(text.find("moerun_op_seconds_count 400000\n"), std::string::npos);
}

TEST(MetricsTest, LatencyBucketsAndResidentBytes) {
  std::vector<double> b = LatencyBuckets();
  ASSERT_GE(b.size(), 10u);
  EXPECT_DOUBLE_EQ(b.front(), 0.00005);
  EXPECT_DOUBLE_EQ(b.back(), 60);
  for (size_t i = 1; i < b.size(); ++i) {
    EXPECT_GT(b[i], b[i - 1]);
    EXPECT_LE(b[i] / b[i - 1], 3.01);
  }
  MetricsRegistry r;
  EXPECT_NO_THROW(r.AddHistogram("moerun_default_seconds", "d", LatencyBuckets()));
  double rss = ProcessResidentBytes();
  EXPECT_GT(rss, 1024 * 1024);  // a running test binary holds more than 1 MiB
  EXPECT_EQ(rss, std::floor(rss));
}

}  // namespace
}  // namespace moerun
