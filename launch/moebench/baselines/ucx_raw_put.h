// The raw-UCX baseline of `moebench transport --transport ucx` ("ucx_raw_put", baselines.h): the
// same byte matrix as AlltoallvBaseline moved with nothing but ucp_put_nbx, one flush per peer and
// an 8-byte completion signal, on a UCX context and worker of its own. It is what the ucx
// transport's rendezvous (RTR, put, flush, FIN) could at best reach over the same UCX_TLS: its
// buffers are registered and the peers' addresses and remote keys exchanged once, at creation.
// Plain types only; the UCX calls stay in this file's .cc, which is built only with UCX.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "base/status.h"
#include "launch/moebench/baselines/baselines.h"
#include "transport/transport.h"

namespace moerun {

class RawPutBaseline final : public RoundTripBaseline {
 public:
  // Collective over `bootstrap`'s ranks (which it uses for the address exchange and for the
  // barrier before each round; it must outlive this object's RoundTripMs calls): every rank
  // passes the bytes it sends to and receives from each rank in the dispatch (the combine is the
  // transpose). Allocates and registers one send and one receive buffer.
  static Result<std::unique_ptr<RawPutBaseline>> Create(Transport* bootstrap,
                                                        const std::vector<int64_t>& send_bytes,
                                                        const std::vector<int64_t>& recv_bytes);
  ~RawPutBaseline() override;
  RawPutBaseline(const RawPutBaseline&) = delete;
  RawPutBaseline& operator=(const RawPutBaseline&) = delete;

  // One round trip, collective: a barrier over the bootstrap, then the dispatch (each rank puts
  // its bytes for every peer straight into that peer's receive buffer, flushes, signals) and the
  // combine (the transpose, back into the senders' send buffers). This rank's milliseconds from
  // the end of the barrier until it holds everything it receives (the caller takes rank 0's).
  // Waiting progresses the worker and yields the CPU after any pass that found nothing to do.
  // Allocates nothing; gives up with an error after 60 s.
  Result<double> RoundTripMs() override;

 private:
  struct Impl;
  explicit RawPutBaseline(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moerun
