// The control endpoint of router 0 for moectl: ControlRequest frames (same framing as serving)
// answered with ControlResponse. Every request carries a token compared in constant time with
// the server's; a missing or wrong one is refused (UNAUTHENTICATED) and counted
// (moerun_control_auth_failures_total). After a few wrong tokens from one peer address, the
// address cools down (doubling): its requests are refused without their token being checked and
// its connections are not read until the cool-down ends (timers; the I/O thread never waits). A
// right token from another address is answered at once. One summary line per interval is logged
// instead of a line per try. The token file is read again when it changes, the old token
// accepted for a grace period. The provider's functions run on the endpoint's I/O thread and
// must be thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "base/metrics.h"
#include "moerun/v1/control.pb.h"
#include "runtime/serving/control_auth.h"
#include "runtime/serving/framed_server.h"

namespace moerun {

// The largest control frame the endpoint reads (1 MiB): a larger one is refused with
// FRAME_TOO_LARGE and the connection closed. Clients (moectl, moerun.ctl) check their requests
// against it before sending, and say so, since a refusal that arrives while the client is still
// writing may be lost with the connection.
inline constexpr uint32_t kControlMaxFrameBytes = 1u << 20;

struct ControlProvider {
  std::function<moerun::v1::StatusResponse()> status;
  std::function<moerun::v1::PlacementResponse()> placement;
  std::function<moerun::v1::StatsResponse()> stats;
  // A planner dry run; an error is answered INVALID_ARGUMENT with its message.
  std::function<Result<moerun::v1::PlanResponse>(const moerun::v1::PlanRequest&)> plan;
  // Starts a migration (returns at once with its status; "skipped" when below min_gain); an
  // error (bad placement, one already running) is answered with its code and message.
  std::function<Result<moerun::v1::MigrationStatus>(const moerun::v1::ApplyRequest&)> apply;
  // The running or last migration.
  std::function<moerun::v1::MigrationStatus()> progress;
  // Expert weight updates: start one, or status / promote / rollback.
  std::function<Result<moerun::v1::ExpertResponse>(const moerun::v1::ExpertUpdateRequest&)>
      expert_update;
  std::function<Result<moerun::v1::ExpertResponse>(const moerun::v1::ExpertActionRequest&)>
      expert_action;
  // A process joining the job (moerun serve --join): `done` is called once, from any thread,
  // with the grant or why not (the answer is sent from the I/O thread).
  std::function<void(const moerun::v1::JoinRequest&,
                     std::function<void(Result<moerun::v1::JoinResponse>)> done)>
      join;
};

// How the endpoint checks tokens (ReadTokenFile and the policies: runtime/serving/control_auth.h).
struct ControlAuthOptions {
  // The file the token came from: read again when it changes (looked at at most once a second,
  // when a request comes), the old token accepted for `grace` after a change. Empty: the token
  // given to Start is the only one.
  std::string token_file;
  std::chrono::seconds grace{60};
  AuthBackoffOptions backoff;
  // Wrong tokens after the first of a quiet period are logged as one summary per interval.
  std::chrono::seconds log_interval{10};
};

class ControlEndpoint {
 public:
  static Result<std::unique_ptr<ControlEndpoint>> Start(const FramedServerOptions& options,
                                                        std::string token, ControlProvider provider,
                                                        MetricsRegistry* metrics,
                                                        ControlAuthOptions auth = {});
  ~ControlEndpoint();
  uint16_t port() const { return server_->port(); }
  void Stop();

 private:
  void OnFrame(const std::shared_ptr<FramedConnection>& conn, std::string_view body);
  // Whether `token` is accepted; if not, the refusal is counted, logged (summarised), and sent
  // now or after the peer's back-off delay (the connection paused until then).
  bool Authenticate(const std::shared_ptr<FramedConnection>& conn, const std::string& token);
  void ArmAuthLogTimer();

  // Where answers that come from other threads (join) are posted; cleared when the server
  // stops, so that a late answer is dropped instead of reaching a dead I/O context.
  struct Poster;
  std::shared_ptr<Poster> poster_;
  // Token checking (I/O thread only): the token file's watch, the back-off per address, the
  // summarised log and its timer.
  std::unique_ptr<TokenFileWatch> tokens_;
  std::unique_ptr<AuthBackoff> backoff_;
  std::unique_ptr<AuthFailureLog> auth_log_;
  ControlProvider provider_;
  std::unique_ptr<FramedServer> server_;
  // The log's boost::asio::steady_timer on server_'s I/O context (declared after server_, so
  // destroyed before the context).
  std::shared_ptr<void> auth_log_timer_;
  Counter* auth_failures_ = nullptr;
  // status, placement, stats, plan, malformed, apply, progress, expert_update, expert_action,
  // join
  Counter* requests_[10] = {};
};

}  // namespace moerun
