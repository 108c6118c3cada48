// The control endpoint of router 0 for moectl: ControlRequest frames (same framing as serving)
// answered with ControlResponse. Every request carries a token compared in constant time with
// the server's; a missing or wrong one is refused (UNAUTHENTICATED) and counted
// (moerun_control_auth_failures_total). The provider's functions run on the endpoint's I/O
// thread and must be thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "base/metrics.h"
#include "moerun/v1/control.pb.h"
#include "serving/framed_server.h"

namespace moerun {

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

// Reads a token file: its first line, surrounding whitespace removed; an error if the file is
// missing, unreadable, empty, or readable by others than its owner's group (mode & 007).
Result<std::string> ReadTokenFile(const std::string& path);

// Equal strings in time that depends only on their lengths.
bool ConstantTimeEqual(const std::string& a, const std::string& b);

class ControlEndpoint {
 public:
  static Result<std::unique_ptr<ControlEndpoint>> Start(const FramedServerOptions& options,
                                                        std::string token, ControlProvider provider,
                                                        MetricsRegistry* metrics);
  ~ControlEndpoint();
  uint16_t port() const { return server_->port(); }
  void Stop();

 private:
  void OnFrame(const std::shared_ptr<FramedConnection>& conn, std::string_view body);

  // Where answers that come from other threads (join) are posted; cleared when the server
  // stops, so that a late answer is dropped instead of reaching a dead I/O context.
  struct Poster;
  std::shared_ptr<Poster> poster_;
  std::string token_;
  ControlProvider provider_;
  std::unique_ptr<FramedServer> server_;
  Counter* auth_failures_ = nullptr;
  // status, placement, stats, plan, malformed, apply, progress, expert_update, expert_action,
  // join
  Counter* requests_[10] = {};
};

}  // namespace moerun
