#include "runtime/service/router_service.h"

#include <optional>
#include <thread>

#include "base/clock.h"
#include "base/log.h"
#include "runtime/ep/router_layer.h"
#include "runtime/migration/router_control.h"

namespace moerun {
RouterService::RouterService(RouterRank& router, RouterServiceOptions options)
    : router_(router), opts_(std::move(options)), batcher_(opts_.batching, opts_.model.hidden) {}

RouterService::~RouterService() {
  if (endpoint_) endpoint_->Stop();
}

Result<std::unique_ptr<RouterService>> RouterService::Start(RouterRank& router,
                                                            RouterServiceOptions options,
                                                            MetricsRegistry* metrics) {
  std::unique_ptr<RouterService> s(new RouterService(router, std::move(options)));
  MOERUN_ASSIGN_OR_RETURN(s->endpoint_, ServingEndpoint::Start(s->opts_.serving, s->opts_.model,
                                                               &s->batcher_, metrics));
  s->batches_ = metrics->AddCounter("moerun_batches_total", "Batches run");
  s->batch_tokens_ = metrics->AddCounter("moerun_batch_tokens_total", "Tokens of the batches run");
  return s;
}

Status RouterService::Run(std::atomic<bool>& stop, RouterServiceHooks hooks) {
  stop_ = &stop;
  hooks_ = std::move(hooks);
  batcher_.Run(
      [&](int layer, const float* x, int64_t tokens, float* out, Deadline deadline,
          BatchStream* stream) {
        const Status s = Forward(layer, x, tokens, out, deadline, stream);
        const int64_t ran = stream != nullptr ? stream->tokens() : tokens;
        batches_->Inc();
        batch_tokens_->Inc(static_cast<uint64_t>(ran));
        if (hooks_.on_batch) hooks_.on_batch(ran, s.ok());
        return s;
      },
      [this] { return StopRequested(); }, [this] { Poll(); });
  endpoint_->Stop();
  hooks_ = RouterServiceHooks{};
  return control_failed_;
}

Status RouterService::Probe(const float* x, int64_t tokens, float* out, Deadline deadline,
                            BatchStream* stream) {
  // Each expert rank in turn: the batch's rows there and back.
  const int64_t hidden = opts_.model.hidden;
  probe_ranks_.clear();
  for (int r = opts_.model.first_expert_rank;
       r < opts_.model.first_expert_rank + opts_.model.expert_ranks; ++r) {
    if (router_.health() != nullptr && router_.health()->dead_mask()[static_cast<size_t>(r)]) {
      continue;
    }
    MOERUN_ASSIGN_OR_RETURN(const int64_t us,
                            router_.EchoRoundTrip(r, x, tokens, hidden, out, deadline));
    RankTiming t;
    t.rank = r;
    t.rows = tokens;
    t.round_trip_us = us;
    probe_ranks_.push_back(t);
  }
  if (probe_ranks_.empty()) return Status::Unavailable("no live expert rank to probe");
  BatchTiming timing;
  timing.ranks = probe_ranks_;
  if (stream != nullptr) stream->Done(tokens, timing);
  return Status::Ok();
}

namespace {

// The batch's stream while it waits for re-placed experts: what it reports carries the wait.
class WaitedStream : public BatchStream {
 public:
  WaitedStream(BatchStream* inner, SteadyClock::time_point from) : inner_(inner), from_(from) {}
  void WaitedUntil(SteadyClock::time_point t) { to_ = t; }
  int64_t Extend(int64_t tokens, Deadline* deadline) override {
    return inner_->Extend(tokens, deadline);
  }
  void Done(int64_t done, const BatchTiming& timing) override {
    BatchTiming t = timing;
    t.replaced_wait_from = from_;
    t.replaced_wait_to = to_;
    inner_->Done(done, t);
  }
  int64_t tokens() const override { return inner_->tokens(); }

 private:
  BatchStream* inner_;
  SteadyClock::time_point from_, to_;
};

}  // namespace

Status RouterService::Forward(int layer, const float* x, int64_t tokens, float* out,
                              Deadline deadline, BatchStream* stream) {
  if (layer == kTransportProbeLayer) return Probe(x, tokens, out, deadline, stream);
  Status s = router_.Forward(layer, x, tokens, out, deadline, stream);
  // Experts whose every copy died are being re-placed (router 0's recovery migration): the batch
  // waits for them, bounded by its deadline; the control moves on meanwhile (no microbatch of
  // this router is in flight between two calls).
  RouterLayer* l = router_.layer(layer);
  if (s.ok() || l == nullptr || !l->waiting_for_copies()) return s;
  const auto t0 = std::chrono::steady_clock::now();
  spdlog::warn("router {}: a batch of {} token(s) waits for re-placed experts ({})", router_.rank(),
               tokens, s.ToString());
  std::optional<WaitedStream> waited;
  if (stream != nullptr) waited.emplace(stream, t0);
  while (!s.ok() && l->waiting_for_copies() && SteadyClock::now() < deadline &&
         control_failed_.ok() && !stop_->load()) {
    Poll();
    if (l->orphans() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    // The batch as it grew; what was answered already is computed again (the same bits) and
    // not answered twice.
    if (stream != nullptr) tokens = stream->tokens();
    if (waited) waited->WaitedUntil(SteadyClock::now());
    s = router_.Forward(layer, x, tokens, out, deadline, waited ? &*waited : nullptr);
  }
  spdlog::info("router {}: the batch waited {:.3f} s for re-placed experts: {}", router_.rank(),
               SecondsSince(t0), s.ok() ? "answered" : s.ToString());
  return s;
}

bool RouterService::StopRequested() {
  if (!stop_->load()) return false;
  if (!draining_) {
    draining_ = true;
    // Router 0 takes the other routers with it: one SIGTERM to rank 0 drains the whole job.
    if (router_.rank() == 0 && router_.control() != nullptr) {
      if (Status s = router_.control()->DrainOthers(); !s.ok()) {
        spdlog::warn("router 0: could not ask the other routers to drain: {}", s.ToString());
      }
    }
    if (hooks_.on_drain) hooks_.on_drain();
    endpoint_->BeginDrain();
    drain_until_ = std::chrono::steady_clock::now() + opts_.drain_timeout;
  }
  if (endpoint_->in_flight() == 0) return true;
  if (std::chrono::steady_clock::now() >= drain_until_) {
    spdlog::warn("drain timeout: {} request(s) still in flight", endpoint_->in_flight());
    return true;
  }
  return false;
}

void RouterService::Poll() {
  if (control_failed_.ok()) {
    control_failed_ = router_.Poll();
    if (!stop_->load() && router_.control() != nullptr && router_.control()->drain_requested()) {
      spdlog::info("router {}: router 0 drains the job: draining", router_.rank());
      stop_->store(true);
    }
    if (!control_failed_.ok()) {
      spdlog::error("router {}: the control channel failed ({}): stopping", router_.rank(),
                    control_failed_.ToString());
      stop_->store(true);
    }
  } else if (router_.health() != nullptr) {
    router_.health()->Poll();
  }
  if (hooks_.tick) hooks_.tick();
}

}  // namespace moerun
