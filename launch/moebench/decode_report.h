// What `moebench decode` reports (launch/moebench/decode_bench.h): the JSON report (the same
// conventions as `moebench serve`'s: the flags, counts, errors by kind, latency objects with
// p50/p90/p99/max/mean/count in ms), the one-line human summary on stderr, and the exit code.
// Functions only; no state.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "launch/moebench/decode_bench.h"
#include "launch/moebench/decode_chain.h"
#include "launch/moebench/decode_run.h"
#include "launch/moebench/decode_workload.h"

namespace moerun::bench {

struct DecodeResult {
  DecodeStats stats;            // every micro-batch's, merged
  std::vector<double> step_ms;  // the measured steps in which every micro-batch got through
  int64_t steps = 0;            // measured steps that every micro-batch got through
  int64_t failed_steps = 0;     // measured steps in which a request failed
  int64_t warmup_steps = 0;     // warm-up steps run
  int64_t tokens = 0;           // S per step that every micro-batch got through
  double wall_s = 0;            // from the first measured step's start to the last one's end
  std::vector<double> lone_ms;  // the lone one-token requests' round trips
  uint64_t failovers = 0;
  uint64_t retried = 0;
  std::string stopped;  // why the run stopped before its end ("" when it did not)
  double measure_start_unix_s = 0;
};

// The JSON report (sorts the latency vectors of r in place).
nlohmann::json DecodeReport(const DecodeBenchFlags& f, const DecodeWorkload& w,
                            const std::vector<MicroBatch>& microbatches, DecodeResult* r);
// The summary on stderr: throughput with the time per token and the lone request's latency
// beside it, then the parts and the errors, if any.
void PrintDecodeSummary(const DecodeBenchFlags& f, const nlohmann::json& report,
                        const DecodeResult& r);
// 0, kExitAnswersDiffer (with --verify, every failure an answer that differs) or 1.
int DecodeExitCode(const DecodeBenchFlags& f, const DecodeResult& r);

}  // namespace moerun::bench
