// The ucx transport's endpoints: one per peer rank, from the peers' worker addresses, in UCX's
// peer error mode, and which peers have failed. A peer's endpoint error (UCX reports it from
// worker progress) marks the peer failed and logs "ucx: rank N failed: ..." once; an error of an
// endpoint closed by a replacement (ReplacePeer) is ignored. Internal to transport/ucx/.
// Thread-safety: none (called from the worker's thread, as the worker's progress).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/clock.h"
#include "base/status.h"

namespace moerun::ucx {

class UcxEndpoints {
 public:
  explicit UcxEndpoints(ucp_worker_h worker = nullptr) : worker_(worker) {}
  UcxEndpoints(const UcxEndpoints&) = delete;
  UcxEndpoints& operator=(const UcxEndpoints&) = delete;

  void set_worker(ucp_worker_h worker) { worker_ = worker; }
  // Takes every rank's worker address (an empty one: a peer without an endpoint). No endpoint
  // is open yet and no peer has failed.
  void Assign(std::vector<std::vector<uint8_t>> addresses);
  // Creates the endpoint of `peer` to its address (peer error mode; a new generation). On an
  // error the peer is failed with it.
  Status Open(int peer);
  // Closes the endpoint of `peer` (forced: without the peer's confirmation), waiting for UCX
  // until `deadline`.
  void Close(size_t peer, bool force, Deadline deadline);
  // Closes every endpoint, forced where the peer failed.
  void CloseAll(Deadline deadline);
  // From here on, errors of the current endpoint of `peer` are ignored (it is being replaced).
  void Forget(int peer) { ++generation_[static_cast<size_t>(peer)]; }
  void set_address(int peer, std::span<const uint8_t> address) {
    addresses_[static_cast<size_t>(peer)].assign(address.begin(), address.end());
  }
  // Marks `peer` failed with `status` (no log line).
  void Fail(int peer, ucs_status_t status) { failed_[static_cast<size_t>(peer)] = status; }

  size_t size() const { return addresses_.size(); }
  ucp_ep_h ep(int peer) const { return eps_[static_cast<size_t>(peer)]; }
  const std::vector<uint8_t>& address(int peer) const {
    return addresses_[static_cast<size_t>(peer)];
  }
  // Whether UCX writes a put to `peer` with the hardware (the endpoint has an RMA lane: RDMA
  // verbs, xpmem, ...) rather than emulating it in software with active messages (TCP, sysv/posix
  // shared memory, CMA in UCX 1.13). Known once the endpoint is open.
  bool native_put(int peer) const { return native_put_[static_cast<size_t>(peer)] != 0; }
  // UCS_OK while the peer is alive, else the error that failed it.
  ucs_status_t failure(int peer) const { return failed_[static_cast<size_t>(peer)]; }
  bool failed(int peer) const {
    return peer >= 0 && static_cast<size_t>(peer) < failed_.size() && failure(peer) != UCS_OK;
  }
  // kInvalidArgument for a rank that is not one ("ucx: <what>: no rank N"), kUnavailable for a
  // failed one.
  Status Check(int peer, const char* what) const;

 private:
  // An endpoint's error handler argument, one per endpoint ever made and kept to the end: an
  // error of an endpoint that a replacement closed may still arrive, and must not fail its
  // successor.
  struct ErrorContext {
    UcxEndpoints* self = nullptr;
    int peer = 0;
    uint32_t generation = 0;
  };
  static void OnError(void* arg, ucp_ep_h, ucs_status_t status);
  void OnPeerError(const ErrorContext& ctx, ucs_status_t status);

  ucp_worker_h worker_;
  std::vector<ucp_ep_h> eps_;
  std::vector<std::vector<uint8_t>> addresses_;  // every rank's worker address (this one's too)
  std::vector<uint32_t> generation_;             // per peer: the generation of eps_[peer]
  std::vector<std::unique_ptr<ErrorContext>> contexts_;  // every endpoint's, closed ones' too
  std::vector<ucs_status_t> failed_;
  std::vector<uint8_t> native_put_;  // per peer: native_put()
};

// Whether the endpoint's lanes include an RMA lane (" rma#N" in UCX's description of its lanes,
// the lanes ucp_put_nbx uses; without one UCX emulates puts with active messages).
bool EndpointHasRmaLane(ucp_ep_h ep);

}  // namespace moerun::ucx
