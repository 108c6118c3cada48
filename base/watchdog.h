// WaitWithWatchdog: polls an asynchronous operation until it is done, fails, or misses its
// deadline, and aborts it on failure. Used where a vendor library reports progress only through a
// query (NCCL's ncclCommGetAsyncError, cudaEventQuery) and a stuck peer would otherwise hang the
// caller forever. No vendor types here: the caller wraps its queries in `poll` and its abort
// (ncclCommAbort) in `on_abort`.
//
// Blocking: blocks the calling thread until `poll` reports done or an error, or the deadline
// passes; never longer (each pass calls `poll` once, so the wait overshoots the deadline by at
// most one `poll` call plus one sleep). It spins for `idle_spins` passes, then yields its core
// and then sleeps between polls (base/idle_backoff.h: 50 µs, up to 1 ms on an oversubscribed
// host), as Transport::WaitAll.
// Thread-safety: no shared state; `poll` and `on_abort` run on the calling thread.
// Allocation: none (the callables are FunctionRefs), except to build the error message.
#pragma once

#include <chrono>
#include <string_view>

#include "base/function_ref.h"
#include "base/status.h"

namespace moerun {

// The same clock and time point as transport/transport.h's Deadline.
using WatchdogDeadline = std::chrono::steady_clock::time_point;

// `poll`: true when the operation is done, false while in flight, an error when the operation
// failed (its error getter reported one). It is called at least once, even past the deadline.
// On an error or at the deadline `on_abort` is called exactly once (before returning) and the
// result is the error, prefixed with `what` (code kept), or kDeadlineExceeded naming `what`.
// On success `on_abort` is not called.
Status WaitWithWatchdog(FunctionRef<Result<bool>()> poll, WatchdogDeadline deadline,
                        FunctionRef<void()> on_abort, std::string_view what, int idle_spins = 2000);

}  // namespace moerun
