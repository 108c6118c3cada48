// W3C traceparent parsing and formatting, the OTLP endpoint's syntax, and the spans made of a
// request's trace (their tree, resources and times).
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "base/trace_context.h"
#include "runtime/serving/request_trace.h"
#include "runtime/serving/tracing_options.h"

namespace moerun {
namespace {

constexpr const char* kGood = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

TEST(TraceparentTest, ParsesTheRecommendationsExample) {
  TraceContext c;
  ASSERT_TRUE(ParseTraceparent(kGood, &c));
  EXPECT_EQ(HexOf(c.trace_id.data(), 16), "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(HexOf(c.parent_id.data(), 8), "00f067aa0ba902b7");
  EXPECT_TRUE(c.sampled());
  EXPECT_EQ(FormatTraceparent(c), kGood);
  ASSERT_TRUE(ParseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", &c));
  EXPECT_FALSE(c.sampled());
}

TEST(TraceparentTest, RefusesWhatTheRecommendationCallsInvalid) {
  const char* bad[] = {
      "",
      "garbage",
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",     // short flags
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  // v00 with more
      "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",    // uppercase
      "00-00000000000000000000000000000000-00f067aa0ba902b7-01",    // zero trace id
      "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",    // zero parent id
      "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    // version ff
      "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    // separator
      "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    // not hex
      "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",   // later version, no '-'
  };
  for (const char* t : bad) {
    TraceContext c;
    EXPECT_FALSE(ParseTraceparent(t, &c)) << t;
  }
}

TEST(TraceparentTest, ALaterVersionIsReadByItsFirstFields) {
  TraceContext c;
  EXPECT_TRUE(
      ParseTraceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-next", &c));
  EXPECT_TRUE(ParseTraceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", &c));
}

TEST(TraceparentTest, NewIdsAreNotZeroAndDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const TraceId t = NewTraceId();
    const SpanId s = NewSpanId();
    EXPECT_TRUE(seen.insert(HexOf(t.data(), t.size())).second);
    EXPECT_TRUE(seen.insert(HexOf(s.data(), s.size())).second);
  }
}

TEST(OtlpEndpointTest, ParsesAndRefuses) {
  auto t = ParseOtlpEndpoint("http://collector:4318");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->host, "collector");
  EXPECT_EQ(t->port, "4318");
  EXPECT_EQ(t->path, "/v1/traces");
  t = ParseOtlpEndpoint("127.0.0.1:9/otlp/v1/traces");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->path, "/otlp/v1/traces");
  t = ParseOtlpEndpoint("http://[::1]:4318");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->host, "::1");
  for (const char* bad : {"https://c:4318", "grpc://c:4317", "collector", "http://c:0",
                          "http://c:65536", "http://c:43x", "http://:4318", "http://[::1]4318"}) {
    EXPECT_FALSE(ParseOtlpEndpoint(bad).ok()) << bad;
  }
  TracingOptions o;
  o.endpoint = "http://c:4318";
  o.sample = 1.5;
  EXPECT_FALSE(CheckTracingOptions(o).ok());
}

// A request of two microbatches; ranks 1 and 2 took part in the first, rank 1 in the second
// (which failed before it was combined).
RequestTrace TwoMicrobatches() {
  using std::chrono::microseconds;
  const auto t0 = std::chrono::steady_clock::now();
  RequestTrace t;
  if (!ParseTraceparent(kGood, &t.ctx)) ADD_FAILURE() << "the example traceparent";
  t.has_parent = true;
  t.why = "caller";
  t.tokens = 8;
  t.received = t0;
  t.batch_start = t0 + microseconds(10);
  MicrobatchTimes m;
  m.gate = t0 + microseconds(10);
  m.dispatch = t0 + microseconds(20);
  m.sent = t0 + microseconds(30);
  m.wait = t0 + microseconds(40);
  m.combine = t0 + microseconds(90);
  m.end = t0 + microseconds(100);
  t.microbatches.push_back(m);
  MicrobatchTimes unfinished;
  unfinished.gate = t0 + microseconds(100);
  t.microbatches.push_back(unfinished);
  const int64_t base = UnixNanos(t0);
  for (int r : {1, 2}) {
    RankTimes rt;
    rt.microbatch = 0;
    rt.rank = r;
    rt.rows = 4;
    rt.sent = t0 + microseconds(25);
    rt.received = t0 + microseconds(85);
    rt.header_ns = base + 35000;
    rt.compute_start_ns = base + 45000;
    rt.answer_ns = base + 75000;
    rt.cache_wait_us = r == 2 ? 7 : 0;
    t.ranks.push_back(rt);
  }
  RankTimes no_times;  // an answer without the rank's times: the router's span only
  no_times.microbatch = 1;
  no_times.rank = 1;
  t.ranks.push_back(no_times);
  t.batch_done = t0 + microseconds(120);
  t.answered = t0 + microseconds(130);
  return t;
}

TEST(RequestTraceTest, SpansFormOneTreeUnderTheCallersSpan) {
  const RequestTrace t = TwoMicrobatches();
  TraceSource src;
  src.router_rank = 0;
  src.host = "h";
  moerun::otlp::v1::ExportTraceServiceRequest req;
  AppendSpans(t, src, &req);
  // The router's resource, then one per expert rank with times (ranks 1 and 2).
  ASSERT_EQ(req.resource_spans_size(), 3);
  std::map<std::string, const moerun::otlp::v1::Span*> by_id;
  std::map<std::string, std::string> resource_of;
  int64_t n = 0;
  for (const auto& rs : req.resource_spans()) {
    std::string instance;
    for (const auto& kv : rs.resource().attributes()) {
      if (kv.key() == "service.instance.id") instance = kv.value().string_value();
    }
    for (const auto& ss : rs.scope_spans()) {
      for (const auto& s : ss.spans()) {
        EXPECT_EQ(s.trace_id(),
                  std::string(reinterpret_cast<const char*>(t.ctx.trace_id.data()), 16));
        EXPECT_TRUE(by_id.emplace(s.span_id(), &s).second);
        resource_of[s.span_id()] = instance;
        EXPECT_LE(s.start_time_unix_nano(), s.end_time_unix_nano());
        ++n;
      }
    }
  }
  EXPECT_EQ(n, SpanCount(t));
  std::map<std::string, int> names;
  for (const auto& [id, s] : by_id) {
    ++names[s->name()];
    if (s->name() == "moerun.request") {
      EXPECT_EQ(s->parent_span_id(),
                std::string(reinterpret_cast<const char*>(t.ctx.parent_id.data()), 8));
      EXPECT_EQ(resource_of[id], "rank-0");
      continue;
    }
    ASSERT_TRUE(by_id.count(s->parent_span_id())) << s->name();
    const auto* parent = by_id[s->parent_span_id()];
    if (s->name() == "moerun.expert") {
      EXPECT_EQ(parent->name(), "moerun.expert_rank");
      EXPECT_NE(resource_of[id], "rank-0");
    }
  }
  EXPECT_EQ(names["moerun.microbatch"], 2);
  EXPECT_EQ(names["moerun.gate"], 1);  // the unfinished microbatch has no parts
  EXPECT_EQ(names["moerun.expert_rank"], 3);
  EXPECT_EQ(names["moerun.expert"], 2);
  EXPECT_EQ(names["moerun.expert.compute"], 2);
}

TEST(RequestTraceTest, ARefusedRequestAndAReplacedWait) {
  RequestTrace t;
  t.ctx.trace_id = NewTraceId();
  t.why = "failed";
  t.code = 3;
  t.error = "overloaded";
  t.received = std::chrono::steady_clock::now();
  t.batch_start = t.batch_done = t.answered = t.received + std::chrono::microseconds(5);
  moerun::otlp::v1::ExportTraceServiceRequest req;
  AppendSpans(t, TraceSource{}, &req);
  ASSERT_EQ(req.resource_spans_size(), 1);
  const auto& spans = req.resource_spans(0).scope_spans(0).spans();
  EXPECT_EQ(spans.size(), SpanCount(t));
  EXPECT_EQ(spans[0].name(), "moerun.request");
  EXPECT_TRUE(spans[0].parent_span_id().empty());
  EXPECT_EQ(spans[0].status().code(), moerun::otlp::v1::Status::STATUS_CODE_ERROR);
  EXPECT_EQ(spans[0].status().message(), "overloaded");

  t.replaced_wait_from = t.received + std::chrono::microseconds(1);
  t.replaced_wait_to = t.received + std::chrono::microseconds(4);
  moerun::otlp::v1::ExportTraceServiceRequest waited;
  AppendSpans(t, TraceSource{}, &waited);
  const auto& w = waited.resource_spans(0).scope_spans(0).spans();
  EXPECT_EQ(w.size(), SpanCount(t));
  bool found = false;
  for (const auto& s : w) {
    if (s.name() != "moerun.replaced_wait") continue;
    found = true;
    EXPECT_EQ(s.parent_span_id(), w[0].span_id());
    EXPECT_EQ(s.end_time_unix_nano() - s.start_time_unix_nano(), 3000u);
  }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace moerun
