// `moebench replay`: placements judged on routing recorded from real inference
// (router/replay/routing_trace.h reads the files as they were published). For each trace ×
// expert-rank count × planner policy:
//   - the planner's placement, made from the planning part of the trace (--plan-fraction F > 0
//     on a token-level trace: the first F of each stream's tokens, or with --split streams the
//     first F of the streams; else the whole trace) and timed: PlanPlacement over all layers, the
//     median of --timing-runs runs, ÷ layers;
//   - window balancedness of that placement on the judging part (the rest; or the whole trace),
//     mean and min over layers;
//   - per batch size B (token-level traces only; null for window counts): the replay of
//     router/replay/replay_metrics.h (MeasureBatches): (max − mean) ÷ mean of the rank loads per
//     (layer, batch) as mean / p50 / p95 / max, the most distinct experts one rank computes per
//     batch, the share of token copies sent off their router's node (per row, per (token, rank),
//     per (token, node)) and the distinct nodes per token.
// node-aware plans with the planning part's tokens as its routing sample (window counts: none),
// within --node-slack. A policy that does not apply to a configuration (eplb-hierarchical where
// groups % nodes != 0, node-aware where the nodes do not divide the experts) is reported as not
// applicable. Prints a table (stdout; stderr with --json) and with --json a
// JSON report on stdout. Bad input (a missing or malformed file, bad numbers, slots that do not
// divide over the ranks) ends with one line and exit 2.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace moerun::bench {

struct ReplayBenchFlags {
  std::vector<std::string> traces;  // --trace FILE (repeatable)
  std::string ranks = "32";         // --ranks: comma-separated expert-rank counts
  // --redundant: one value for every rank count, or one per rank count; empty: = the ranks (one
  // redundant slot per rank).
  std::string redundant;
  int nodes = 1;             // --nodes: nodes the expert ranks span (divides every rank count)
  int routers_per_node = 1;  // --routers-per-node
  int groups = 1;            // --groups: expert groups (EPLB hierarchical); 1 where it does not
                             // divide a trace's experts
  std::string batch = "64,256,1024";                               // --batch: tokens per batch
  std::string policies = "default,eplb-global,eplb-hierarchical";  // --policies
  double plan_fraction = 0;      // --plan-fraction in [0, 1): 0 plans and judges on the whole trace
  std::string split = "tokens";  // --split tokens|streams: how --plan-fraction cuts
  int experts = 0;               // --experts: the model's expert count for token-level files
  int timing_runs = 3;           // --timing-runs: planner runs, the median is reported
  double node_slack = 0.05;      // --node-slack: node-aware's knob (router/node_planner.h)
  double local_share = 0.75;     // --local-share: node-local's knobs (router/node_local.h)
  double copy_prior = 0;         // --copy-prior
  // --spill S: the routers prefer copies on their own node within this bound (router/
  // dispatch_plan.h, DispatchLocality; the runtime's `dispatch: {prefer_node: true, spill: S}`);
  // < 0: the plain choice (the least loaded rank).
  double spill = -1;
  // --activated-batch B: plan on ActivationLoad (router/activation_load.h) of the planning part at
  // B tokens a batch (the experts a rank reads per batch) instead of its token counts; 0: tokens.
  int64_t activated_batch = 0;
  // --expert-bytes: the bytes of one expert, for each plan's rebalance cost (router/
  // rebalance_cost.h): from the job's start (round robin, no redundant slot) to the plan, and,
  // with --plan-fraction on a token-level trace, from the plan to the same policy's plan on the
  // judging part (re-planning as the traffic moved on). 0: copies and messages only.
  int64_t expert_bytes = 0;
  bool json = false;  // --json
};

// The flags' own checks (numbers, lists, ranges), no I/O.
Status Validate(const ReplayBenchFlags& f);
int RunReplayBench(const ReplayBenchFlags& f);

}  // namespace moerun::bench
