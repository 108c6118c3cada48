// The ucx transport's requests: the table of operations (one per Isend/Irecv, reused through a
// free list; a request id is the slot and its generation, so a stale id finds nothing), each
// op's protocol state and UCX requests, and the helpers that post, poll and reap those UCX
// requests. Internal to transport/ucx/. Thread-safety: none (the worker's thread).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/status.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_wire.h"

namespace moerun::ucx {

// Where a receive's completion callback leaves its result (UCX reports a receive's length only
// to the callback, or in the parameters when it completes at once).
struct RecvState {
  void* req = nullptr;
  bool fired = false;
  ucs_status_t status = UCS_OK;
  size_t length = 0;
};

enum class Kind : uint8_t { kEagerSend, kEagerRecv, kPutSend, kPutRecv };
enum class Step : uint8_t { kFree, kEager, kWaitRtr, kPutting, kFinSend, kWaitFin };

struct Op {
  uint32_t generation = 0;
  Step step = Step::kFree;
  bool zombie = false;  // cancelled by the user, finishing its protocol
  bool finished = false;
  Status result;
  Kind kind = Kind::kEagerSend;
  int peer = 0;
  int tag = 0;
  void* buf = nullptr;
  size_t bytes = 0;
  void* data_req = nullptr;   // eager send/recv, or the put
  void* flush_req = nullptr;  // put send: the endpoint flush after the put
  void* ctl_req = nullptr;    // put send: the RTR receive; put receive: the FIN receive
  ucp_tag_recv_info_t info{};
  RecvState data_rs, ctl_rs;
  bool data_done = false, flush_done = false, ctl_done = false;
  ucs_status_t data_status = UCS_OK, flush_status = UCS_OK, ctl_status = UCS_OK;
  RtrMsg rtr;      // put send: the RTR received
  FinMsg fin;      // put receive: the FIN received
  FinMsg fin_out;  // put send: the FIN sent
  void* fin_req = nullptr;
  bool fin_done = false;
  ucs_status_t fin_status = UCS_OK;
  ucp_mem_h temp_memh = nullptr;   // put receive: the region registered for this message only
  ucp_rkey_h temp_rkey = nullptr;  // put send: the key of such a region
};

class UcxOps {
 public:
  // Preallocates `n` ops (no allocation on the hot path below that many in flight).
  void Init(ucp_context_h context, ucp_worker_h worker, uint32_t n);

  // A fresh op in step kEager (the table doubles when full); kInvalidArgument for a negative tag.
  Result<uint32_t> New(Kind kind, int peer, int tag, void* buf, size_t bytes);
  // Frees the op's one-message registration and key, and its slot (a new generation).
  void Release(uint32_t index);
  // The live, not cancelled op of a request, or null.
  Op* Find(Request r);
  static uint32_t Index(uint64_t id) { return static_cast<uint32_t>((id & 0xffffffffu) - 1); }
  uint64_t MakeId(uint32_t index) const {
    return (static_cast<uint64_t>(ops_[index]->generation) << 32) | (index + 1u);
  }
  Op& operator[](uint32_t index) { return *ops_[index]; }
  uint32_t size() const { return static_cast<uint32_t>(ops_.size()); }

  // Posts a tag receive for the op's data (ctl false) or control note (ctl true).
  Status PostRecv(Op& op, bool ctl, void* buf, size_t len, ucp_tag_t tag);
  // True once that receive is done (status and op.info.length set).
  static bool PollRecv(Op& op, bool ctl);
  // True once a send-side request is done (*status set; the request freed).
  static bool Poll(void*& req, bool* done, ucs_status_t* status);
  // Cancels and reaps the op's UCX requests (after a failure or a cancel).
  void Reap(Op& op);
  // Waits a little for a request (cancelling it first if `cancel`), then frees it.
  void ReapOne(void*& req, bool cancel);

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<std::unique_ptr<Op>> ops_;
  std::vector<uint32_t> free_;
};

}  // namespace moerun::ucx
