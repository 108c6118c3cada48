// The host-side bookkeeping of the nccl transport (nccl_transport.h), vendor-free so that every
// machine tests it: which messages go over NCCL, on which of the two communicators, the envelope
// that announces each NCCL message, the matching of envelopes to posted receives (MPI's posted
// and unexpected queues), the order of one flush's grouped operations, and the sizes of the
// device staging buffers.
//
// Thread-safety: the functions are pure; a BulkMatcher or StagingPool is used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "base/status.h"

namespace moerun {

// Where a message travels: over the bootstrap transport (mpi) or over NCCL.
enum class NcclPath : uint8_t { kBootstrap, kNccl };

// NCCL carries the messages whose tag is one of `bulk_tags` (a rank's messages to itself too: the
// transport puts a send to itself and its receive in one group, as NCCL requires); every other
// message (other tags, the reserved collective tags) goes over the bootstrap transport. Both
// sides decide by the same rule, so a (pair, tag) channel is never split between the two paths.
NcclPath PathOf(std::span<const int> bulk_tags, int self, int peer, int tag);

// The communicator a message from `from` to `to` travels on: 0 ("up") when from < to, else 1
// ("down"; a rank's messages to itself too). Each direction of a pair has its own communicator (and
// CUDA stream), so that a rank's receive from a peer never queues behind its own send to that peer:
// NCCL runs one communicator's grouped operations one group after another.
inline int NcclCommOf(int from, int to) { return from < to ? 0 : 1; }

// Announces one NCCL message, sent over the bootstrap (a reserved tag, so in posting order per
// pair) right after the sender's group is enqueued: the receiver posts its ncclRecv only on the
// envelope, with the size the envelope names, so a receive of another size or tag never takes
// the message (it is a clear error) and NCCL's in-order matching cannot pair a message with the
// wrong receive. `seq` counts the sender's messages to this receiver from 0: a gap is corruption.
struct BulkEnvelope {
  uint32_t magic = 0x4c43434e;  // "NCCL"
  int32_t tag = 0;
  uint64_t bytes = 0;
  uint64_t seq = 0;
};
static_assert(sizeof(BulkEnvelope) == 24);
inline constexpr uint32_t kBulkEnvelopeMagic = 0x4c43434e;

// Checks an arriving envelope from `peer`: magic, a bulk tag, the expected sequence number.
Status CheckEnvelope(const BulkEnvelope& e, int peer, uint64_t expected_seq,
                     std::span<const int> bulk_tags);

// One peer's NCCL receives: the receives posted and not yet matched, and the messages announced
// before a receive of their tag was posted (the transport receives those into staging memory at
// once, so that a sender never waits for the receiver's application to post). Matching is by tag,
// in posting order per tag, as MPI's: the first posted receive of the envelope's tag takes it.
class BulkMatcher {
 public:
  struct Posted {
    uint64_t id = 0;
    int tag = 0;
    uint64_t bytes = 0;
  };
  struct Unexpected {
    uint64_t handle = 0;  // the transport's name for the staged message
    int tag = 0;
    uint64_t bytes = 0;
  };
  // A receive is posted: returns the first unexpected message of its tag (removed) if one
  // arrived before it; otherwise the receive waits for its envelope.
  std::optional<Unexpected> Post(uint64_t id, int tag, uint64_t bytes);
  // An envelope arrived: returns the first posted receive of its tag (removed); otherwise the
  // message is kept as unexpected under `handle`. The caller compares the sizes.
  std::optional<Posted> Arrive(int tag, uint64_t bytes, uint64_t handle);
  // Withdraws a posted receive that has not been matched; false when there is none with `id`.
  bool Withdraw(uint64_t id);
  size_t posted() const { return posted_.size(); }
  size_t unexpected() const { return unexpected_.size(); }

 private:
  std::deque<Posted> posted_;
  std::deque<Unexpected> unexpected_;
};

// One NCCL operation of a flush: a send, or a receive whose envelope has arrived.
struct BulkOp {
  enum class Kind : uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = 0;
  uint64_t bytes = 0;
  uint64_t id = 0;  // the transport's operation

  bool operator==(const BulkOp&) const = default;
};
struct GroupedBulkOp {
  BulkOp op;
  int comm = 0;  // NcclCommOf(sender, receiver)

  bool operator==(const GroupedBulkOp&) const = default;
};
// The NCCL calls of a flush: the queued operations in the order they were decided (sends as
// posted, receives as their envelopes arrived), each on its direction's communicator; zero-byte
// messages get no NCCL call (their envelope completes them). The transport issues each
// communicator's operations as ONE group (ncclGroupStart ... ncclGroupEnd; past 1024 operations,
// further groups), in this order: a router's dispatch to all its expert ranks is one group. (One
// group per communicator, not one for both: NCCL makes the streams of one group wait for each
// other, which would tie a rank's results to the next microbatch's rows.) `out` is cleared first.
void PlanFlush(int self, std::span<const BulkOp> queued, std::vector<GroupedBulkOp>& out);

// Device staging buffers for host-memory messages, bookkeeping only (the transport allocates):
// slots are allocated once and grown to the largest message they carry, never shrunk; a free
// slot is reused (the smallest free one that fits; else the largest free one, grown; else a new
// one). Capacities are rounded up to kStagingGranule.
class StagingPool {
 public:
  static constexpr size_t kStagingGranule = size_t{64} << 10;
  static size_t CapacityFor(size_t bytes);

  struct Grant {
    int slot = -1;
    size_t capacity = 0;      // the slot's capacity after this grant
    size_t old_capacity = 0;  // before it: 0 for a new slot
    bool allocate = false;    // the caller (re)allocates the slot's memory to `capacity`
  };
  Grant Acquire(size_t bytes);
  void Release(int slot);
  size_t capacity(int slot) const { return slots_[static_cast<size_t>(slot)].capacity; }
  bool in_use(int slot) const { return slots_[static_cast<size_t>(slot)].in_use; }
  int slots() const { return static_cast<int>(slots_.size()); }
  size_t total_bytes() const;

 private:
  struct Slot {
    size_t capacity = 0;
    bool in_use = false;
  };
  std::vector<Slot> slots_;
};

}  // namespace moerun
