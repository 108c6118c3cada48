// The ucx transport: host memory over UCX (InfiniBand/RoCE verbs, shared memory, TCP: whatever
// UCX_TLS allows). No UCX type appears outside transport/ucx/.
//
// Messages below `put_min` bytes go as UCX tagged eager messages. Larger ones go as UCX tagged
// messages too (UCX's rendezvous) where the peer's endpoint has no RMA lane and puts are not
// forced: UCX would emulate a put with active messages, slower than its rendezvous, and UCX 1.13
// aborts (ucs_fatal) a process whose acknowledgement of an emulated put fails because the sender
// has just died. Where the endpoint has hardware RMA (or MOERUN_UCX_PROTOCOL=put), they are
// written by the sender straight into the receive buffer with ucp_put_nbx (zero copy):
//   1. the receiver's Irecv sends a ready-to-receive note (RTR: request id, size, address and the
//      remote key of the registered region holding the buffer) to the sender;
//   2. the sender's Isend takes the RTRs of its (peer, tag) channel in order, checks the size,
//      puts the bytes at the address, flushes the endpoint (remote completion) and sends a FIN;
//   3. the FIN completes the receive.
// Receive buffers inside memory given to RegisterMemory are registered once; others are
// registered for that one message (counted as on-demand registrations). A size mismatch fails
// both sides with an error when both sizes are on the same side of put_min; across it (an eager
// receive, a put send or the reverse) the two never meet and both miss their deadline, which
// names the peer. (Within moerun both sides take sizes from the same plan.) Endpoints use
// UCP_ERR_HANDLING_MODE_PEER: a peer that dies fails its requests with kUnavailable instead of
// hanging them; one that stops answering misses deadlines.
//
// Cancel: an eager receive is withdrawn. A put receive whose RTR is out tells the sender
// (REVOKE); if the sender had already taken the RTR, its bytes may still land in the buffer:
// keep registered memory alive until UnregisterMemory or the transport's end. A send cannot be
// withdrawn once started (can_withdraw_sends is false): the runtime strands or ends the job.
//
// A new process takes over a dead rank's number (moerun serve --join) in two steps: it opens a
// worker (CreateUcxJoiner) and hands its address to the job; each rank that talks to it calls
// ReplacePeer(rank, address), which force-closes the old endpoint, reaps the cancelled requests
// still finishing against the old process, and drops what the old process left behind (remote
// keys, its unmatched messages and notes of every kind, revokes, stashed RTRs); then the joiner
// learns the others' addresses and connects (UcxJoiner::Connect). A message from the old process
// still in flight when ReplacePeer runs is dropped only if it lands before ReplacePeer returns:
// call it once the old process is dead (or its transport destroyed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "transport/registry.h"
#include "transport/transport.h"

namespace moerun {

// How large messages move (MOERUN_UCX_PROTOCOL). kAuto: by put to the peers whose endpoint has
// hardware RMA (an RMA lane: verbs, xpmem), else as UCX tagged messages: UCX 1.13 emulates puts
// over TCP and sysv/posix/CMA shared memory in software, about 3x slower than its tagged
// rendezvous over TCP and ~5 % slower over shared memory here (docs/operator-guide.md), and not
// safe against a sender's death (above). kPut: puts to every peer; kTag: tagged messages only.
enum class UcxProtocol { kAuto, kPut, kTag };

struct UcxOptions {
  size_t put_min = 16384;  // messages of at least this many bytes go by put (MOERUN_UCX_PUT_MIN)
  UcxProtocol protocol = UcxProtocol::kAuto;
  // Ranks after the launched ones (MOERUN_UCX_SPARE_RANKS; moerun serve sets it from the config's
  // spare_expert_ranks): the transport's size is the bootstrap's plus these; they have no process
  // and no address (failed from the start) until ReplacePeer gives one a joined process's.
  int spare_ranks = 0;
};

// Creates this rank's UCX endpoint set: one context and worker, endpoints to every rank from
// worker addresses exchanged over `bootstrap` (which the ucx transport then keeps, for Abort and
// to finalise it last). Sets UCX_MM_ERROR_HANDLING=y when the user has not (UCX 1.13's
// shared-memory transports need it in peer error mode) and UCX_KEEPALIVE_INTERVAL=1s (so that a
// dead peer is detected in about a second), and logs that it did.
Result<std::unique_ptr<Transport>> CreateUcxTransport(std::unique_ptr<Transport> bootstrap,
                                                      UcxOptions options = {});

// The first half of a ucx transport for a process that joins a running job (moerun serve
// --join): the UCX context and worker, and its address to hand to the job. The job's ranks take
// the joiner in with ReplacePeer(rank, address()) before it sends them anything (what reaches
// them earlier from its rank number is dropped as the old process's). Its options must be the
// job's: both sides choose eager or put by the same put_min.
// It is the registry's TransportJoiner (registry.h), whose Connect here gives the transport of
// rank `rank` with endpoints to every peer whose address is not empty; a peer without one is
// failed from the start (peer_failed is true, its requests fail with kUnavailable). No bootstrap
// transport: Abort ends the process; Barrier is not meant to be used.
using UcxJoiner = TransportJoiner;
// Same environment settings (and log lines) as CreateUcxTransport.
Result<std::unique_ptr<UcxJoiner>> CreateUcxJoiner(UcxOptions options = {});

// The options from the environment (MOERUN_UCX_PUT_MIN, MOERUN_UCX_PROTOCOL,
// MOERUN_UCX_SPARE_RANKS), with a clear error for a bad value.
Result<UcxOptions> UcxOptionsFromEnvironment();

// Whether this UCX build handles CUDA device memory (UCS_MEMORY_TYPE_CUDA among the memory types
// ucp_context_query reports): with it, device buffers can be registered with UCX directly;
// without it (Debian's UCX, and the GPU machine's as far as known) they must be staged through
// pinned host memory. Makes and ends a UCX context of its own (a few milliseconds); the transport
// checks its own context the same way and logs UcxCudaMemoryNote once (rank 0). Thread-safe.
// (Built only with UCX; the runtime makes the transport through transport/registry.h.)
Result<bool> UcxSupportsCudaMemory();
// The log line for the answer: "ucx: CUDA memory: registered directly" or why not.
const char* UcxCudaMemoryNote(bool supported);

}  // namespace moerun
