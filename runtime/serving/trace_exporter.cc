#include "runtime/serving/trace_exporter.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "base/log.h"

namespace moerun {

namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = boost::asio::ip::tcp;
using Clock = std::chrono::steady_clock;

struct TraceExporter::Connection {
  boost::asio::io_context io;
  std::optional<beast::tcp_stream> stream;
  std::optional<tcp::resolver::results_type> resolved;
  beast::flat_buffer buffer;
};

TraceExporter::TraceExporter(TracingOptions options)
    : opts_(std::move(options)), conn_(std::make_unique<Connection>()) {}

Result<std::unique_ptr<TraceExporter>> TraceExporter::Start(TracingOptions options,
                                                            MetricsRegistry* metrics) {
  MOERUN_RETURN_IF_ERROR(CheckTracingOptions(options));
  if (!options.enabled()) return Status::InvalidArgument("tracing has no endpoint");
  std::unique_ptr<TraceExporter> e(new TraceExporter(std::move(options)));
  MOERUN_ASSIGN_OR_RETURN(e->target_, ParseOtlpEndpoint(e->opts_.endpoint));
  const auto dropped = [&](const char* reason) {
    return metrics->AddCounter("moerun_trace_spans_dropped_total",
                               "Trace spans not exported: queue_full (the collector is slower "
                               "than the traces come), export_failed (no collector, refused, "
                               "timed out or a bad answer), rejected (the collector said so)",
                               {{"reason", reason}});
  };
  e->exported_ = metrics->AddCounter("moerun_trace_spans_exported_total",
                                     "Trace spans the collector accepted");
  e->dropped_full_ = dropped("queue_full");
  e->dropped_failed_ = dropped("export_failed");
  e->dropped_rejected_ = dropped("rejected");
  const auto exports = [&](const char* result) {
    return metrics->AddCounter("moerun_trace_exports_total", "OTLP/HTTP posts to the collector",
                               {{"result", result}});
  };
  e->exports_ok_ = exports("ok");
  e->exports_failed_ = exports("failed");
  e->queue_gauge_ =
      metrics->AddGauge("moerun_trace_queue_spans", "Trace spans waiting for the exporter");
  e->thread_ = std::thread([raw = e.get()] { raw->Run(); });
  spdlog::info("tracing: OTLP/HTTP to http://{}:{}{} (share {}, slow_ms {}, failed requests)",
               e->target_.host, e->target_.port, e->target_.path, e->opts_.sample,
               e->opts_.slow_ms);
  return e;
}

TraceExporter::~TraceExporter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool TraceExporter::Offer(RequestTrace&& t) {
  const int64_t spans = SpanCount(t);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || queued_spans_ + spans > static_cast<int64_t>(opts_.max_queue_spans)) {
      dropped_full_->Inc(static_cast<uint64_t>(spans));
      return false;
    }
    queued_spans_ += spans;
    queue_.push_back(std::move(t));
    queue_gauge_->Set(static_cast<double>(queued_spans_));
    if (queued_spans_ < opts_.batch_spans) return true;
  }
  cv_.notify_one();
  return true;
}

void TraceExporter::Flush() {
  cv_.notify_all();
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return (queue_.empty() && !busy_) || !thread_.joinable(); });
}

void TraceExporter::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait_for(lock, opts_.flush_interval,
                 [&] { return stop_ || queued_spans_ >= opts_.batch_spans; });
    if (queue_.empty()) {
      idle_cv_.notify_all();
      if (stop_) return;
      continue;
    }
    std::deque<RequestTrace> batch;
    batch.swap(queue_);
    queued_spans_ = 0;
    queue_gauge_->Set(0);
    busy_ = true;
    lock.unlock();
    // Posts of at most batch_spans spans each (the messages of one post are all that is built
    // at a time); after a failed post the rest of the round is dropped, not tried one by one.
    bool failed = false;
    while (!batch.empty()) {
      moerun::otlp::v1::ExportTraceServiceRequest req;
      int64_t n = 0;
      while (!batch.empty() && (n == 0 || n + SpanCount(batch.front()) <= opts_.batch_spans)) {
        n += SpanCount(batch.front());
        if (!failed) AppendSpans(batch.front(), opts_.source, &req);
        batch.pop_front();
      }
      if (failed) {
        dropped_failed_->Inc(static_cast<uint64_t>(n));
        continue;
      }
      const bool ok = Post(req.SerializeAsString(), n);
      (ok ? exports_ok_ : exports_failed_)->Inc();
      if (!ok) {
        dropped_failed_->Inc(static_cast<uint64_t>(n));
        failed = true;
      }
    }
    lock.lock();
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

bool TraceExporter::Post(const std::string& body, int64_t spans) {
  Connection& c = *conn_;
  const auto deadline = Clock::now() + opts_.timeout;
  http::request<http::string_body> req{http::verb::post, target_.path, 11};
  req.set(http::field::host, target_.host + ":" + target_.port);
  req.set(http::field::content_type, "application/x-protobuf");
  req.set(http::field::user_agent, "moerun");
  req.keep_alive(true);
  req.body() = body;
  req.prepare_payload();
  const auto close = [&] {
    if (!c.stream) return;
    beast::error_code ignored;
    c.stream->socket().close(ignored);
    c.stream.reset();
  };
  // One exchange on the open connection, or on a new one; "" when an answer came (in *res).
  const auto attempt = [&](http::response<http::string_body>* res) {
    std::string failed;
    bool done = false;
    http::response_parser<http::string_body> parser;
    parser.body_limit(64 * 1024);
    parser.header_limit(16 * 1024);
    const auto fail = [&](const char* what, const beast::error_code& ec) {
      failed = std::string(what) + ": " + ec.message();
      close();
    };
    const auto read = [&] {
      c.buffer.clear();
      http::async_read(*c.stream, c.buffer, parser, [&](beast::error_code ec, size_t) {
        if (ec) return fail("reading the answer", ec);
        done = true;
      });
    };
    const auto write = [&] {
      c.stream->expires_at(deadline);
      http::async_write(*c.stream, req, [&](beast::error_code ec, size_t) {
        if (ec) return fail("sending", ec);
        read();
      });
    };
    const auto connect = [&] {
      c.stream.emplace(c.io);
      c.stream->expires_at(deadline);
      c.stream->async_connect(*c.resolved, [&](beast::error_code ec, const tcp::endpoint&) {
        if (ec) {
          c.resolved.reset();  // resolved again next time (the collector may have moved)
          return fail("connecting", ec);
        }
        write();
      });
    };
    tcp::resolver resolver(c.io);
    if (c.stream) {
      write();
    } else if (c.resolved) {
      connect();
    } else {
      resolver.async_resolve(target_.host, target_.port,
                             [&](beast::error_code ec, tcp::resolver::results_type r) {
                               if (ec) return fail("resolving", ec);
                               c.resolved = std::move(r);
                               connect();
                             });
    }
    c.io.restart();
    c.io.run();
    if (done) *res = parser.release();
    return done ? std::string() : (failed.empty() ? std::string("no answer") : failed);
  };
  http::response<http::string_body> res;
  const bool reused = c.stream.has_value();
  std::string failed = attempt(&res);
  // A kept-alive connection the collector closed meanwhile: once more on a new one.
  if (!failed.empty() && reused && Clock::now() < deadline) failed = attempt(&res);
  if (failed.empty()) {
    const unsigned status = res.result_int();
    if (status / 100 == 2) {
      moerun::otlp::v1::ExportTraceServiceResponse answer;
      int64_t rejected = 0;
      if (!res.body().empty() && answer.ParseFromString(res.body())) {
        rejected = std::clamp<int64_t>(answer.partial_success().rejected_spans(), 0, spans);
      }
      exported_->Inc(static_cast<uint64_t>(spans - rejected));
      if (rejected > 0) dropped_rejected_->Inc(static_cast<uint64_t>(rejected));
      if (!res.keep_alive()) close();
      return true;
    }
    failed = "the collector answered HTTP " + std::to_string(status);
    close();
  }
  const auto now = Clock::now();
  if (now - last_warning_ >= std::chrono::seconds(10)) {
    last_warning_ = now;
    spdlog::warn("tracing: {} spans dropped: the collector at http://{}:{}{}: {}", spans,
                 target_.host, target_.port, target_.path, failed);
  }
  return false;
}

}  // namespace moerun
