// Doorbell: how a rank wakes a peer on the same host that blocks waiting for messages, where the
// transport itself offers no way to block (MPI: Open MPI's progress only polls). Each rank owns
// a UNIX datagram socket in the abstract namespace (no file; gone with the process), named
// "moerun-bell/<host>/<pid>/<random>", and a shared-memory word that says whether it is asleep
// (POSIX shared memory named after the bell, unlinked once the peers have mapped it); the names
// are exchanged once (the transport's own all-gather), and a sender rings its peer's bell after
// posting a message to it, only when the peer's word says it is asleep (a rank that is awake sees
// the message without a system call on either side). A rank with nothing to do blocks in Wait:
// it marks itself asleep, checks its transport once more (`recheck`), then ppolls its socket
// until a ring or its timeout, and drains every ring queued. Rings never block and their failures
// are ignored: a peer on another host (its name has another host, or lives in another network
// namespace) is not rung and wakes by its timeout, as before; a full socket means the peer has
// rings queued already; a peer whose word cannot be mapped is rung always.
//
// Correctness never depends on a ring: it only shortens a wait. The sleeper's word is set before
// its recheck and the sender's message is posted before it reads the word (both with a full
// fence), so either the recheck sees the message or the sender sees the word and rings; a ring
// sent before the ppoll stays queued, so Wait returns at once (no lost wake-up).
// Thread-safety: Ring and Wait may be called from different threads (they touch different
// state); SetPeers before either. Not copyable; movable.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "base/function_ref.h"
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
  // from this one's, or whose name is empty or malformed, is never rung. Maps the asleep word of
  // each peer on this host (every peer must have opened its bell: after the all-gather).
  void SetPeers(const std::vector<std::string>& names);
  // Removes this rank's shared-memory name (once every peer has mapped it: after a barrier); the
  // destructor does it too.
  void Unlink();
  // Rings `peer`'s bell if it is asleep (no-op for peers without one). A ring within kCoalesce of
  // the last one to the same peer is skipped: a waiter woken spins a while before it blocks again
  // (at least IdleBackoff's spin phase), so it sees the second message without a ring of its own
  // (a dispatch's header and rows cost one ring, not two). Call it after the message is posted.
  void Ring(int peer) { Ring(peer, std::chrono::steady_clock::now()); }
  void Ring(int peer, std::chrono::steady_clock::time_point now);  // (tests give the time)
  static constexpr std::chrono::microseconds kCoalesce{10};
  // Marks this rank asleep, then blocks until a ring arrives or `max` passes unless `recheck`
  // (the transport's last look for an arrival, after the mark) finds something; drains what is
  // queued. True when rung or the recheck found something.
  bool Wait(std::chrono::microseconds max, FunctionRef<bool()> recheck);
  bool Wait(std::chrono::microseconds max) {
    return Wait(max, [] { return false; });
  }
  bool open() const { return fd_ >= 0; }
  // Peers that can be rung (same host).
  int ringable() const;
  uint64_t rings_sent() const { return rings_; }
  uint64_t rings_skipped_awake() const { return awake_; }  // the peer was not asleep
  uint64_t ring_failures() const { return failures_; }

 private:
  void Release();
  void UnmapPeerWords();  // every peer's asleep word mapped (peer_asleep_ keeps its size)
  int fd_ = -1;
  std::atomic<uint32_t>* asleep_ = nullptr;  // this rank's word (shared memory), or null
  std::string shm_name_;                     // while not unlinked
  std::string name_;
  std::string host_;
  // Per peer: the socket address's path bytes (NUL first), empty when not ringable.
  std::vector<std::string> peers_;
  std::vector<std::chrono::steady_clock::time_point> rung_at_;  // by peer
  std::vector<std::atomic<uint32_t>*> peer_asleep_;             // by peer; null: always ring
  uint64_t rings_ = 0, failures_ = 0, awake_ = 0;
};

// Blocks until `fd` is readable or `max` passes (fd < 0: sleeps max). True when readable.
bool WaitReadable(int fd, std::chrono::microseconds max);

// The host part of a bell name ("" when `name` is not one).
std::string DoorbellHost(const std::string& name);

}  // namespace moerun
