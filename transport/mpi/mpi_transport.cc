#include "transport/mpi/mpi_transport.h"

#include <mpi.h>

#include <array>
#include <cstdlib>
#include <vector>

#include "runtime/log.h"

namespace moerun {
namespace {

// Messages are cut into chunks that fit MPI's int counts.
constexpr size_t kChunk = size_t{1} << 30;
constexpr int kMaxChunks = 16;  // 16 GiB per message

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

struct Entry {
  uint32_t generation = 0;
  bool used = false;
  bool send = false;
  int peer = 0;
  size_t bytes = 0;
  int chunks = 0;
  std::array<MPI_Request, kMaxChunks> reqs{};
};

int g_endpoints = 0;

class MpiTransport : public Transport {
 public:
  explicit MpiTransport(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    entries_.resize(1024);
    for (uint32_t i = 1024; i > 0; --i) free_.push_back(i - 1);
    ++g_endpoints;
  }

  ~MpiTransport() override {
    for (uint32_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].used) (void)Cancel(Request{MakeId(i), entries_[i].peer});
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

  Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) override {
    return Post(true, peer, tag, const_cast<void*>(buf), bytes);
  }
  Result<Request> Irecv(int peer, int tag, void* buf, size_t bytes) override {
    return Post(false, peer, tag, buf, bytes);
  }

  Result<bool> Test(Request r) override {
    Entry* e = Find(r);
    if (e == nullptr) return Status::InvalidArgument("mpi: unknown request");
    int done = 0;
    std::array<MPI_Status, kMaxChunks> st{};
    const int rc = MPI_Testall(e->chunks, e->reqs.data(), &done, st.data());
    if (rc != MPI_SUCCESS) {
      // Some chunk failed (e.g. MPI_ERR_TRUNCATE: a longer message than the receive expects).
      // Chunks still pending are withdrawn before the entry is reused.
      int code = rc;
      for (int c = 0; c < e->chunks; ++c) {
        const int err = rc == MPI_ERR_IN_STATUS ? st[static_cast<size_t>(c)].MPI_ERROR : rc;
        if (err != MPI_SUCCESS && err != MPI_ERR_PENDING) code = err;
      }
      WithdrawPending(e);
      const Status s = code == MPI_ERR_TRUNCATE
                           ? Status::InvalidArgument("message longer than the " +
                                                     std::to_string(e->bytes) +
                                                     " bytes the receiver expected")
                           : Status::Unavailable("MPI_Testall: " + MpiError(code));
      Release(r);
      return s;
    }
    if (!done) return false;
    if (!e->send) {
      size_t got = 0;
      for (int c = 0; c < e->chunks; ++c) {
        int count = 0;
        MPI_Get_count(&st[static_cast<size_t>(c)], MPI_BYTE, &count);
        got += static_cast<size_t>(count);
      }
      if (got != e->bytes) {
        const Status s =
            Status::InvalidArgument("message of " + std::to_string(got) + " bytes where " +
                                    std::to_string(e->bytes) + " were expected");
        Release(r);
        return s;
      }
    }
    Release(r);
    return true;
  }

  Status Cancel(Request r) override {
    Entry* e = Find(r);
    if (e == nullptr) return Status::Ok();
    WithdrawPending(e);
    Release(r);
    return Status::Ok();
  }

  [[noreturn]] void Abort(int exit_code) override {
    spdlog::default_logger()->flush();
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::_Exit(exit_code);
  }

 private:
  static uint64_t MakeIdWith(uint32_t index, uint32_t generation) {
    return (static_cast<uint64_t>(generation) << 32) | (index + 1u);
  }
  uint64_t MakeId(uint32_t index) const { return MakeIdWith(index, entries_[index].generation); }

  Entry* Find(Request r) {
    const uint64_t index = (r.id & 0xffffffffu) - 1;
    if (r.id == 0 || index >= entries_.size()) return nullptr;
    Entry& e = entries_[index];
    if (!e.used || e.generation != static_cast<uint32_t>(r.id >> 32)) return nullptr;
    return &e;
  }

  // Withdraws the chunks of an entry that are still active. Receives are cancelled and reaped.
  // A send is cancelled if MPI still can; one already matched by a peer that stopped cannot be
  // reaped without waiting on that peer, so it is left to MPI (its buffer must outlive the job:
  // after such a failure the job is ended anyway).
  void WithdrawPending(Entry* e) {
    for (int c = 0; c < e->chunks; ++c) {
      MPI_Request& q = e->reqs[static_cast<size_t>(c)];
      if (q == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&q);
      if (!e->send) {
        MPI_Wait(&q, MPI_STATUS_IGNORE);
        continue;
      }
      int done = 0;
      for (int i = 0; i < 1000 && !done; ++i) MPI_Test(&q, &done, MPI_STATUS_IGNORE);
      if (!done) MPI_Request_free(&q);
    }
  }

  void Release(Request r) {
    const uint32_t index = static_cast<uint32_t>((r.id & 0xffffffffu) - 1);
    Entry& e = entries_[index];
    e.used = false;
    ++e.generation;
    free_.push_back(index);
  }

  Result<Request> Post(bool send, int peer, int tag, void* buf, size_t bytes) {
    if (peer < 0 || peer >= size_)
      return Status::InvalidArgument("mpi: no rank " + std::to_string(peer));
    if (bytes > kChunk * kMaxChunks) return Status::InvalidArgument("mpi: message too large");
    if (free_.empty()) {
      const uint32_t old = static_cast<uint32_t>(entries_.size());
      entries_.resize(old * 2);
      for (uint32_t i = old * 2; i > old; --i) free_.push_back(i - 1);
    }
    const uint32_t index = free_.back();
    free_.pop_back();
    Entry& e = entries_[index];
    e.used = true;
    e.send = send;
    e.peer = peer;
    e.bytes = bytes;
    e.chunks = bytes == 0 ? 1 : static_cast<int>((bytes + kChunk - 1) / kChunk);
    for (int c = 0; c < e.chunks; ++c) {
      const size_t off = static_cast<size_t>(c) * kChunk;
      const int n = static_cast<int>(std::min(kChunk, bytes - off));
      char* p = static_cast<char*>(buf) + (bytes == 0 ? 0 : off);
      const int rc =
          send ? MPI_Isend(p, n, MPI_BYTE, peer, tag, comm_, &e.reqs[static_cast<size_t>(c)])
               : MPI_Irecv(p, n, MPI_BYTE, peer, tag, comm_, &e.reqs[static_cast<size_t>(c)]);
      if (rc != MPI_SUCCESS) {
        for (int d = 0; d < c; ++d) MPI_Request_free(&e.reqs[static_cast<size_t>(d)]);
        Release(Request{MakeId(index), peer});
        return Status::Unavailable(std::string(send ? "MPI_Isend" : "MPI_Irecv") + " to rank " +
                                   std::to_string(peer) + ": " + MpiError(rc));
      }
    }
    return Request{MakeId(index), peer};
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::vector<Entry> entries_;
  std::vector<uint32_t> free_;
};

}  // namespace

bool LaunchedByMpiLauncher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

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
  return std::unique_ptr<Transport>(new MpiTransport(comm));
}

}  // namespace moerun
