#include "serving/serving_endpoint.h"

#include <boost/asio/steady_timer.hpp>

#include "base/log.h"
#include "serving/serve_client.h"

namespace moerun {

using moerun::v1::ErrorCode;
using Clock = std::chrono::steady_clock;

struct ServingEndpoint::Pending {
  ServingEndpoint* ep = nullptr;
  std::shared_ptr<FramedConnection> conn;
  ParsedRequest req;
  std::vector<float> out;
  BudgetLease lease, out_lease;
  Clock::time_point received;
  std::unique_ptr<boost::asio::steady_timer> timer;
  bool answered = false;
};

namespace {
// What the batcher's callback carries: keeps the request alive until the batcher is done with it.
struct Box {
  std::shared_ptr<ServingEndpoint::Pending> p;
};
}  // namespace

Result<std::unique_ptr<ServingEndpoint>> ServingEndpoint::Start(ServingOptions options,
                                                                ServedModel model, Batcher* batcher,
                                                                MetricsRegistry* metrics) {
  std::unique_ptr<ServingEndpoint> ep(new ServingEndpoint());
  ep->opts_ = options;
  ep->model_ = std::move(model);
  ep->batcher_ = batcher;
  for (int c = 0; c < 10; ++c) {
    ep->by_code_[c] =
        metrics->AddCounter("moerun_requests_total", "Serving requests answered, by result code",
                            {{"code", ErrorCodeKind(static_cast<ErrorCode>(c))}});
  }
  ep->tokens_ = metrics->AddCounter("moerun_request_tokens_total",
                                    "Tokens of the serving requests answered OK");
  ep->latency_ = metrics->AddHistogram("moerun_request_duration_seconds",
                                       "From a request's last byte to its answer being queued",
                                       LatencyBuckets());
  ep->in_flight_gauge_ =
      metrics->AddGauge("moerun_requests_in_flight", "Requests accepted and not yet answered");
  ep->connections_ = metrics->AddGauge("moerun_serving_connections", "Open serving connections");
  ServingEndpoint* raw = ep.get();
  FramedHandlers h;
  h.on_frame = [raw](const std::shared_ptr<FramedConnection>& c, std::string body,
                     BudgetLease lease) { raw->OnFrame(c, std::move(body), std::move(lease)); };
  h.error_frame = [raw](ErrorCode code, const std::string& message) {
    raw->by_code_[static_cast<int>(code) % 10]->Inc();
    return EncodeInferError(0, code, message);
  };
  h.on_connections = [raw](int n) { raw->connections_->Set(n); };
  h.on_read_closed = [raw](const std::shared_ptr<FramedConnection>& c) {
    // Answers still owed go out first; then the connection closes.
    if (raw->per_conn_.count(c->id()) == 0) return c->CloseAfterWrites();
    raw->half_closed_.insert(c->id());
  };
  MOERUN_ASSIGN_OR_RETURN(ep->server_, FramedServer::Start(options.framed, std::move(h)));
  return ep;
}

ServingEndpoint::~ServingEndpoint() { Stop(); }

uint16_t ServingEndpoint::port() const { return server_->port(); }

void ServingEndpoint::BeginDrain() {
  if (draining_.exchange(true)) return;
  server_->StopAccepting();
  spdlog::info("serving: draining ({} requests in flight)", in_flight_.load());
}

void ServingEndpoint::Stop() {
  if (server_) server_->Stop();
}

void ServingEndpoint::Answer(Pending& p, std::string frame, ErrorCode code) {
  if (p.answered) return;
  p.answered = true;
  if (p.timer) p.timer->cancel();
  p.conn->Send(std::move(frame));
  by_code_[static_cast<int>(code) % 10]->Inc();
  if (code == moerun::v1::OK) tokens_->Inc(static_cast<uint64_t>(p.req.tokens));
  latency_->Observe(std::chrono::duration<double>(Clock::now() - p.received).count());
}

// The batcher gave the request back: its connection may read again (a request answered early by
// its deadline still counted until then, so one client cannot fill the batcher's queue).
void ServingEndpoint::Release(Pending& p) {
  const uint64_t id = p.conn->id();
  auto it = per_conn_.find(id);
  if (it == per_conn_.end()) return;
  const int left = --it->second;
  if (left == 0) {
    per_conn_.erase(it);
    if (half_closed_.erase(id) > 0) return p.conn->CloseAfterWrites();
  }
  if (left < opts_.max_inflight_per_connection) p.conn->Resume();
}

void ServingEndpoint::OnFrame(const std::shared_ptr<FramedConnection>& conn, std::string body,
                              BudgetLease lease) {
  auto p = std::make_shared<Pending>();
  p->ep = this;
  p->conn = conn;
  p->received = Clock::now();
  RequestError err;
  const bool ok = ParseInferRequest(body, model_, &p->req, &err);
  body = std::string();
  lease.Release();  // the body is gone; the budget now covers the floats
  auto refuse = [&](uint64_t id, ErrorCode code, const std::string& message) {
    conn->Send(EncodeInferError(id, code, message));
    by_code_[static_cast<int>(code) % 10]->Inc();
  };
  if (!ok) return refuse(err.id, err.code, err.message);
  if (draining_.load()) {
    return refuse(p->req.id, moerun::v1::UNAVAILABLE, "the server is draining (shutting down)");
  }
  const int64_t bytes = static_cast<int64_t>(p->req.x.size() * sizeof(float));
  if (!server_->TryLease(bytes, &p->lease) || !server_->TryLease(bytes, &p->out_lease)) {
    return refuse(p->req.id, moerun::v1::OVERLOADED,
                  "the server holds too many request bytes; retry later");
  }
  p->out.resize(p->req.x.size());
  auto deadline_ms = p->req.deadline_ms > 0 ? std::chrono::milliseconds(p->req.deadline_ms)
                                            : opts_.default_deadline;
  deadline_ms = std::min(deadline_ms, opts_.max_deadline);
  const auto deadline = p->received + deadline_ms;

  BatchRequest br;
  br.layer = p->req.layer;
  br.x = p->req.x.data();
  br.out = p->out.data();
  br.tokens = p->req.tokens;
  br.deadline = deadline;
  br.done = &ServingEndpoint::OnBatchDone;
  auto* box = new Box{p};
  br.ctx = box;
  in_flight_.fetch_add(1);
  in_flight_gauge_->Set(static_cast<double>(in_flight_.load()));
  const Status s = batcher_->Submit(br);
  if (!s.ok()) {
    delete box;
    in_flight_.fetch_sub(1);
    in_flight_gauge_->Set(static_cast<double>(in_flight_.load()));
    return refuse(p->req.id, ErrorCodeOf(s), s.message());
  }
  if (++per_conn_[conn->id()] >= opts_.max_inflight_per_connection) conn->Pause();
  // The deadline holds even if the batch that carries this request is slow to come back.
  p->timer = std::make_unique<boost::asio::steady_timer>(server_->io());
  p->timer->expires_at(deadline);
  p->timer->async_wait([this, p, deadline_ms](const boost::system::error_code& ec) {
    if (ec) return;
    Answer(*p,
           EncodeInferError(p->req.id, moerun::v1::DEADLINE_EXCEEDED,
                            "no answer within the request's deadline of " +
                                std::to_string(deadline_ms.count()) +
                                " ms (is an expert rank not answering? see /health/ready)"),
           moerun::v1::DEADLINE_EXCEEDED);
  });
}

void ServingEndpoint::OnBatchDone(void* ctx, const Status& status, const BatchInfo& info) {
  // Runs on the router thread: hand the result to the I/O thread.
  std::unique_ptr<Box> box(static_cast<Box*>(ctx));
  std::shared_ptr<Pending> p = std::move(box->p);
  ServingEndpoint* ep = p->ep;
  std::string frame;
  ErrorCode code = ErrorCodeOf(status);
  if (status.ok()) {
    frame =
        EncodeInferAnswer(p->req.id, p->req.dtype, p->req.tokens,
                          static_cast<int64_t>(p->out.size()) / p->req.tokens, p->out.data(), info);
  } else {
    frame = EncodeInferError(p->req.id, code, status.message());
  }
  ep->in_flight_.fetch_sub(1);
  ep->in_flight_gauge_->Set(static_cast<double>(ep->in_flight_.load()));
  ep->server_->Post([ep, p, frame = std::move(frame), code]() mutable {
    ep->Answer(*p, std::move(frame), code);
    ep->Release(*p);
  });
}

}  // namespace moerun
