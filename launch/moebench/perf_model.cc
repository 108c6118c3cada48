#include "launch/moebench/perf_model.h"

#include <algorithm>
#include <cmath>

namespace moerun::bench {
namespace {

int RoutersPerBatch(const Deployment& d) { return std::max(1, d.routers); }

// Tokens one router handles per microbatch, and the microbatch count.
void Microbatches(const Deployment& d, int64_t* per_router_mb, int* count) {
  const int64_t per_router =
      std::max<int64_t>(1, (d.tokens + RoutersPerBatch(d) - 1) / RoutersPerBatch(d));
  const int64_t mb =
      d.microbatch_tokens > 0 ? std::min(d.microbatch_tokens, per_router) : per_router;
  *per_router_mb = mb;
  *count = static_cast<int>((per_router + mb - 1) / mb);
}

// One router's messages to the expert ranks (one per rank with rows), then the same back: the
// serial time of the sends on one path. Where nodes > 1, the ranks of other nodes are reached
// over `net`, concurrently with the node's own over `link`: the slower path counts.
double WireMs(const ModelShape& m, const MachineProfile& p, const Deployment& d,
              const std::vector<double>& rows_per_rank_one_router) {
  const int n = static_cast<int>(rows_per_rank_one_router.size());
  const int nodes = std::max(1, d.nodes);
  const int per_node = (n + nodes - 1) / nodes;
  double local = 0, remote = 0;
  for (int r = 0; r < n; ++r) {
    const double rows = rows_per_rank_one_router[static_cast<size_t>(r)];
    if (rows <= 0) continue;
    const double bytes = rows * static_cast<double>(m.hidden) * m.activation_bytes;
    // The router sits on node 0 (any router sees the same picture by symmetry).
    const bool off_node = nodes > 1 && r / per_node != 0;
    const LinkFit& l = off_node ? p.net : p.link;
    const double ms = l.latency_us / 1e3 + bytes / (l.gbps * 1e9) * 1e3;
    (off_node ? remote : local) += ms;
  }
  return std::max(local, remote);
}

}  // namespace

std::vector<double> RowsPerRank(const ModelShape& m, const Deployment& d, double tokens) {
  std::vector<double> rows(d.slot_shares.size(), 0.0);
  for (size_t r = 0; r < d.slot_shares.size(); ++r) {
    for (double share : d.slot_shares[r]) rows[r] += tokens * m.top_k * share;
  }
  return rows;
}

double RankExpertMs(const ModelShape& m, const MachineProfile& p, const Deployment& d, int rank,
                    double tokens) {
  const auto w = static_cast<double>(m.ExpertWeights());
  double ns = 0;
  bool any = false;
  for (double share : d.slot_shares[static_cast<size_t>(rank)]) {
    if (share <= 0) continue;
    const double pick = std::min(1.0, m.top_k * share);  // one token picks e
    const double used = 1.0 - std::pow(1.0 - pick, tokens);
    const double rows = tokens * m.top_k * share;
    ns += used * w * p.kernel.fixed_ns + rows * w * p.kernel.row_ns;
    any = true;
  }
  return any ? ns / 1e6 + p.kernel.overhead_us / 1e3 : 0.0;
}

LayerPrediction PredictLayer(const ModelShape& m, const MachineProfile& p, const Deployment& d) {
  LayerPrediction out;
  int64_t tm = 0;
  Microbatches(d, &tm, &out.microbatches);
  out.microbatch_tokens = tm;
  const int routers = RoutersPerBatch(d);
  const auto t = static_cast<double>(tm);
  const double all = t * routers;  // every router's microbatch reaches the expert ranks together

  // The router: the gate (and the shared expert), packing and combining t * k rows.
  const double kh = t * m.top_k * static_cast<double>(m.hidden);
  out.gate_ms =
      p.gate_fixed_us / 1e3 + t * m.experts * static_cast<double>(m.hidden) * p.gate_mac_ns / 1e6;
  if (m.shared_inter > 0) {
    const double ws = 3.0 * static_cast<double>(m.hidden) * static_cast<double>(m.shared_inter);
    out.gate_ms +=
        ws * (p.kernel.fixed_ns + t * p.kernel.row_ns) / 1e6 + p.kernel.overhead_us / 1e3;
  }
  out.rows_per_rank = RowsPerRank(m, d, all);
  std::vector<double> mine = RowsPerRank(m, d, t);  // one router's rows to each rank
  const double wire = WireMs(m, p, d, mine);
  out.dispatch_ms = kh * p.combine_value_ns / 1e6 + wire;
  out.combine_ms = wire + kh * p.combine_value_ns / 1e6;

  // The expert ranks: the slowest, or a node's serialized sum where its cores are oversubscribed.
  const int n = static_cast<int>(d.slot_shares.size());
  const int nodes = std::max(1, d.nodes);
  const int ranks_per_node = ((d.colocated ? n : n + routers) + nodes - 1) / nodes;
  out.oversubscribed = p.cores > 0 && ranks_per_node * std::max(1, p.threads) > p.cores;
  double slowest = 0;
  std::vector<double> node_sum(static_cast<size_t>(nodes), 0.0);
  const int experts_per_node = (n + nodes - 1) / nodes;
  for (int r = 0; r < n; ++r) {
    const double ms = RankExpertMs(m, p, d, r, all);
    out.expert_ms_per_rank.push_back(ms);
    slowest = std::max(slowest, ms);
    node_sum[static_cast<size_t>(r / experts_per_node)] += ms;
  }
  out.expert_ms = slowest;
  if (out.oversubscribed) {
    const double slots = std::max(1, p.cores / std::max(1, p.threads));
    if (p.shared_factor > 0) {
      out.expert_ms = slowest * p.shared_factor;
    } else {
      for (double s : node_sum) out.expert_ms = std::max(out.expert_ms, s / slots);
    }
  }

  // Microbatches: the router's part of microbatch i+1 overlaps the experts' part of i, unless
  // the router shares the experts' device or cores (then every part of every microbatch adds).
  const double router = out.gate_ms + out.dispatch_ms + out.combine_ms;
  const double one = router + out.expert_ms;
  const int mbs = out.microbatches;
  if (mbs == 1 || out.oversubscribed || d.colocated) {
    out.layer_ms = mbs * one;
  } else {
    out.layer_ms = one + (mbs - 1) * std::max(router, out.expert_ms);
  }
  out.tokens_per_s = out.layer_ms > 0 ? static_cast<double>(d.tokens) / (out.layer_ms / 1e3) : 0;
  return out;
}

ServedPrediction PredictServed(const ModelShape& m, const MachineProfile& p, Deployment d,
                               double rate, int64_t tokens_per_request, int64_t max_batch_tokens,
                               double max_wait_us, double overhead_us) {
  ServedPrediction s;
  const auto tpr = static_cast<double>(tokens_per_request);
  const auto cap = static_cast<double>(std::max(max_batch_tokens, tokens_per_request));
  auto layer_ms = [&](double b) {
    d.tokens = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(b)));
    return PredictLayer(m, p, d).layer_ms;
  };
  const double cap_ms = layer_ms(cap);
  s.capacity_tokens_per_s = cap / (cap_ms / 1e3);
  const double offered = rate * tpr;  // tokens/s
  if (offered >= s.capacity_tokens_per_s) {
    s.saturated = true;
    s.batch_tokens = cap;
    s.batch_ms = s.cycle_ms = cap_ms;
    s.tokens_per_s = s.capacity_tokens_per_s;
    return s;
  }
  // The least fixed point of b = offered * C(b), from one request up (C grows with b): the
  // router takes what arrived while its last batch ran, and never waits for more.
  (void)max_wait_us;  // the growth window of a running batch: not modelled (see the header)
  double b = tpr;
  for (int i = 0; i < 200; ++i) {
    const double next = std::clamp(offered * layer_ms(b) / 1e3, tpr, cap);
    if (std::fabs(next - b) < 1e-6 * b) break;
    b = next;
  }
  s.batch_tokens = b;
  s.batch_ms = layer_ms(b);
  s.cycle_ms = s.batch_ms;
  // The router is busy a share u of the time (batches per second x their time); a request that
  // finds it busy waits for the rest of the batch, a uniform part of it: P(wait > x) =
  // u (1 - x / C), whose quantile q is C (1 - (1 - q) / u) where u > 1 - q, else 0.
  const double u = std::min(1.0, offered / b * s.batch_ms / 1e3);
  auto wait_quantile = [&](double q) { return u > 1 - q ? s.cycle_ms * (1 - (1 - q) / u) : 0.0; };
  s.p50_ms = wait_quantile(0.50) + s.batch_ms + overhead_us / 1e3;
  s.p99_ms = wait_quantile(0.99) + s.batch_ms + overhead_us / 1e3;
  s.tokens_per_s = offered;
  return s;
}

std::vector<RankMemory> MemoryPerRank(const ModelShape& m, const Deployment& d) {
  const int routers = RoutersPerBatch(d);
  const auto h = static_cast<double>(m.hidden);
  const double per_router = std::ceil(static_cast<double>(d.tokens) / routers);
  int64_t tm = 0;
  int mbs = 1;
  Microbatches(d, &tm, &mbs);
  RankMemory router;
  router.router = true;
  router.weight_bytes = static_cast<double>(m.experts) * h * 4.0;  // the gate, F32
  if (m.shared_inter > 0) {
    router.weight_bytes += 3.0 * h * static_cast<double>(m.shared_inter) * m.weight_bytes;
  }
  // Input and output of its tokens, and the k rows of each sent and received.
  router.buffer_bytes =
      per_router * h * m.activation_bytes * 2 + per_router * m.top_k * h * m.activation_bytes * 2;
  std::vector<RankMemory> out;
  if (!d.colocated) out.assign(static_cast<size_t>(routers), router);
  const std::vector<double> rows = RowsPerRank(m, d, static_cast<double>(tm) * routers);
  for (size_t r = 0; r < d.slot_shares.size(); ++r) {
    RankMemory e;
    e.weight_bytes = static_cast<double>(d.slot_shares[r].size()) *
                     static_cast<double>(m.ExpertWeights()) * m.weight_bytes;
    e.buffer_bytes = rows[r] * (h * m.activation_bytes * 2 +
                                2.0 * static_cast<double>(m.expert_inter) * m.activation_bytes);
    if (d.colocated) {
      e.weight_bytes += router.weight_bytes;
      e.buffer_bytes += router.buffer_bytes;
    }
    out.push_back(e);
  }
  return out;
}

AffineFit FitAffine(const std::vector<double>& x, const std::vector<double>& y) {
  const size_t n = std::min(x.size(), y.size());
  if (n == 0) return {};
  double sx = 0, sy = 0;
  for (size_t i = 0; i < n; ++i) {
    sx += x[i];
    sy += y[i];
  }
  const double mx = sx / static_cast<double>(n), my = sy / static_cast<double>(n);
  double sxx = 0, sxy = 0;
  for (size_t i = 0; i < n; ++i) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
  }
  if (sxx <= 0) return {my, 0};
  const double b = sxy / sxx;
  return {my - b * mx, b};
}

std::vector<std::vector<double>> UniformLinearSlots(int experts, int ranks) {
  std::vector<std::vector<double>> out(static_cast<size_t>(std::max(1, ranks)));
  for (int e = 0; e < experts; ++e) {
    out[static_cast<size_t>(static_cast<int64_t>(e) * ranks / experts)].push_back(1.0 / experts);
  }
  return out;
}

}  // namespace moerun::bench
