// Doorbell: how a rank wakes a peer on the same host that blocks waiting for messages, where the
// transport itself offers no way to block (MPI: Open MPI's progress only polls). Each rank owns
// a UNIX datagram socket in the abstract namespace (no file; gone with the process), named
// "moerun-bell/<host>/<pid>/<random>"; the names are exchanged once (the transport's own
// all-gather), and a sender rings its peer's bell after posting a message to it. A rank with
// nothing to do blocks in Wait (ppoll on its socket) until a ring or its timeout, then drains
// every ring queued. Rings never block and their failures are ignored: a peer on another host
// (its name has another host, or lives in another network namespace) is not rung and wakes by
// its timeout, as before; a full socket means the peer has rings queued already.
//
// Correctness never depends on a ring: it only shortens a wait. A ring sent between a rank's
// last poll of its transport and its Wait stays queued, so Wait returns at once (no lost
// wake-up).
// Thread-safety: Ring and Wait may be called from different threads (they touch different
// state); SetPeers before either. Not copyable; movable.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace moerun {

class Doorbell {
 public:
  // Longest name, with its terminating NUL (what the all-gather carries per rank).
  static constexpr size_t kNameBytes = 96;

  static Result<Doorbell> Open();
  Doorbell() = default;
  Doorbell(Doorbell&& o) noexcept;
  Doorbell& operator=(Doorbell&& o) noexcept;
  Doorbell(const Doorbell&) = delete;
  Doorbell& operator=(const Doorbell&) = delete;
  ~Doorbell();

  // This rank's bell name (without the abstract namespace's leading NUL).
  const std::string& name() const { return name_; }
  // The peers' names by rank (this rank's own included, never rung); a peer whose host differs
  // from this one's, or whose name is empty or malformed, is never rung.
  void SetPeers(const std::vector<std::string>& names);
  // Rings `peer`'s bell (no-op for peers without one). A ring within kCoalesce of the last one to
  // the same peer is skipped: a waiter woken spins a while before it blocks again (at least
  // IdleBackoff's spin phase), so it sees the second message without a ring of its own (a
  // dispatch's header and rows cost one ring, not two).
  void Ring(int peer) { Ring(peer, std::chrono::steady_clock::now()); }
  void Ring(int peer, std::chrono::steady_clock::time_point now);  // (tests give the time)
  static constexpr std::chrono::microseconds kCoalesce{10};
  // Blocks until a ring arrives or `max` passes; drains what is queued. True when rung.
  bool Wait(std::chrono::microseconds max);
  bool open() const { return fd_ >= 0; }
  // Peers that can be rung (same host).
  int ringable() const;
  uint64_t rings_sent() const { return rings_; }
  uint64_t ring_failures() const { return failures_; }

 private:
  int fd_ = -1;
  std::string name_;
  std::string host_;
  // Per peer: the socket address's path bytes (NUL first), empty when not ringable.
  std::vector<std::string> peers_;
  std::vector<std::chrono::steady_clock::time_point> rung_at_;  // by peer
  uint64_t rings_ = 0, failures_ = 0;
};

// Blocks until `fd` is readable or `max` passes (fd < 0: sleeps max). True when readable.
bool WaitReadable(int fd, std::chrono::microseconds max);

// The host part of a bell name ("" when `name` is not one).
std::string DoorbellHost(const std::string& name);

}  // namespace moerun
