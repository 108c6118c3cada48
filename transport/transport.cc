#include "transport/transport.h"

#include <algorithm>

#include "base/idle_backoff.h"

namespace moerun {

Status Transport::WaitAll(std::span<Request> reqs, Deadline deadline, const char* what,
                          bool cancel_late, std::span<SteadyClock::time_point> done_at) {
  size_t pending = 0;
  for (const Request& r : reqs) pending += r.valid();
  IdleBackoff idle(static_cast<uint64_t>(idle_spins()), this);
  while (pending > 0) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      Request& r = reqs[i];
      if (!r.valid()) continue;
      Result<bool> done = Test(r);
      if (!done.ok()) {
        const int peer = r.peer;
        r = Request{};
        for (Request& o : reqs) {
          if (o.valid() && cancel_late) (void)Cancel(o), o = Request{};
        }
        return done.status().WithContext(std::string(what) + " with rank " + std::to_string(peer));
      }
      if (*done) {
        r = Request{};
        --pending;
        if (i < done_at.size()) done_at[i] = SteadyClock::now();
      }
    }
    if (pending == 0) break;
    if (SteadyClock::now() >= deadline) {
      int peer = -1;
      for (Request& o : reqs) {
        if (!o.valid()) continue;
        if (peer < 0 || o.peer < peer) peer = o.peer;
        if (cancel_late) {
          (void)Cancel(o);
          o = Request{};
        }
      }
      return Status::DeadlineExceeded(std::string(what) + ": rank " + std::to_string(peer) +
                                      " did not answer before the deadline");
    }
    // Spin briefly for latency, then yield so that oversubscribed ranks make progress.
    idle.Idle();
  }
  return Status::Ok();
}

Status Transport::ReplacePeer(int /*peer*/, std::span<const uint8_t> /*address*/) {
  return Status::Unsupported(std::string("the ") + name() +
                             " transport cannot take a rank back at a new address (ReplacePeer)");
}

Status Transport::Wait(Request r, Deadline deadline, const char* what) {
  return WaitAll(std::span<Request>(&r, 1), deadline, what);
}

Status Transport::Send(int peer, int tag, const void* buf, size_t bytes, Deadline deadline) {
  MOERUN_ASSIGN_OR_RETURN(Request r, Isend(peer, tag, buf, bytes));
  return Wait(r, deadline, "send");
}

Status Transport::Recv(int peer, int tag, void* buf, size_t bytes, Deadline deadline) {
  MOERUN_ASSIGN_OR_RETURN(Request r, Irecv(peer, tag, buf, bytes));
  return Wait(r, deadline, "receive");
}

Status Transport::Barrier(Deadline deadline, int among) {
  const int n = among > 0 ? std::min(among, size()) : size();
  const int me = rank();
  uint8_t out = 1, in = 0;
  for (int dist = 1, round = 0; dist < n; dist *= 2, ++round) {
    const int to = (me + dist) % n;
    const int from = (me - dist + n) % n;
    MOERUN_ASSIGN_OR_RETURN(Request s, Isend(to, kReservedTagBase + round, &out, 1));
    MOERUN_ASSIGN_OR_RETURN(Request r, Irecv(from, kReservedTagBase + round, &in, 1));
    Request both[2] = {s, r};
    MOERUN_RETURN_IF_ERROR(WaitAll(both, deadline, "barrier"));
  }
  return Status::Ok();
}

Result<std::vector<std::vector<uint8_t>>> AllGatherBytes(Transport& t,
                                                         const std::vector<uint8_t>& mine, int tag,
                                                         size_t max_bytes, Deadline deadline,
                                                         const char* what, int among) {
  const int n = among > 0 ? std::min(among, t.size()) : t.size(), me = t.rank();
  std::vector<uint64_t> lens(static_cast<size_t>(n), 0);
  std::vector<std::vector<uint8_t>> all(static_cast<size_t>(t.size()));
  const uint64_t my_len = mine.size();
  std::vector<Request> reqs;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    MOERUN_ASSIGN_OR_RETURN(Request r,
                            t.Irecv(p, tag, &lens[static_cast<size_t>(p)], sizeof(uint64_t)));
    reqs.push_back(r);
    MOERUN_ASSIGN_OR_RETURN(Request q, t.Isend(p, tag, &my_len, sizeof my_len));
    reqs.push_back(q);
  }
  MOERUN_RETURN_IF_ERROR(t.WaitAll(reqs, deadline, what));
  reqs.clear();
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const auto pi = static_cast<size_t>(p);
    if (lens[pi] == 0 || lens[pi] > max_bytes) {
      return Status::Corrupt(std::string(what) + ": rank " + std::to_string(p) + " sent " +
                             std::to_string(lens[pi]) + " bytes");
    }
    all[pi].resize(lens[pi]);
    MOERUN_ASSIGN_OR_RETURN(Request r, t.Irecv(p, tag + 1, all[pi].data(), lens[pi]));
    reqs.push_back(r);
    MOERUN_ASSIGN_OR_RETURN(Request q, t.Isend(p, tag + 1, mine.data(), mine.size()));
    reqs.push_back(q);
  }
  MOERUN_RETURN_IF_ERROR(t.WaitAll(reqs, deadline, what));
  all[static_cast<size_t>(me)] = mine;
  return all;
}

}  // namespace moerun
