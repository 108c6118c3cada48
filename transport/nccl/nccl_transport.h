// The nccl transport: the bulk messages of expert parallelism (a microbatch's rows, an expert
// rank's results) over NCCL point-to-point, one GPU per rank; everything else over a bootstrap
// host transport (mpi), which it owns. No NCCL or CUDA type appears here. Built only with NCCL
// (MOERUN_WITH_NCCL); the runtime makes it through transport/registry.h ("nccl").
//
// Paths (nccl_bulk.h, PathOf): messages whose tag is one of `bulk_tags` between two different
// ranks go over NCCL; all others (headers, pongs, control, the barrier's and the other reserved
// collective tags, a rank's messages to itself) go over the bootstrap, so per (pair, tag) order
// holds on each path and both sides always agree on the path. Within moerun the launcher passes
// kTagRows and kTagResult: both sides know their sizes before they move (the router from its
// dispatch plan, an expert rank from the header it received first).
//
// NCCL messages:
//   - Isend queues the send; the next Test (WaitAll, Barrier: any Test of any request) flushes
//     every queued send and every receive whose envelope has arrived as ONE
//     ncclGroupStart/ncclGroupEnd per communicator (so a router's dispatch to all expert ranks is
//     one grouped call with the plan's exact byte counts), then sends one envelope per message
//     (tag, bytes, sequence number: nccl_bulk.h) over the bootstrap. A send to this rank itself
//     is announced at once and its receive joins the same group, as NCCL requires.
//   - A receive's ncclRecv is posted when the sender's envelope arrives, into the posted receive
//     of the envelope's tag (first posted, first matched), or, when none is posted yet, into a
//     staging buffer that a later receive of that tag takes (as MPI's unexpected messages). So
//     receives of different tags may be posted in any order, and a receive of the wrong size
//     fails with kInvalidArgument naming the peer, tag and both sizes (its message is drained and
//     dropped), instead of corrupting data or hanging.
//   - Two communicators (the second made with ncclCommSplit), each with its own CUDA stream: one
//     for messages from a lower to a higher rank, one for the other direction, so a rank's
//     receive from a peer never waits behind its own send to that peer. NCCL runs the groups of
//     one communicator one after another; the operations of one group run together. The two
//     directions are never put in one group (NCCL would make their streams wait for each other).
//     Limitation: with two or more senders sending to two or more common receivers in separate
//     flushes, receivers that see the envelopes in crossed orders can stall each other; the
//     stall ends at the caller's deadline (the communicators are then aborted). moerun's routers
//     send a microbatch to all expert ranks in one flush.
//   - Completion by a CUDA event recorded behind the operation (and its staging copy).
//   - Host buffers are staged through device buffers of this transport (StagingPool: allocated
//     once per slot, grown to the largest message, reused); RegisterMemory pins host memory
//     (cudaHostRegister) so that the staging copies run at full speed. A device pointer (on this
//     rank's GPU) is used directly: its data must be complete when Isend is called (synchronise
//     the stream that produced it), and a received device buffer is complete when Test says so.
//   - Failures: Test polls ncclCommGetAsyncError; an error aborts both communicators
//     (ncclCommAbort) and fails every NCCL request with kUnavailable naming its peer; as NCCL's
//     error names no peer, every peer with a transfer in flight then reports peer_failed. NCCL
//     cannot withdraw an enqueued operation: a Cancel of an NCCL request that has been enqueued
//     (WaitAll at its deadline) aborts the communicators likewise, after which every NCCL-tag
//     request fails with kUnavailable; only the cancelled request's peer reports peer_failed
//     (the bootstrap path keeps working, so the runtime's error reporting and Abort still work). A
//     request still only queued (a send not yet flushed, a receive whose envelope has not come)
//     is withdrawn without harm.
//
// Thread-safety: one thread at a time (the rank's main thread); it sets that thread's current
// CUDA device. Buffers: owned by the caller, valid until the request completes or is cancelled
// (after an abort the transport waits for its streams before a Cancel returns, so a cancelled
// buffer is no longer read or written). The bootstrap transport is owned and destroyed last.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace moerun {

struct NcclTransportOptions {
  int device = -1;             // this rank's GPU (launch/local_device.h chooses it)
  std::vector<int> bulk_tags;  // tags that travel over NCCL (each below kReservedTagBase)
  Deadline deadline{};         // for creating the communicators (collective)
};

// Collective over every rank of `bootstrap`: exchanges the NCCL unique id over it, opens a
// non-blocking communicator under a watchdog (nccl_exchange.h: a rank that cannot prepare its
// GPU makes all fail naming it; at the deadline the communicator is aborted) and splits the
// second one from it. kInvalidArgument for bad options.
Result<std::unique_ptr<Transport>> CreateNcclTransport(std::unique_ptr<Transport> bootstrap,
                                                       NcclTransportOptions options);

}  // namespace moerun
