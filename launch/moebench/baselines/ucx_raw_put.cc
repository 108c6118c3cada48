#include "launch/moebench/baselines/ucx_raw_put.h"

#include <sched.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

namespace moerun {
namespace {

// Bootstrap tags (the ucx transport's own bootstrap uses kReservedTagBase + 200 and + 201).
constexpr int kTagAddresses = kReservedTagBase + 300;  // and 301
constexpr int kTagInfo = kReservedTagBase + 302;

constexpr uint32_t kMagic = 0x54555052;  // "RPUT"
constexpr size_t kMaxRkey = 1024;
constexpr size_t kAlign = 4096;
constexpr uint64_t kSignalSpace = uint64_t{0x52} << 56;
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
constexpr auto kRoundLimit = std::chrono::seconds(60);

enum Buf : int { kSend = 0, kRecv = 1 };
enum Phase : int { kDispatch = 0, kCombine = 1 };

// What each rank tells each peer once, at creation (host byte order: one job, one architecture).
struct PeerInfo {
  uint32_t magic = kMagic;
  uint32_t pad = 0;
  uint32_t rkey_len[2] = {0, 0};  // of my send buffer, of my receive buffer
  uint64_t base[2] = {0, 0};      // their addresses
  uint64_t recv_off = 0;          // where your dispatch bytes go in my receive buffer
  uint64_t recv_bytes = 0;        // how many dispatch bytes I expect from you
  uint64_t send_off = 0;          // where your combine bytes go in my send buffer
  uint64_t send_bytes = 0;        // how many dispatch bytes I send you (and get back)
  uint8_t rkey[2][kMaxRkey] = {};
};

ucp_tag_t SignalTag(int phase, int src) {
  return kSignalSpace | (static_cast<uint64_t>(phase) << 32) |
         (static_cast<uint64_t>(static_cast<uint32_t>(src)));
}

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

}  // namespace

struct RawPutBaseline::Impl {
  struct Peer {
    Impl* self = nullptr;
    int rank = 0;
    ucp_ep_h ep = nullptr;
    ucs_status_t failed = UCS_OK;
    ucp_rkey_h rkey[2] = {nullptr, nullptr};  // the peer's send buffer, receive buffer
    uint64_t remote[2] = {0, 0};  // where my bytes go there: combine (its send buffer), dispatch
    int64_t send = 0, recv = 0;   // dispatch bytes to and from the peer
    size_t send_off = 0, recv_off = 0;  // in my buffers
    // One round's state, per phase.
    void* flush_req[2] = {nullptr, nullptr};
    bool flushed[2] = {true, true};
    void* sig_send_req[2] = {nullptr, nullptr};
    void* sig_recv_req[2] = {nullptr, nullptr};
    bool awaiting[2] = {false, false};
    alignas(8) uint64_t sig_out[2] = {0, 0};
    alignas(8) uint64_t sig_in[2] = {0, 0};
  };

  Transport* boot = nullptr;
  int rank = 0, size = 0;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<Peer> peers;  // never resized after Init (the error handlers point into it)
  std::unique_ptr<char, FreeDeleter> buf[2];
  size_t len[2] = {0, 0};
  ucp_mem_h memh[2] = {nullptr, nullptr};
  uint64_t round = 0;

  ~Impl() { Shutdown(); }

  static void OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    if (p->failed == UCS_OK) p->failed = status;
  }

  Status Init(const std::vector<int64_t>& send_bytes, const std::vector<int64_t>& recv_bytes);
  Status MapBuffer(int which, size_t bytes);
  Status StartPhase(int phase);
  Status Wait(int phase, Deadline deadline);
  // Withdraws whatever a failed round left in flight.
  void Reap();
  void Shutdown();
};

Status RawPutBaseline::Impl::MapBuffer(int which, size_t bytes) {
  const size_t n = std::max<size_t>((bytes + kAlign - 1) / kAlign * kAlign, kAlign);
  buf[which].reset(static_cast<char*>(std::aligned_alloc(kAlign, n)));
  if (buf[which] == nullptr) {
    return Status::ResourceExhausted("raw ucx baseline: allocating " + std::to_string(n) +
                                     " bytes");
  }
  std::memset(buf[which].get(), which == kSend ? 1 : 0, n);  // touch every page
  len[which] = n;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = buf[which].get();
  mp.length = n;
  const ucs_status_t s = ucp_mem_map(context, &mp, &memh[which]);
  if (s != UCS_OK) {
    memh[which] = nullptr;
    return Status::Unavailable("raw ucx baseline: ucp_mem_map: " + UcsError(s));
  }
  return Status::Ok();
}

Status RawPutBaseline::Impl::Init(const std::vector<int64_t>& send_bytes,
                                  const std::vector<int64_t>& recv_bytes) {
  rank = boot->rank();
  size = boot->size();
  const auto n = static_cast<size_t>(size);
  if (send_bytes.size() != n || recv_bytes.size() != n) {
    return Status::InvalidArgument("raw ucx baseline: one entry per rank is needed");
  }
  if (send_bytes[static_cast<size_t>(rank)] != recv_bytes[static_cast<size_t>(rank)]) {
    return Status::InvalidArgument("raw ucx baseline: a rank's bytes to itself differ both ways");
  }
  // UCX 1.13's shared-memory transports need this in peer error mode (as the ucx transport).
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 0);

  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) {
    return Status::Unavailable("raw ucx baseline: reading UCX's configuration: " + UcsError(s));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  params.mt_workers_shared = 0;
  s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    context = nullptr;
    return Status::Unavailable("raw ucx baseline: ucp_init: " + UcsError(s));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(context, &wp, &worker);
  if (s != UCS_OK) {
    worker = nullptr;
    return Status::Unavailable("raw ucx baseline: ucp_worker_create: " + UcsError(s));
  }

  // Worker addresses over the bootstrap.
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(worker, &addr, &addr_len);
  if (s != UCS_OK) {
    return Status::Unavailable("raw ucx baseline: ucp_worker_get_address: " + UcsError(s));
  }
  std::vector<uint8_t> mine(reinterpret_cast<uint8_t*>(addr),
                            reinterpret_cast<uint8_t*>(addr) + addr_len);
  ucp_worker_release_address(worker, addr);
  const Deadline deadline = DeadlineIn(std::chrono::seconds(120));
  MOERUN_ASSIGN_OR_RETURN(const std::vector<std::vector<uint8_t>> addrs,
                          AllGatherBytes(*boot, mine, kTagAddresses, size_t{1} << 20, deadline,
                                         "raw ucx baseline (worker addresses)"));

  // Per-peer offsets in one send and one receive buffer (as MPI_Alltoallv's displacements).
  peers.resize(n);
  size_t stotal = 0, rtotal = 0;
  for (int p = 0; p < size; ++p) {
    const auto pi = static_cast<size_t>(p);
    if (send_bytes[pi] < 0 || recv_bytes[pi] < 0) {
      return Status::InvalidArgument("raw ucx baseline: negative byte counts");
    }
    Peer& peer = peers[pi];
    peer.self = this;
    peer.rank = p;
    peer.send = send_bytes[pi];
    peer.recv = recv_bytes[pi];
    peer.send_off = stotal;
    peer.recv_off = rtotal;
    stotal += static_cast<size_t>(send_bytes[pi]);
    rtotal += static_cast<size_t>(recv_bytes[pi]);
  }
  MOERUN_RETURN_IF_ERROR(MapBuffer(kSend, stotal));
  MOERUN_RETURN_IF_ERROR(MapBuffer(kRecv, rtotal));

  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    Peer& peer = peers[static_cast<size_t>(p)];
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addrs[static_cast<size_t>(p)].data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = OnEpError;
    ep.err_handler.arg = &peer;
    s = ucp_ep_create(worker, &ep, &peer.ep);
    if (s != UCS_OK) {
      peer.ep = nullptr;
      return Status::Unavailable("raw ucx baseline: connecting to rank " + std::to_string(p) +
                                 ": " + UcsError(s));
    }
  }

  // Buffer addresses, offsets and remote keys, once.
  std::vector<PeerInfo> out(n), in(n);
  for (int which : {kSend, kRecv}) {
    void* packed = nullptr;
    size_t plen = 0;
    s = ucp_rkey_pack(context, memh[which], &packed, &plen);
    if (s != UCS_OK) {
      return Status::Unavailable("raw ucx baseline: ucp_rkey_pack: " + UcsError(s));
    }
    if (plen > kMaxRkey) {
      ucp_rkey_buffer_release(packed);
      return Status::Unavailable("raw ucx baseline: a remote key of " + std::to_string(plen) +
                                 " bytes (at most " + std::to_string(kMaxRkey) + " supported)");
    }
    for (PeerInfo& o : out) {
      o.rkey_len[which] = static_cast<uint32_t>(plen);
      o.base[which] = reinterpret_cast<uint64_t>(buf[which].get());
      std::memcpy(o.rkey[which], packed, plen);
    }
    ucp_rkey_buffer_release(packed);
  }
  {
    std::vector<Request> reqs;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const auto pi = static_cast<size_t>(p);
      out[pi].recv_off = peers[pi].recv_off;
      out[pi].recv_bytes = static_cast<uint64_t>(peers[pi].recv);
      out[pi].send_off = peers[pi].send_off;
      out[pi].send_bytes = static_cast<uint64_t>(peers[pi].send);
      MOERUN_ASSIGN_OR_RETURN(Request r, boot->Irecv(p, kTagInfo, &in[pi], sizeof(PeerInfo)));
      reqs.push_back(r);
      MOERUN_ASSIGN_OR_RETURN(Request q, boot->Isend(p, kTagInfo, &out[pi], sizeof(PeerInfo)));
      reqs.push_back(q);
    }
    MOERUN_RETURN_IF_ERROR(boot->WaitAll(reqs, deadline, "raw ucx baseline (remote keys)"));
  }
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const auto pi = static_cast<size_t>(p);
    const PeerInfo& info = in[pi];
    Peer& peer = peers[pi];
    if (info.magic != kMagic || info.rkey_len[kSend] > kMaxRkey ||
        info.rkey_len[kRecv] > kMaxRkey) {
      return Status::Corrupt("raw ucx baseline: a malformed note from rank " + std::to_string(p));
    }
    if (info.recv_bytes != static_cast<uint64_t>(peer.send) ||
        info.send_bytes != static_cast<uint64_t>(peer.recv)) {
      return Status::InvalidArgument("raw ucx baseline: rank " + std::to_string(p) + " expects " +
                                     std::to_string(info.recv_bytes) + " bytes from and sends " +
                                     std::to_string(info.send_bytes) + " bytes to rank " +
                                     std::to_string(rank) + ", which sends " +
                                     std::to_string(peer.send) + " and expects " +
                                     std::to_string(peer.recv));
    }
    for (int which : {kSend, kRecv}) {
      s = ucp_ep_rkey_unpack(peer.ep, info.rkey[which], &peer.rkey[which]);
      if (s != UCS_OK) {
        peer.rkey[which] = nullptr;
        return Status::Unavailable("raw ucx baseline: unpacking rank " + std::to_string(p) +
                                   "'s remote key: " + UcsError(s));
      }
    }
    peer.remote[kRecv] = info.base[kRecv] + info.recv_off;  // dispatch: its receive buffer
    peer.remote[kSend] = info.base[kSend] + info.send_off;  // combine: its send buffer
  }
  return boot->Barrier(deadline);
}

// Puts this rank's bytes of the phase to every peer and flushes each endpoint written.
Status RawPutBaseline::Impl::StartPhase(int phase) {
  // Dispatch: my send buffer into the peers' receive buffers; combine: the transpose.
  const int from = phase == kDispatch ? kSend : kRecv;
  const int to = phase == kDispatch ? kRecv : kSend;
  const Peer& me = peers[static_cast<size_t>(rank)];
  if (me.send > 0) {  // bytes to myself: a copy (none in `moebench transport`)
    char* s = buf[from].get() + (phase == kDispatch ? me.send_off : me.recv_off);
    char* d = buf[to].get() + (phase == kDispatch ? me.recv_off : me.send_off);
    std::memcpy(d, s, static_cast<size_t>(me.send));
  }
  for (Peer& peer : peers) {
    if (peer.rank == rank) continue;
    const int64_t bytes = phase == kDispatch ? peer.send : peer.recv;
    if (bytes == 0) continue;
    if (peer.failed != UCS_OK) {
      return Status::Unavailable("raw ucx baseline: rank " + std::to_string(peer.rank) +
                                 " failed (" + UcsError(peer.failed) + ")");
    }
    const char* src = buf[from].get() + (phase == kDispatch ? peer.send_off : peer.recv_off);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh[from];
    void* req = ucp_put_nbx(peer.ep, src, static_cast<size_t>(bytes), peer.remote[to],
                            peer.rkey[to], &param);
    if (UCS_PTR_IS_ERR(req)) {
      return Status::Unavailable("raw ucx baseline: put to rank " + std::to_string(peer.rank) +
                                 ": " + UcsError(UCS_PTR_STATUS(req)));
    }
    if (req != nullptr) ucp_request_free(req);  // the flush behind it reports its completion
    ucp_request_param_t fp{};
    void* flush = ucp_ep_flush_nbx(peer.ep, &fp);
    if (UCS_PTR_IS_ERR(flush)) {
      return Status::Unavailable("raw ucx baseline: flush to rank " + std::to_string(peer.rank) +
                                 ": " + UcsError(UCS_PTR_STATUS(flush)));
    }
    peer.flush_req[phase] = flush;
    peer.flushed[phase] = false;
  }
  return Status::Ok();
}

// Waits for the phase: each flushed endpoint gets its signal, each writer's signal arrives.
Status RawPutBaseline::Impl::Wait(int phase, Deadline deadline) {
  for (;;) {
    unsigned events = 0;
    for (int i = 0; i < 64; ++i) {
      const unsigned e = ucp_worker_progress(worker);
      if (e == 0) break;
      events += e;
    }
    bool pending = false;
    for (Peer& peer : peers) {
      if (!peer.flushed[phase]) {
        void*& fr = peer.flush_req[phase];
        if (fr != nullptr) {
          const ucs_status_t st = ucp_request_check_status(fr);
          if (st == UCS_INPROGRESS) {
            pending = true;
          } else {
            ucp_request_free(fr);
            fr = nullptr;
            if (st != UCS_OK) {
              return Status::Unavailable("raw ucx baseline: put to rank " +
                                         std::to_string(peer.rank) + ": " + UcsError(st));
            }
          }
        }
        if (fr == nullptr) {
          // Remotely complete: tell the peer its bytes are there.
          peer.flushed[phase] = true;
          peer.sig_out[phase] = round;
          ucp_request_param_t sp{};
          void* sr = ucp_tag_send_nbx(peer.ep, &peer.sig_out[phase], sizeof(uint64_t),
                                      SignalTag(phase, rank), &sp);
          if (UCS_PTR_IS_ERR(sr)) {
            return Status::Unavailable("raw ucx baseline: signal to rank " +
                                       std::to_string(peer.rank) + ": " +
                                       UcsError(UCS_PTR_STATUS(sr)));
          }
          peer.sig_send_req[phase] = sr;
        }
      }
      if (peer.awaiting[phase]) {
        void*& rr = peer.sig_recv_req[phase];
        if (rr != nullptr) {
          const ucs_status_t st = ucp_request_check_status(rr);
          if (st == UCS_INPROGRESS) {
            if (peer.failed != UCS_OK) {
              return Status::Unavailable("raw ucx baseline: rank " + std::to_string(peer.rank) +
                                         " failed (" + UcsError(peer.failed) + ")");
            }
            pending = true;
            continue;
          }
          ucp_request_free(rr);
          rr = nullptr;
          if (st != UCS_OK) {
            return Status::Unavailable("raw ucx baseline: signal from rank " +
                                       std::to_string(peer.rank) + ": " + UcsError(st));
          }
        }
        if (peer.sig_in[phase] != round) {
          return Status::Corrupt("raw ucx baseline: rank " + std::to_string(peer.rank) +
                                 " signalled round " + std::to_string(peer.sig_in[phase]) +
                                 " in round " + std::to_string(round));
        }
        peer.awaiting[phase] = false;
      }
    }
    if (!pending) return Status::Ok();
    if (SteadyClock::now() >= deadline) {
      for (const Peer& peer : peers) {
        if (!peer.flushed[phase] || peer.awaiting[phase]) {
          return Status::DeadlineExceeded(
              std::string("raw ucx baseline: ") + (phase == kDispatch ? "dispatch" : "combine") +
              ": rank " + std::to_string(peer.rank) + " did not answer before the deadline");
        }
      }
    }
    // A pass that found nothing to do gives the CPU away: with more ranks than cores (and
    // UCX's shared-memory and TCP puts, which the target's progress completes) spinning only
    // delays the peer this rank waits for (4 ranks on 2 cores: 48 ms instead of 2.5 ms).
    if (events == 0) sched_yield();
  }
}

void RawPutBaseline::Impl::Reap() {
  for (Peer& peer : peers) {
    for (int phase : {kDispatch, kCombine}) {
      if (peer.sig_recv_req[phase] != nullptr) {
        ucp_request_cancel(worker, peer.sig_recv_req[phase]);
        ucp_request_free(peer.sig_recv_req[phase]);
        peer.sig_recv_req[phase] = nullptr;
      }
      if (peer.flush_req[phase] != nullptr) {
        ucp_request_free(peer.flush_req[phase]);
        peer.flush_req[phase] = nullptr;
      }
      if (peer.sig_send_req[phase] != nullptr) {
        ucp_request_free(peer.sig_send_req[phase]);
        peer.sig_send_req[phase] = nullptr;
      }
      peer.flushed[phase] = true;
      peer.awaiting[phase] = false;
    }
  }
}

void RawPutBaseline::Impl::Shutdown() {
  if (worker != nullptr) {
    Reap();
    for (Peer& peer : peers) {
      for (ucp_rkey_h& k : peer.rkey) {
        if (k != nullptr) ucp_rkey_destroy(k), k = nullptr;
      }
    }
    std::vector<void*> closing;
    for (Peer& peer : peers) {
      if (peer.ep == nullptr) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = peer.failed != UCS_OK ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* req = ucp_ep_close_nbx(peer.ep, &param);
      if (UCS_PTR_IS_PTR(req)) closing.push_back(req);
      peer.ep = nullptr;
    }
    const Deadline deadline = DeadlineIn(std::chrono::seconds(2));
    for (void* req : closing) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS && SteadyClock::now() < deadline) {
        ucp_worker_progress(worker);
      }
      ucp_request_free(req);
    }
    for (ucp_mem_h& m : memh) {
      if (m != nullptr) ucp_mem_unmap(context, m), m = nullptr;
    }
    ucp_worker_destroy(worker);
    worker = nullptr;
  }
  if (context != nullptr) {
    for (ucp_mem_h& m : memh) {
      if (m != nullptr) ucp_mem_unmap(context, m), m = nullptr;
    }
    ucp_cleanup(context);
    context = nullptr;
  }
}

RawPutBaseline::RawPutBaseline(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RawPutBaseline::~RawPutBaseline() = default;

Result<std::unique_ptr<RawPutBaseline>> RawPutBaseline::Create(
    Transport* bootstrap, const std::vector<int64_t>& send_bytes,
    const std::vector<int64_t>& recv_bytes) {
  if (bootstrap == nullptr) {
    return Status::InvalidArgument("raw ucx baseline: no bootstrap transport");
  }
  auto impl = std::make_unique<Impl>();
  impl->boot = bootstrap;
  MOERUN_RETURN_IF_ERROR(impl->Init(send_bytes, recv_bytes));
  return std::unique_ptr<RawPutBaseline>(new RawPutBaseline(std::move(impl)));
}

Result<double> RawPutBaseline::RoundTripMs() {
  Impl& b = *impl_;
  const Deadline deadline = DeadlineIn(kRoundLimit);
  MOERUN_RETURN_IF_ERROR(b.boot->Barrier(deadline));
  const auto t0 = SteadyClock::now();
  ++b.round;
  // The signals of both phases from every peer that writes here.
  for (Impl::Peer& peer : b.peers) {
    if (peer.rank == b.rank) continue;
    for (int phase : {kDispatch, kCombine}) {
      // Dispatch: peers that send to me write here; combine: those I sent to write back.
      if ((phase == kDispatch ? peer.recv : peer.send) == 0) continue;
      ucp_request_param_t rp{};
      void* rr = ucp_tag_recv_nbx(b.worker, &peer.sig_in[phase], sizeof(uint64_t),
                                  SignalTag(phase, peer.rank), kFullMask, &rp);
      if (UCS_PTR_IS_ERR(rr)) {
        b.Reap();
        return Status::Unavailable("raw ucx baseline: receive from rank " +
                                   std::to_string(peer.rank) + ": " + UcsError(UCS_PTR_STATUS(rr)));
      }
      peer.sig_recv_req[phase] = rr;
      peer.awaiting[phase] = true;
    }
  }
  for (int phase : {kDispatch, kCombine}) {
    Status s = b.StartPhase(phase);
    if (s.ok()) s = b.Wait(phase, deadline);
    if (!s.ok()) {
      b.Reap();
      return s;
    }
  }
  const double ms = std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count();
  // The signals' own sends (eager: done by now, or nearly).
  for (Impl::Peer& peer : b.peers) {
    for (void*& sr : peer.sig_send_req) {
      if (sr == nullptr) continue;
      while (ucp_request_check_status(sr) == UCS_INPROGRESS) {
        if (SteadyClock::now() >= deadline) {
          b.Reap();
          return Status::DeadlineExceeded("raw ucx baseline: a signal to rank " +
                                          std::to_string(peer.rank) + " did not leave");
        }
        ucp_worker_progress(b.worker);
      }
      const ucs_status_t st = ucp_request_check_status(sr);
      ucp_request_free(sr);
      sr = nullptr;
      if (st != UCS_OK) {
        b.Reap();
        return Status::Unavailable("raw ucx baseline: signal to rank " + std::to_string(peer.rank) +
                                   ": " + UcsError(st));
      }
    }
  }
  // Untimed: everything this rank sent has left (a signal queued in UCX leaves only while this
  // rank progresses its worker, which it does not while the caller waits in another transport).
  ucp_request_param_t fp{};
  void* flush = ucp_worker_flush_nbx(b.worker, &fp);
  if (UCS_PTR_IS_ERR(flush)) {
    return Status::Unavailable("raw ucx baseline: ucp_worker_flush_nbx: " +
                               UcsError(UCS_PTR_STATUS(flush)));
  }
  if (flush != nullptr) {
    while (ucp_request_check_status(flush) == UCS_INPROGRESS && SteadyClock::now() < deadline) {
      ucp_worker_progress(b.worker);
    }
    const ucs_status_t st = ucp_request_check_status(flush);
    ucp_request_free(flush);
    if (st != UCS_OK) {
      return st == UCS_INPROGRESS
                 ? Status::DeadlineExceeded("raw ucx baseline: the worker flush did not finish")
                 : Status::Unavailable("raw ucx baseline: ucp_worker_flush_nbx: " + UcsError(st));
    }
  }
  return ms;
}

}  // namespace moerun
