#include "serving/control_endpoint.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include "base/log.h"
#include "serving/frame.h"

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

Result<std::string> ReadTokenFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::NotFound("token file " + path + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 007) != 0) {
    return Status::InvalidArgument("token file " + path +
                                   " is readable or writable by others: chmod o-rwx it");
  }
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return Status::InvalidArgument("token file " + path + " is empty or unreadable");
  }
  const auto b = line.find_first_not_of(" \t\r\n");
  const auto e = line.find_last_not_of(" \t\r\n");
  if (b == std::string::npos) return Status::InvalidArgument("token file " + path + " is empty");
  return line.substr(b, e - b + 1);
}

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  // Compares every byte of the longer string whatever the content; lengths may leak.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

Result<std::unique_ptr<ControlEndpoint>> ControlEndpoint::Start(const FramedServerOptions& options,
                                                                std::string token,
                                                                ControlProvider provider,
                                                                MetricsRegistry* metrics) {
  if (token.empty()) return Status::InvalidArgument("control endpoint: empty token");
  std::unique_ptr<ControlEndpoint> ep(new ControlEndpoint());
  ep->token_ = std::move(token);
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
  o.max_frame_bytes = std::min<uint32_t>(o.max_frame_bytes, 1u << 20);
  // Capacity kept for authenticated clients: connections count as untrusted until a request of
  // theirs carries the token (OnFrame marks them), at most 3/4 of the cap, and silent or
  // unauthenticated ones are closed first to make room (serving/framed_server.h).
  if (o.max_untrusted_connections <= 0) {
    o.max_untrusted_connections = std::max(1, o.max_connections * 3 / 4);
  }
  MOERUN_ASSIGN_OR_RETURN(ep->server_, FramedServer::Start(o, std::move(h)));
  ep->poster_ = std::make_shared<Poster>();
  ep->poster_->io = &ep->server_->io();
  return ep;
}

void ControlEndpoint::OnFrame(const std::shared_ptr<FramedConnection>& conn,
                              std::string_view body) {
  ControlRequest req;
  if (!req.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    requests_[4]->Inc();
    return conn->Send(ErrorFrame(moerun::v1::MALFORMED_FRAME,
                                 "the frame is not a valid moerun.v1.ControlRequest"));
  }
  if (req.token().empty() || !ConstantTimeEqual(req.token(), token_)) {
    auth_failures_->Inc();
    spdlog::warn("control: refused a request with {} token",
                 req.token().empty() ? "no" : "a wrong");
    return conn->Send(
        ErrorFrame(moerun::v1::UNAUTHENTICATED,
                   req.token().empty() ? "a token is required (--token-file)" : "wrong token"));
  }
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
