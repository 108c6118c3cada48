// `moebench decode`: the attention side of a model's decode, emulated against a running
// `moerun serve` job, one MoE layer at a time (attention-FFN disaggregation: each layer's request
// waits for the one before).
//
// S sequences (--sequences), one token each per layer, go through every MoE layer the job serves
// (or --layers), in ascending order; a decode step is every layer once for the S sequences. The
// hidden state flows: layer l+1's input is the residual plus layer l's output, RMS-normalised
// (launch/moebench/decode_chain.h); each step starts from one of --inputs fixed pseudo-random
// states, cycled. Before each layer a micro-batch "attends" for --attention-us times its share of
// the sequences by sleeping (not spinning: the client leaves the cores to the job).
// --pingpong M splits the S sequences into M micro-batches (MegaScale-Infer's ping-pong), each
// with its own connection and thread and its own chain of layers, so the job computes one
// micro-batch's layer while the client attends to another; a step ends when every micro-batch has
// been through every layer (the micro-batches start each step together).
//
// Before the run one request per layer (of the largest micro-batch's tokens) checks that the job
// serves it and takes requests of that size; without --layers the model's MoE layers that the job
// does not serve are left out (--layers names layers that must be served). After the warm-up
// steps, lone one-token requests (every layer, twice, one at a time) measure the round trip one
// request sees on an idle job: every throughput figure is reported beside it.
// With --verify every answer must be bitwise equal to the same layers computed in process
// (the layer is batch-invariant): the chain is computed before the run, one layer loaded at a
// time (memory: one layer's weights and the expected answers). --parts asks the server for each
// answer's Timing and reports the p50 of each part that the answers carry (none from a server
// that does not fill it).
//
// Every wait has a deadline (--deadline-ms, else 60 s per answer). A request whose connection is
// lost (the router died) or that gets no answer in time stops the run at once, naming the step,
// the layer and the micro-batch; three failed steps in a row stop it too.
// Prints a human summary on stderr and, with --json, a JSON report on stdout.
// Exit code: 0 all answers OK (and verified); 3 (kExitAnswersDiffer) with --verify when every
// failure is an answer that differs from the local layers; 1 any other error; 2 bad flags (or a
// layer the job does not serve, or a request size it refuses).
#pragma once

#include <cstdint>
#include <string>

#include "launch/layer_flags.h"
#include "launch/moebench/client_common.h"

namespace moerun::bench {

struct DecodeBenchFlags {
  ClientFlags client;         // --target, --key-file, --tls-ca-file, --tls-server-name
  int64_t sequences = 1;      // --sequences S
  int pingpong = 1;           // --pingpong M: micro-batches
  std::string layers;         // --layers "3,5-9" (empty: every MoE layer the job serves)
  double attention_us = 0;    // --attention-us: one layer's attention for all S sequences
  int64_t steps = 0;          // --steps: measured steps (0: --duration)
  double duration_s = 0;      // --duration: measured seconds (0 with no --steps: 10)
  int warmup_steps = 1;       // --warmup: steps left out of the statistics
  std::string dtype = "f32";  // --dtype of the request data: f32 | bf16
  int64_t deadline_ms = 0;    // --deadline-ms sent in each request (0: the server's default)
  int64_t hidden = 0;         // --hidden (required without --model/--preset)
  int inputs = 4;             // --inputs: distinct start states, cycled over the steps
  uint64_t seed_inputs = 1;   // --seed-inputs
  bool verify = false;        // --verify against the layers computed in process
  bool parts = false;         // --parts: ask for and report the answers' Timing
  // --model/--preset and the preset's flags: the model's layers and hidden size, and with
  // --verify its weights.
  LayerFlags layer;
  bool json = false;
};

int RunDecodeBench(const DecodeBenchFlags& f);
// The flags' own checks (ranges, combinations), no I/O; RunDecodeBench checks them too.
Status Validate(const DecodeBenchFlags& f);

}  // namespace moerun::bench
