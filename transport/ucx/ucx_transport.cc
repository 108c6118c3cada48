// The ucx transport's core (ucx_transport_impl.h lists its parts): opening it, replacing a dead
// peer, Isend/Irecv/Test/Cancel over the two protocols (ucx_tagged.cc, ucx_put.cc), progress,
// and the end.
#include "transport/ucx/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "base/log.h"
#include "transport/ucx/ucx_environment.h"
#include "transport/ucx/ucx_transport_impl.h"

namespace moerun {
namespace ucx {

Status UcxTransport::Init() {
  MOERUN_RETURN_IF_ERROR(OpenWorker());
  // Exchange worker addresses over the bootstrap transport.
  const Deadline deadline = DeadlineIn(std::chrono::seconds(120));
  MOERUN_ASSIGN_OR_RETURN(
      std::vector<std::vector<uint8_t>> addrs,
      AllGatherBytes(*boot_, own_address(), kReservedTagBase + 200, size_t{1} << 20, deadline,
                     "ucx bootstrap (worker addresses)"));
  // The spare ranks: no address (failed from the start) until a joined process takes one.
  addrs.resize(addrs.size() + static_cast<size_t>(opts_.spare_ranks));
  MOERUN_RETURN_IF_ERROR(Connect(rank_, std::move(addrs)));
  return boot_->Barrier(deadline);
}

Status UcxTransport::OpenWorker() {
  SetUcxEnvironmentDefaults(loud());
  MOERUN_RETURN_IF_ERROR(worker_.Open(loud()));
  endpoints_.set_worker(worker_.handle());
  regions_.set_context(worker_.context());
  // Preallocated pools: no allocation on the hot path below these sizes.
  ops_.Init(worker_.context(), worker_.handle(), 1024);
  active_.reserve(1024);
  notes_.Init(worker_.handle(), 256);
  revoked_.reserve(1024);
  stash_.reserve(64);
  ChooseProtocol();
  return Status::Ok();
}

void UcxTransport::ChooseProtocol() {
  if (opts_.protocol == UcxProtocol::kAuto && !SharedMemoryMayBeUsed() && TcpOnly()) {
    opts_.protocol = UcxProtocol::kTag;
    if (loud()) {
      spdlog::info(
          "ucx: UCX_TLS offers TCP only, where UCX emulates puts in software: large "
          "messages go as UCX tagged messages (MOERUN_UCX_PROTOCOL=put to force puts)");
    }
  }
  if (opts_.protocol == UcxProtocol::kTag) {
    opts_.put_min = std::numeric_limits<size_t>::max();
  } else if (opts_.protocol == UcxProtocol::kPut && loud()) {
    spdlog::info("ucx: messages of {} bytes and more go by put (MOERUN_UCX_PUT_MIN)",
                 opts_.put_min);
  }
}

void UcxTransport::LogPutPeers() const {
  if (opts_.protocol != UcxProtocol::kAuto || !loud()) return;
  int peers = 0;
  int native = 0;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || endpoints_.failed(p)) continue;
    ++peers;
    if (endpoints_.native_put(p)) ++native;
  }
  if (native > 0) {
    spdlog::info(
        "ucx: messages of {} bytes and more go by put to {} of {} peer(s) (hardware RMA; "
        "MOERUN_UCX_PUT_MIN); to the others as UCX tagged messages",
        opts_.put_min, native, peers);
  } else {
    // UCX 1.13 emulates puts with active messages where an endpoint has no RMA lane; the
    // target acknowledges each one and aborts the process (ucs_fatal) when that acknowledgement
    // fails because the sender has just died. Tagged rendezvous is also faster there.
    spdlog::info(
        "ucx: no peer's endpoint has hardware RMA (UCX would emulate puts in software): "
        "large messages go as UCX tagged messages (MOERUN_UCX_PROTOCOL=put forces puts)");
  }
}

Status UcxTransport::Connect(int rank, std::vector<std::vector<uint8_t>> addrs) {
  if (!worker_.open()) return Status::Internal("ucx: Connect before OpenWorker");
  if (addrs.empty() || rank < 0 || static_cast<size_t>(rank) >= addrs.size()) {
    return Status::InvalidArgument("ucx: no rank " + std::to_string(rank) + " among " +
                                   std::to_string(addrs.size()) + " ranks");
  }
  if (addrs.size() > 0xffffff) {  // MakeTag carries 24 bits of the source rank
    return Status::InvalidArgument("ucx: " + std::to_string(addrs.size()) +
                                   " ranks (at most 16777215 supported)");
  }
  rank_ = rank;
  size_ = static_cast<int>(addrs.size());
  addrs[static_cast<size_t>(rank)] = own_address();
  endpoints_.Assign(std::move(addrs));
  rkeys_.Resize(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    if (endpoints_.address(p).empty()) {
      // A rank the joiner was given no address for (dead, or not yet replaced itself).
      endpoints_.Fail(p, UCS_ERR_UNREACHABLE);
      spdlog::info("ucx: rank {} has no address: failed from the start", p);
      continue;
    }
    MOERUN_RETURN_IF_ERROR(endpoints_.Open(p));
  }
  if (loud()) {
    const char* tls = std::getenv("UCX_TLS");
    spdlog::info("ucx: UCX {} with {} ranks{}, UCX_TLS={}", ucp_get_version_string(), size_,
                 boot_ == nullptr ? " (joined as rank " + std::to_string(rank_) + ")" : "",
                 tls ? tls : "(UCX's default)");
  }
  LogPutPeers();
  return Status::Ok();
}

Status UcxTransport::ReplacePeer(int peer, std::span<const uint8_t> address) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    return Status::InvalidArgument("ucx: ReplacePeer(" + std::to_string(peer) + "): " +
                                   (peer == rank_ ? std::string("a rank cannot replace itself")
                                                  : "no such rank among " + std::to_string(size_)));
  }
  if (address.empty()) {
    return Status::InvalidArgument("ucx: ReplacePeer(" + std::to_string(peer) +
                                   "): an empty address");
  }
  // The caller's requests of that rank must be done; cancelled ones still finishing their
  // protocol (zombies) never will against a dead process: they are reaped here.
  std::vector<uint32_t> zombies;
  for (uint32_t i = 0; i < ops_.size(); ++i) {
    const Op& op = ops_[i];
    if (op.step == Step::kFree || op.peer != peer) continue;
    if (op.zombie) {
      zombies.push_back(i);
    } else if (!op.finished) {
      return Status::InvalidArgument(
          "ucx: ReplacePeer(" + std::to_string(peer) + "): a " +
          (op.kind == Kind::kEagerSend || op.kind == Kind::kPutSend ? "send to" : "receive from") +
          " rank " + std::to_string(peer) + " (tag " + std::to_string(op.tag) +
          ") is still in flight: complete or cancel it first");
    }
  }
  // From here on an error of the old endpoint is ignored.
  endpoints_.Forget(peer);
  // The zombies first (their puts use the remote keys), then the keys (UCX: before the endpoint
  // they were unpacked on), then the endpoint, forced: the old process cannot confirm.
  for (uint32_t i : zombies) {
    ops_.Reap(ops_[i]);
    ops_.Release(i);
    std::erase(active_, i);
  }
  rkeys_.DropPeer(peer);
  endpoints_.Close(static_cast<size_t>(peer), /*force=*/true, DeadlineIn(std::chrono::seconds(2)));
  notes_.Sweep();  // notes to the old process, cancelled by the close
  ForgetPutState(peer);
  // What the old process sent that nobody took, in every space (eager messages, RTRs, REVOKEs,
  // FINs): let what is still on its way land, then drop it all, so that no receive meant for the
  // new process takes it.
  worker_.ProgressUntilIdle();
  worker_.DiscardUnexpected(SourceTag(peer), kSourceMask);
  endpoints_.set_address(peer, address);
  MOERUN_RETURN_IF_ERROR(endpoints_.Open(peer));
  spdlog::info("ucx: rank {} replaced (new endpoint)", peer);
  return Status::Ok();
}

Result<Request> UcxTransport::Isend(int peer, int tag, const void* buf, size_t bytes) {
  MOERUN_RETURN_IF_ERROR(endpoints_.Check(peer, "send"));
  const bool put = UsePut(peer, bytes);
  MOERUN_ASSIGN_OR_RETURN(const uint32_t index, ops_.New(put ? Kind::kPutSend : Kind::kEagerSend,
                                                         peer, tag, const_cast<void*>(buf), bytes));
  // On an error, the op is released.
  MOERUN_RETURN_IF_ERROR(put ? StartPutSend(index) : StartEagerSend(index));
  CountSent(peer, bytes);
  return Request{ops_.MakeId(index), peer};
}

Result<Request> UcxTransport::Irecv(int peer, int tag, void* buf, size_t bytes) {
  MOERUN_RETURN_IF_ERROR(endpoints_.Check(peer, "receive"));
  const bool put = UsePut(peer, bytes);
  MOERUN_ASSIGN_OR_RETURN(const uint32_t index,
                          ops_.New(put ? Kind::kPutRecv : Kind::kEagerRecv, peer, tag, buf, bytes));
  // On an error, the op is released.
  MOERUN_RETURN_IF_ERROR(put ? StartPutRecv(index) : StartEagerRecv(index));
  return Request{ops_.MakeId(index), peer};
}

void UcxTransport::Progress() {
  worker_.Progress();
  notes_.Sweep();
  for (size_t i = 0; i < active_.size();) {
    const uint32_t index = active_[i];
    Drive(index);
    Op& op = ops_[index];
    if (op.finished) {
      if (op.zombie) ops_.Release(index);
      active_[i] = active_.back();
      active_.pop_back();
    } else {
      ++i;
    }
  }
}

Result<bool> UcxTransport::Advance(uint32_t index) {
  Op& op = ops_[index];
  Result<bool> out = false;
  const ucs_status_t peer_status = endpoints_.failure(op.peer);
  switch (op.kind) {
    case Kind::kEagerSend:
      out = AdvanceEagerSend(op);
      break;
    case Kind::kEagerRecv:
      out = AdvanceEagerRecv(op);
      break;
    case Kind::kPutSend:
      out = AdvancePutSend(index, op);
      break;
    case Kind::kPutRecv:
      out = AdvancePutRecv(index, op);
      break;
  }
  if (out.ok() && !*out && peer_status != UCS_OK) {
    out = Status::Unavailable("ucx: rank " + std::to_string(op.peer) + " failed (" +
                              UcsError(peer_status) + ")");
  }
  return out;
}

void UcxTransport::Drive(uint32_t index) {
  Op& op = ops_[index];
  if (op.finished) return;
  Result<bool> out = Advance(index);
  if (out.ok() && !*out) return;
  op.finished = true;
  op.result = out.ok() ? Status::Ok() : out.status();
  ops_.Reap(op);
}

void UcxTransport::RemoveActive(uint32_t index) {
  for (size_t i = 0; i < active_.size(); ++i) {
    if (active_[i] == index) {
      active_[i] = active_.back();
      active_.pop_back();
      return;
    }
  }
}

Result<bool> UcxTransport::Test(Request r) {
  if (ops_.Find(r) == nullptr) return Status::InvalidArgument("ucx: unknown request");
  Progress();
  if (ops_.Find(r) == nullptr) return Status::InvalidArgument("ucx: unknown request");
  const uint32_t index = UcxOps::Index(r.id);
  Drive(index);
  Op& op = ops_[index];
  if (!op.finished) return false;
  if (op.kind == Kind::kPutSend) RemoveActive(index);
  const Status result = op.result;
  ops_.Release(index);
  if (!result.ok()) return result;
  return true;
}

Status UcxTransport::Cancel(Request r) {
  Op* op = ops_.Find(r);
  if (op == nullptr) return Status::Ok();
  const uint32_t index = UcxOps::Index(r.id);
  switch (op->kind) {
    case Kind::kEagerRecv:
    case Kind::kEagerSend:  // the send goes on in UCX; its buffer must stay valid
      ops_.Reap(*op);
      ops_.Release(index);
      return Status::Ok();
    case Kind::kPutSend:
      return CancelPutSend(index, *op);
    case Kind::kPutRecv:
      return CancelPutRecv(index, *op, r.id);
  }
  return Status::Ok();
}

void UcxTransport::Shutdown() {
  if (!worker_.open()) {
    worker_.Close();  // the context, if the worker was never made
    return;
  }
  for (uint32_t i = 0; i < ops_.size(); ++i) {
    if (ops_[i].step != Step::kFree) {
      ops_.Reap(ops_[i]);
      ops_.Release(i);
    }
  }
  notes_.Drain();
  // Notes nobody will read (RTRs of receives that were never matched, late REVOKEs): take them
  // off UCX's queue, so that it does not warn about them at the end.
  worker_.DiscardUnexpected(0, 0);
  rkeys_.DropAll();
  endpoints_.CloseAll(DeadlineIn(std::chrono::seconds(2)));
  worker_.DiscardUnexpected(0, 0);  // and those that landed while the endpoints closed
  regions_.UnmapAll();
  worker_.Close();
}

}  // namespace ucx

Result<std::unique_ptr<Transport>> CreateUcxTransport(std::unique_ptr<Transport> bootstrap,
                                                      UcxOptions options) {
  if (bootstrap == nullptr) return Status::InvalidArgument("ucx: no bootstrap transport");
  auto t = std::make_unique<ucx::UcxTransport>(std::move(bootstrap), options);
  MOERUN_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace moerun
