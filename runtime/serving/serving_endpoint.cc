#include "runtime/serving/serving_endpoint.h"

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <algorithm>
#include <cstring>
#include <random>

#include "base/log.h"
#include "base/trace_context.h"
#include "runtime/serving/buffer_pool.h"
#include "runtime/serving/control_auth.h"
#include "runtime/serving/handler_memory.h"
#include "runtime/serving/serve_client.h"

namespace moerun {

using moerun::v1::ErrorCode;
using Clock = std::chrono::steady_clock;

// One request from its frame to its answer; slots are reused.
struct ServingEndpoint::Pending {
  ServingEndpoint* ep = nullptr;
  std::shared_ptr<FramedConnection> conn;
  PooledBuffer body;    // the request frame: its data is the batcher's input until gathered
  PooledBuffer answer;  // the answer frame, its data written by the batcher
  AnswerLayout layout;
  ParsedRequest req;
  BudgetLease lease, out_lease;
  Clock::time_point received, deadline;
  std::chrono::milliseconds deadline_ms{0};
  // From the batcher (router thread), read by the I/O thread after the hand-back.
  Status status;
  BatchInfo info;                 // without its timing pointer: timing and ranks hold it
  AnswerTiming timing;            // batch: the router's parts (ranks: in `ranks`)
  std::vector<RankTiming> ranks;  // room for every expert rank, reserved once per slot
  bool have_timing = false;
  Clock::time_point batch_done;
  size_t frame_offset = 0, frame_size = 0;
  bool answered = false;
  int heap_pos = -1;        // in the deadline heap, or -1
  Pending* next = nullptr;  // the finished list
  // Tracing: the request's context (a valid traceparent's, or none), why it is traced from the
  // start (null: not head-sampled), its batch's times (copied only with tracing on), its answer.
  TraceContext trace;
  bool trace_parent = false;
  const char* trace_why = nullptr;
  std::vector<MicrobatchTimes> mb_times;
  std::vector<RankTimes> rank_times;
  Clock::time_point replaced_wait_from, replaced_wait_to;
  Clock::time_point answered_at;
  ErrorCode answered_code = moerun::v1::OK;
  std::string answered_error;
};

// One timer for every deadline: a min-heap of the requests by deadline (I/O thread only).
struct ServingEndpoint::Timers {
  explicit Timers(boost::asio::io_context& io)
      : timer(io), key_log_timer(io), key_log(std::chrono::seconds(10), 4096, "serving", "key") {}
  boost::asio::steady_timer timer;
  // The log of requests refused for their key: its interval's timer runs while it is open.
  boost::asio::steady_timer key_log_timer;
  AuthFailureLog key_log;
  HandlerMemory* timer_mem = nullptr;
  HandlerMemory* wake_mem = nullptr;
  std::vector<Pending*> heap;
  Clock::time_point armed = Clock::time_point::max();

  bool Before(size_t a, size_t b) const { return heap[a]->deadline < heap[b]->deadline; }
  void Swap(size_t a, size_t b) {
    std::swap(heap[a], heap[b]);
    heap[a]->heap_pos = static_cast<int>(a);
    heap[b]->heap_pos = static_cast<int>(b);
  }
  void Up(size_t i) {
    while (i > 0 && Before(i, (i - 1) / 2)) {
      Swap(i, (i - 1) / 2);
      i = (i - 1) / 2;
    }
  }
  void Down(size_t i) {
    for (;;) {
      size_t m = i;
      for (size_t c = 2 * i + 1; c <= 2 * i + 2 && c < heap.size(); ++c) {
        if (Before(c, m)) m = c;
      }
      if (m == i) return;
      Swap(i, m);
      i = m;
    }
  }
  void Push(Pending* p) {
    heap.push_back(p);
    p->heap_pos = static_cast<int>(heap.size() - 1);
    Up(heap.size() - 1);
  }
  void Erase(Pending* p) {
    const size_t i = static_cast<size_t>(p->heap_pos);
    const size_t last = heap.size() - 1;
    if (i != last) Swap(i, last);
    heap.pop_back();
    p->heap_pos = -1;
    if (i < heap.size()) {
      Up(i);
      Down(i);
    }
  }
};

namespace {

// The id (field 1, a varint) of an InferRequest from the first bytes of its body, or 0 when they
// do not hold it whole: the fields before it are skipped (the bytes may be cut anywhere).
uint64_t PeekRequestId(std::string_view b) {
  size_t i = 0;
  const auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && i < b.size(); shift += 7) {
      const auto byte = static_cast<uint8_t>(b[i++]);
      *v |= uint64_t{byte & 0x7fu} << shift;
      if ((byte & 0x80u) == 0) return true;
    }
    return false;
  };
  while (i < b.size()) {
    uint64_t tag = 0, v = 0;
    if (!varint(&tag)) return 0;
    const uint64_t field = tag >> 3;
    switch (tag & 7u) {
      case 0:  // varint
        if (!varint(&v)) return 0;
        if (field == 1) return v;
        break;
      case 1:  // 64-bit
        i += 8;
        break;
      case 2:  // length-delimited
        if (!varint(&v) || v > b.size() - std::min(i, b.size())) return 0;
        i += static_cast<size_t>(v);
        break;
      case 5:  // 32-bit
        i += 4;
        break;
      default:
        return 0;
    }
  }
  return 0;
}

}  // namespace

ServingEndpoint::ServingEndpoint() = default;

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
  {
    auto part = [&](const char* name) {
      return metrics->AddHistogram(
          "moerun_request_part_seconds",
          "Where the requests' time went on the router: queue (arrival to its batch), gate, "
          "dispatch, wait (for the expert ranks), combine, shared (expert, during the wait), "
          "reply (batch done to the answer handed to the socket); summed over the "
          "microbatches of its batch",
          LatencyBuckets(), {{"part", name}});
    };
    PartHistograms& h = ep->parts_;
    h.queue = part("queue");
    h.gate = part("gate");
    h.dispatch = part("dispatch");
    h.wait = part("wait");
    h.combine = part("combine");
    h.shared = part("shared");
    h.reply = part("reply");
    for (int r = 0; r < ep->model_.expert_ranks; ++r) {
      const std::string rank = std::to_string(ep->model_.first_expert_rank + r);
      h.round_trip.push_back(metrics->AddHistogram(
          "moerun_expert_round_trip_seconds",
          "Per request, its batch's round trips with this expert rank: header sent to answer "
          "received, summed over the batch's microbatches",
          LatencyBuckets(), {{"rank", rank}}));
      h.compute.push_back(metrics->AddHistogram(
          "moerun_expert_compute_seconds",
          "Per request, this expert rank's own time for its batch's rows, as it reported it",
          LatencyBuckets(), {{"rank", rank}}));
    }
  }
  ep->connections_ = metrics->AddGauge("moerun_serving_connections", "Open serving connections");
  if (options.tracing.enabled()) {
    MOERUN_ASSIGN_OR_RETURN(ep->tracer_, TraceExporter::Start(options.tracing, metrics));
    ep->bad_traceparent_ = metrics->AddCounter(
        "moerun_trace_bad_traceparent_total",
        "Requests whose traceparent was malformed (ignored: traced, if at all, as without one)");
    const auto traced = [&](const char* why) {
      return metrics->AddCounter("moerun_trace_requests_total",
                                 "Requests traced, by why: caller (its traceparent said sampled), "
                                 "share (tracing.sample), slow (over tracing.slow_ms), failed",
                                 {{"why", why}});
    };
    ep->traced_caller_ = traced("caller");
    ep->traced_share_ = traced("share");
    ep->traced_slow_ = traced("slow");
    ep->traced_failed_ = traced("failed");
  }
  ServingEndpoint* raw = ep.get();
  FramedHandlers h;
  h.on_frame = [raw](const std::shared_ptr<FramedConnection>& c, PooledBuffer body,
                     BudgetLease lease) { raw->OnFrame(c, std::move(body), std::move(lease)); };
  h.error_frame = [raw](ErrorCode code, const std::string& message, uint64_t id) {
    raw->by_code_[static_cast<int>(code) % 10]->Inc();
    return EncodeInferError(id, code, message);
  };
  h.frame_id = PeekRequestId;
  h.on_connections = [raw](int n) {
    raw->connections_->Set(n);
    raw->OnConnections(n);
  };
  h.on_read_closed = [](const std::shared_ptr<FramedConnection>& c) {
    // Answers still owed go out first; then the connection closes.
    if (c->held == 0) return c->CloseAfterWrites();
    c->close_when_answered = true;
  };
  ep->slots_.reserve(1024);
  ep->free_.reserve(1024);
  FramedServerOptions framed = options.framed;
  framed.defer_accept = true;  // the timers first: they need the server's I/O context
  MOERUN_ASSIGN_OR_RETURN(ep->server_, FramedServer::Start(framed, std::move(h)));
  ep->timers_ = std::make_unique<Timers>(ep->server_->io());
  ep->timers_->timer_mem = ep->server_->NewHandlerMemory();
  ep->timers_->wake_mem = ep->server_->NewHandlerMemory();
  ep->timers_->heap.reserve(1024);
  if (!options.key.empty() && !options.key_file.empty()) {
    ep->key_watch_ = std::make_unique<TokenFileWatch>(
        options.key_file, options.key, options.key_grace,
        [](const std::string& path) { return ReadTokenFile(path).WithContext("serving key file"); },
        TokenFileWatch::Stamper{}, "serving", "key");
  }
  if (!options.key.empty())
    spdlog::info("{}: every request must carry the serving key", framed.name);
  ep->server_->StartAccepting();  // after this post, the I/O thread sees all of the above
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

ServingEndpoint::Pending* ServingEndpoint::TakeSlot() {
  if (free_.empty()) {
    slots_.push_back(std::make_unique<Pending>());
    slots_.back()->ep = this;
    slots_.back()->ranks.reserve(static_cast<size_t>(model_.expert_ranks));
    return slots_.back().get();
  }
  Pending* p = free_.back();
  free_.pop_back();
  return p;
}

void ServingEndpoint::FreeSlot(Pending* p) {
  p->conn.reset();
  p->body.Release();
  p->answer.Release();
  p->lease.Release();
  p->out_lease.Release();
  p->status = Status::Ok();
  p->have_timing = false;
  p->answered = false;
  p->next = nullptr;
  p->trace_parent = false;
  p->trace_why = nullptr;
  p->mb_times.clear();
  p->rank_times.clear();
  p->replaced_wait_from = p->replaced_wait_to = Clock::time_point{};
  p->info = BatchInfo{};
  p->batch_done = Clock::time_point{};
  p->answered_code = moerun::v1::OK;
  p->answered_error.clear();
  free_.push_back(p);
}

void ServingEndpoint::Refuse(FramedConnection& conn, uint64_t id, ErrorCode code,
                             const std::string& message) {
  conn.Send(EncodeInferError(id, code, message));
  by_code_[static_cast<int>(code) % 10]->Inc();
}

void ServingEndpoint::Answer(Pending& p, ErrorCode code, const std::string& message) {
  if (p.answered) return;
  p.answered = true;
  p.answered_at = Clock::now();
  p.answered_code = code;
  if (tracer_ && code != moerun::v1::OK) p.answered_error = message;
  if (code == moerun::v1::OK) {
    p.conn->Send(std::move(p.answer), p.frame_offset, p.frame_size);
    tokens_->Inc(static_cast<uint64_t>(p.req.tokens));
  } else {
    p.conn->Send(EncodeInferError(p.req.id, code, message));
  }
  by_code_[static_cast<int>(code) % 10]->Inc();
  latency_->Observe(std::chrono::duration<double>(Clock::now() - p.received).count());
}

// The batcher gave the request back: its connection may read again (a request answered early by
// its deadline still counted until then, so one client cannot fill the batcher's queue).
void ServingEndpoint::Release(Pending& p) {
  FramedConnection& c = *p.conn;
  const int left = --c.held;
  if (left == 0 && c.close_when_answered) return c.CloseAfterWrites();
  if (left < opts_.max_inflight_per_connection) c.Resume();
}

void ServingEndpoint::OnFrame(const std::shared_ptr<FramedConnection>& conn, PooledBuffer body,
                              BudgetLease lease) {
  Pending* p = TakeSlot();
  p->conn = conn;
  p->received = Clock::now();
  p->body = std::move(body);
  RequestError err;
  const std::string_view body_bytes(p->body.data(), p->body.size());
  std::string_view key = opts_.key;
  if (key_watch_) {  // the key file is looked at again (at most once a second)
    if (const std::string line = key_watch_->Poll(p->received); !line.empty()) {
      spdlog::warn("{}", line);
    }
    key = key_watch_->token();
  }
  bool parsed = ParseInferRequest(body_bytes, model_, &p->req, &err, key);
  if (!parsed && err.code == moerun::v1::UNAUTHENTICATED && key_watch_ && !p->req.key.empty() &&
      key_watch_->Accepts(p->req.key, p->received)) {
    // The previous key within its grace period: the request is checked as any other.
    const std::string_view sent = p->req.key;
    parsed = ParseInferRequest(body_bytes, model_, &p->req, &err, sent);
  }
  if (!parsed) {
    if (err.code == moerun::v1::UNAUTHENTICATED) LogRefusedKey(*conn, p->req.key.empty());
    Refuse(*conn, err.id, err.code, err.message);
    return FreeSlot(p);
  }
  if (tracer_ && p->req.probe == moerun::v1::PROBE_NONE) StartTrace(*p);
  if (draining_.load()) {
    Refuse(*conn, p->req.id, moerun::v1::UNAVAILABLE, "the server is draining (shutting down)");
    TraceRefused(*p, moerun::v1::UNAVAILABLE, "the server is draining (shutting down)");
    return FreeSlot(p);
  }
  // The body stays (the batcher decodes it in place); the answer needs its own bytes.
  p->lease = std::move(lease);
  p->layout = LayoutAnswer(p->req.dtype, p->req.tokens, model_.hidden,
                           p->req.timing ? model_.expert_ranks : -1);
  if (!server_->TryLease(static_cast<int64_t>(p->layout.capacity), &p->out_lease)) {
    Refuse(*conn, p->req.id, moerun::v1::OVERLOADED,
           "the server holds too many request bytes; retry later");
    TraceRefused(*p, moerun::v1::OVERLOADED, "the server holds too many request bytes");
    return FreeSlot(p);
  }
  p->answer = server_->buffers().Take(p->layout.capacity);
  if (p->req.probe == moerun::v1::PROBE_CLIENT) return AnswerProbe(p);
  p->deadline_ms = p->req.deadline_ms > 0 ? std::chrono::milliseconds(p->req.deadline_ms)
                                          : opts_.default_deadline;
  p->deadline_ms = std::min(p->deadline_ms, opts_.max_deadline);
  p->deadline = p->received + p->deadline_ms;

  BatchRequest br;
  br.layer = p->req.probe == moerun::v1::PROBE_TRANSPORT ? kTransportProbeLayer : p->req.layer;
  br.x = p->req.data.data();
  br.x_type = RowTypeOf(p->req.dtype);
  br.out = p->answer.data() + p->layout.data_offset;
  br.out_type = br.x_type;
  br.tokens = p->req.tokens;
  br.deadline = p->deadline;
  br.done = &ServingEndpoint::OnBatchDone;
  br.ctx = p;
  in_flight_.fetch_add(1);
  in_flight_gauge_->Set(static_cast<double>(in_flight_.load()));
  const Status s = batcher_->Submit(br);
  if (!s.ok()) {
    in_flight_.fetch_sub(1);
    in_flight_gauge_->Set(static_cast<double>(in_flight_.load()));
    Refuse(*conn, p->req.id, ErrorCodeOf(s), s.message());
    TraceRefused(*p, ErrorCodeOf(s), s.message());
    return FreeSlot(p);
  }
  if (++conn->held >= opts_.max_inflight_per_connection) conn->Pause();
  // The deadline holds even if the batch that carries this request is slow to come back.
  Arm(p);
}

// Once a wave of connections (a flood of thousands) has mostly gone, the memory of their state
// goes back to the system: freed, it stayed in the allocator's heap (a 4,200-connection flood
// left the process ~36 MiB larger; trimmed, ~16 MiB).
void ServingEndpoint::OnConnections(int n) {
  conn_peak_ = std::max(conn_peak_, n);
  if (conn_peak_ >= 256 && n <= conn_peak_ / 8) {
    conn_peak_ = n;
    TrimFreeMemory();
  }
}

void ServingEndpoint::LogRefusedKey(FramedConnection& conn, bool missing) {
  const std::string line =
      timers_->key_log.Record(conn.peer_address(), missing ? "no key" : "a wrong key");
  if (line.empty()) return;
  spdlog::warn("{}", line);
  ArmKeyLogTimer();
}

// Once per interval while refusals come: their summary; a quiet interval stops the timer.
void ServingEndpoint::ArmKeyLogTimer() {
  Timers& t = *timers_;
  t.key_log_timer.expires_after(t.key_log.interval());
  t.key_log_timer.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    const std::string summary = timers_->key_log.TakeSummary();
    if (summary.empty()) return;
    spdlog::warn("{}", summary);
    ArmKeyLogTimer();
  });
}

void ServingEndpoint::Arm(Pending* p) {
  Timers& t = *timers_;
  t.Push(p);
  if (p->deadline >= t.armed) return;
  t.armed = p->deadline;
  t.timer.expires_at(t.armed);
  t.timer.async_wait(WithMemory(t.timer_mem, [this](const boost::system::error_code& ec) {
    if (!ec) OnDeadlines();
  }));
}

void ServingEndpoint::OnDeadlines() {
  Timers& t = *timers_;
  t.armed = Clock::time_point::max();
  const auto now = Clock::now();
  while (!t.heap.empty() && t.heap.front()->deadline <= now) {
    Pending* p = t.heap.front();
    t.Erase(p);
    Answer(*p, moerun::v1::DEADLINE_EXCEEDED,
           "no answer within the request's deadline of " + std::to_string(p->deadline_ms.count()) +
               " ms (is an expert rank not answering? see /health/ready)");
  }
  if (t.heap.empty()) return;
  t.armed = t.heap.front()->deadline;
  t.timer.expires_at(t.armed);
  t.timer.async_wait(WithMemory(t.timer_mem, [this](const boost::system::error_code& ec) {
    if (!ec) OnDeadlines();
  }));
}

void ServingEndpoint::OnBatchDone(void* ctx, const Status& status, const BatchInfo& info) {
  // Runs on the router thread: finish the answer frame, then hand the request to the I/O thread.
  auto* p = static_cast<Pending*>(ctx);
  ServingEndpoint* ep = p->ep;
  p->status = status;
  p->batch_done = Clock::now();
  p->info = info;
  p->info.timing = nullptr;
  p->have_timing = info.timing != nullptr;
  if (p->have_timing) {
    p->timing.batch = *info.timing;
    // The ranks are copied (room for every expert rank was reserved: no allocation).
    const size_t n = std::min(info.timing->ranks.size(), p->ranks.capacity());
    p->ranks.assign(info.timing->ranks.begin(), info.timing->ranks.begin() + n);
    p->timing.batch.ranks = p->ranks;
    if (ep->tracer_ && p->req.probe == moerun::v1::PROBE_NONE) {
      p->mb_times.assign(info.timing->microbatches.begin(), info.timing->microbatches.end());
      p->rank_times.assign(info.timing->rank_times.begin(), info.timing->rank_times.end());
      p->replaced_wait_from = info.timing->replaced_wait_from;
      p->replaced_wait_to = info.timing->replaced_wait_to;
    }
  }
  ep->in_flight_.fetch_sub(1);
  ep->in_flight_gauge_->Set(static_cast<double>(ep->in_flight_.load()));
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(ep->done_mu_);
    p->next = ep->done_head_;
    ep->done_head_ = p;
    wake = !ep->wake_posted_;
    ep->wake_posted_ = true;
  }
  if (wake) {
    boost::asio::post(ep->server_->io(),
                      WithMemory(ep->timers_->wake_mem, [ep] { ep->TakeFinished(); }));
  }
}

void ServingEndpoint::AnswerProbe(Pending* p) {
  // The answer is the request's own data, as a layer's answer would be laid out: the client's
  // round trip with the same bytes and no work behind it.
  std::memcpy(p->answer.data() + p->layout.data_offset, p->req.data.data(), p->req.data.size());
  AnswerTiming t;
  t.server_us =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - p->received).count();
  FinishAnswer(p->answer.data(), p->layout, p->req.id, p->req.dtype, p->req.tokens, model_.hidden,
               BatchInfo{}, &p->frame_offset, &p->frame_size, p->req.timing ? &t : nullptr);
  Answer(*p, moerun::v1::OK, "");
  FreeSlot(p);
}

void ServingEndpoint::ObserveParts(const AnswerTiming& t) {
  auto s = [](int64_t us) { return static_cast<double>(us) * 1e-6; };
  parts_.queue->Observe(s(t.queue_us));
  parts_.gate->Observe(s(t.batch.gate_us));
  parts_.dispatch->Observe(s(t.batch.dispatch_us));
  parts_.wait->Observe(s(t.batch.wait_us));
  parts_.combine->Observe(s(t.batch.combine_us));
  parts_.shared->Observe(s(t.batch.shared_us));
  parts_.reply->Observe(s(t.reply_us));
  for (const RankTiming& r : t.batch.ranks) {
    const int i = r.rank - model_.first_expert_rank;
    if (i < 0 || i >= static_cast<int>(parts_.round_trip.size())) continue;
    parts_.round_trip[static_cast<size_t>(i)]->Observe(s(r.round_trip_us));
    parts_.compute[static_cast<size_t>(i)]->Observe(s(r.compute_us));
  }
}

void ServingEndpoint::TakeFinished() {
  Pending* list = nullptr;
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    list = done_head_;
    done_head_ = nullptr;
    wake_posted_ = false;
  }
  Pending* fifo = nullptr;  // the list came newest first
  while (list != nullptr) {
    Pending* next = list->next;
    list->next = fifo;
    fifo = list;
    list = next;
  }
  while (fifo != nullptr) {
    Pending* p = fifo;
    fifo = p->next;
    if (p->heap_pos >= 0) timers_->Erase(p);
    if (p->status.ok()) {
      // The frame around the data, now that the reply's time is known.
      const auto now = Clock::now();
      AnswerTiming& t = p->timing;
      t.queue_us = p->info.queue_us;
      t.batch_tokens = p->info.batch_tokens;
      t.reply_us =
          std::chrono::duration_cast<std::chrono::microseconds>(now - p->batch_done).count();
      t.server_us =
          std::chrono::duration_cast<std::chrono::microseconds>(now - p->received).count();
      if (!p->have_timing) t.batch = BatchTiming{};
      FinishAnswer(p->answer.data(), p->layout, p->req.id, p->req.dtype, p->req.tokens,
                   model_.hidden, p->info, &p->frame_offset, &p->frame_size,
                   p->req.timing ? &t : nullptr);
      if (p->have_timing && p->req.probe == moerun::v1::PROBE_NONE) ObserveParts(t);
    }
    Answer(*p, ErrorCodeOf(p->status), p->status.message());
    if (tracer_ && p->req.probe == moerun::v1::PROBE_NONE) FinishTrace(*p);
    Release(*p);
    FreeSlot(p);
  }
}

void ServingEndpoint::StartTrace(Pending& p) {
  p.trace = TraceContext{};
  if (!p.req.traceparent.empty()) {
    p.trace_parent = ParseTraceparent(p.req.traceparent, &p.trace);
    if (!p.trace_parent) bad_traceparent_->Inc();
  }
  const double share = opts_.tracing.sample;
  thread_local std::mt19937_64 rng{std::random_device{}()};
  if (p.trace_parent && p.trace.sampled()) {
    p.trace_why = "caller";
  } else if (share > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < share) {
    p.trace_why = "share";
  }
}

void ServingEndpoint::TraceRefused(Pending& p, ErrorCode code, const std::string& message) {
  if (!tracer_ || p.req.probe != moerun::v1::PROBE_NONE) return;
  p.answered_at = Clock::now();
  p.answered_code = code;
  p.answered_error = message;
  FinishTrace(p);
}

void ServingEndpoint::FinishTrace(Pending& p) {
  const char* why = p.trace_why;
  const bool failed = p.answered_code != moerun::v1::OK;
  const auto server = p.answered_at - p.received;
  if (why == nullptr && failed) why = "failed";
  if (why == nullptr && opts_.tracing.slow_ms > 0 &&
      server >= std::chrono::milliseconds(opts_.tracing.slow_ms)) {
    why = "slow";
  }
  if (why == nullptr) return;
  const std::string_view w = why;
  (w == "caller"   ? traced_caller_
   : w == "share"  ? traced_share_
   : w == "failed" ? traced_failed_
                   : traced_slow_)
      ->Inc();
  RequestTrace t;
  t.ctx = p.trace;
  t.has_parent = p.trace_parent;
  if (!t.has_parent) t.ctx.trace_id = NewTraceId();
  t.why = why;
  t.request_id = p.req.id;
  t.layer = p.req.layer;
  t.tokens = p.req.tokens;
  t.batch_tokens = p.info.batch_tokens;
  t.code = static_cast<int>(p.answered_code);
  t.error = std::move(p.answered_error);
  t.received = p.received;
  // Refused before a batch (no batch_done): the root span alone, its parts at its end.
  const bool batched = p.batch_done != Clock::time_point{};
  t.batch_start = batched ? p.received + std::chrono::microseconds(p.info.queue_us) : p.answered_at;
  t.batch_done = batched ? p.batch_done : p.answered_at;
  t.replaced_wait_from = p.replaced_wait_from;
  t.replaced_wait_to = p.replaced_wait_to;
  t.answered = p.answered_at;
  t.microbatches = std::move(p.mb_times);
  t.ranks = std::move(p.rank_times);
  tracer_->Offer(std::move(t));
}

}  // namespace moerun
