// What `tracing:` in the serve config sets (runtime/serving/trace_exporter.h exports), and its
// endpoint's syntax. No network code here: the config reader and its tests use it alone.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "base/status.h"
#include "runtime/serving/request_trace.h"

namespace moerun {

struct TracingOptions {
  // http://HOST:PORT[/PATH] (PATH default /v1/traces), or HOST:PORT; empty: tracing off.
  std::string endpoint;
  double sample = 0.01;  // share of the requests without a sampled traceparent that are traced
  int64_t slow_ms = 0;   // > 0: every request slower than this (frame in to answer out) too
  // Every failed request is traced, and every request whose traceparent says sampled.
  size_t max_queue_spans = 16384;
  int64_t batch_spans = 2048;
  std::chrono::milliseconds flush_interval{500};
  std::chrono::milliseconds timeout{2000};
  TraceSource source;  // router rank, host
  bool enabled() const { return !endpoint.empty(); }
};

struct OtlpTarget {
  std::string host, port, path;
};
// Parses TracingOptions::endpoint; https and other schemes are refused with a clear error.
Result<OtlpTarget> ParseOtlpEndpoint(const std::string& endpoint);
// Checks the options (the endpoint's syntax, the share, the bounds).
Status CheckTracingOptions(const TracingOptions& o);

}  // namespace moerun
