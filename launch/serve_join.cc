#include "launch/serve_join.h"

#include <unistd.h>

#include <thread>

#include "base/clock.h"
#include "base/host_name.h"
#include "base/log.h"
#include "moerun/v1/control.pb.h"
#include "router/placement.h"
#include "runtime/ep/protocol.h"
#include "runtime/serving/serve_client.h"
#include "transport/registry.h"

namespace moerun {
namespace {

// One join request on a fresh connection: the answer, or why it could not be had.
Status AskOnce(const std::string& control, const ClientTls& tls,
               const moerun::v1::ControlRequest& req, std::chrono::milliseconds timeout,
               moerun::v1::ControlResponse* resp) {
  ClientOptions co;
  co.connect_timeout = timeout;
  co.tls = tls;
  MOERUN_ASSIGN_OR_RETURN(auto conn, ServeConnection::Connect(control, co));
  const Deadline deadline = DeadlineIn(timeout);
  MOERUN_RETURN_IF_ERROR(conn->Send(req, deadline));
  return conn->Receive(resp, deadline);
}

}  // namespace

Result<Joined> JoinJob(const JoinTarget& target) {
  // The joiner takes over a rank of a ucx job (only ucx can replace a peer).
  MOERUN_ASSIGN_OR_RETURN(const TransportBackend* ucx, RequireTransport("ucx"));
  MOERUN_ASSIGN_OR_RETURN(std::unique_ptr<TransportJoiner> joiner, ucx->create_joiner());
  moerun::v1::ControlRequest req;
  req.set_token(target.token);
  moerun::v1::JoinRequest* j = req.mutable_join();
  j->set_address(joiner->address().data(), joiner->address().size());
  j->set_host(HostName());
  j->set_pid(::getpid());
  j->set_num_experts(target.num_experts);
  for (int l : target.layers) j->add_layers(l);

  const Deadline until = DeadlineIn(target.timeout);
  moerun::v1::ControlResponse resp;
  std::string last_wait;
  while (true) {
    // Router 0 answers between batches once it has replaced its endpoint: seconds at most.
    const Status s = AskOnce(target.control, target.tls, req, std::chrono::seconds(30), &resp);
    std::string wait;
    if (!s.ok()) {
      wait = "cannot reach router 0's control endpoint " + target.control + ": " + s.ToString();
    } else if (resp.code() == moerun::v1::UNAVAILABLE) {
      wait = resp.message();
    } else if (resp.code() != moerun::v1::OK) {
      return Status::InvalidArgument("join refused by " + target.control + ": " +
                                     ErrorCodeKind(resp.code()) + ": " + resp.message());
    } else {
      break;
    }
    if (SteadyClock::now() >= until) {
      return Status::Unavailable("could not join the job within " +
                                 std::to_string(target.timeout.count() / 1000) + " s: " + wait);
    }
    if (wait != last_wait) spdlog::info("join: waiting: {}", wait);
    last_wait = wait;
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  const moerun::v1::JoinResponse& g = resp.join();
  if (g.ranks() < 2 || g.rank() < g.routers() || g.rank() >= g.ranks() ||
      g.addresses_size() != g.ranks()) {
    return Status::Corrupt("router 0's join answer is inconsistent (rank " +
                           std::to_string(g.rank()) + " of " + std::to_string(g.ranks()) + ", " +
                           std::to_string(g.addresses_size()) + " addresses)");
  }
  if (g.routers() != target.routers) {
    return Status::InvalidArgument("the job has " + std::to_string(g.routers()) +
                                   " router(s), this config " + std::to_string(target.routers) +
                                   ": start the joiner with the job's config");
  }
  // The dispatch headers this process will read must be the routers' size.
  MOERUN_ASSIGN_OR_RETURN(
      const Placement initial,
      Placement::Make(target.placement, target.num_experts, g.ranks(), g.routers()));
  const size_t mine = HeaderBytes(initial, target.layers);
  if (mine != g.header_bytes()) {
    return Status::InvalidArgument("this config's placement (" + target.placement + ") makes " +
                                   std::to_string(mine) + "-byte dispatch headers, the job's are " +
                                   std::to_string(g.header_bytes()) +
                                   ": start the joiner with the job's config");
  }
  std::vector<std::vector<uint8_t>> addresses;
  for (const std::string& a : g.addresses()) addresses.emplace_back(a.begin(), a.end());
  Joined out;
  MOERUN_ASSIGN_OR_RETURN(out.transport, joiner->Connect(g.rank(), addresses));
  out.placement_version = g.placement_version();
  return out;
}

}  // namespace moerun
