#include "transport/mpi/mpi_transport.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "base/log.h"
#include "transport/doorbell.h"

namespace moerun {
namespace {

// Receives use matched probes (MPI_Improbe + MPI_Imrecv): a message is taken off MPI's queue
// only once its size is known, so a message of the wrong size is drained into scratch memory
// and reported, never written over a buffer too small for it (Open MPI's vader/CMA path can
// write past a receive buffer on truncation). Every logical message is one MPI message; above
// 2 GiB its datatype is built from 1 GiB blocks, so message boundaries always hold.
//
// Counters: none (Transport::counters() is all zero), and copied_bytes is truly 0 for our code:
// MPI_Isend and MPI_Imrecv take the caller's own buffers, so this transport copies no payload.
// The copies MPI makes (its eager buffers, shared-memory FIFOs) are MPI's and not ours to count;
// a message of the wrong size is received by MPI into scratch_ and dropped, never delivered. A
// staging or bounce copy added here must count its bytes in copied_bytes (override counters()).

constexpr size_t kBlock = size_t{1} << 30;

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

// The datatype and count that carry `bytes` bytes as one message. *owned is set when the caller
// must free the type (after posting; MPI keeps it alive until the operation completes).
void TypeFor(size_t bytes, MPI_Datatype* type, int* count, bool* owned) {
  *owned = false;
  if (bytes <= static_cast<size_t>(std::numeric_limits<int>::max())) {
    *type = MPI_BYTE;
    *count = static_cast<int>(bytes);
    return;
  }
  MPI_Datatype block;
  MPI_Type_contiguous(static_cast<int>(kBlock), MPI_BYTE, &block);
  const int blocks = static_cast<int>(bytes / kBlock);
  const int rest = static_cast<int>(bytes % kBlock);
  int lens[2] = {blocks, rest};
  MPI_Aint disp[2] = {0, static_cast<MPI_Aint>(static_cast<size_t>(blocks) * kBlock)};
  MPI_Datatype types[2] = {block, MPI_BYTE};
  MPI_Type_create_struct(rest > 0 ? 2 : 1, lens, disp, types, type);
  MPI_Type_commit(type);
  MPI_Type_free(&block);
  *count = 1;
  *owned = true;
}

enum class Phase : uint8_t { kFree, kUnmatched, kPosted };

struct Entry {
  uint32_t generation = 0;
  Phase phase = Phase::kFree;
  bool send = false;
  int peer = 0;
  int tag = 0;
  void* buf = nullptr;
  size_t bytes = 0;
  MPI_Request req = MPI_REQUEST_NULL;
  size_t wrong_size = 0;  // a mismatched message's size (its receive then fails)
  bool mismatch = false;
};

int g_endpoints = 0;

class MpiTransport : public Transport {
 public:
  MpiTransport(MPI_Comm comm, Doorbell bell) : comm_(comm), bell_(std::move(bell)) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    entries_.resize(1024);
    for (uint32_t i = 1024; i > 0; --i) free_.push_back(i - 1);
    unmatched_.reserve(1024);
    ++g_endpoints;
  }

  ~MpiTransport() override {
    for (uint32_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].phase != Phase::kFree) (void)Cancel(Request{MakeId(i), entries_[i].peer});
    }
    MPI_Comm_free(&comm_);
    if (--g_endpoints == 0) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    }
  }

  const char* name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool can_withdraw_sends() const override { return false; }

  Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) override {
    MOERUN_ASSIGN_OR_RETURN(const uint32_t index,
                            NewEntry(true, peer, tag, const_cast<void*>(buf), bytes));
    Entry& e = entries_[index];
    MPI_Datatype type;
    int count = 0;
    bool owned = false;
    TypeFor(bytes, &type, &count, &owned);
    const int rc = MPI_Isend(buf, count, type, peer, tag, comm_, &e.req);
    if (owned) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) {
      Release(index);
      return Status::Unavailable("MPI_Isend to rank " + std::to_string(peer) + ": " + MpiError(rc));
    }
    e.phase = Phase::kPosted;
    CountSent(peer, bytes);
    bell_.Ring(peer);  // a peer asleep in WaitForActivity looks now
    return Request{MakeId(index), peer};
  }

  Result<Request> Irecv(int peer, int tag, void* buf, size_t bytes) override {
    MOERUN_ASSIGN_OR_RETURN(const uint32_t index, NewEntry(false, peer, tag, buf, bytes));
    entries_[index].phase = Phase::kUnmatched;
    unmatched_.push_back(index);
    MatchReceives(peer, tag);
    return Request{MakeId(index), peer};
  }

  Result<bool> Test(Request r) override {
    Entry* e = Find(r);
    if (e == nullptr) return Status::InvalidArgument("mpi: unknown request");
    const uint32_t index = Index(r);
    if (e->phase == Phase::kUnmatched) MatchReceives(e->peer, e->tag);
    MatchEveryPeerNowAndThen();
    if (e->phase == Phase::kUnmatched) return false;
    int done = 0;
    MPI_Status st;
    const int rc = MPI_Test(&e->req, &done, &st);
    if (rc != MPI_SUCCESS) {
      const Status s =
          Status::Unavailable(std::string(e->send ? "send to" : "receive from") + " rank " +
                              std::to_string(e->peer) + ": " + MpiError(rc));
      Release(index);
      return s;
    }
    if (!done) return false;
    if (e->mismatch) {
      const Status s =
          Status::InvalidArgument("message of " + std::to_string(e->wrong_size) + " bytes where " +
                                  std::to_string(e->bytes) + " were expected");
      Release(index);
      return s;
    }
    Release(index);
    return true;
  }

  Status Cancel(Request r) override {
    Entry* e = Find(r);
    if (e == nullptr) return Status::Ok();
    const uint32_t index = Index(r);
    if (e->phase == Phase::kUnmatched) {
      // Never handed to MPI: nothing can arrive in its buffer.
      for (size_t i = 0; i < unmatched_.size(); ++i) {
        if (unmatched_[i] == index) {
          unmatched_.erase(unmatched_.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        }
      }
    } else if (e->req != MPI_REQUEST_NULL) {
      // A matched receive is already arriving, and MPI cannot withdraw a send a peer may be
      // reading: give it a moment to finish, then leave it to MPI (its buffer must outlive the
      // transport; the runtime ends the job after such a failure).
      MPI_Cancel(&e->req);
      int done = 0;
      for (int i = 0; i < 1000 && !done; ++i) MPI_Test(&e->req, &done, MPI_STATUS_IGNORE);
      if (!done) MPI_Request_free(&e->req);
    }
    Release(index);
    return Status::Ok();
  }

  // Open MPI's progress only polls: a rank that has nothing to do blocks on its doorbell
  // (transport/doorbell.h), which every Isend to it rings. Peers on other hosts do not ring: there
  // the wait ends by its timeout, as a sleep did.
  bool WaitForActivity(std::chrono::microseconds max) override {
    return bell_.Wait(max, [this] { return AnythingToDo(); });
  }
  bool wakes_on_arrival() const override { return bell_.ringable() > 0; }

  [[noreturn]] void Abort(int exit_code) override {
    spdlog::default_logger()->flush();
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::_Exit(exit_code);
  }

 private:
  static uint32_t Index(Request r) { return static_cast<uint32_t>((r.id & 0xffffffffu) - 1); }
  uint64_t MakeId(uint32_t index) const {
    return (static_cast<uint64_t>(entries_[index].generation) << 32) | (index + 1u);
  }

  Entry* Find(Request r) {
    const uint64_t index = (r.id & 0xffffffffu) - 1;
    if (r.id == 0 || index >= entries_.size()) return nullptr;
    Entry& e = entries_[index];
    if (e.phase == Phase::kFree || e.generation != static_cast<uint32_t>(r.id >> 32))
      return nullptr;
    return &e;
  }

  Result<uint32_t> NewEntry(bool send, int peer, int tag, void* buf, size_t bytes) {
    if (peer < 0 || peer >= size_)
      return Status::InvalidArgument("mpi: no rank " + std::to_string(peer));
    if (tag < 0) return Status::InvalidArgument("mpi: negative tag");
    if (bytes / kBlock > static_cast<size_t>(std::numeric_limits<int>::max())) {
      return Status::InvalidArgument("mpi: message too large");
    }
    if (free_.empty()) {
      const uint32_t old = static_cast<uint32_t>(entries_.size());
      entries_.resize(old * 2);
      for (uint32_t i = old * 2; i > old; --i) free_.push_back(i - 1);
    }
    const uint32_t index = free_.back();
    free_.pop_back();
    Entry& e = entries_[index];
    e.send = send;
    e.peer = peer;
    e.tag = tag;
    e.buf = buf;
    e.bytes = bytes;
    e.req = MPI_REQUEST_NULL;
    e.mismatch = false;
    e.wrong_size = 0;
    return index;
  }

  void Release(uint32_t index) {
    Entry& e = entries_[index];
    e.phase = Phase::kFree;
    ++e.generation;
    free_.push_back(index);
  }

  // Whether a Test would make progress now: a posted request has completed, or a message waits
  // for one of the unmatched receives (a message nobody asked for yet does not count: it would
  // keep a waiting rank awake). The doorbell's last look before sleeping.
  bool AnythingToDo() {
    for (const Entry& e : entries_) {
      if (e.phase != Phase::kPosted || e.req == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Request req = e.req;
      MPI_Request_get_status(req, &done, MPI_STATUS_IGNORE);
      if (done) return true;
    }
    for (uint32_t index : unmatched_) {
      const Entry& e = entries_[index];
      int flag = 0;
      MPI_Iprobe(e.peer, e.tag, comm_, &flag, MPI_STATUS_IGNORE);
      if (flag) return true;
    }
    return false;
  }

  // Every waiting receive is matched now and then whatever is tested: a rank that waits only on
  // its sends must still match the receives its peers' large (rendezvous) sends wait for, or two
  // such ranks wait on each other. Not on every Test: that made a router's pass over 60 pongs
  // quadratic (below). At most once a millisecond, and no more than a fifth of the time: where
  // each probe yields the core (Open MPI oversubscribed), one pass over 60 peers takes long.
  void MatchEveryPeerNowAndThen() {
    if (unmatched_.empty()) return;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_full_match_) return;
    keys_.clear();
    for (uint32_t index : unmatched_) {
      const Entry& e = entries_[index];
      const std::pair<int, int> key{e.peer, e.tag};
      if (std::find(keys_.begin(), keys_.end(), key) == keys_.end()) keys_.push_back(key);
    }
    for (const auto& [peer, tag] : keys_) MatchReceives(peer, tag);
    const auto done = std::chrono::steady_clock::now();
    next_full_match_ = done + std::max<std::chrono::steady_clock::duration>(
                                  std::chrono::milliseconds(1), 4 * (done - now));
  }

  // Hands the messages of (peer, tag) that arrived to the receives waiting for them, oldest
  // receive first, so that receives are matched in the order they were posted. It probes only
  // that pair, and once when nothing arrived: a rank waiting on many peers (a router's pongs
  // from 60 expert ranks) probes each peer once per pass, where probing every waiting receive
  // on every Test made a pass quadratic in the rank count (3,600 probes at 64 ranks, each a
  // sched_yield inside Open MPI with mpi_yield_when_idle).
  void MatchReceives(int peer, int tag) {
    size_t kept = 0;
    bool more = true;
    for (size_t i = 0; i < unmatched_.size(); ++i) {
      const uint32_t index = unmatched_[i];
      Entry& e = entries_[index];
      int flag = 0;
      MPI_Message msg = MPI_MESSAGE_NULL;
      MPI_Status st;
      if (more && e.peer == peer && e.tag == tag) {
        MPI_Improbe(peer, tag, comm_, &flag, &msg, &st);
        more = flag != 0;
      }
      if (!flag) {
        unmatched_[kept++] = index;
        continue;
      }
      MPI_Count count = 0;
      MPI_Get_elements_x(&st, MPI_BYTE, &count);
      void* dst = e.buf;
      size_t bytes = e.bytes;
      if (static_cast<size_t>(count) != e.bytes) {
        // Drain it into scratch memory; the receive fails once it has arrived.
        e.mismatch = true;
        e.wrong_size = static_cast<size_t>(count);
        scratch_.resize(std::max(scratch_.size(), e.wrong_size));
        dst = scratch_.data();
        bytes = e.wrong_size;
      }
      MPI_Datatype type;
      int n = 0;
      bool owned = false;
      TypeFor(bytes, &type, &n, &owned);
      MPI_Imrecv(dst, n, type, &msg, &e.req);
      if (owned) MPI_Type_free(&type);
      e.phase = Phase::kPosted;
    }
    unmatched_.resize(kept);
  }

  MPI_Comm comm_;
  Doorbell bell_;
  int rank_ = 0, size_ = 1;
  std::vector<Entry> entries_;
  std::vector<uint32_t> free_;
  std::vector<uint32_t> unmatched_;        // receives not yet matched, in posting order
  std::vector<std::pair<int, int>> keys_;  // scratch of MatchEveryPeerNowAndThen
  std::chrono::steady_clock::time_point next_full_match_{};
  std::vector<char> scratch_;  // where messages of the wrong size are drained
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateMpiTransport() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) return Status::Unavailable("MPI_Init_thread failed: " + MpiError(rc));
  }
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  // Every rank's doorbell name (an empty one where the bell could not be opened, or
  // MOERUN_MPI_DOORBELL=off: that rank is then woken by its sleeps' end only).
  Doorbell bell;
  const char* env = std::getenv("MOERUN_MPI_DOORBELL");
  const bool wanted = env == nullptr || std::string(env) != "off";
  if (wanted) {
    Result<Doorbell> opened = Doorbell::Open();
    if (opened.ok()) {
      bell = std::move(*opened);
    } else {
      spdlog::warn("mpi: no doorbell, idle ranks wake by their sleep's end: {}",
                   opened.status().ToString());
    }
  }
  int size = 1;
  MPI_Comm_size(comm, &size);
  std::vector<char> mine(Doorbell::kNameBytes, '\0');
  std::memcpy(mine.data(), bell.name().data(), std::min(bell.name().size(), mine.size() - 1));
  std::vector<char> all(Doorbell::kNameBytes * static_cast<size_t>(size), '\0');
  const int rc = MPI_Allgather(mine.data(), static_cast<int>(Doorbell::kNameBytes), MPI_CHAR,
                               all.data(), static_cast<int>(Doorbell::kNameBytes), MPI_CHAR, comm);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&comm);
    return Status::Unavailable("mpi: exchanging the doorbells' names: " + MpiError(rc));
  }
  std::vector<std::string> names(static_cast<size_t>(size));
  for (size_t r = 0; r < names.size(); ++r) {
    const char* p = all.data() + r * Doorbell::kNameBytes;
    names[r].assign(p, strnlen(p, Doorbell::kNameBytes));
  }
  if (bell.open()) bell.SetPeers(names);
  // Every rank has mapped its peers' asleep words: their names can go.
  MPI_Barrier(comm);
  bell.Unlink();
  return std::unique_ptr<Transport>(new MpiTransport(comm, std::move(bell)));
}

}  // namespace moerun
