// The ucx transport's outgoing control notes (RTR, REVOKE, FIN): a pool of small buffers, each
// kept until UCX is done with its bytes, so that sending one never waits. Internal to
// transport/ucx/. Thread-safety: none (the worker's thread).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/status.h"
#include "transport/ucx/ucx_wire.h"

namespace moerun::ucx {

class UcxNotes {
 public:
  // Preallocates `n` buffers (the pool grows when all are in flight).
  void Init(ucp_worker_h worker, uint32_t n);
  // Sends `len` bytes of `msg` (at most an RtrMsg) to `peer` on `ep` with `tag`.
  Status Send(ucp_ep_h ep, int peer, ucp_tag_t tag, const void* msg, size_t len);
  // Frees the buffers UCX is done with (sent, or cancelled by a closed endpoint).
  void Sweep();
  // Progresses the worker a while for the notes in flight, then frees them all (the end).
  void Drain();

 private:
  // A note in flight, kept until UCX is done with its bytes.
  struct Note {
    void* req = nullptr;
    alignas(8) uint8_t bytes[sizeof(RtrMsg)];
  };
  ucp_worker_h worker_ = nullptr;
  std::vector<std::unique_ptr<Note>> notes_;
  std::vector<uint32_t> free_, busy_;
};

}  // namespace moerun::ucx
