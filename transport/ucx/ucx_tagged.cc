// The ucx transport's tagged protocol: a message below put_min (every message under
// UcxProtocol::kTag) is one UCX tagged message on the (source, tag) channel's data space; UCX
// matches them in order and moves large ones by its own rendezvous.
#include <string>

#include "transport/ucx/ucx_transport_impl.h"

namespace moerun::ucx {

Status UcxTransport::StartEagerSend(uint32_t index) {
  Op& op = ops_[index];
  ucp_request_param_t param{};
  void* req = ucp_tag_send_nbx(endpoints_.ep(op.peer), op.buf, op.bytes,
                               MakeTag(kData, rank_, op.tag), &param);
  if (UCS_PTR_IS_ERR(req)) {
    const int peer = op.peer;
    ops_.Release(index);
    return Status::Unavailable("ucx: send to rank " + std::to_string(peer) + ": " +
                               UcsError(UCS_PTR_STATUS(req)));
  }
  op.data_req = req;
  eager_bytes_.fetch_add(op.bytes, std::memory_order_relaxed);
  return Status::Ok();
}

Status UcxTransport::StartEagerRecv(uint32_t index) {
  Op& op = ops_[index];
  if (Status st = ops_.PostRecv(op, false, op.buf, op.bytes, MakeTag(kData, op.peer, op.tag));
      !st.ok()) {
    ops_.Release(index);
    return st;
  }
  return Status::Ok();
}

Result<bool> UcxTransport::AdvanceEagerSend(Op& op) {
  if (!UcxOps::Poll(op.data_req, &op.data_done, &op.data_status)) return false;
  if (op.data_status != UCS_OK) {
    return Status::Unavailable("ucx: send to rank " + std::to_string(op.peer) + ": " +
                               UcsError(op.data_status));
  }
  return true;
}

Result<bool> UcxTransport::AdvanceEagerRecv(Op& op) {
  if (!UcxOps::PollRecv(op, false)) return false;
  if (op.data_status == UCS_ERR_MESSAGE_TRUNCATED) {
    return Status::InvalidArgument("a message longer than the " + std::to_string(op.bytes) +
                                   " bytes expected");
  }
  if (op.data_status != UCS_OK) {
    return Status::Unavailable("ucx: receive from rank " + std::to_string(op.peer) + ": " +
                               UcsError(op.data_status));
  }
  if (op.info.length != op.bytes) {
    return Status::InvalidArgument("message of " + std::to_string(op.info.length) +
                                   " bytes where " + std::to_string(op.bytes) + " were expected");
  }
  return true;
}

}  // namespace moerun::ucx
