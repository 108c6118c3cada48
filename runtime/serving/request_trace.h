// One request's trace: what the serving endpoint keeps of a sampled request (its times and its
// batch's, the router's and each expert rank's), and the OpenTelemetry spans made of it.
//
// The spans (names and parents; times are each process's own clock, ns since the Unix epoch):
//   moerun.request        SERVER  frame received -> answer handed to the socket; the child of the
//                                 caller's span when the request carried a traceparent
//     moerun.queue                received -> its batch started
//     moerun.microbatch           per microbatch of its batch: gate -> combined
//       moerun.gate, moerun.dispatch, moerun.wait, moerun.combine   the router's parts, in turn
//       moerun.expert_rank CLIENT per expert rank that got rows: header sent -> answer received
//         moerun.expert   SERVER  on that rank (its resource, its clock): header taken -> answer
//                                 sent, with moerun.clock_offset_ns (its clock minus the
//                                 router's, estimated by the router) to line it up
//           moerun.expert.receive  header taken -> compute started (the rows arriving)
//           moerun.expert.compute  compute started -> answer sent (moerun.cache_wait_us: of
//                                  which waiting for the expert cache's loads)
//     moerun.replaced_wait        when its batch waited for experts whose every copy had died
//                                 to be placed again (the microbatches are the call's after it)
//     moerun.reply                batch done -> answer handed to the socket
// A request refused before it reached a batch (overload, draining) has the root span alone.
// The expert ranks' times come back to the router in each answer's trailer, so one exporter per
// router sends the whole tree, and a request can be kept after it ended (slow or failed) without
// the expert ranks holding spans for every request.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "base/batch_stream.h"
#include "base/trace_context.h"
#include "moerun/otlp/v1/trace.pb.h"

namespace moerun {

struct RequestTrace {
  using TimePoint = std::chrono::steady_clock::time_point;
  TraceContext ctx;         // trace id; parent_id: the caller's span when has_parent
  bool has_parent = false;  // the request carried a valid traceparent
  std::string why;          // why it was kept: "caller", "share", "slow", "failed"
  uint64_t request_id = 0;
  int layer = 0;
  int64_t tokens = 0, batch_tokens = 0;
  int code = 0;  // moerun.v1.ErrorCode
  std::string error;
  TimePoint received{}, batch_start{}, batch_done{}, answered{};
  TimePoint replaced_wait_from{}, replaced_wait_to{};  // BatchTiming's (unset: no such wait)
  std::vector<MicrobatchTimes> microbatches;
  std::vector<RankTimes> ranks;
};

// Who made the spans: the router (its rank and host); expert ranks are named by rank.
struct TraceSource {
  int router_rank = 0;
  std::string host;
  std::string service = "moerun";
};

// The spans AppendSpans makes for `t`.
int64_t SpanCount(const RequestTrace& t);
// Appends t's spans: one ResourceSpans for the router's, one per expert rank that took part.
void AppendSpans(const RequestTrace& t, const TraceSource& source,
                 moerun::otlp::v1::ExportTraceServiceRequest* out);

}  // namespace moerun
