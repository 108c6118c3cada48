// Exports request traces to an OpenTelemetry collector: OTLP/HTTP, protobuf bodies
// (`POST /v1/traces`, Content-Type application/x-protobuf), from a thread of its own.
//
// The serving path only offers a finished request's RequestTrace (a few vectors moved into a
// queue); the exporter's thread makes the spans, batches them (every `flush_interval`, or
// sooner once `batch_spans` wait) and posts them. The queue is bounded (`max_queue_spans`):
// when the collector is slow, down, refusing or answering garbage, traces are dropped and
// counted, never waited for; an answer to a client is never delayed by tracing. Each post has
// `timeout` for connecting, sending and reading the answer (at most 64 KiB of it); an address
// that does not resolve is tried again at the next batch.
//
// Metrics: moerun_trace_spans_exported_total, moerun_trace_spans_dropped_total{reason=
// queue_full|export_failed|rejected}, moerun_trace_exports_total{result=ok|failed},
// moerun_trace_queue_spans.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "base/metrics.h"
#include "base/status.h"
#include "runtime/serving/request_trace.h"
#include "runtime/serving/tracing_options.h"

namespace moerun {

class TraceExporter {
 public:
  // Starts the thread; nothing is resolved or connected yet (a collector that is not there yet
  // is not an error). `metrics` must outlive the exporter.
  static Result<std::unique_ptr<TraceExporter>> Start(TracingOptions options,
                                                      MetricsRegistry* metrics);
  // Posts what is queued (within one `timeout`), then stops the thread.
  ~TraceExporter();
  TraceExporter(const TraceExporter&) = delete;
  TraceExporter& operator=(const TraceExporter&) = delete;

  const TracingOptions& options() const { return opts_; }
  // Queues a finished request's trace; false (and counted) when the queue has no room.
  bool Offer(RequestTrace&& t);
  // Blocks until everything offered so far was posted or dropped (tests, shutdown).
  void Flush();

 private:
  explicit TraceExporter(TracingOptions options);
  void Run();
  // Posts one body; false on any failure (logged, at most once per 10 s).
  bool Post(const std::string& body, int64_t spans);

  TracingOptions opts_;
  OtlpTarget target_;
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<RequestTrace> queue_;
  int64_t queued_spans_ = 0;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
  std::chrono::steady_clock::time_point last_warning_{};
  struct Connection;
  std::unique_ptr<Connection> conn_;  // the exporter thread's

  Counter* exported_ = nullptr;
  Counter* dropped_full_ = nullptr;
  Counter* dropped_failed_ = nullptr;
  Counter* dropped_rejected_ = nullptr;
  Counter* exports_ok_ = nullptr;
  Counter* exports_failed_ = nullptr;
  Gauge* queue_gauge_ = nullptr;
};

}  // namespace moerun
