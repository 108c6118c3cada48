// Transfers of abandoned microbatches (a rank missed the deadline), kept posted with their
// buffers until they complete: a late rank then drains them in order, its late answers land in
// these buffers and are dropped, and the channel stays in step for the next microbatch. Owned by
// the router thread (PeerHealth holds one; a RouterLayer without a PeerHealth holds its own).
#pragma once

#include <functional>
#include <vector>

#include "base/aligned_buffer.h"
#include "transport/transport.h"

namespace moerun {

class StrandedTransfers {
 public:
  explicit StrandedTransfers(Transport* transport) : t_(transport) {}
  // Receives are withdrawn; the buffers of sends that cannot be (mpi) are parked for the
  // process's lifetime.
  ~StrandedTransfers();
  StrandedTransfers(const StrandedTransfers&) = delete;
  StrandedTransfers& operator=(const StrandedTransfers&) = delete;

  void Add(std::vector<Request> requests, std::vector<AlignedBuffer> buffers);
  // Tests every transfer; `finished(request, status)` is called once for each that completed
  // (status ok) or failed. A group whose transfers are all over releases its buffers.
  void Poll(const std::function<void(const Request&, const Status&)>& finished);
  // Withdraws every transfer with `rank` (its process is gone or replaced).
  void CancelPeer(int rank);
  // Groups with a transfer still outstanding.
  size_t groups() const { return groups_.size(); }
  // Whether a transfer still outstanding satisfies `pred` (by its peer).
  bool AnyPeer(const std::function<bool(int)>& pred) const;

 private:
  struct Group {
    std::vector<Request> requests;
    std::vector<AlignedBuffer> buffers;
  };
  Transport* t_;
  std::vector<Group> groups_;
};

}  // namespace moerun
