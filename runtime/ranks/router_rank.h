// A router rank once its job is ready, as one object: its layers (a RouterLayer per MoE layer it
// serves), the health of the expert ranks (PeerHealth: probes, and transfers of missed deadlines
// taken over), and its side of migrations and expert updates (RouterControl). The serving loop
// (or `moerun forward`, or a test) hands it batches with Forward and calls Poll between batches
// and when idle; when its work is done, Finish ends this router's part of the job: late transfers
// settle and the expert ranks are told it stops (they stop once every router has).
//
// Threads: one thread, the router's, calls Forward, Poll and Finish. control() may be handed to
// other threads: RouterControl says which of its functions they may call.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "router/placement.h"
#include "runtime/ep/peer_health.h"
#include "runtime/ep/router_layer.h"
#include "runtime/migration/router_control.h"
#include "transport/transport.h"

namespace moerun {

struct RouterRankOptions {
  // Probe the expert ranks and take over the transfers of missed deadlines
  // (runtime/ep/peer_health.h); without it each layer keeps a missed deadline's transfers posted
  // itself (a late rank stays in step) and no rank is ever declared dead.
  std::optional<PeerHealthOptions> health;
  // A RouterControl: migrations, expert updates, placement switches told by router 0.
  bool control = false;
};

class RouterRank {
 public:
  // The layers use `placement`; `weights` by layer number hold the router's tensors.
  RouterRank(Transport* transport, std::shared_ptr<const Placement> placement,
             const std::map<int, std::shared_ptr<MoeLayerWeights>>& weights,
             const CpuKernels& kernels, ThreadPool* pool, size_t header_bytes, EpOptions ep,
             const RouterRankOptions& options);
  ~RouterRank();  // frees everything; without Finish, the expert ranks are not told

  int rank() const { return t_->rank(); }
  // The layers by number (stable for the object's life).
  const std::map<int, RouterLayer*>& layers() const { return by_number_; }
  RouterLayer* layer(int number) const;
  PeerHealth* health() const { return health_.get(); }       // null without health
  RouterControl* control() const { return control_.get(); }  // null without control

  // One batch through layer `number`: x [tokens][hidden] -> out; the probes are moved on first.
  // kInvalidArgument for a layer this router does not serve.
  // With a `stream`, the batch grows while it runs (RouterLayer::Forward).
  Status Forward(int number, const float* x, int64_t tokens, float* out,
                 Deadline deadline = Deadline::max(), BatchStream* stream = nullptr);
  // The floor of a dispatch's round trip with expert rank `rank` (between batches): `rows` rows of
  // `hidden` floats from x go there and come back (a kEcho header: no compute), into out, bitwise.
  // Returns the round trip in microseconds. Errors: a rank that is not an expert rank, a size
  // over kMaxEchoBytes, `deadline` (the caller's) passed before the echo was sent, a transfer
  // that fails or misses the expert-parallel deadline, an answer that is not the rows sent.
  Result<int64_t> EchoRoundTrip(int rank, const float* x, int64_t rows, int64_t hidden, float* out,
                                Deadline deadline);
  // Between batches and when idle: health probes and late transfers, control messages and the
  // steps of a migration. An error from the control channel ends the router's part.
  Status Poll();
  // Ends this router's part: the control channel closes, late transfers settle (up to the job's
  // deadline), and the expert ranks get this router's shutdown. Once; later calls return Ok.
  Status Finish();

 private:
  Transport* t_;
  std::shared_ptr<const Placement> placement_;
  size_t header_bytes_;
  EpOptions ep_;
  std::vector<std::unique_ptr<RouterLayer>> owned_;
  std::map<int, RouterLayer*> by_number_;
  std::unique_ptr<PeerHealth> health_;
  std::unique_ptr<RouterControl> control_;
  bool finished_ = false;
  uint32_t echo_seq_ = 0;
  std::vector<char> echo_header_;
  std::vector<float> echo_in_;
};

// Tells every expert rank that router `t->rank()` stops (a kShutdown header). Ranks `dead` marks
// (by rank) are not waited for: one whose process is gone is skipped, one that may be frozen gets
// the message on a short wait.
Status SendShutdown(Transport* t, const Placement& placement, size_t header_bytes,
                    std::chrono::milliseconds deadline, const std::vector<bool>& dead = {});

// What the transport moved and how (RDMA backends), in the log: the zero-copy evidence of a run.
void LogTransportCounters(const Transport& t);

}  // namespace moerun
