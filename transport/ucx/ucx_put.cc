// The ucx transport's put protocol (zero copy, messages of put_min bytes and more;
// ucx_transport.h describes it): the receiver's RTR, the sender's put, flush and FIN, and the
// REVOKE of a cancelled receive. Each side's op moves through its Steps in Advance*.
#include <cstring>
#include <string>

#include "transport/ucx/ucx_transport_impl.h"

namespace moerun::ucx {

Status UcxTransport::StartPutSend(uint32_t index) {
  Op& op = ops_[index];
  op.step = Step::kWaitRtr;
  // An RTR a cancelled send took comes first; else wait for the channel's next one.
  bool stashed = false;
  for (size_t i = 0; i < stash_.size(); ++i) {
    if (stash_[i].peer == op.peer && stash_[i].tag == op.tag) {
      op.rtr = stash_[i].rtr;
      stash_.erase(stash_.begin() + static_cast<std::ptrdiff_t>(i));
      op.ctl_done = true;
      op.info.length = kRtrHeader + op.rtr.rkey_len;
      stashed = true;
      break;
    }
  }
  if (!stashed) {
    if (Status st = ops_.PostRecv(op, true, &op.rtr, sizeof op.rtr, MakeTag(kRtr, op.peer, op.tag));
        !st.ok()) {
      ops_.Release(index);
      return st;
    }
  }
  active_.push_back(index);
  return Status::Ok();
}

Status UcxTransport::StartPutRecv(uint32_t index) {
  Op& op = ops_[index];
  const int peer = op.peer;
  // The FIN receive first, then the RTR that lets the sender write.
  const uint64_t id = ops_.MakeId(index);
  RtrMsg rtr;
  rtr.id = id;
  rtr.bytes = op.bytes;
  rtr.addr = reinterpret_cast<uint64_t>(op.buf);
  if (const Region* r = regions_.Find(op.buf, op.bytes)) {
    rtr.region = r->uid;
    rtr.rkey_len = static_cast<uint32_t>(r->packed.size());
    std::memcpy(rtr.rkey, r->packed.data(), r->packed.size());
  } else {
    Result<Region> temp = regions_.Map(op.buf, op.bytes);
    if (!temp.ok()) {
      ops_.Release(index);
      return temp.status();
    }
    on_demand_.fetch_add(1, std::memory_order_relaxed);
    op.temp_memh = temp->memh;
    rtr.region = temp->uid;
    rtr.flags = kRtrTemporary;
    rtr.rkey_len = static_cast<uint32_t>(temp->packed.size());
    std::memcpy(rtr.rkey, temp->packed.data(), temp->packed.size());
  }
  if (Status st = ops_.PostRecv(op, true, &op.fin, sizeof op.fin, MakeTag(kFin, peer, FinTag(id)));
      !st.ok()) {
    ops_.Release(index);
    return st;
  }
  op.step = Step::kWaitFin;
  if (Status s = SendNote(peer, kRtr, op.tag, &rtr, kRtrHeader + rtr.rkey_len); !s.ok()) {
    ops_.Reap(op);
    ops_.Release(index);
    return s;
  }
  return Status::Ok();
}

Result<ucp_rkey_h> UcxTransport::RkeyFor(Op& op) {
  const bool temporary = (op.rtr.flags & kRtrTemporary) != 0;
  if (!temporary) {
    if (ucp_rkey_h cached = rkeys_.Find(op.peer, op.rtr.region)) return cached;
  }
  MOERUN_ASSIGN_OR_RETURN(ucp_rkey_h rkey,
                          UnpackRemoteKey(endpoints_.ep(op.peer), op.peer, op.rtr.rkey));
  if (temporary) {
    op.temp_rkey = rkey;
  } else {
    rkeys_.Add(op.peer, op.rtr.region, rkey);
  }
  return rkey;
}

Status UcxTransport::StartPut(Op& op) {
  MOERUN_ASSIGN_OR_RETURN(ucp_rkey_h rkey, RkeyFor(op));
  ucp_ep_h ep = endpoints_.ep(op.peer);
  // The source buffer's memory handle is not passed (UCP_OP_ATTR_FIELD_MEMH): UCX 1.13 crashed
  // (SIGSEGV in ucp_request_memory_dereg, from ucp_ep_set_failed purging the pending puts of a
  // shared-memory endpoint) when a peer died with such puts queued. UCX registers the source
  // itself (its registration cache makes that one lookup per put after the first).
  ucp_request_param_t param{};
  void* req = ucp_put_nbx(ep, op.buf, op.bytes, op.rtr.addr, rkey, &param);
  if (UCS_PTR_IS_ERR(req)) {
    return Status::Unavailable("ucx: put to rank " + std::to_string(op.peer) + ": " +
                               UcsError(UCS_PTR_STATUS(req)));
  }
  op.data_req = req;
  op.data_done = req == nullptr;
  ucp_request_param_t fp{};
  void* flush = ucp_ep_flush_nbx(ep, &fp);
  if (UCS_PTR_IS_ERR(flush)) {
    return Status::Unavailable("ucx: flush to rank " + std::to_string(op.peer) + ": " +
                               UcsError(UCS_PTR_STATUS(flush)));
  }
  op.flush_req = flush;
  op.flush_done = flush == nullptr;
  put_bytes_.fetch_add(op.bytes, std::memory_order_relaxed);
  op.step = Step::kPutting;
  return Status::Ok();
}

Result<bool> UcxTransport::AdvancePutSend(uint32_t index, Op& op) {
  if (op.step == Step::kWaitRtr) {
    if (!UcxOps::PollRecv(op, true)) return false;
    if (op.ctl_status != UCS_OK) {
      return Status::Unavailable("ucx: waiting for rank " + std::to_string(op.peer) +
                                 " to be ready: " + UcsError(op.ctl_status));
    }
    if (op.info.length < kRtrHeader || op.rtr.magic != kNoteMagic || op.rtr.rkey_len > kMaxRkey ||
        kRtrHeader + op.rtr.rkey_len != op.info.length) {
      return Status::Corrupt("ucx: a malformed ready-to-receive note from rank " +
                             std::to_string(op.peer));
    }
    DrainRevokes(op.peer, op.tag);
    if (TakeRevoke(op.peer, op.rtr.id)) {
      // That receive was cancelled: answer it and wait for the channel's next one.
      FinMsg fin;
      fin.code = kFinRevoked;
      fin.id = op.rtr.id;
      (void)SendNote(op.peer, kFin, FinTag(op.rtr.id), &fin, sizeof fin);
      if (op.temp_rkey != nullptr) ucp_rkey_destroy(op.temp_rkey), op.temp_rkey = nullptr;
      MOERUN_RETURN_IF_ERROR(
          ops_.PostRecv(op, true, &op.rtr, sizeof op.rtr, MakeTag(kRtr, op.peer, op.tag)));
      return AdvancePutSend(index, op);
    }
    if (op.rtr.bytes != op.bytes) {
      FinMsg fin;
      fin.code = kFinSizeMismatch;
      fin.id = op.rtr.id;
      fin.bytes = op.bytes;
      (void)SendNote(op.peer, kFin, FinTag(op.rtr.id), &fin, sizeof fin);
      return Status::InvalidArgument("a message of " + std::to_string(op.bytes) +
                                     " bytes where rank " + std::to_string(op.peer) + " expects " +
                                     std::to_string(op.rtr.bytes));
    }
    MOERUN_RETURN_IF_ERROR(StartPut(op));
  }
  if (op.step == Step::kFinSend) {
    // Done once UCX has taken the FIN: a rank that stops progressing UCX after its send
    // completed (say, to wait in an MPI barrier) must not hold the receiver back.
    if (!UcxOps::Poll(op.fin_req, &op.fin_done, &op.fin_status)) return false;
    if (op.fin_status != UCS_OK) {
      return Status::Unavailable("ucx: completion note to rank " + std::to_string(op.peer) + ": " +
                                 UcsError(op.fin_status));
    }
    return true;
  }
  // Step::kPutting: the put and the flush behind it, then the FIN.
  if (!UcxOps::Poll(op.data_req, &op.data_done, &op.data_status)) return false;
  if (!UcxOps::Poll(op.flush_req, &op.flush_done, &op.flush_status)) return false;
  if (op.data_status != UCS_OK || op.flush_status != UCS_OK) {
    return Status::Unavailable(
        "ucx: put to rank " + std::to_string(op.peer) + ": " +
        UcsError(op.data_status != UCS_OK ? op.data_status : op.flush_status));
  }
  op.fin_out = FinMsg{};
  op.fin_out.id = op.rtr.id;
  op.fin_out.bytes = op.bytes;
  ucp_request_param_t param{};
  void* req = ucp_tag_send_nbx(endpoints_.ep(op.peer), &op.fin_out, sizeof op.fin_out,
                               MakeTag(kFin, rank_, FinTag(op.rtr.id)), &param);
  if (UCS_PTR_IS_ERR(req)) {
    return Status::Unavailable("ucx: completion note to rank " + std::to_string(op.peer) + ": " +
                               UcsError(UCS_PTR_STATUS(req)));
  }
  op.fin_req = req;
  op.fin_done = req == nullptr;
  op.step = Step::kFinSend;
  return AdvancePutSend(index, op);
}

Result<bool> UcxTransport::AdvancePutRecv(uint32_t index, Op& op) {
  if (!UcxOps::PollRecv(op, true)) return false;
  if (op.ctl_status != UCS_OK) {
    return Status::Unavailable("ucx: receive from rank " + std::to_string(op.peer) + ": " +
                               UcsError(op.ctl_status));
  }
  if (op.info.length != sizeof(FinMsg) || op.fin.magic != kNoteMagic ||
      op.fin.id != ops_.MakeId(index)) {
    return Status::Corrupt("ucx: a malformed completion note from rank " + std::to_string(op.peer));
  }
  if (op.fin.code == kFinSizeMismatch) {
    return Status::InvalidArgument("message of " + std::to_string(op.fin.bytes) + " bytes where " +
                                   std::to_string(op.bytes) + " were expected");
  }
  if (op.fin.code == kFinRevoked && !op.zombie) {
    return Status::Internal("ucx: rank " + std::to_string(op.peer) +
                            " answered a receive that was not cancelled as cancelled");
  }
  return true;
}

Status UcxTransport::CancelPutSend(uint32_t index, Op& op) {
  if (!op.finished && op.step != Step::kWaitRtr) {
    op.zombie = true;  // the put is on its way: finish it (and its FIN) in the background
    return Status::Ok();
  }
  if (!op.finished && op.ctl_req != nullptr) {
    // Withdraw the RTR receive; an RTR that slipped in goes to the channel's next send.
    ucp_worker_h worker = worker_.handle();
    ucp_request_cancel(worker, op.ctl_req);
    for (int i = 0; i < 100000 && !op.ctl_rs.fired; ++i) ucp_worker_progress(worker);
    if (op.ctl_rs.fired && op.ctl_rs.status == UCS_OK && op.ctl_rs.length >= kRtrHeader &&
        op.rtr.magic == kNoteMagic) {
      stash_.push_back(Stashed{op.peer, op.tag, op.rtr});
    }
    ucp_request_free(op.ctl_req);
    op.ctl_req = nullptr;
    op.ctl_rs.req = nullptr;
  }
  RemoveActive(index);
  ops_.Release(index);
  return Status::Ok();
}

Status UcxTransport::CancelPutRecv(uint32_t index, Op& op, uint64_t id) {
  if (op.finished) {
    ops_.Release(index);
    return Status::Ok();
  }
  RevokeMsg rv;
  rv.id = id;
  (void)SendNote(op.peer, kRevoke, op.tag, &rv, sizeof rv);
  op.zombie = true;  // waits for the sender's answer to its RTR
  active_.push_back(index);
  return Status::Ok();
}

void UcxTransport::DrainRevokes(int peer, int tag) {
  ucp_worker_h worker = worker_.handle();
  for (;;) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg =
        ucp_tag_probe_nb(worker, MakeTag(kRevoke, peer, tag), kFullMask, 1, &info);
    if (msg == nullptr) return;
    RevokeMsg rv;
    ucp_request_param_t param{};
    void* req = ucp_tag_msg_recv_nbx(worker, &rv, sizeof rv, msg, &param);
    bool done = false;
    ucs_status_t st = UCS_OK;
    if (UCS_PTR_IS_ERR(req)) continue;
    while (!UcxOps::Poll(req, &done, &st)) ucp_worker_progress(worker);
    if (st != UCS_OK || info.length != sizeof rv || rv.magic != kNoteMagic) continue;
    if (revoked_.size() >= 1024) revoked_.erase(revoked_.begin());
    revoked_.emplace_back(peer, rv.id);
  }
}

bool UcxTransport::TakeRevoke(int peer, uint64_t id) {
  for (size_t i = 0; i < revoked_.size(); ++i) {
    if (revoked_[i].first == peer && revoked_[i].second == id) {
      revoked_.erase(revoked_.begin() + static_cast<std::ptrdiff_t>(i));
      return true;
    }
  }
  return false;
}

void UcxTransport::ForgetPutState(int peer) {
  std::erase_if(stash_, [&](const Stashed& st) { return st.peer == peer; });
  std::erase_if(revoked_, [&](const std::pair<int, uint64_t>& rv) { return rv.first == peer; });
}

}  // namespace moerun::ucx
