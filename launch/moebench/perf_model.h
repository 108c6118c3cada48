// The performance model of `moebench model`: per-layer time by part (gate, dispatch, expert
// compute, combine), tokens/s, p50/p99 at an offered request rate and memory per rank, from a
// model's shape, a deployment (ranks, nodes, placement, routing shares, microbatching) and a
// machine profile (measured by `moebench calibrate`, or from figures a user gives). Plain
// functions of plain data, no I/O; the equations and their assumptions are in
// docs/performance-model.md, and each function's comment names the ones it makes.
#pragma once

#include <cstdint>
#include <vector>

namespace moerun::bench {

// The shape of one MoE layer. A routed expert holds W = 3 * hidden * expert_inter weights
// (gate, up, down), `weight_bytes` bytes each as held (FP8: codes and block scales).
struct ModelShape {
  int64_t hidden = 0;
  int64_t expert_inter = 0;
  int64_t shared_inter = 0;  // 0: no shared expert (it runs on the routers)
  int experts = 0;
  int top_k = 0;
  double weight_bytes = 4;      // bytes per expert weight as held
  double activation_bytes = 4;  // bytes per value of the rows sent and held (moerun: F32)
  int64_t ExpertWeights() const { return 3 * hidden * expert_inter; }
};

// Expert FFN time of one expert over r > 0 rows: W * (fixed_ns + r * row_ns) nanoseconds (W as
// above); 0 for r = 0. `fixed_ns` is reading the weights once, `row_ns` the arithmetic per row.
struct KernelFit {
  double fixed_ns = 0;     // per weight, once per expert pass
  double row_ns = 0;       // per weight and row
  double overhead_us = 0;  // per grouped pass (a kernel launch, a thread pool's wake-up)
};

// One message of `bytes` between two ranks takes latency_us + bytes / (gbps * 1e9) seconds; a
// rank's messages to several peers go one after another (the router's one thread posts them).
struct LinkFit {
  double latency_us = 0;
  double gbps = 1;
};

struct MachineProfile {
  KernelFit kernel;             // for the model's weight type
  double gate_fixed_us = 0;     // per gate pass
  double gate_mac_ns = 0;       // per multiply-add of the gate (tokens * experts * hidden)
  double combine_value_ns = 0;  // per value moved by pack or combine (tokens * k * hidden)
  LinkFit link;                 // between ranks of one node
  LinkFit net;                  // between nodes (used where nodes > 1)
  // CPU sharing: with `cores` > 0, the ranks of one node share its cores; a rank's kernels use
  // `threads` of them. When the node's ranks ask for more threads than it has cores, their
  // compute serializes (the node runs cores / threads ranks at a time) and microbatches do not
  // overlap. 0: every rank has its own device (GPUs).
  int cores = 0;
  int threads = 1;
  // Oversubscribed, as measured (`moebench calibrate` under mpirun): expert ranks computing
  // together take shared_factor times their time alone, so the slowest rank's X_r becomes
  // X_r * shared_factor (a machine shared with other work runs our ranks side by side, each
  // slower, rather than one after another). 0: not measured; the node's work adds (above).
  double shared_factor = 0;
};

struct Deployment {
  int routers = 1;
  int expert_ranks = 1;
  int nodes = 1;
  bool colocated = false;         // routers share the expert ranks' devices (ranks = expert ranks)
  int64_t tokens = 1;             // tokens per batch, all routers together
  int64_t microbatch_tokens = 0;  // per router; 0: one microbatch
  // Per expert rank, its expert slots: the share of all top-k selections each slot takes (over
  // all ranks the shares sum to 1; an expert with several replicas splits its share among them).
  std::vector<std::vector<double>> slot_shares;
};

struct LayerPrediction {
  int microbatches = 1;
  int64_t microbatch_tokens = 0;  // per router
  bool oversubscribed = false;    // the node's ranks share too few cores: no overlap
  // Parts of one microbatch (ms), as the router sees them.
  double gate_ms = 0;                      // gate (and the shared expert, on the router)
  double dispatch_ms = 0;                  // pack the rows, send them to the expert ranks
  double expert_ms = 0;                    // the slowest expert rank (or the node's serialized sum)
  double combine_ms = 0;                   // results back, combine
  std::vector<double> expert_ms_per_rank;  // per microbatch
  std::vector<double> rows_per_rank;       // expected rows per microbatch
  double layer_ms = 0;  // the whole batch, microbatches overlapped where they can
  double tokens_per_s = 0;
};

// The expected rows each expert rank gets from `tokens` tokens (all routers).
std::vector<double> RowsPerRank(const ModelShape& m, const Deployment& d, double tokens);

// The expert ms of one rank over `tokens` tokens: per hosted slot s with expected rows
// n_s = tokens * k * share_s, P(s is used) * W * fixed + n_s * W * row, plus the pass overhead.
// P(s is used) = 1 - (1 - k * share_s)^tokens (each token picks s with probability k * share_s).
double RankExpertMs(const ModelShape& m, const MachineProfile& p, const Deployment& d, int rank,
                    double tokens);

// One layer over d.tokens tokens.
LayerPrediction PredictLayer(const ModelShape& m, const MachineProfile& p, const Deployment& d);

// Serving through the router's batcher at `rate` requests/s of `tokens_per_request` tokens each
// (Poisson arrivals, every request for this one layer). The batcher never waits for batch-mates:
// a free router takes whatever is queued (up to max_batch_tokens) at once. Steady state as a
// cycle: a batch of b tokens takes S(b) (PredictLayer), b = rate * tpr * S(b) (what arrived while
// the last one ran; at least one request, at most max_batch_tokens), solved by fixed-point
// iteration. The router is busy a share u = (batches/s) * S(b); a request that finds it busy
// waits a uniform part of the running batch: the wait's quantile q is S (1 - (1 - q) / u) where
// u > 1 - q, else 0; p50 and p99 add S(b) and the overhead. (Arrivals that join the running batch
// within max_wait_us, as its next microbatch, are not modelled: they make the wait shorter.)
// Saturated (the largest batch cannot keep up with the rate): tokens/s is the capacity and the
// latencies grow without bound (reported as saturated).
struct ServedPrediction {
  bool saturated = false;
  double batch_tokens = 0;
  double cycle_ms = 0;
  double batch_ms = 0;
  double p50_ms = 0, p99_ms = 0;
  double tokens_per_s = 0;
  double capacity_tokens_per_s = 0;  // at max_batch_tokens
};
ServedPrediction PredictServed(const ModelShape& m, const MachineProfile& p, Deployment d,
                               double rate, int64_t tokens_per_request, int64_t max_batch_tokens,
                               double max_wait_us, double overhead_us);

// Memory of each rank in bytes: routers first (the gate in F32, the shared expert, the batch's
// input and output and the rows sent and received, F32), then expert ranks (hosted experts'
// weights; the rows in and out and the intermediate [rows][2 * inter], F32, at the microbatch's
// expected rows). Co-located: each expert rank also holds a router's share.
struct RankMemory {
  bool router = false;
  double weight_bytes = 0;
  double buffer_bytes = 0;
  double total() const { return weight_bytes + buffer_bytes; }
};
std::vector<RankMemory> MemoryPerRank(const ModelShape& m, const Deployment& d);

// Least squares y = a + b * x over the points (a, b); b = 0 with fewer than two distinct x.
struct AffineFit {
  double a = 0, b = 0;
};
AffineFit FitAffine(const std::vector<double>& x, const std::vector<double>& y);

// Uniform routing over a linear placement: rank r of n hosts experts [r * E / n, (r + 1) * E / n),
// each with share 1 / E.
std::vector<std::vector<double>> UniformLinearSlots(int experts, int ranks);

}  // namespace moerun::bench
