#include "runtime/serving/control_endpoint.h"

#include <cstring>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "base/log.h"
#include "runtime/serving/frame.h"

namespace moerun {

using moerun::v1::ControlRequest;
using moerun::v1::ControlResponse;
using moerun::v1::ErrorCode;

namespace {

// A provider's error as the answer's code: bad input stays INVALID_ARGUMENT; "try again later"
// (a migration already running, a rank that does not answer) is UNAVAILABLE.
ErrorCode ErrorCodeFor(const Status& s) {
  switch (s.code()) {
    case StatusCode::kUnavailable:
      return moerun::v1::UNAVAILABLE;
    case StatusCode::kResourceExhausted:
      return moerun::v1::OVERLOADED;
    case StatusCode::kDeadlineExceeded:
      return moerun::v1::DEADLINE_EXCEEDED;
    case StatusCode::kIoError:
    case StatusCode::kInternal:
      return moerun::v1::INTERNAL;
    default:  // invalid argument, not found, corrupt, unsupported
      return moerun::v1::INVALID_ARGUMENT;
  }
}

std::string ErrorFrame(ErrorCode code, const std::string& message) {
  ControlResponse r;
  r.set_code(code);
  r.set_message(message);
  return EncodeFrame(r).value();  // an error answer is small: it always fits in a frame
}

}  // namespace

struct ControlEndpoint::Poster {
  std::mutex mu;
  boost::asio::io_context* io = nullptr;
};

ControlEndpoint::~ControlEndpoint() { Stop(); }

void ControlEndpoint::Stop() {
  if (poster_) {
    std::lock_guard<std::mutex> lock(poster_->mu);
    poster_->io = nullptr;
  }
  if (server_) server_->Stop();
}

Result<std::unique_ptr<ControlEndpoint>> ControlEndpoint::Start(const FramedServerOptions& options,
                                                                std::string token,
                                                                ControlProvider provider,
                                                                MetricsRegistry* metrics,
                                                                ControlAuthOptions auth) {
  if (token.empty()) return Status::InvalidArgument("control endpoint: empty token");
  std::unique_ptr<ControlEndpoint> ep(new ControlEndpoint());
  ep->tokens_ = std::make_unique<TokenFileWatch>(auth.token_file, std::move(token), auth.grace);
  ep->backoff_ = std::make_unique<AuthBackoff>(auth.backoff);
  ep->auth_log_ = std::make_unique<AuthFailureLog>(auth.log_interval);
  ep->provider_ = std::move(provider);
  ep->auth_failures_ = metrics->AddCounter("moerun_control_auth_failures_total",
                                           "Control requests refused for a missing or wrong token");
  const char* kinds[10] = {"status", "placement", "stats",         "plan",          "malformed",
                           "apply",  "progress",  "expert_update", "expert_action", "join"};
  for (int i = 0; i < 10; ++i) {
    ep->requests_[i] = metrics->AddCounter("moerun_control_requests_total",
                                           "Control requests, by command", {{"command", kinds[i]}});
  }
  ControlEndpoint* raw = ep.get();
  FramedHandlers h;
  h.on_frame = [raw](const std::shared_ptr<FramedConnection>& c, PooledBuffer body, BudgetLease) {
    raw->OnFrame(c, std::string_view(body.data(), body.size()));
  };
  h.error_frame = [](ErrorCode code, const std::string& message, uint64_t) {
    return ErrorFrame(code, message);
  };
  FramedServerOptions o = options;
  o.max_frame_bytes = std::min<uint32_t>(o.max_frame_bytes, kControlMaxFrameBytes);
  // Capacity kept for authenticated clients: connections count as untrusted until a request of
  // theirs carries the token (OnFrame marks them), at most 3/4 of the cap, and silent or
  // unauthenticated ones are closed first to make room (runtime/serving/framed_server.h).
  if (o.max_untrusted_connections <= 0) {
    o.max_untrusted_connections = std::max(1, o.max_connections * 3 / 4);
  }
  MOERUN_ASSIGN_OR_RETURN(ep->server_, FramedServer::Start(o, std::move(h)));
  ep->poster_ = std::make_shared<Poster>();
  ep->poster_->io = &ep->server_->io();
  ep->auth_log_timer_ = std::make_shared<boost::asio::steady_timer>(ep->server_->io());
  return ep;
}

bool ControlEndpoint::Authenticate(const std::shared_ptr<FramedConnection>& conn,
                                   const std::string& token) {
  const auto now = AuthClock::now();
  // At most one stat(2) a second: a rotated token file takes effect without a restart.
  if (std::string line = tokens_->Poll(now); !line.empty()) spdlog::warn("{}", line);
  const std::string address = conn->peer_address();
  const AuthBackoff::Decision d = backoff_->Admit(address, now);
  if (!d.refuse && tokens_->Accepts(token, now)) return true;
  auth_failures_->Inc();
  const std::string line = auth_log_->Record(address, d.refuse ? "a token during its cool-down"
                                                      : token.empty() ? "no token"
                                                                      : "a wrong token");
  if (!line.empty()) {
    spdlog::warn("{}", line);
    ArmAuthLogTimer();
  }
  if (!d.refuse) {
    backoff_->OnFailure(address, now);
    conn->Send(ErrorFrame(moerun::v1::UNAUTHENTICATED,
                          token.empty() ? "a token is required (--token-file)" : "wrong token"));
    return false;
  }
  // Cooling down: refused unchecked; the connection reads nothing more until the cool-down ends
  // (a timer: the I/O thread goes on), so that it cannot spin on refusals.
  conn->Send(ErrorFrame(moerun::v1::UNAUTHENTICATED,
                        "too many wrong tokens from " + address + ": requests are refused for " +
                            std::to_string(d.wait.count()) + " ms more"));
  if (d.close) {
    conn->CloseAfterWrites();
    return false;
  }
  conn->Pause();
  auto timer = std::make_shared<boost::asio::steady_timer>(server_->io(), d.wait);
  AuthBackoff* backoff = backoff_.get();
  timer->async_wait([timer, conn, backoff, address](const boost::system::error_code&) {
    backoff->Released(address);
    if (conn->open()) conn->Resume();
  });
  return false;
}

void ControlEndpoint::ArmAuthLogTimer() {
  auto* timer = static_cast<boost::asio::steady_timer*>(auth_log_timer_.get());
  timer->expires_after(auth_log_->interval());
  AuthFailureLog* log = auth_log_.get();
  std::weak_ptr<void> alive = auth_log_timer_;
  timer->async_wait([this, log, alive](const boost::system::error_code& ec) {
    if (ec || alive.expired()) return;
    const std::string summary = log->TakeSummary();
    if (summary.empty()) return;  // a quiet interval: the next refusal gets its own line
    spdlog::warn("{}", summary);
    ArmAuthLogTimer();
  });
}

void ControlEndpoint::OnFrame(const std::shared_ptr<FramedConnection>& conn,
                              std::string_view body) {
  ControlRequest req;
  if (!req.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    requests_[4]->Inc();
    return conn->Send(ErrorFrame(moerun::v1::MALFORMED_FRAME,
                                 "the frame is not a valid moerun.v1.ControlRequest"));
  }
  if (!Authenticate(conn, req.token())) return;
  conn->MarkTrusted();  // authenticated: never closed to make room
  ControlResponse r;
  r.set_code(moerun::v1::OK);
  try {
    switch (req.command_case()) {
      case ControlRequest::kStatus:
        requests_[0]->Inc();
        *r.mutable_status() = provider_.status();
        break;
      case ControlRequest::kPlacement:
        requests_[1]->Inc();
        *r.mutable_placement() = provider_.placement();
        break;
      case ControlRequest::kStats:
        requests_[2]->Inc();
        *r.mutable_stats() = provider_.stats();
        break;
      case ControlRequest::kPlan: {
        requests_[3]->Inc();
        if (!provider_.plan) {
          return conn->Send(ErrorFrame(moerun::v1::INVALID_ARGUMENT, "planning is not offered"));
        }
        Result<moerun::v1::PlanResponse> plan = provider_.plan(req.plan());
        if (!plan.ok()) {
          return conn->Send(ErrorFrame(moerun::v1::INVALID_ARGUMENT, plan.status().message()));
        }
        *r.mutable_plan() = std::move(plan).value();
        break;
      }
      case ControlRequest::kApply: {
        requests_[5]->Inc();
        if (!provider_.apply) {
          return conn->Send(
              ErrorFrame(moerun::v1::INVALID_ARGUMENT, "applying a placement is not offered"));
        }
        Result<moerun::v1::MigrationStatus> m = provider_.apply(req.apply());
        if (!m.ok()) return conn->Send(ErrorFrame(ErrorCodeFor(m.status()), m.status().message()));
        *r.mutable_migration() = std::move(m).value();
        break;
      }
      case ControlRequest::kProgress:
        requests_[6]->Inc();
        if (!provider_.progress) {
          return conn->Send(
              ErrorFrame(moerun::v1::INVALID_ARGUMENT, "migration progress is not offered"));
        }
        *r.mutable_migration() = provider_.progress();
        break;
      case ControlRequest::kExpertUpdate: {
        requests_[7]->Inc();
        if (!provider_.expert_update) {
          return conn->Send(
              ErrorFrame(moerun::v1::INVALID_ARGUMENT, "expert updates are not offered"));
        }
        Result<moerun::v1::ExpertResponse> e = provider_.expert_update(req.expert_update());
        if (!e.ok()) return conn->Send(ErrorFrame(ErrorCodeFor(e.status()), e.status().message()));
        *r.mutable_experts() = std::move(e).value();
        break;
      }
      case ControlRequest::kExpertAction: {
        requests_[8]->Inc();
        if (!provider_.expert_action) {
          return conn->Send(ErrorFrame(moerun::v1::INVALID_ARGUMENT,
                                       "expert status, promote and rollback are not offered"));
        }
        Result<moerun::v1::ExpertResponse> e = provider_.expert_action(req.expert_action());
        if (!e.ok()) return conn->Send(ErrorFrame(ErrorCodeFor(e.status()), e.status().message()));
        *r.mutable_experts() = std::move(e).value();
        break;
      }
      case ControlRequest::kJoin: {
        requests_[9]->Inc();
        if (!provider_.join) {
          return conn->Send(
              ErrorFrame(moerun::v1::INVALID_ARGUMENT, "joining this job is not offered"));
        }
        // Answered when router 0's thread has taken the joiner in (between batches).
        std::shared_ptr<Poster> poster = poster_;
        ++conn->held;  // an answer is owed: the connection is not idle until it is sent
        provider_.join(req.join(), [poster, conn](Result<moerun::v1::JoinResponse> grant) {
          std::string frame;
          if (!grant.ok()) {
            frame = ErrorFrame(ErrorCodeFor(grant.status()), grant.status().message());
          } else {
            ControlResponse ok;
            ok.set_code(moerun::v1::OK);
            *ok.mutable_join() = std::move(grant).value();
            Result<std::string> f = EncodeFrame(ok);
            frame = f.ok() ? std::move(*f) : ErrorFrame(moerun::v1::INTERNAL, f.status().message());
          }
          std::lock_guard<std::mutex> lock(poster->mu);
          if (poster->io == nullptr) return;  // the endpoint has stopped
          boost::asio::post(*poster->io, [conn, frame = std::move(frame)]() mutable {
            --conn->held;
            conn->Send(std::move(frame));
          });
        });
        return;
      }
      default:
        requests_[4]->Inc();
        return conn->Send(ErrorFrame(moerun::v1::INVALID_ARGUMENT, "no command in the request"));
    }
  } catch (const std::exception& e) {
    return conn->Send(ErrorFrame(moerun::v1::INTERNAL, e.what()));
  }
  Result<std::string> frame = EncodeFrame(r);
  conn->Send(frame.ok() ? std::move(*frame)
                        : ErrorFrame(moerun::v1::INTERNAL, frame.status().message()));
}

}  // namespace moerun
