// The ucx transport's class (ucx_transport.h describes the protocols): the Transport interface
// over its parts, each in its own file:
//   ucx_worker.h     the UCX context and worker, progress;
//   ucx_endpoints.h  the endpoints to the peers and which peers failed;
//   ucx_memory.h     registered regions and the peers' remote keys;
//   ucx_ops.h        the request table and the UCX requests of each op;
//   ucx_notes.h      the outgoing control notes;
// and its duties split the same way: ucx_transport.cc (opening, replacing a peer, Test/Cancel,
// progress, the end), ucx_tagged.cc (messages below put_min, and all of them under
// UcxProtocol::kTag: UCX tagged eager messages), ucx_put.cc (the zero-copy put protocol: RTR,
// put, FIN, REVOKE), ucx_joiner.cc (a process joining a running job). Internal to
// transport/ucx/. Thread-safety: one thread at a time (transport.h).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "transport/transport.h"
#include "transport/ucx/ucx_endpoints.h"
#include "transport/ucx/ucx_memory.h"
#include "transport/ucx/ucx_notes.h"
#include "transport/ucx/ucx_ops.h"
#include "transport/ucx/ucx_transport.h"
#include "transport/ucx/ucx_wire.h"
#include "transport/ucx/ucx_worker.h"

namespace moerun::ucx {

class UcxTransport : public Transport {
 public:
  // Without a bootstrap (a joiner), the rank and size come with Connect.
  UcxTransport(std::unique_ptr<Transport> bootstrap, UcxOptions opts)
      : boot_(std::move(bootstrap)),
        opts_(opts),
        rank_(boot_ != nullptr ? boot_->rank() : -1),
        size_(boot_ != nullptr ? boot_->size() : 0) {}

  ~UcxTransport() override { Shutdown(); }

  // OpenWorker, the worker addresses exchanged over the bootstrap, Connect, a barrier.
  Status Init();
  // The context and the worker, and this process's worker address; no endpoints yet.
  Status OpenWorker();
  // Endpoints to every rank of `addrs` that has an address (addrs[rank] is replaced by this
  // process's own); the others are failed from the start.
  Status Connect(int rank, std::vector<std::vector<uint8_t>> addrs);
  const std::vector<uint8_t>& own_address() const { return worker_.address(); }

  const char* name() const override { return "ucx"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool can_withdraw_sends() const override { return false; }
  bool peer_failed(int peer) const override { return peer < size_ && endpoints_.failed(peer); }
  int idle_spins() const override { return 16; }
  // Blocks on the worker's event fd (ucx_worker.h): an arrival wakes it.
  bool WaitForActivity(std::chrono::microseconds max) override { return worker_.Wait(max); }
  bool wakes_on_arrival() const override { return worker_.can_wait(); }
  std::vector<uint8_t> peer_address(int peer) const override {
    if (peer < 0 || peer >= size_) return {};
    return endpoints_.address(peer);
  }
  Status ReplacePeer(int peer, std::span<const uint8_t> address) override;

  Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) override;
  Result<Request> Irecv(int peer, int tag, void* buf, size_t bytes) override;
  Result<bool> Test(Request r) override;
  Status Cancel(Request r) override;
  Status RegisterMemory(void* p, size_t bytes) override { return regions_.Register(p, bytes); }
  void UnregisterMemory(void* p) override { regions_.Unregister(p); }
  // copied_bytes stays 0 because this transport's code never copies a message's payload: an
  // eager send hands the caller's buffer to ucp_tag_send_nbx and an eager receive posts the
  // caller's buffer to ucp_tag_recv_nbx (UCX's copies through its bounce buffers, and out of
  // its unexpected queue, are the library's: eager_bytes counts the bytes sent that way); a put
  // writes the caller's buffer into the receiver's (put_bytes). The memcpys here copy control
  // notes (RTR, FIN, REVOKE) and remote keys, not payload; messages dropped at ReplacePeer or
  // the end are received by UCX into a scratch buffer and never delivered. A copy of a payload
  // added here (a bounce or staging buffer) must add its bytes to copied_bytes.
  TransportCounters counters() const override {
    TransportCounters c;
    c.put_bytes = put_bytes_.load(std::memory_order_relaxed);
    c.eager_bytes = eager_bytes_.load(std::memory_order_relaxed);
    c.registrations = regions_.registrations();
    c.on_demand_registrations = on_demand_.load(std::memory_order_relaxed);
    return c;
  }
  [[noreturn]] void Abort(int exit_code) override {
    if (boot_ != nullptr) boot_->Abort(exit_code);
    std::_Exit(exit_code);
  }

 private:
  // Rank 0 logs the transport's settings; so does a joiner, which has no rank 0 beside it.
  bool loud() const { return boot_ == nullptr || rank_ == 0; }
  // Chooses eager or put for large messages (UcxProtocol, UCX_TLS) and logs the choice.
  void ChooseProtocol();
  // After the endpoints are open: under auto, logs to how many peers puts go (UsePut).
  void LogPutPeers() const;
  // Whether a message of `bytes` to or from `peer` goes by put: at put_min bytes and more, when
  // puts are forced or (auto) the peer's endpoint writes puts with the hardware. Both sides of a
  // message decide alike (their endpoints have the same lanes).
  bool UsePut(int peer, size_t bytes) const {
    if (bytes < opts_.put_min) return false;
    return opts_.protocol == UcxProtocol::kPut || endpoints_.native_put(peer);
  }

  void Progress();
  // Advances an op's protocol: true when it completed, an error when it failed, false while in
  // flight. Drive records the outcome in the op (finished, result) for Test to report.
  Result<bool> Advance(uint32_t index);
  void Drive(uint32_t index);
  void RemoveActive(uint32_t index);
  void Shutdown();

  // ucx_tagged.cc: one UCX tagged message per send.
  Status StartEagerSend(uint32_t index);
  Status StartEagerRecv(uint32_t index);
  Result<bool> AdvanceEagerSend(Op& op);
  Result<bool> AdvanceEagerRecv(Op& op);

  // ucx_put.cc: the put protocol.
  Status StartPutSend(uint32_t index);
  Status StartPutRecv(uint32_t index);
  Result<bool> AdvancePutSend(uint32_t index, Op& op);
  Result<bool> AdvancePutRecv(uint32_t index, Op& op);
  Status StartPut(Op& op);
  Status CancelPutSend(uint32_t index, Op& op);
  Status CancelPutRecv(uint32_t index, Op& op, uint64_t id);
  Result<ucp_rkey_h> RkeyFor(Op& op);
  Status SendNote(int peer, Space space, int tag, const void* msg, size_t len) {
    return notes_.Send(endpoints_.ep(peer), peer, MakeTag(space, rank_, tag), msg, len);
  }
  void DrainRevokes(int peer, int tag);
  bool TakeRevoke(int peer, uint64_t id);
  // Drops the put protocol's state of a replaced peer (stashed RTRs, revokes).
  void ForgetPutState(int peer);

  std::unique_ptr<Transport> boot_;
  UcxOptions opts_;
  int rank_, size_;
  UcxWorker worker_;
  UcxEndpoints endpoints_;
  UcxOps ops_;
  // Ops that must move without the user testing them: put sends (they answer RTRs) and
  // cancelled ops finishing their protocol (zombies, released when done).
  std::vector<uint32_t> active_;
  UcxNotes notes_;
  UcxRegistrations regions_;
  UcxRemoteKeys rkeys_;
  std::vector<std::pair<int, uint64_t>> revoked_;  // (peer, receive id)
  struct Stashed {
    int peer, tag;
    RtrMsg rtr;
  };
  std::vector<Stashed> stash_;  // RTRs taken by sends that were then cancelled
  std::atomic<uint64_t> put_bytes_{0}, eager_bytes_{0}, on_demand_{0};
};

}  // namespace moerun::ucx
