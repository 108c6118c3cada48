#include "transport/nccl/nccl_plan.h"

#include <string>

namespace moerun {

Status ValidateExchangeOffsets(std::span<const int64_t> offsets, int ranks, const char* which) {
  if (ranks < 1) {
    return Status::InvalidArgument("nccl exchange: " + std::to_string(ranks) + " ranks");
  }
  const size_t want = static_cast<size_t>(ranks) + 1;
  if (offsets.size() != want) {
    return Status::InvalidArgument(std::string("nccl exchange: ") + which + ": " +
                                   std::to_string(offsets.size()) +
                                   " offsets, want ranks + 1 = " + std::to_string(want));
  }
  if (offsets[0] < 0) {
    return Status::InvalidArgument(std::string("nccl exchange: ") + which +
                                   ": offset[0] = " + std::to_string(offsets[0]) + " is negative");
  }
  for (size_t p = 0; p + 1 < offsets.size(); ++p) {
    if (offsets[p + 1] < offsets[p]) {
      return Status::InvalidArgument(
          std::string("nccl exchange: ") + which + ": offset[" + std::to_string(p + 1) +
          "] = " + std::to_string(offsets[p + 1]) + " is below offset[" + std::to_string(p) +
          "] = " + std::to_string(offsets[p]) + " (offsets must not decrease)");
    }
  }
  return Status::Ok();
}

Status PlanGroupedTransfers(int ranks, std::span<const int64_t> send_offsets,
                            std::span<const int64_t> recv_offsets, std::vector<PeerTransfer>& out) {
  out.clear();
  MOERUN_RETURN_IF_ERROR(ValidateExchangeOffsets(send_offsets, ranks, "send offsets"));
  MOERUN_RETURN_IF_ERROR(ValidateExchangeOffsets(recv_offsets, ranks, "receive offsets"));
  for (int p = 0; p < ranks; ++p) {
    const auto i = static_cast<size_t>(p);
    const int64_t send = send_offsets[i + 1] - send_offsets[i];
    const int64_t recv = recv_offsets[i + 1] - recv_offsets[i];
    if (send > 0) out.push_back({PeerTransfer::Kind::kSend, p, send_offsets[i], send});
    if (recv > 0) out.push_back({PeerTransfer::Kind::kRecv, p, recv_offsets[i], recv});
  }
  return Status::Ok();
}

}  // namespace moerun
