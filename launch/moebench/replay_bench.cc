#include "launch/moebench/replay_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "base/exit_code.h"
#include "base/log.h"
#include "router/activation_load.h"
#include "router/placement.h"
#include "router/planner.h"
#include "router/rebalance_cost.h"
#include "router/replay/replay_metrics.h"
#include "router/replay/routing_trace.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;

// "32,64" -> {32, 64}: each a whole number in [lo, hi].
Result<std::vector<int64_t>> ParseList(const std::string& flag, const std::string& text, int64_t lo,
                                       int64_t hi) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size() || v < lo || v > hi) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      return Status::InvalidArgument(flag + ": '" + item + "' is not a whole number in [" +
                                     std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
  }
  if (out.empty() || (!text.empty() && text.back() == ',')) {
    return Status::InvalidArgument(flag + ": '" + text + "' is not a comma-separated list");
  }
  return out;
}

Result<std::vector<PlannerPolicy>> ParsePolicies(const std::string& text) {
  std::vector<PlannerPolicy> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    Result<PlannerPolicy> p = ParsePlannerPolicy(item);
    if (!p.ok()) return Status::InvalidArgument("--policies: " + p.status().message());
    out.push_back(*p);
  }
  if (out.empty()) return Status::InvalidArgument("--policies: no policy given");
  return out;
}

struct Parsed {
  std::vector<int64_t> ranks, redundant, batches;
  std::vector<PlannerPolicy> policies;
  SplitBy split = SplitBy::kTokens;
};

Result<Parsed> Parse(const ReplayBenchFlags& f) {
  Parsed p;
  if (f.traces.empty()) return Status::InvalidArgument("--trace: give at least one file");
  MOERUN_ASSIGN_OR_RETURN(p.ranks, ParseList("--ranks", f.ranks, 1, 4096));
  if (f.redundant.empty()) {
    p.redundant = p.ranks;
  } else {
    MOERUN_ASSIGN_OR_RETURN(p.redundant, ParseList("--redundant", f.redundant, 0, 1 << 20));
    if (p.redundant.size() == 1) p.redundant.assign(p.ranks.size(), p.redundant[0]);
    if (p.redundant.size() != p.ranks.size()) {
      return Status::InvalidArgument("--redundant: give one value, or one per --ranks value");
    }
  }
  MOERUN_ASSIGN_OR_RETURN(p.batches, ParseList("--batch", f.batch, 1, int64_t{1} << 30));
  MOERUN_ASSIGN_OR_RETURN(p.policies, ParsePolicies(f.policies));
  if (f.nodes < 1) return Status::InvalidArgument("--nodes must be >= 1");
  for (int64_t r : p.ranks) {
    if (r % f.nodes != 0) {
      return Status::InvalidArgument("--nodes " + std::to_string(f.nodes) +
                                     " does not divide --ranks " + std::to_string(r));
    }
  }
  if (f.routers_per_node < 1) return Status::InvalidArgument("--routers-per-node must be >= 1");
  if (f.groups < 1) return Status::InvalidArgument("--groups must be >= 1");
  if (!(f.plan_fraction >= 0 && f.plan_fraction < 1)) {
    return Status::InvalidArgument("--plan-fraction must be in [0, 1)");
  }
  if (f.split == "tokens") {
    p.split = SplitBy::kTokens;
  } else if (f.split == "streams") {
    p.split = SplitBy::kStreams;
  } else {
    return Status::InvalidArgument("--split must be tokens or streams");
  }
  if (f.experts < 0) return Status::InvalidArgument("--experts must be >= 0");
  if (!(f.local_share >= 0 && f.local_share <= 1)) {
    return Status::InvalidArgument("--local-share must be in [0, 1]");
  }
  if (!(f.copy_prior >= 0 && f.copy_prior <= 1e6)) {
    return Status::InvalidArgument("--copy-prior must be in [0, 1e6]");
  }
  if (!(f.spill >= -1 && f.spill <= 1000)) {
    return Status::InvalidArgument("--spill must be in [0, 1000] (or < 0: no preference)");
  }
  if (!(f.node_slack >= 0 && f.node_slack <= 10)) {
    return Status::InvalidArgument("--node-slack must be in [0, 10]");
  }
  if (f.activated_batch < 0) return Status::InvalidArgument("--activated-batch must be >= 0");
  if (f.timing_runs < 1 || f.timing_runs > 100) {
    return Status::InvalidArgument("--timing-runs must be in [1, 100]");
  }
  return p;
}

json Num(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

json BatchJson(const BatchMetrics& m) {
  json j = {{"batch_tokens", m.batch_tokens},
            {"batches", m.batches},
            {"tokens_judged", m.tokens_judged},
            {"tokens_left_out", m.tokens_left_out}};
  if (m.batches == 0) {
    j["note"] = "no full batch of this size in any stream";
    return j;
  }
  j["imbalance"] = {{"mean", Num(m.imbalance_mean)},
                    {"p50", Num(m.imbalance_p50)},
                    {"p95", Num(m.imbalance_p95)},
                    {"max", Num(m.imbalance_max)}};
  j["max_rank_experts"] = {{"mean", Num(m.max_rank_experts_mean)},
                           {"max", Num(m.max_rank_experts_max)}};
  j["off_node_share"] = {{"rows", Num(m.off_node_share_rows)},
                         {"token_rank", Num(m.off_node_share_token_rank)},
                         {"token_node", Num(m.off_node_share_token_node)}};
  j["nodes_per_token"] = Num(m.nodes_per_token);
  j["off_node_copies_per_token"] = Num(m.off_node_copies_per_token);
  return j;
}

// node-aware's routing sample: every stream's tokens of the trace, layer by layer (window
// counts: none).
RoutingSample SampleOf(const RoutingTrace& t) {
  RoutingSample s;
  if (!t.token_level()) return s;
  s.top_k = t.top_k;
  s.ids.resize(static_cast<size_t>(t.num_layers()));
  for (const RoutingTrace::Stream& st : t.streams) {
    for (size_t l = 0; l < s.ids.size() && l < st.ids.size(); ++l) {
      s.ids[l].insert(s.ids[l].end(), st.ids[l].begin(), st.ids[l].end());
    }
  }
  return s;
}

// Tokens behind a trace's counts: the streams' tokens, or for window counts with a known top-k,
// a layer's assignments ÷ k (0 where neither is known).
double PlanTokens(const RoutingTrace& t) {
  double tokens = 0;
  for (const RoutingTrace::Stream& st : t.streams) tokens += static_cast<double>(st.tokens);
  if (tokens > 0 || t.top_k < 1 || t.counts.empty()) return tokens;
  for (double c : t.counts[0]) tokens += c;
  return tokens / t.top_k;
}

// Why `policy` does not apply here (empty: it does).
std::string NotApplicable(PlannerPolicy policy, const PlannerInput& in) {
  if (policy == PlannerPolicy::kEplbHierarchical && in.num_groups % in.num_nodes != 0) {
    return "groups (" + std::to_string(in.num_groups) + ") % nodes (" +
           std::to_string(in.num_nodes) + ") != 0";
  }
  const size_t experts = in.load.empty() ? 0 : in.load[0].size();
  if (policy == PlannerPolicy::kNodeAware && experts % static_cast<size_t>(in.num_nodes) != 0) {
    return "nodes (" + std::to_string(in.num_nodes) + ") do not divide the experts (" +
           std::to_string(experts) + ")";
  }
  return "";
}

std::string Fixed(const json& v, int digits) {
  if (!v.is_number()) return "—";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v.get<double>());
  return buf;
}

void PrintTable(const json& report, std::FILE* out) {
  std::fprintf(out, "%-34s %5s %5s %-18s %8s %8s %9s %6s %27s %9s %17s %12s\n", "trace", "ranks",
               "slots", "policy", "win.mean", "win.min", "plan ms/L", "batch",
               "imbalance mean/p50/p95/max", "experts", "off-node r/tr/tn", "nodes/x-node");
  for (const json& r : report["results"]) {
    std::string name = r["trace"].get<std::string>();
    if (name.size() > 34) name = "…" + name.substr(name.size() - 33);
    if (!r["applicable"].get<bool>()) {
      std::fprintf(out, "%-34s %5d %5d %-18s not applicable: %s\n", name.c_str(),
                   r["ranks"].get<int>(), r["slots"].get<int>(),
                   r["policy"].get<std::string>().c_str(), r["note"].get<std::string>().c_str());
      continue;
    }
    const std::string win = Fixed(r["window_balancedness"]["mean"], 4);
    const std::string wmin = Fixed(r["window_balancedness"]["min"], 4);
    const std::string ms = Fixed(r["planner_ms_per_layer"], 2);
    auto line = [&](const std::string& batch, const std::string& imb, const std::string& ex,
                    const std::string& off, const std::string& nodes) {
      std::fprintf(out, "%-34s %5d %5d %-18s %8s %8s %9s %6s %27s %9s %17s %12s\n", name.c_str(),
                   r["ranks"].get<int>(), r["slots"].get<int>(),
                   r["policy"].get<std::string>().c_str(), win.c_str(), wmin.c_str(), ms.c_str(),
                   batch.c_str(), imb.c_str(), ex.c_str(), off.c_str(), nodes.c_str());
    };
    if (!r["batches"].is_array()) {
      line("—", "—", "—", "—", "—");
      continue;
    }
    for (const json& b : r["batches"]) {
      const std::string bt = std::to_string(b["batch_tokens"].get<int64_t>());
      if (b["batches"].get<int64_t>() == 0) {
        line(bt, "no full batch", "—", "—", "—");
        continue;
      }
      const json& i = b["imbalance"];
      line(bt,
           Fixed(i["mean"], 3) + "/" + Fixed(i["p50"], 3) + "/" + Fixed(i["p95"], 3) + "/" +
               Fixed(i["max"], 3),
           Fixed(b["max_rank_experts"]["mean"], 1) + "/" + Fixed(b["max_rank_experts"]["max"], 0),
           Fixed(b["off_node_share"]["rows"], 3) + "/" +
               Fixed(b["off_node_share"]["token_rank"], 3) + "/" +
               Fixed(b["off_node_share"]["token_node"], 3),
           Fixed(b["nodes_per_token"], 2) + "/" + Fixed(b["off_node_copies_per_token"], 2));
    }
  }
}

// The cost of moving every layer from `from` to `to` (router/rebalance_cost.h) on a job of
// `ranks` expert ranks after `routers` routers; null where a plan is not a placement table (an
// EPLB plan may put two copies of an expert on one rank).
json CostJson(const std::vector<const LayerPlacement*>& from, const std::vector<LayerMaps>& to,
              int ranks, int routers, int64_t expert_bytes) {
  RebalanceCost c;
  for (size_t l = 0; l < to.size(); ++l) {
    Result<LayerPlacement> b = ToLayerPlacement(to[l], ranks, routers);
    if (!b.ok()) return nullptr;
    if (Placement::SameSlots(*from[l], *b)) continue;
    AddStep(&c,
            CostOfLayer(static_cast<int>(l), *from[l], *b, ranks + routers, routers, expert_bytes),
            0);
  }
  return {{"steps", c.steps.size()},
          {"copies_loaded", c.copies_loaded},
          {"copies_released", c.copies_released},
          {"load_bytes", c.load_bytes},
          {"critical_bytes", c.critical_bytes},
          {"max_rank_bytes", c.max_rank_bytes},
          {"messages", c.messages}};
}

}  // namespace

Status Validate(const ReplayBenchFlags& f) { return Parse(f).status(); }

int RunReplayBench(const ReplayBenchFlags& f) {
  Result<Parsed> parsed = Parse(f);
  if (!parsed.ok()) return FailWith(parsed.status());
  const Parsed& p = *parsed;
  RoutingTraceOptions read_options;
  read_options.num_experts = f.experts;

  json report = {{"bench", "replay"},
                 {"config",
                  {{"ranks", p.ranks},
                   {"redundant", p.redundant},
                   {"nodes", f.nodes},
                   {"routers_per_node", f.routers_per_node},
                   {"groups", f.groups},
                   {"batch", p.batches},
                   {"plan_fraction", f.plan_fraction},
                   {"split", f.split},
                   {"timing_runs", f.timing_runs},
                   {"node_slack", f.node_slack},
                   {"local_share", f.local_share},
                   {"copy_prior", f.copy_prior},
                   {"spill", f.spill >= 0 ? json(f.spill) : json(nullptr)},
                   {"activated_batch", f.activated_batch}}},
                 {"results", json::array()}};
  // Every trace is read (and every configuration checked) before anything is planned, so a bad
  // file or number ends the run at once.
  std::vector<RoutingTrace> traces;
  for (const std::string& path : f.traces) {
    Result<RoutingTrace> t = ReadRoutingTrace(path, read_options);
    if (!t.ok()) return FailWith(t.status());
    for (size_t i = 0; i < p.ranks.size(); ++i) {
      const int64_t slots = t->num_experts + p.redundant[i];
      const std::string what = path + ": " + std::to_string(t->num_experts) + " experts + " +
                               std::to_string(p.redundant[i]) +
                               " redundant = " + std::to_string(slots) + " slots ";
      if (slots % p.ranks[i] != 0) {
        return FailWith(Status::InvalidArgument(what + "do not divide over " +
                                                std::to_string(p.ranks[i]) + " ranks"));
      }
      if (slots / p.ranks[i] > t->num_experts) {
        return FailWith(Status::InvalidArgument(
            what + "put " + std::to_string(slots / p.ranks[i]) + " on each of " +
            std::to_string(p.ranks[i]) + " ranks, more than the experts (a rank holds each once)"));
      }
    }
    traces.push_back(std::move(*t));
  }

  for (const RoutingTrace& trace : traces) {
    // The planning and judging parts.
    const RoutingTrace* plan_on = &trace;
    const RoutingTrace* judge_on = &trace;
    std::optional<TraceParts> parts;
    std::string planned_on = "the whole trace", judged_on = "the whole trace";
    if (f.plan_fraction > 0 && trace.token_level()) {
      Result<TraceParts> split = SplitTrace(trace, f.plan_fraction, p.split);
      if (!split.ok()) return FailWith(split.status());
      parts = std::move(*split);
      plan_on = &parts->plan;
      judge_on = &parts->judge;
      char buf[96];
      std::snprintf(buf, sizeof buf, "the first %g of %s", f.plan_fraction,
                    p.split == SplitBy::kTokens ? "each stream's tokens" : "the streams");
      planned_on = buf;
      judged_on = "the rest";
    } else if (f.plan_fraction > 0) {
      judged_on = "the whole trace (window counts cannot be split)";
    }
    int64_t tokens = 0;
    for (const auto& s : trace.streams) tokens += s.tokens;
    const bool groups_fit = trace.num_experts % f.groups == 0;
    // The same for every rank count: node-aware's sample, and the planner's loads for
    // --activated-batch.
    const bool node_aware =
        std::find_if(p.policies.begin(), p.policies.end(), [](auto q) {
          return q == PlannerPolicy::kNodeAware || q == PlannerPolicy::kNodeLocal;
        }) != p.policies.end();
    const RoutingSample sample = node_aware ? SampleOf(*plan_on) : RoutingSample{};
    std::vector<std::vector<double>> activated;
    if (f.activated_batch > 0) {
      Result<std::vector<std::vector<double>>> act =
          ActivationLoad(plan_on->counts, PlanTokens(*plan_on), f.activated_batch);
      if (!act.ok()) return FailWith(act.status().WithContext(trace.source));
      activated = std::move(*act);
    }

    for (size_t ri = 0; ri < p.ranks.size(); ++ri) {
      PlannerInput in;
      in.load = plan_on->counts;
      in.num_ranks = static_cast<int>(p.ranks[ri]);
      in.num_slots = static_cast<int>(trace.num_experts + p.redundant[ri]);
      in.num_nodes = f.nodes;
      in.num_groups = groups_fit ? f.groups : 1;
      in.sample = sample;
      in.node_slack = f.node_slack;
      in.local_share = f.local_share;
      in.copy_prior = f.copy_prior;
      if (f.activated_batch > 0) in.load = activated;
      ReplayTopology topo;
      topo.num_ranks = in.num_ranks;
      topo.num_nodes = f.nodes;
      topo.routers_per_node = f.routers_per_node;
      topo.spill = f.spill;

      for (PlannerPolicy policy : p.policies) {
        json r = {{"trace", trace.source},
                  {"format", trace.token_level() ? "tokens" : "window"},
                  {"layers", trace.num_layers()},
                  {"experts", trace.num_experts},
                  {"top_k", trace.top_k},
                  {"tokens", trace.token_level() ? json(tokens) : json(nullptr)},
                  {"ranks", in.num_ranks},
                  {"redundant", p.redundant[ri]},
                  {"slots", in.num_slots},
                  {"nodes", f.nodes},
                  {"routers_per_node", f.routers_per_node},
                  {"groups", in.num_groups},
                  {"policy", PlannerPolicyName(policy)},
                  {"planned_for", f.activated_batch > 0
                                      ? "experts used per batch of " +
                                            std::to_string(f.activated_batch) + " tokens"
                                      : std::string("tokens")},
                  {"planned_on", planned_on},
                  {"judged_on", judged_on}};
        std::string note;
        if (!groups_fit && f.groups != 1) {
          note = "groups " + std::to_string(f.groups) + " do not divide " +
                 std::to_string(trace.num_experts) + " experts: planned with 1 group";
        }
        const std::string na = NotApplicable(policy, in);
        if (!na.empty()) {
          r["applicable"] = false;
          r["note"] = na;
          report["results"].push_back(std::move(r));
          continue;
        }
        r["applicable"] = true;
        if (!note.empty()) r["note"] = note;
        std::vector<double> times;
        std::vector<LayerMaps> plan;
        for (int run = 0; run < f.timing_runs; ++run) {
          const auto t0 = std::chrono::steady_clock::now();
          Result<std::vector<LayerMaps>> pl = PlanPlacement(in, policy);
          const auto t1 = std::chrono::steady_clock::now();
          if (!pl.ok()) {
            return FailWith(
                pl.status().WithContext(trace.source + ": " + PlannerPolicyName(policy)));
          }
          times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
          if (run == 0) plan = std::move(*pl);
        }
        std::sort(times.begin(), times.end());
        r["planner_ms_per_layer"] = times[times.size() / 2] / trace.num_layers();
        Result<WindowBalance> w = WindowBalancedness(*judge_on, plan, in.num_ranks);
        if (!w.ok()) return FailWith(w.status().WithContext(trace.source));
        r["window_balancedness"] = {{"mean", w->mean}, {"min", w->min}};
        // What the plan costs to reach: from the job's round-robin start, and (a split trace)
        // on to the same policy's plan on the judged part.
        {
          const int routers = std::max(1, f.nodes * f.routers_per_node);
          Result<Placement> start = Placement::RoundRobin(static_cast<int>(trace.num_experts),
                                                          in.num_ranks + routers, routers);
          if (!start.ok()) return FailWith(start.status());
          std::vector<const LayerPlacement*> from(plan.size(), start->Layer(0));
          r["rebalance_from_start"] = CostJson(from, plan, in.num_ranks, routers, f.expert_bytes);
          if (parts) {
            PlannerInput later = in;
            later.load = judge_on->counts;
            Result<std::vector<LayerMaps>> replan = PlanPlacement(later, policy);
            if (!replan.ok()) return FailWith(replan.status().WithContext(trace.source));
            std::vector<LayerPlacement> now;
            for (const LayerMaps& m : plan) {
              Result<LayerPlacement> lp = ToLayerPlacement(m, in.num_ranks, routers);
              if (!lp.ok()) break;
              now.push_back(std::move(*lp));
            }
            Result<WindowBalance> w2 = WindowBalancedness(*judge_on, *replan, in.num_ranks);
            if (!w2.ok()) return FailWith(w2.status().WithContext(trace.source));
            json rp = {{"window_balancedness", {{"mean", w2->mean}, {"min", w2->min}}}};
            if (now.size() == plan.size()) {
              std::vector<const LayerPlacement*> from_plan;
              for (const LayerPlacement& lp : now) from_plan.push_back(&lp);
              rp["cost"] = CostJson(from_plan, *replan, in.num_ranks, routers, f.expert_bytes);
            } else {
              rp["cost"] = nullptr;
            }
            r["replan_on_judged"] = std::move(rp);
          }
        }
        if (trace.token_level()) {
          json batches = json::array();
          for (int64_t b : p.batches) {
            Result<BatchMetrics> m = MeasureBatches(*judge_on, plan, topo, b);
            if (!m.ok()) return FailWith(m.status().WithContext(trace.source));
            batches.push_back(BatchJson(*m));
          }
          r["batches"] = std::move(batches);
        } else {
          r["batches"] = nullptr;
        }
        report["results"].push_back(std::move(r));
      }
    }
  }
  PrintTable(report, f.json ? stderr : stdout);
  if (f.json) std::printf("%s\n", report.dump(2).c_str());
  return 0;
}

}  // namespace moerun::bench
