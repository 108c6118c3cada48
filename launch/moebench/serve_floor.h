// `moebench serve --floor`: the floor of a lone request's round trip, measured in the same run.
//
// A phase of rounds on one connection, one request in flight; each round, for the same input:
//   1. the request itself (asking for its Timing: where its time went on the server);
//   2. a client probe (InferRequest.probe = PROBE_CLIENT): the same request bytes, answered by the
//      serving endpoint at once with the same answer bytes: the client connection's own round trip
//      (TCP or TLS, whichever the connection speaks);
//   3. a transport probe (PROBE_TRANSPORT): the router sends the request's rows to each expert
//      rank in turn and gets them back, no compute: the transport's own round trip between the
//      router and an expert rank (mpi, ucx: whichever the job runs), as the router timed it;
//   4. the layer in this process, for the same tokens: its compute (with the flags' threads and
//      with one thread, whichever is faster: a lone token's layer may lose more to waking a
//      thread pool than it gains from it).
// The floor is the sum of the p50s of 2, 3 and 4 (what a request must pay at least: its bytes
// both ways on the client's connection and on the transport, and the layer's work), and
// x_floor = p50 of 1 / floor (ours / the physical floor: 1 is the best possible). Rounds
// interleave the four, so that the machine's drift falls on all of them alike.
//
// Thread-safety: one call at a time per connection.
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/layer/moe_layer.h"
#include "runtime/serving/serve_client.h"

namespace moerun::bench {

struct FloorInputs {
  ServeConnection* connection = nullptr;
  // The requests' bodies without their id (a Protobuf message is the concatenation of its
  // fields), their inputs as floats and, when verifying, the answers' data expected (the
  // caller's, not copied: they may be large).
  std::span<const std::string> bodies;
  std::span<const std::vector<float>> inputs;
  std::span<const std::string> expected;  // empty: answers are not compared
  int64_t tokens = 0;
  MoeLayer* layer = nullptr;         // the same layer, in process
  MoeLayer* layer_single = nullptr;  // and on one thread (null: not timed)
  int layer_threads = 0;             // layer's
  double duration_s = 5;             // rounds until then (at least 20 rounds)
  std::chrono::milliseconds wait{60000};
};

// The report: rounds; round_trip_ms, client_pingpong_ms, transport_pingpong_ms (every expert
// rank's round trips pooled; transport_by_rank_p50_ms by rank) and layer_ms as latency JSON;
// floor_ms, x_floor, p99_over_p50 (of the round trip); parts_p50_ms (the request's Timing);
// layer_single_thread_ms beside layer_ms (the floor takes the lower p50).
// Errors: a failed or wrong answer of any kind (a probe answer that is not its request's data).
Result<nlohmann::json> MeasureFloor(const FloorInputs& in);

// The probe and timing fields as bytes to append to a request body (Protobuf: the last value of
// a field wins, so a body with these appended asks for them).
std::string ProbeFields(int probe, bool timing);

}  // namespace moerun::bench
