// `moebench serve`: a load generator for a router's serving endpoint (TCP, length-prefixed
// InferRequest/InferResponse frames). N connections send requests of T tokens each, drawn from P
// fixed pseudo-random inputs:
//   - closed loop (no --rate): one thread per connection, one request in flight at a time;
//   - open loop (--rate R requests/s in total): per connection a sender on a fixed schedule of
//     R/N per second and a receiver; latency counts from the scheduled send time, so a server that
//     falls behind is charged for the wait (no coordinated omission); at most 1024 requests in
//     flight per connection, skipped sends count as "client_backlog" errors.
// With --verify every answer must be bitwise equal to the local MoE layer's output for its input,
// computed once before the run (the layer is batch-invariant and identical on every ISA).
// Prints a human summary on stderr and, with --json, a JSON report on stdout (with a per-second
// "timeline" of answers, errors and latency, and the measured run's start as a Unix time, so that
// a fault injected at a known time can be read off it; --plot FILE.svg draws that timeline:
// latency p50/p99/max and answers per second). Requests sent
// during the warmup are left out of the statistics (their errors still fail the run).
// With --tls-ca-file every connection speaks TLS (the handshake is not part of a request's
// latency: connections are made before the run).
// Exit code: 0 all answers OK (and verified); 3 (kExitAnswersDiffer) with --verify when every
// failure is an answer that differs from the local layer; 1 any other error; 2 bad flags.
#pragma once

#include <cstdint>
#include <string>

#include "launch/layer_flags.h"
#include "launch/moebench/client_common.h"

namespace moerun::bench {

struct ServeBenchFlags {
  ClientFlags client;              // --target, --key-file, --tls-ca-file, --tls-server-name
  int concurrency = 1;             // --concurrency: connections
  double duration_s = 10;          // --duration: measured seconds
  int64_t tokens_per_request = 1;  // --tokens-per-request
  double rate = 0;                 // --rate: requests/s in total (0: closed loop)
  std::string dtype = "f32";       // --dtype of the request data: f32 | bf16
  int64_t deadline_ms = 0;         // --deadline-ms sent in each request (0: the server's default)
  double warmup_s = 1;             // --warmup
  int64_t hidden = 0;              // --hidden (required without --verify)
  int inputs = 64;                 // --inputs: distinct request inputs
  uint64_t seed_inputs = 1;        // --seed-inputs
  bool verify = false;             // --verify against the local layer
  LayerFlags layer;  // --layer (also the request's layer), and with --verify --model/--preset,
                     // --seed, --experts, --weights-dtype (into layer.dtype)
  bool json = false;
  std::string plot;  // --plot FILE.svg: latency and throughput per second of the run
  // --floor: after the run, a phase as long as it measures the floor of a lone request's round
  // trip beside it (launch/moebench/serve_floor.h); needs --verify (the layer in process),
  // --concurrency 1, the closed loop and one target.
  bool floor = false;
  // --trace-share: this share of the requests carries a new sampled W3C traceparent (a router
  // with tracing on exports their spans); --trace-log FILE: one line per traced request of the
  // closed loop, "TRACEPARENT ROUND_TRIP_US CODE".
  double trace_share = 0;
  std::string trace_log;
};

int RunServeBench(const ServeBenchFlags& f);
// The flags' own checks (ranges, combinations), no I/O; RunServeBench checks them too.
Status Validate(const ServeBenchFlags& f);

}  // namespace moerun::bench
