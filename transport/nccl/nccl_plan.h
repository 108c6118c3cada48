// The host side of one grouped NCCL exchange, vendor-free (tested on any machine): which peers
// get an ncclSend / ncclRecv of how many bytes, from the per-peer byte offsets of the send and
// receive buffers. The router knows every size before anything moves (docs/DESIGN.md), so both
// sides of a pair take their sizes from the same plan; NCCL cannot check that they agree.
//
// Offsets: `ranks + 1` non-decreasing, non-negative byte offsets; peer p's bytes are
// [offset[p], offset[p + 1]). A peer with no bytes in a direction gets no call in it (NCCL would
// accept a zero-count call, but skipping saves a kernel slot).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace moerun {

struct PeerTransfer {
  enum class Kind : uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = 0;
  int64_t offset = 0;  // into the send (kSend) or receive (kRecv) buffer
  int64_t bytes = 0;   // > 0

  bool operator==(const PeerTransfer&) const = default;
};

// Checks one offsets array; `which` names it in the error ("send offsets").
Status ValidateExchangeOffsets(std::span<const int64_t> offsets, int ranks, const char* which);

// Fills `out` (cleared first; its capacity is reused, so a warm caller does not allocate) with
// the transfers in peer order, for each peer its send before its receive. Errors
// (InvalidArgument): ranks < 1, an offsets array of another size than ranks + 1, a negative or
// decreasing offset.
Status PlanGroupedTransfers(int ranks, std::span<const int64_t> send_offsets,
                            std::span<const int64_t> recv_offsets, std::vector<PeerTransfer>& out);

}  // namespace moerun
