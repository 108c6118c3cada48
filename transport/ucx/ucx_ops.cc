#include "transport/ucx/ucx_ops.h"

#include <string>

namespace moerun::ucx {
namespace {

// RecvState::req while ucp_tag_recv_nbx runs (it may call the callback before it returns).
void* const kPosting = reinterpret_cast<void*>(uintptr_t{1});

void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
  auto* rs = static_cast<RecvState*>(user);
  if (rs->req != request && rs->req != kPosting) return;  // a request reaped earlier
  rs->fired = true;
  rs->status = status;
  rs->length = info != nullptr ? info->length : 0;
}

}  // namespace

void UcxOps::Init(ucp_context_h context, ucp_worker_h worker, uint32_t n) {
  context_ = context;
  worker_ = worker;
  ops_.reserve(n);
  for (uint32_t i = 0; i < n; ++i) ops_.push_back(std::make_unique<Op>());
  for (uint32_t i = n; i > 0; --i) free_.push_back(i - 1);
}

Op* UcxOps::Find(Request r) {
  const uint64_t index = (r.id & 0xffffffffu) - 1;
  if (r.id == 0 || index >= ops_.size()) return nullptr;
  Op* op = ops_[index].get();
  if (op->step == Step::kFree || op->zombie ||
      op->generation != static_cast<uint32_t>(r.id >> 32)) {
    return nullptr;
  }
  return op;
}

Result<uint32_t> UcxOps::New(Kind kind, int peer, int tag, void* buf, size_t bytes) {
  if (tag < 0) return Status::InvalidArgument("ucx: negative tag");
  if (free_.empty()) {
    const auto old = static_cast<uint32_t>(ops_.size());
    for (uint32_t i = 0; i < old; ++i) ops_.push_back(std::make_unique<Op>());
    for (uint32_t i = old * 2; i > old; --i) free_.push_back(i - 1);
  }
  const uint32_t index = free_.back();
  free_.pop_back();
  Op& op = *ops_[index];
  const uint32_t gen = op.generation;
  op = Op{};
  op.generation = gen;
  op.kind = kind;
  op.peer = peer;
  op.tag = tag;
  op.buf = buf;
  op.bytes = bytes;
  op.step = Step::kEager;
  return index;
}

void UcxOps::Release(uint32_t index) {
  Op& op = *ops_[index];
  if (op.temp_rkey != nullptr) ucp_rkey_destroy(op.temp_rkey);
  if (op.temp_memh != nullptr) ucp_mem_unmap(context_, op.temp_memh);
  op.temp_rkey = nullptr;
  op.temp_memh = nullptr;
  op.step = Step::kFree;
  op.zombie = false;
  ++op.generation;
  free_.push_back(index);
}

bool UcxOps::Poll(void*& req, bool* done, ucs_status_t* status) {
  if (*done) return true;
  if (req == nullptr) {
    *done = true;
    return true;
  }
  const ucs_status_t s = ucp_request_check_status(req);
  if (s == UCS_INPROGRESS) return false;
  *status = s;
  *done = true;
  ucp_request_free(req);
  req = nullptr;
  return true;
}

Status UcxOps::PostRecv(Op& op, bool ctl, void* buf, size_t len, ucp_tag_t tag) {
  RecvState& rs = ctl ? op.ctl_rs : op.data_rs;
  rs = RecvState{};
  ucp_request_param_t param{};
  // Always a request (UCX 1.13 does not report the length of a receive completed at once).
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = OnRecv;
  param.user_data = &rs;
  rs.req = kPosting;
  void* req = ucp_tag_recv_nbx(worker_, buf, len, tag, kFullMask, &param);
  if (UCS_PTR_IS_ERR(req) || req == nullptr) {
    rs.req = nullptr;
    return Status::Unavailable("ucx: receive from rank " + std::to_string(op.peer) + ": " +
                               UcsError(req == nullptr ? UCS_ERR_NO_MESSAGE : UCS_PTR_STATUS(req)));
  }
  rs.req = req;
  (ctl ? op.ctl_req : op.data_req) = req;
  (ctl ? op.ctl_done : op.data_done) = false;
  (ctl ? op.ctl_status : op.data_status) = UCS_OK;
  return Status::Ok();
}

bool UcxOps::PollRecv(Op& op, bool ctl) {
  bool& done = ctl ? op.ctl_done : op.data_done;
  if (done) return true;
  void*& req = ctl ? op.ctl_req : op.data_req;
  RecvState& rs = ctl ? op.ctl_rs : op.data_rs;
  if (req == nullptr) return done = true;
  if (!rs.fired) return false;
  (ctl ? op.ctl_status : op.data_status) = rs.status;
  op.info.length = rs.length;
  ucp_request_free(req);
  req = nullptr;
  rs.req = nullptr;
  return done = true;
}

void UcxOps::ReapOne(void*& req, bool cancel) {
  if (req == nullptr) return;
  if (cancel) ucp_request_cancel(worker_, req);
  for (int i = 0; i < 1000 && ucp_request_check_status(req) == UCS_INPROGRESS; ++i) {
    ucp_worker_progress(worker_);
  }
  ucp_request_free(req);  // released by UCX once complete, if it is not yet
  req = nullptr;
}

void UcxOps::Reap(Op& op) {
  // Receives can be cancelled; sends and puts complete (or fail) by themselves.
  ReapOne(op.data_req, op.kind == Kind::kEagerRecv);
  ReapOne(op.flush_req, false);
  ReapOne(op.fin_req, false);
  ReapOne(op.ctl_req, true);
}

}  // namespace moerun::ucx
