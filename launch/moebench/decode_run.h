// One micro-batch of `moebench decode` (launch/moebench/decode_bench.h): its connection and its
// chain of layers. RunStep sends every layer's request in turn for the micro-batch's sequences
// (after "attending" for its share of the attention time, asleep), checks each answer (and with
// --verify compares it bitwise with the expected one), and makes the next layer's input from it.
// It counts what happened in DecodeStats, which the run merges at the end.
// Not thread-safe: one thread runs a micro-batch (the run gives each its own).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "launch/moebench/client_common.h"
#include "launch/moebench/decode_chain.h"
#include "launch/moebench/decode_workload.h"
#include "runtime/serving/failover_client.h"

namespace moerun::bench {

// A run's counts: the answers (measured ones in requests/ok/errors and the latencies, the
// warm-up's only in counts.warmup_*), the attention as slept, and --parts.
struct DecodeStats {
  AnswerCounts counts;
  std::vector<double> round_trip_ms;  // of the measured answers that were OK
  std::vector<double> attention_ms;   // each measured sleep as it was (the sleep's overshoot)
  // --parts: the server's Timing of the measured answers that carried one, in µs, by part name
  // (a part that was 0 in an answer is not recorded for it); per expert rank its round trip and
  // compute.
  int64_t with_timing = 0;
  std::map<std::string, std::vector<double>> parts_us;
  std::vector<double> batch_tokens;  // of the batch that computed each answer
  std::map<int, std::vector<double>> rank_round_trip_us;
  std::map<int, std::vector<double>> rank_compute_us;

  void Merge(const DecodeStats& o);
};

struct DecodeRunOptions {
  double attention_us = 0;                // one layer's attention for all S sequences
  uint32_t deadline_ms = 0;               // sent in each request (0: the server's default)
  std::chrono::milliseconds wait{60000};  // the client's wait for one answer
  bool parts = false;                     // InferRequest.timing
  bool verify = false;
};

class MicroBatchRunner {
 public:
  MicroBatchRunner(const DecodeWorkload& w, const DecodeRunOptions& o, int index, MicroBatch mb,
                   std::unique_ptr<FailoverClient> client);

  // Every layer once for the micro-batch's sequences, starting from start state p. False when a
  // request failed (the rest of the step is skipped); fatal() then says whether the run must stop
  // (the connection was lost, or no answer came in time).
  bool RunStep(int64_t step, int p, bool measured);

  const DecodeStats& stats() const { return stats_; }
  const std::string& fatal() const { return fatal_; }
  const MicroBatch& microbatch() const { return mb_; }
  uint64_t failovers() const { return client_->failovers(); }
  uint64_t retried() const { return client_->retried(); }

 private:
  void RecordParts(const v1::InferResponse& r, double round_trip_ms);

  const DecodeWorkload& w_;
  const DecodeRunOptions o_;
  const int index_;
  const MicroBatch mb_;
  std::unique_ptr<FailoverClient> client_;
  uint64_t seq_ = 0;
  DecodeStats stats_;
  std::string fatal_;
  std::vector<float> x_, y_;
  v1::InferRequest request_;
  v1::InferResponse response_;
};

// `passes` rounds of one-token requests over every layer, one at a time on `client`: the round
// trip one lone request sees (ms each). The first failure is returned, naming the layer.
Result<std::vector<double>> LoneRoundTrips(const DecodeWorkload& w, const DecodeRunOptions& o,
                                           FailoverClient* client, int passes);

}  // namespace moerun::bench
