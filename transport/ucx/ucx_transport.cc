#include "transport/ucx/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/log.h"

namespace moerun {
namespace {

// Wire format of the control notes (host byte order: one job runs on one architecture).
constexpr uint32_t kNoteMagic = 0x52584355;  // "UCXR"
constexpr size_t kMaxRkey = 512;

enum Space : uint64_t { kData = 1, kRtr = 2, kRevoke = 3, kFin = 4 };
enum FinCode : uint32_t { kFinOk = 0, kFinSizeMismatch = 1, kFinRevoked = 2 };
constexpr uint32_t kRtrTemporary = 1;  // the region is registered for this message only

struct RtrMsg {
  uint32_t magic = kNoteMagic;
  uint32_t rkey_len = 0;
  uint64_t id = 0;  // the receiver's request id
  uint64_t bytes = 0;
  uint64_t addr = 0;
  uint64_t region = 0;  // the receiver's region uid (the sender caches its unpacked key)
  uint32_t flags = 0;
  uint32_t pad = 0;
  uint8_t rkey[kMaxRkey] = {};
};
constexpr size_t kRtrHeader = offsetof(RtrMsg, rkey);
struct RevokeMsg {
  uint32_t magic = kNoteMagic;
  uint32_t pad = 0;
  uint64_t id = 0;
};
struct FinMsg {
  uint32_t magic = kNoteMagic;
  uint32_t code = kFinOk;
  uint64_t id = 0;
  uint64_t bytes = 0;  // the sender's size
};

ucp_tag_t MakeTag(Space s, int src, int tag) {
  return (static_cast<uint64_t>(s) << 56) |
         (static_cast<uint64_t>(static_cast<uint32_t>(src) & 0xffffffu) << 32) |
         static_cast<uint32_t>(tag);
}
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// Every message from `src`, whatever its space and tag (MakeTag's source bits only).
constexpr ucp_tag_t kSourceMask = ucp_tag_t{0xffffff} << 32;
ucp_tag_t SourceTag(int src) {
  return static_cast<uint64_t>(static_cast<uint32_t>(src) & 0xffffffu) << 32;
}

// A FIN is addressed to one receive (by its slot in the receiver's request table), not to the
// (peer, tag) channel: sends of one channel may finish out of order.
int FinTag(uint64_t receive_id) { return static_cast<int>((receive_id & 0x7fffffffu)); }

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

// Whether a context's UCX handles CUDA memory (ucp_context_query's memory types).
Result<bool> ContextSupportsCuda(ucp_context_h context) {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t s = ucp_context_query(context, &attr);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_context_query: " + UcsError(s));
  return (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

// Where a receive's completion callback leaves its result (UCX reports a receive's length only
// to the callback, or in the parameters when it completes at once).
struct RecvState {
  void* req = nullptr;
  bool fired = false;
  ucs_status_t status = UCS_OK;
  size_t length = 0;
};

// RecvState::req while ucp_tag_recv_nbx runs (it may call the callback before it returns).
void* const kPosting = reinterpret_cast<void*>(uintptr_t{1});

void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
  auto* rs = static_cast<RecvState*>(user);
  if (rs->req != request && rs->req != kPosting) return;  // a request reaped earlier
  rs->fired = true;
  rs->status = status;
  rs->length = info != nullptr ? info->length : 0;
}

enum class Kind : uint8_t { kEagerSend, kEagerRecv, kPutSend, kPutRecv };
enum class Step : uint8_t { kFree, kEager, kWaitRtr, kPutting, kFinSend, kWaitFin };

struct Op {
  uint32_t generation = 0;
  Step step = Step::kFree;
  bool zombie = false;  // cancelled by the user, finishing its protocol
  bool finished = false;
  Status result;
  Kind kind = Kind::kEagerSend;
  int peer = 0;
  int tag = 0;
  void* buf = nullptr;
  size_t bytes = 0;
  void* data_req = nullptr;   // eager send/recv, or the put
  void* flush_req = nullptr;  // put send: the endpoint flush after the put
  void* ctl_req = nullptr;    // put send: the RTR receive; put receive: the FIN receive
  ucp_tag_recv_info_t info{};
  RecvState data_rs, ctl_rs;
  bool data_done = false, flush_done = false, ctl_done = false;
  ucs_status_t data_status = UCS_OK, flush_status = UCS_OK, ctl_status = UCS_OK;
  RtrMsg rtr;      // put send: the RTR received
  FinMsg fin;      // put receive: the FIN received
  FinMsg fin_out;  // put send: the FIN sent
  void* fin_req = nullptr;
  bool fin_done = false;
  ucs_status_t fin_status = UCS_OK;
  ucp_mem_h temp_memh = nullptr;
  ucp_rkey_h temp_rkey = nullptr;
};

// A small message in flight (RTR, REVOKE, FIN), kept until UCX is done with its bytes.
struct Note {
  void* req = nullptr;
  alignas(8) uint8_t bytes[sizeof(RtrMsg)];
};

struct Region {
  uintptr_t base = 0;
  size_t len = 0;
  ucp_mem_h memh = nullptr;
  uint64_t uid = 0;
  std::vector<uint8_t> packed;  // the remote key
};

class UcxTransport;
// An endpoint's error handler argument, one per endpoint ever made and kept to the end: an error
// of an endpoint that ReplacePeer closed may still arrive, and must not fail its successor.
struct EpContext {
  UcxTransport* self = nullptr;
  int peer = 0;
  uint32_t generation = 0;
};

class UcxTransport : public Transport {
 public:
  // Without a bootstrap (a joiner), the rank and size come with Connect.
  UcxTransport(std::unique_ptr<Transport> bootstrap, UcxOptions opts)
      : boot_(std::move(bootstrap)),
        opts_(opts),
        rank_(boot_ != nullptr ? boot_->rank() : -1),
        size_(boot_ != nullptr ? boot_->size() : 0) {}

  ~UcxTransport() override { Shutdown(); }

  // OpenWorker, the worker addresses exchanged over the bootstrap, Connect, a barrier.
  Status Init();
  // The context and the worker, and this process's worker address; no endpoints yet.
  Status OpenWorker();
  // Endpoints to every rank of `addrs` that has an address (addrs[rank] is replaced by this
  // process's own); the others are failed from the start.
  Status Connect(int rank, std::vector<std::vector<uint8_t>> addrs);
  const std::vector<uint8_t>& own_address() const { return own_address_; }

  const char* name() const override { return "ucx"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool can_withdraw_sends() const override { return false; }
  bool peer_failed(int peer) const override {
    return peer >= 0 && peer < size_ && failed_[static_cast<size_t>(peer)] != UCS_OK;
  }
  int idle_spins() const override { return 16; }
  std::vector<uint8_t> peer_address(int peer) const override {
    if (peer < 0 || peer >= size_) return {};
    return addresses_[static_cast<size_t>(peer)];
  }
  Status ReplacePeer(int peer, std::span<const uint8_t> address) override;

  Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) override;
  Result<Request> Irecv(int peer, int tag, void* buf, size_t bytes) override;
  Result<bool> Test(Request r) override;
  Status Cancel(Request r) override;
  Status RegisterMemory(void* p, size_t bytes) override;
  void UnregisterMemory(void* p) override;
  TransportCounters counters() const override {
    TransportCounters c;
    c.put_bytes = put_bytes_.load(std::memory_order_relaxed);
    c.eager_bytes = eager_bytes_.load(std::memory_order_relaxed);
    c.registrations = registrations_.load(std::memory_order_relaxed);
    c.on_demand_registrations = on_demand_.load(std::memory_order_relaxed);
    return c;
  }
  [[noreturn]] void Abort(int exit_code) override {
    if (boot_ != nullptr) boot_->Abort(exit_code);
    std::_Exit(exit_code);
  }

  void OnPeerError(const EpContext& ctx, ucs_status_t status) {
    const int peer = ctx.peer;
    if (peer < 0 || peer >= size_) return;
    const auto pi = static_cast<size_t>(peer);
    if (ctx.generation != ep_gen_[pi]) return;  // an endpoint ReplacePeer closed
    if (failed_[pi] == UCS_OK) {
      failed_[pi] = status;
      spdlog::warn("ucx: rank {} failed: {}", peer, UcsError(status));
    }
  }

 private:
  static uint32_t Index(uint64_t id) { return static_cast<uint32_t>((id & 0xffffffffu) - 1); }
  uint64_t MakeId(uint32_t index) const {
    return (static_cast<uint64_t>(ops_[index]->generation) << 32) | (index + 1u);
  }
  Op* Find(Request r) {
    const uint64_t index = (r.id & 0xffffffffu) - 1;
    if (r.id == 0 || index >= ops_.size()) return nullptr;
    Op* op = ops_[index].get();
    if (op->step == Step::kFree || op->zombie ||
        op->generation != static_cast<uint32_t>(r.id >> 32)) {
      return nullptr;
    }
    return op;
  }
  Result<uint32_t> NewOp(Kind kind, int peer, int tag, void* buf, size_t bytes);
  void Release(uint32_t index);
  Status CheckPeer(int peer, const char* what) const;
  // Rank 0 logs the transport's settings; so does a joiner, which has no rank 0 beside it.
  bool loud() const { return boot_ == nullptr || rank_ == 0; }
  // Creates eps_[peer] to addresses_[peer] (peer error mode; a new EpContext generation).
  Status OpenEndpoint(int peer);
  // Closes eps_[p] (forced: without the peer's confirmation), waiting for UCX until `deadline`.
  void CloseEndpoint(size_t p, bool force, Deadline deadline);
  // Takes every message matching (tag, mask) off UCX's unexpected queue and drops it.
  void DiscardUnexpected(ucp_tag_t tag, ucp_tag_t mask);

  void Progress();
  // Advances an op's protocol: true when it completed, an error when it failed, false while in
  // flight. Drive records the outcome in the op (finished, result) for Test to report.
  Result<bool> Advance(uint32_t index);
  void Drive(uint32_t index);
  Result<bool> AdvancePutSend(uint32_t index, Op& op);
  Status StartPut(Op& op);
  // Cancels and reaps the op's UCX requests (after a failure or a cancel).
  void Reap(Op& op);
  void ReapOne(void*& req, bool cancel);
  static bool Poll(void*& req, bool* done, ucs_status_t* status);
  // Posts a tag receive for the op's data (ctl false) or control note (ctl true).
  Status PostRecv(Op& op, bool ctl, void* buf, size_t len, ucp_tag_t tag);
  // True once that receive is done (status and op.info.length set).
  static bool PollRecv(Op& op, bool ctl);

  Status SendNote(int peer, Space space, int tag, const void* msg, size_t len);
  void SweepNotes();
  void DrainRevokes(int peer, int tag);
  bool TakeRevoke(int peer, uint64_t id);
  Result<ucp_rkey_h> RkeyFor(Op& op);
  const Region* FindRegion(const void* p, size_t bytes) const;
  Result<Region> MapRegion(void* p, size_t bytes);
  void Shutdown();

  std::unique_ptr<Transport> boot_;
  UcxOptions opts_;
  int rank_, size_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  std::vector<std::vector<uint8_t>> addresses_;  // every rank's worker address (own_address_ too)
  std::vector<uint8_t> own_address_;
  std::vector<uint32_t> ep_gen_;                    // per peer: the generation of eps_[peer]
  std::vector<std::unique_ptr<EpContext>> ep_ctx_;  // every endpoint's, closed ones' too
  std::vector<ucs_status_t> failed_;
  std::vector<std::unique_ptr<Op>> ops_;
  std::vector<uint32_t> free_;
  // Ops that must move without the user testing them: put sends (they answer RTRs) and
  // cancelled ops finishing their protocol (zombies, released when done).
  std::vector<uint32_t> active_;
  std::vector<std::unique_ptr<Note>> notes_;
  std::vector<uint32_t> free_notes_, busy_notes_;
  std::vector<Region> regions_;
  uint64_t next_uid_ = 1;
  std::vector<std::unordered_map<uint64_t, ucp_rkey_h>> rkeys_;  // per peer, by region uid
  std::vector<std::pair<int, uint64_t>> revoked_;                // (peer, receive id)
  struct Stashed {
    int peer, tag;
    RtrMsg rtr;
  };
  std::vector<Stashed> stash_;  // RTRs taken by sends that were then cancelled
  // Where discarded messages land: truncated to this size (a rendezvous message then completes
  // without its data), and alive as long as the worker, for a discard that completes late.
  alignas(8) uint8_t discard_[64] = {};
  std::atomic<uint64_t> put_bytes_{0}, eager_bytes_{0}, registrations_{0}, on_demand_{0};
};

void OnEpErrorThunk(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* ctx = static_cast<EpContext*>(arg);
  ctx->self->OnPeerError(*ctx, status);
}

// Whether UCX_TLS lets UCX use its shared-memory transports (where UCX_MM_ERROR_HANDLING
// matters; elsewhere UCX would warn that the variable is unused).
bool SharedMemoryMayBeUsed() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0' || *tls == '^') return true;
  const std::string list = std::string(",") + tls + ",";
  for (const char* name : {",sm,", ",shm,", ",mm,", ",posix,", ",sysv,", ",all,", ",xpmem,"}) {
    if (list.find(name) != std::string::npos) return true;
  }
  return false;
}

// Whether UCX_TLS names TCP and nothing else but self (then UCX has no hardware put).
bool TcpOnly() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr) return false;
  std::string list = tls;
  bool tcp = false;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, end - start);
    if (name == "tcp") {
      tcp = true;
    } else if (name != "self" && !name.empty()) {
      return false;
    }
    start = end + 1;
  }
  return tcp;
}

Status UcxTransport::Init() {
  MOERUN_RETURN_IF_ERROR(OpenWorker());
  // Exchange worker addresses over the bootstrap transport.
  const Deadline deadline = DeadlineIn(std::chrono::seconds(120));
  MOERUN_ASSIGN_OR_RETURN(
      std::vector<std::vector<uint8_t>> addrs,
      AllGatherBytes(*boot_, own_address_, kReservedTagBase + 200, size_t{1} << 20, deadline,
                     "ucx bootstrap (worker addresses)"));
  MOERUN_RETURN_IF_ERROR(Connect(rank_, std::move(addrs)));
  return boot_->Barrier(deadline);
}

Status UcxTransport::OpenWorker() {
  if (std::getenv("UCX_MM_ERROR_HANDLING") == nullptr && SharedMemoryMayBeUsed()) {
    ::setenv("UCX_MM_ERROR_HANDLING", "y", 0);
    if (loud()) {
      spdlog::info(
          "ucx: set UCX_MM_ERROR_HANDLING=y (UCX's shared-memory transports need it to report a "
          "dead peer; set it yourself to override)");
    }
  }
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    // UCX's default (20 s and more) would leave a killed peer undetected for far longer than a
    // request's deadline; a stopped (not dead) peer still passes keepalive checks.
    ::setenv("UCX_KEEPALIVE_INTERVAL", "1s", 0);
    if (loud()) {
      spdlog::info(
          "ucx: set UCX_KEEPALIVE_INTERVAL=1s, so that a dead peer is detected within "
          "about a second (set it yourself to override)");
    }
  }
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Status::Unavailable("ucx: reading UCX's configuration: " + UcsError(s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  params.mt_workers_shared = 0;
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_init: " + UcsError(s));
  if (loud()) {
    const Result<bool> cuda = ContextSupportsCuda(context_);
    if (cuda.ok()) {
      spdlog::info("{}", UcxCudaMemoryNote(*cuda));
    } else {
      spdlog::warn("{}", cuda.status().ToString());
    }
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_worker_create: " + UcsError(s));
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_worker_get_address: " + UcsError(s));
  own_address_.assign(reinterpret_cast<uint8_t*>(addr),
                      reinterpret_cast<uint8_t*>(addr) + addr_len);
  ucp_worker_release_address(worker_, addr);

  // Preallocated pools: no allocation on the hot path below these sizes.
  ops_.reserve(1024);
  for (uint32_t i = 0; i < 1024; ++i) ops_.push_back(std::make_unique<Op>());
  for (uint32_t i = 1024; i > 0; --i) free_.push_back(i - 1);
  active_.reserve(1024);
  for (uint32_t i = 0; i < 256; ++i) notes_.push_back(std::make_unique<Note>());
  for (uint32_t i = 256; i > 0; --i) free_notes_.push_back(i - 1);
  busy_notes_.reserve(256);
  revoked_.reserve(1024);
  stash_.reserve(64);
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
  } else if (loud()) {
    spdlog::info("ucx: messages of {} bytes and more go by put (MOERUN_UCX_PUT_MIN)",
                 opts_.put_min);
  }
  return Status::Ok();
}

Status UcxTransport::Connect(int rank, std::vector<std::vector<uint8_t>> addrs) {
  if (worker_ == nullptr) return Status::Internal("ucx: Connect before OpenWorker");
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
  addrs[static_cast<size_t>(rank)] = own_address_;
  addresses_ = std::move(addrs);
  const auto n = static_cast<size_t>(size_);
  failed_.assign(n, UCS_OK);
  eps_.assign(n, nullptr);
  ep_gen_.assign(n, 0);
  rkeys_.resize(n);
  for (auto& m : rkeys_) m.reserve(64);
  ep_ctx_.reserve(n);
  for (int p = 0; p < size_; ++p) {
    if (addresses_[static_cast<size_t>(p)].empty()) {
      // A rank the joiner was given no address for (dead, or not yet replaced itself).
      failed_[static_cast<size_t>(p)] = UCS_ERR_UNREACHABLE;
      spdlog::info("ucx: rank {} has no address: failed from the start", p);
      continue;
    }
    MOERUN_RETURN_IF_ERROR(OpenEndpoint(p));
  }
  if (loud()) {
    const char* tls = std::getenv("UCX_TLS");
    spdlog::info("ucx: UCX {} with {} ranks{}, UCX_TLS={}", ucp_get_version_string(), size_,
                 boot_ == nullptr ? " (joined as rank " + std::to_string(rank_) + ")" : "",
                 tls ? tls : "(UCX's default)");
  }
  return Status::Ok();
}

Status UcxTransport::OpenEndpoint(int peer) {
  const auto pi = static_cast<size_t>(peer);
  ep_ctx_.push_back(std::make_unique<EpContext>(EpContext{this, peer, ++ep_gen_[pi]}));
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(addresses_[pi].data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = OnEpErrorThunk;
  ep.err_handler.arg = ep_ctx_.back().get();
  const ucs_status_t s = ucp_ep_create(worker_, &ep, &eps_[pi]);
  if (s != UCS_OK) {
    eps_[pi] = nullptr;
    failed_[pi] = s;
    return Status::Unavailable("ucx: connecting to rank " + std::to_string(peer) + ": " +
                               UcsError(s));
  }
  failed_[pi] = UCS_OK;
  return Status::Ok();
}

void UcxTransport::CloseEndpoint(size_t p, bool force, Deadline deadline) {
  ucp_ep_h ep = eps_[p];
  if (ep == nullptr) return;
  eps_[p] = nullptr;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = ucp_ep_close_nbx(ep, &param);
  if (UCS_PTR_IS_PTR(req)) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS && SteadyClock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(req);
  }
}

void UcxTransport::DiscardUnexpected(ucp_tag_t tag, ucp_tag_t mask) {
  for (int i = 0; i < 100000; ++i) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, tag, mask, 1, &info);
    if (msg == nullptr) break;
    ucp_request_param_t param{};
    void* req = ucp_tag_msg_recv_nbx(worker_, discard_, std::min(info.length, sizeof discard_), msg,
                                     &param);
    if (UCS_PTR_IS_PTR(req)) {
      for (int k = 0; k < 100000 && ucp_request_check_status(req) == UCS_INPROGRESS; ++k) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(req);
    }
  }
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
  const auto pi = static_cast<size_t>(peer);
  // The caller's requests of that rank must be done; cancelled ones still finishing their
  // protocol (zombies) never will against a dead process: they are reaped here.
  std::vector<uint32_t> zombies;
  for (uint32_t i = 0; i < ops_.size(); ++i) {
    const Op& op = *ops_[i];
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
  ++ep_gen_[pi];
  // The zombies first (their puts use the remote keys), then the keys (UCX: before the endpoint
  // they were unpacked on), then the endpoint, forced: the old process cannot confirm.
  for (uint32_t i : zombies) {
    Reap(*ops_[i]);
    Release(i);
    std::erase(active_, i);
  }
  for (auto& [uid, rkey] : rkeys_[pi]) ucp_rkey_destroy(rkey);
  rkeys_[pi].clear();
  CloseEndpoint(pi, /*force=*/true, DeadlineIn(std::chrono::seconds(2)));
  SweepNotes();  // notes to the old process, cancelled by the close
  std::erase_if(stash_, [&](const Stashed& st) { return st.peer == peer; });
  std::erase_if(revoked_, [&](const std::pair<int, uint64_t>& rv) { return rv.first == peer; });
  // What the old process sent that nobody took, in every space (eager messages, RTRs, REVOKEs,
  // FINs): let what is still on its way land, then drop it all, so that no receive meant for the
  // new process takes it.
  for (int i = 0, idle = 0; i < 100000 && idle < 64; ++i) {
    idle = ucp_worker_progress(worker_) != 0 ? 0 : idle + 1;
  }
  DiscardUnexpected(SourceTag(peer), kSourceMask);
  addresses_[pi].assign(address.begin(), address.end());
  MOERUN_RETURN_IF_ERROR(OpenEndpoint(peer));
  spdlog::info("ucx: rank {} replaced (new endpoint)", peer);
  return Status::Ok();
}

Status UcxTransport::CheckPeer(int peer, const char* what) const {
  if (peer < 0 || peer >= size_) {
    return Status::InvalidArgument(std::string("ucx: ") + what + ": no rank " +
                                   std::to_string(peer));
  }
  const ucs_status_t f = failed_[static_cast<size_t>(peer)];
  if (f != UCS_OK) {
    return Status::Unavailable("ucx: rank " + std::to_string(peer) + " failed (" + UcsError(f) +
                               ")");
  }
  return Status::Ok();
}

Result<uint32_t> UcxTransport::NewOp(Kind kind, int peer, int tag, void* buf, size_t bytes) {
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

void UcxTransport::Release(uint32_t index) {
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

bool UcxTransport::Poll(void*& req, bool* done, ucs_status_t* status) {
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

Status UcxTransport::PostRecv(Op& op, bool ctl, void* buf, size_t len, ucp_tag_t tag) {
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

bool UcxTransport::PollRecv(Op& op, bool ctl) {
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

void UcxTransport::ReapOne(void*& req, bool cancel) {
  if (req == nullptr) return;
  if (cancel) ucp_request_cancel(worker_, req);
  for (int i = 0; i < 1000 && ucp_request_check_status(req) == UCS_INPROGRESS; ++i) {
    ucp_worker_progress(worker_);
  }
  ucp_request_free(req);  // released by UCX once complete, if it is not yet
  req = nullptr;
}

void UcxTransport::Reap(Op& op) {
  // Receives can be cancelled; sends and puts complete (or fail) by themselves.
  ReapOne(op.data_req, op.kind == Kind::kEagerRecv);
  ReapOne(op.flush_req, false);
  ReapOne(op.fin_req, false);
  ReapOne(op.ctl_req, true);
}

void UcxTransport::Progress() {
  for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) {
  }
  SweepNotes();
  for (size_t i = 0; i < active_.size();) {
    const uint32_t index = active_[i];
    Drive(index);
    Op& op = *ops_[index];
    if (op.finished) {
      if (op.zombie) Release(index);
      active_[i] = active_.back();
      active_.pop_back();
    } else {
      ++i;
    }
  }
}

Status UcxTransport::SendNote(int peer, Space space, int tag, const void* msg, size_t len) {
  if (free_notes_.empty()) {
    SweepNotes();
    if (free_notes_.empty()) {
      const auto at = static_cast<uint32_t>(notes_.size());
      notes_.push_back(std::make_unique<Note>());
      free_notes_.push_back(at);
    }
  }
  const uint32_t i = free_notes_.back();
  Note& note = *notes_[i];
  std::memcpy(note.bytes, msg, len);
  ucp_request_param_t param{};
  void* req = ucp_tag_send_nbx(eps_[static_cast<size_t>(peer)], note.bytes, len,
                               MakeTag(space, rank_, tag), &param);
  if (UCS_PTR_IS_ERR(req)) {
    return Status::Unavailable("ucx: control message to rank " + std::to_string(peer) + ": " +
                               UcsError(UCS_PTR_STATUS(req)));
  }
  if (req == nullptr) return Status::Ok();  // sent already: the note is free again
  free_notes_.pop_back();
  note.req = req;
  busy_notes_.push_back(i);
  return Status::Ok();
}

void UcxTransport::SweepNotes() {
  for (size_t k = 0; k < busy_notes_.size();) {
    Note& note = *notes_[busy_notes_[k]];
    if (ucp_request_check_status(note.req) == UCS_INPROGRESS) {
      ++k;
      continue;
    }
    ucp_request_free(note.req);
    note.req = nullptr;
    free_notes_.push_back(busy_notes_[k]);
    busy_notes_[k] = busy_notes_.back();
    busy_notes_.pop_back();
  }
}

void UcxTransport::DrainRevokes(int peer, int tag) {
  for (;;) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg =
        ucp_tag_probe_nb(worker_, MakeTag(kRevoke, peer, tag), kFullMask, 1, &info);
    if (msg == nullptr) return;
    RevokeMsg rv;
    ucp_request_param_t param{};
    void* req = ucp_tag_msg_recv_nbx(worker_, &rv, sizeof rv, msg, &param);
    bool done = false;
    ucs_status_t st = UCS_OK;
    if (UCS_PTR_IS_ERR(req)) continue;
    while (!Poll(req, &done, &st)) ucp_worker_progress(worker_);
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

const Region* UcxTransport::FindRegion(const void* p, size_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const Region& r : regions_) {
    if (a >= r.base && a + bytes <= r.base + r.len) return &r;
  }
  return nullptr;
}

Result<Region> UcxTransport::MapRegion(void* p, size_t bytes) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = p;
  mp.length = bytes;
  Region r;
  ucs_status_t s = ucp_mem_map(context_, &mp, &r.memh);
  if (s != UCS_OK) {
    return Status::Unavailable("ucx: registering " + std::to_string(bytes) +
                               " bytes: " + UcsError(s));
  }
  void* packed = nullptr;
  size_t len = 0;
  s = ucp_rkey_pack(context_, r.memh, &packed, &len);
  if (s != UCS_OK || len > kMaxRkey) {
    if (s == UCS_OK) ucp_rkey_buffer_release(packed);
    ucp_mem_unmap(context_, r.memh);
    return Status::Unavailable(s != UCS_OK ? "ucx: packing a remote key: " + UcsError(s)
                                           : "ucx: a remote key of " + std::to_string(len) +
                                                 " bytes (at most " + std::to_string(kMaxRkey) +
                                                 " supported)");
  }
  r.packed.assign(static_cast<uint8_t*>(packed), static_cast<uint8_t*>(packed) + len);
  ucp_rkey_buffer_release(packed);
  r.base = reinterpret_cast<uintptr_t>(p);
  r.len = bytes;
  r.uid = next_uid_++;
  registrations_.fetch_add(1, std::memory_order_relaxed);
  return r;
}

Status UcxTransport::RegisterMemory(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0 || FindRegion(p, bytes) != nullptr) return Status::Ok();
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (size_t i = 0; i < regions_.size();) {  // overlapped registrations are stale
    const Region& r = regions_[i];
    if (r.base < a + bytes && a < r.base + r.len) {
      ucp_mem_unmap(context_, r.memh);
      regions_.erase(regions_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  MOERUN_ASSIGN_OR_RETURN(Region r, MapRegion(p, bytes));
  regions_.push_back(std::move(r));
  return Status::Ok();
}

void UcxTransport::UnregisterMemory(void* p) {
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (regions_[i].base == reinterpret_cast<uintptr_t>(p)) {
      ucp_mem_unmap(context_, regions_[i].memh);
      regions_.erase(regions_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
}

Result<Request> UcxTransport::Isend(int peer, int tag, const void* buf, size_t bytes) {
  MOERUN_RETURN_IF_ERROR(CheckPeer(peer, "send"));
  const bool put = bytes >= opts_.put_min;
  MOERUN_ASSIGN_OR_RETURN(const uint32_t index, NewOp(put ? Kind::kPutSend : Kind::kEagerSend, peer,
                                                      tag, const_cast<void*>(buf), bytes));
  Op& op = *ops_[index];
  const auto pi = static_cast<size_t>(peer);
  if (!put) {
    ucp_request_param_t param{};
    void* req = ucp_tag_send_nbx(eps_[pi], buf, bytes, MakeTag(kData, rank_, tag), &param);
    if (UCS_PTR_IS_ERR(req)) {
      Release(index);
      return Status::Unavailable("ucx: send to rank " + std::to_string(peer) + ": " +
                                 UcsError(UCS_PTR_STATUS(req)));
    }
    op.data_req = req;
    eager_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  } else {
    op.step = Step::kWaitRtr;
    // An RTR a cancelled send took comes first; else wait for the channel's next one.
    bool stashed = false;
    for (size_t i = 0; i < stash_.size(); ++i) {
      if (stash_[i].peer == peer && stash_[i].tag == tag) {
        op.rtr = stash_[i].rtr;
        stash_.erase(stash_.begin() + static_cast<std::ptrdiff_t>(i));
        op.ctl_done = true;
        op.info.length = kRtrHeader + op.rtr.rkey_len;
        stashed = true;
        break;
      }
    }
    if (!stashed) {
      if (Status st = PostRecv(op, true, &op.rtr, sizeof op.rtr, MakeTag(kRtr, peer, tag));
          !st.ok()) {
        Release(index);
        return st;
      }
    }
  }
  if (put) active_.push_back(index);
  CountSent(peer, bytes);
  return Request{MakeId(index), peer};
}

Result<Request> UcxTransport::Irecv(int peer, int tag, void* buf, size_t bytes) {
  MOERUN_RETURN_IF_ERROR(CheckPeer(peer, "receive"));
  const bool put = bytes >= opts_.put_min;
  MOERUN_ASSIGN_OR_RETURN(const uint32_t index,
                          NewOp(put ? Kind::kPutRecv : Kind::kEagerRecv, peer, tag, buf, bytes));
  Op& op = *ops_[index];
  if (!put) {
    if (Status st = PostRecv(op, false, buf, bytes, MakeTag(kData, peer, tag)); !st.ok()) {
      Release(index);
      return st;
    }
    return Request{MakeId(index), peer};
  }
  // The FIN receive first, then the RTR that lets the sender write.
  const uint64_t id = MakeId(index);
  RtrMsg rtr;
  rtr.id = id;
  rtr.bytes = bytes;
  rtr.addr = reinterpret_cast<uint64_t>(buf);
  if (const Region* r = FindRegion(buf, bytes)) {
    rtr.region = r->uid;
    rtr.rkey_len = static_cast<uint32_t>(r->packed.size());
    std::memcpy(rtr.rkey, r->packed.data(), r->packed.size());
  } else {
    Result<Region> temp = MapRegion(buf, bytes);
    if (!temp.ok()) {
      Release(index);
      return temp.status();
    }
    on_demand_.fetch_add(1, std::memory_order_relaxed);
    op.temp_memh = temp->memh;
    rtr.region = temp->uid;
    rtr.flags = kRtrTemporary;
    rtr.rkey_len = static_cast<uint32_t>(temp->packed.size());
    std::memcpy(rtr.rkey, temp->packed.data(), temp->packed.size());
  }
  if (Status st = PostRecv(op, true, &op.fin, sizeof op.fin, MakeTag(kFin, peer, FinTag(id)));
      !st.ok()) {
    Release(index);
    return st;
  }
  op.step = Step::kWaitFin;
  if (Status s = SendNote(peer, kRtr, tag, &rtr, kRtrHeader + rtr.rkey_len); !s.ok()) {
    Reap(op);
    Release(index);
    return s;
  }
  return Request{id, peer};
}

Result<ucp_rkey_h> UcxTransport::RkeyFor(Op& op) {
  const auto pi = static_cast<size_t>(op.peer);
  const bool temporary = (op.rtr.flags & kRtrTemporary) != 0;
  if (!temporary) {
    auto it = rkeys_[pi].find(op.rtr.region);
    if (it != rkeys_[pi].end()) return it->second;
  }
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t s = ucp_ep_rkey_unpack(eps_[pi], op.rtr.rkey, &rkey);
  if (s != UCS_OK) {
    return Status::Unavailable("ucx: unpacking rank " + std::to_string(op.peer) +
                               "'s remote key: " + UcsError(s));
  }
  if (temporary) {
    op.temp_rkey = rkey;
  } else {
    rkeys_[pi].emplace(op.rtr.region, rkey);
  }
  return rkey;
}

Status UcxTransport::StartPut(Op& op) {
  MOERUN_ASSIGN_OR_RETURN(ucp_rkey_h rkey, RkeyFor(op));
  const auto pi = static_cast<size_t>(op.peer);
  // The source buffer's memory handle is not passed (UCP_OP_ATTR_FIELD_MEMH): UCX 1.13 crashed
  // (SIGSEGV in ucp_request_memory_dereg, from ucp_ep_set_failed purging the pending puts of a
  // shared-memory endpoint) when a peer died with such puts queued. UCX registers the source
  // itself (its registration cache makes that one lookup per put after the first).
  ucp_request_param_t param{};
  void* req = ucp_put_nbx(eps_[pi], op.buf, op.bytes, op.rtr.addr, rkey, &param);
  if (UCS_PTR_IS_ERR(req)) {
    return Status::Unavailable("ucx: put to rank " + std::to_string(op.peer) + ": " +
                               UcsError(UCS_PTR_STATUS(req)));
  }
  op.data_req = req;
  op.data_done = req == nullptr;
  ucp_request_param_t fp{};
  void* flush = ucp_ep_flush_nbx(eps_[pi], &fp);
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
    if (!PollRecv(op, true)) return false;
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
          PostRecv(op, true, &op.rtr, sizeof op.rtr, MakeTag(kRtr, op.peer, op.tag)));
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
    if (!Poll(op.fin_req, &op.fin_done, &op.fin_status)) return false;
    if (op.fin_status != UCS_OK) {
      return Status::Unavailable("ucx: completion note to rank " + std::to_string(op.peer) + ": " +
                                 UcsError(op.fin_status));
    }
    return true;
  }
  // Step::kPutting: the put and the flush behind it, then the FIN.
  if (!Poll(op.data_req, &op.data_done, &op.data_status)) return false;
  if (!Poll(op.flush_req, &op.flush_done, &op.flush_status)) return false;
  if (op.data_status != UCS_OK || op.flush_status != UCS_OK) {
    return Status::Unavailable(
        "ucx: put to rank " + std::to_string(op.peer) + ": " +
        UcsError(op.data_status != UCS_OK ? op.data_status : op.flush_status));
  }
  op.fin_out = FinMsg{};
  op.fin_out.id = op.rtr.id;
  op.fin_out.bytes = op.bytes;
  ucp_request_param_t param{};
  void* req = ucp_tag_send_nbx(eps_[static_cast<size_t>(op.peer)], &op.fin_out, sizeof op.fin_out,
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

Result<bool> UcxTransport::Advance(uint32_t index) {
  Op& op = *ops_[index];
  Result<bool> out = false;
  const ucs_status_t peer_status = failed_[static_cast<size_t>(op.peer)];
  switch (op.kind) {
    case Kind::kEagerSend:
      if (Poll(op.data_req, &op.data_done, &op.data_status)) {
        out =
            op.data_status == UCS_OK
                ? Result<bool>(true)
                : Result<bool>(Status::Unavailable("ucx: send to rank " + std::to_string(op.peer) +
                                                   ": " + UcsError(op.data_status)));
      }
      break;
    case Kind::kEagerRecv:
      if (PollRecv(op, false)) {
        if (op.data_status == UCS_ERR_MESSAGE_TRUNCATED) {
          out = Status::InvalidArgument("a message longer than the " + std::to_string(op.bytes) +
                                        " bytes expected");
        } else if (op.data_status != UCS_OK) {
          out = Status::Unavailable("ucx: receive from rank " + std::to_string(op.peer) + ": " +
                                    UcsError(op.data_status));
        } else if (op.info.length != op.bytes) {
          out = Status::InvalidArgument("message of " + std::to_string(op.info.length) +
                                        " bytes where " + std::to_string(op.bytes) +
                                        " were expected");
        } else {
          out = true;
        }
      }
      break;
    case Kind::kPutSend:
      out = AdvancePutSend(index, op);
      break;
    case Kind::kPutRecv:
      if (PollRecv(op, true)) {
        if (op.ctl_status != UCS_OK) {
          out = Status::Unavailable("ucx: receive from rank " + std::to_string(op.peer) + ": " +
                                    UcsError(op.ctl_status));
        } else if (op.info.length != sizeof(FinMsg) || op.fin.magic != kNoteMagic ||
                   op.fin.id != MakeId(index)) {
          out = Status::Corrupt("ucx: a malformed completion note from rank " +
                                std::to_string(op.peer));
        } else if (op.fin.code == kFinSizeMismatch) {
          out = Status::InvalidArgument("message of " + std::to_string(op.fin.bytes) +
                                        " bytes where " + std::to_string(op.bytes) +
                                        " were expected");
        } else if (op.fin.code == kFinRevoked && !op.zombie) {
          out = Status::Internal("ucx: rank " + std::to_string(op.peer) +
                                 " answered a receive that was not cancelled as cancelled");
        } else {
          out = true;
        }
      }
      break;
  }
  if (out.ok() && !*out && peer_status != UCS_OK) {
    out = Status::Unavailable("ucx: rank " + std::to_string(op.peer) + " failed (" +
                              UcsError(peer_status) + ")");
  }
  return out;
}

void UcxTransport::Drive(uint32_t index) {
  Op& op = *ops_[index];
  if (op.finished) return;
  Result<bool> out = Advance(index);
  if (out.ok() && !*out) return;
  op.finished = true;
  op.result = out.ok() ? Status::Ok() : out.status();
  Reap(op);
}

Result<bool> UcxTransport::Test(Request r) {
  if (Find(r) == nullptr) return Status::InvalidArgument("ucx: unknown request");
  Progress();
  if (Find(r) == nullptr) return Status::InvalidArgument("ucx: unknown request");
  const uint32_t index = Index(r.id);
  Drive(index);
  Op& op = *ops_[index];
  if (!op.finished) return false;
  if (op.kind == Kind::kPutSend) {
    for (size_t i = 0; i < active_.size(); ++i) {
      if (active_[i] == index) {
        active_[i] = active_.back();
        active_.pop_back();
        break;
      }
    }
  }
  const Status result = op.result;
  Release(index);
  if (!result.ok()) return result;
  return true;
}

Status UcxTransport::Cancel(Request r) {
  Op* op = Find(r);
  if (op == nullptr) return Status::Ok();
  const uint32_t index = Index(r.id);
  switch (op->kind) {
    case Kind::kEagerRecv:
    case Kind::kEagerSend:  // the send goes on in UCX; its buffer must stay valid
      Reap(*op);
      Release(index);
      return Status::Ok();
    case Kind::kPutSend:
      if (op->finished || op->step == Step::kWaitRtr) {
        if (!op->finished && op->ctl_req != nullptr) {
          // Withdraw the RTR receive; an RTR that slipped in goes to the channel's next send.
          ucp_request_cancel(worker_, op->ctl_req);
          for (int i = 0; i < 100000 && !op->ctl_rs.fired; ++i) ucp_worker_progress(worker_);
          if (op->ctl_rs.fired && op->ctl_rs.status == UCS_OK && op->ctl_rs.length >= kRtrHeader &&
              op->rtr.magic == kNoteMagic) {
            stash_.push_back(Stashed{op->peer, op->tag, op->rtr});
          }
          ucp_request_free(op->ctl_req);
          op->ctl_req = nullptr;
          op->ctl_rs.req = nullptr;
        }
        for (size_t i = 0; i < active_.size(); ++i) {
          if (active_[i] == index) {
            active_[i] = active_.back();
            active_.pop_back();
            break;
          }
        }
        Release(index);
        return Status::Ok();
      }
      op->zombie = true;  // the put is on its way: finish it (and its FIN) in the background
      return Status::Ok();
    case Kind::kPutRecv: {
      if (op->finished) {
        Release(index);
        return Status::Ok();
      }
      RevokeMsg rv;
      rv.id = r.id;
      (void)SendNote(op->peer, kRevoke, op->tag, &rv, sizeof rv);
      op->zombie = true;  // waits for the sender's answer to its RTR
      active_.push_back(index);
      return Status::Ok();
    }
  }
  return Status::Ok();
}

void UcxTransport::Shutdown() {
  if (worker_ == nullptr) {
    if (context_ != nullptr) ucp_cleanup(context_);
    return;
  }
  for (uint32_t i = 0; i < ops_.size(); ++i) {
    if (ops_[i]->step != Step::kFree) {
      Reap(*ops_[i]);
      Release(i);
    }
  }
  for (int i = 0; i < 1000 && !busy_notes_.empty(); ++i) {
    ucp_worker_progress(worker_);
    SweepNotes();
  }
  for (uint32_t i : busy_notes_) ucp_request_free(notes_[i]->req);
  busy_notes_.clear();
  // Notes nobody will read (RTRs of receives that were never matched, late REVOKEs): take them
  // off UCX's queue, so that it does not warn about them at the end.
  DiscardUnexpected(0, 0);
  for (auto& m : rkeys_) {
    for (auto& [uid, rkey] : m) ucp_rkey_destroy(rkey);
    m.clear();
  }
  const Deadline deadline = DeadlineIn(std::chrono::seconds(2));
  for (size_t p = 0; p < eps_.size(); ++p) CloseEndpoint(p, failed_[p] != UCS_OK, deadline);
  DiscardUnexpected(0, 0);  // and those that landed while the endpoints closed
  for (const Region& r : regions_) ucp_mem_unmap(context_, r.memh);
  regions_.clear();
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
  worker_ = nullptr;
  context_ = nullptr;
}

// A UcxTransport whose worker is open, waiting for the job's addresses.
class UcxJoinerImpl : public UcxJoiner {
 public:
  explicit UcxJoinerImpl(std::unique_ptr<UcxTransport> t)
      : t_(std::move(t)), address_(t_->own_address()) {}
  const std::vector<uint8_t>& address() const override { return address_; }
  Result<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::vector<uint8_t>>& addresses) override {
    if (t_ == nullptr) return Status::InvalidArgument("ucx: this joiner has connected already");
    std::unique_ptr<UcxTransport> t = std::move(t_);
    MOERUN_RETURN_IF_ERROR(t->Connect(rank, addresses));
    return std::unique_ptr<Transport>(std::move(t));
  }

 private:
  std::unique_ptr<UcxTransport> t_;
  std::vector<uint8_t> address_;
};

}  // namespace

Result<UcxOptions> UcxOptionsFromEnvironment() {
  UcxOptions o;
  if (const char* v = std::getenv("MOERUN_UCX_PUT_MIN")) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (end == v || *end != '\0' || n == 0 || n > (1ull << 30)) {
      return Status::InvalidArgument(std::string("MOERUN_UCX_PUT_MIN must be a byte count from 1 "
                                                 "to 1073741824, not '") +
                                     v + "'");
    }
    o.put_min = static_cast<size_t>(n);
  }
  if (const char* v = std::getenv("MOERUN_UCX_PROTOCOL")) {
    const std::string p = v;
    if (p == "auto") {
      o.protocol = UcxProtocol::kAuto;
    } else if (p == "put") {
      o.protocol = UcxProtocol::kPut;
    } else if (p == "tag") {
      o.protocol = UcxProtocol::kTag;
    } else {
      return Status::InvalidArgument("MOERUN_UCX_PROTOCOL must be auto, put or tag, not '" + p +
                                     "'");
    }
  }
  return o;
}

Result<bool> UcxSupportsCudaMemory() {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Status::Unavailable("ucx: reading UCX's configuration: " + UcsError(s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_init: " + UcsError(s));
  Result<bool> cuda = ContextSupportsCuda(context);
  ucp_cleanup(context);
  return cuda;
}

const char* UcxCudaMemoryNote(bool supported) {
  return supported
             ? "ucx: CUDA memory: registered directly"
             : "ucx: CUDA memory not supported by this UCX build: device buffers must be staged "
               "through pinned host memory";
}

Result<std::unique_ptr<Transport>> CreateUcxTransport(std::unique_ptr<Transport> bootstrap,
                                                      UcxOptions options) {
  if (bootstrap == nullptr) return Status::InvalidArgument("ucx: no bootstrap transport");
  auto t = std::make_unique<UcxTransport>(std::move(bootstrap), options);
  MOERUN_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

Result<std::unique_ptr<UcxJoiner>> CreateUcxJoiner(UcxOptions options) {
  auto t = std::make_unique<UcxTransport>(nullptr, options);
  MOERUN_RETURN_IF_ERROR(t->OpenWorker());
  return std::unique_ptr<UcxJoiner>(std::make_unique<UcxJoinerImpl>(std::move(t)));
}

}  // namespace moerun
