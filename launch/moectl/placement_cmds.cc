// moectl placement plan (a dry run on the job's load, or offline on a load matrix), and the
// commands that migrate the job online (placement apply FILE | apply --plan | import FILE,
// rebalance, retire RANK) or follow its migration (placement progress), with --wait.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "launch/moectl/client.h"
#include "launch/moectl/commands.h"
#include "launch/moectl/print.h"
#include "launch/plot/svg_plot.h"
#include "launch/rank_services.h"
#include "router/placement.h"
#include "router/placement_plan.h"

namespace moerun::moectl {

namespace {

// The planner's options of placement plan, apply --plan and rebalance.
struct PlannerFlags {
  int redundant = 0;  // --redundant
  std::string policy = "default";
  int groups = 0, nodes = 0;
  bool incremental = false;  // --incremental [--max-moves N] [--target-balance X]
  int max_moves = 0;
  double target_balance = 0;
  double max_mib = 0;                        // --max-mib: the rebalance's byte budget (0: none)
  double local_share = -1, copy_prior = -1;  // --local-share, --copy-prior (< 0: unset)
  std::string rank_slots;                    // --rank-slots RANK:N[,RANK:N...]
  std::string rank_speed;                    // --rank-speed RANK:S[,RANK:S...]
  bool speed_measured = false;               // --speed-measured
};

struct PlanFlags {  // placement plan
  PlannerFlags planner;
  std::string out;   // --out FILE
  std::string plot;  // --plot FILE.svg
  bool json = false;
  std::string loads_path, placement_path;  // --loads, --placement: offline
  int ranks = 0, routers = 1;
  int64_t expert_bytes = 0;
  std::string cache_experts;  // --cache-experts N[,N...]: offline
};

struct MigrateFlags {      // placement apply/import/progress, rebalance
  std::string file;        // apply FILE, import FILE
  bool from_plan = false;  // apply --plan; always for rebalance
  PlannerFlags planner;
  double min_gain = 0, throttle_mib_s = 0;
  bool wait = false, json = false;
};

Result<std::map<int, int>> ParseRankSlots(const std::string& text);
Result<std::map<int, double>> ParseRankSpeeds(const std::string& text);

void SetPlanRequest(const PlannerFlags& f, v1::PlanRequest* pr) {
  pr->set_redundant(f.redundant);
  pr->set_policy(f.policy);
  pr->set_groups(f.groups);
  pr->set_nodes(f.nodes);
  pr->set_incremental(f.incremental);
  pr->set_max_moves(f.max_moves);
  pr->set_target_balance(f.target_balance);
  pr->set_max_bytes(static_cast<int64_t>(f.max_mib * (1 << 20)));
  if (f.local_share >= 0) pr->set_local_share(f.local_share);
  if (f.copy_prior >= 0) pr->set_copy_prior(f.copy_prior);
  if (auto slots = ParseRankSlots(f.rank_slots); !f.rank_slots.empty() && slots.ok()) {
    for (const auto& [rank, n] : *slots) (*pr->mutable_rank_slots())[rank] = n;
  }
  if (auto speeds = ParseRankSpeeds(f.rank_speed); !f.rank_speed.empty() && speeds.ok()) {
    for (const auto& [rank, v] : *speeds) (*pr->mutable_rank_speed())[rank] = v;
  }
  pr->set_speed_measured(f.speed_measured);
}

// --loads FILE: {"layers": {"0": [loads...], ...}} or [[loads of layer 0], [layer 1], ...].
Result<std::map<int, std::vector<double>>> ReadLoads(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    return Status::InvalidArgument(path + ": not JSON: " + e.what());
  }
  std::map<int, std::vector<double>> loads;
  auto row = [&](const nlohmann::json& v, int layer) -> Status {
    if (!v.is_array()) return Status::InvalidArgument(path + ": layer loads must be arrays");
    for (const auto& x : v) {
      if (!x.is_number()) return Status::InvalidArgument(path + ": loads must be numbers");
      loads[layer].push_back(x.get<double>());
    }
    return Status::Ok();
  };
  if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) MOERUN_RETURN_IF_ERROR(row(j[i], static_cast<int>(i)));
  } else if (j.is_object() && j.contains("layers") && j["layers"].is_object()) {
    for (const auto& [k, v] : j["layers"].items()) {
      int layer = -1;
      try {
        layer = std::stoi(k);
      } catch (const std::exception&) {
      }
      if (layer < 0) return Status::InvalidArgument(path + ": layer '" + k + "' is not a number");
      MOERUN_RETURN_IF_ERROR(row(v, layer));
    }
  } else {
    return Status::InvalidArgument(path + ": expected {\"layers\": {\"0\": [...]}} or [[...]]");
  }
  if (loads.empty()) return Status::InvalidArgument(path + ": no loads");
  return loads;
}

// RANK:V[,RANK:V...] (each rank once; `valid` checks each value), or `bad_pairs` in an error.
template <typename V, typename Valid>
Result<std::map<int, V>> ParseRankPairs(const std::string& text, const char* bad_pairs,
                                        Valid valid) {
  std::map<int, V> out;
  size_t start = 0;
  const auto bad = [&] {
    return Status::InvalidArgument(
        fmt::format("must be {}, comma-separated, not {}", bad_pairs, text));
  };
  while (true) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    const size_t colon = item.find(':');
    if (colon == std::string::npos) return bad();
    int rank = -1;
    V v{};
    const auto [e1, c1] = std::from_chars(item.data(), item.data() + colon, rank);
    const auto [e2, c2] = std::from_chars(item.data() + colon + 1, item.data() + item.size(), v);
    if (c1 != std::errc() || e1 != item.data() + colon || c2 != std::errc() ||
        e2 != item.data() + item.size() || rank < 0 || !valid(v) || !out.emplace(rank, v).second) {
      return bad();
    }
    if (comma == text.size()) break;
    start = comma + 1;
  }
  return out;
}

// --rank-slots RANK:N[,RANK:N...]: the slots of named expert ranks.
Result<std::map<int, int>> ParseRankSlots(const std::string& text) {
  return ParseRankPairs<int>(text, "RANK:SLOTS pairs (whole numbers, each rank once)",
                             [](int n) { return n >= 0; });
}

// --rank-speed RANK:S[,RANK:S...]: the speeds of named expert ranks (finite, above 0).
Result<std::map<int, double>> ParseRankSpeeds(const std::string& text) {
  return ParseRankPairs<double>(
      text, "RANK:SPEED pairs (a rank number, a finite speed above 0; each rank once)",
      [](double v) { return v > 0 && std::isfinite(v); });
}

// The validators of --rank-slots and --rank-speed.
template <typename Parse>
CLI::Validator PairsValidator(Parse parse, const char* form) {
  return CLI::Validator(
      [parse](std::string& text) -> std::string {
        auto v = parse(text);
        return v.ok() ? std::string() : v.status().message();
      },
      form);
}
const CLI::Validator kRankSlots = PairsValidator(ParseRankSlots, "RANK:N[,RANK:N...]");
const CLI::Validator kRankSpeeds = PairsValidator(ParseRankSpeeds, "RANK:S[,RANK:S...]");

// --cache-experts N[,N...]: experts of each layer every expert rank's cache holds (0: no cache).
Result<std::vector<int>> ParseCacheExperts(const std::string& text) {
  std::vector<int> out;
  size_t start = 0;
  while (true) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    int v = -1;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || v < 0) {
      return Status::InvalidArgument(fmt::format(
          "must be whole numbers >= 0 (experts per layer each cache holds), comma-separated, "
          "not {}",
          text));
    }
    out.push_back(v);
    if (comma == text.size()) break;
    start = comma + 1;
  }
  return out;
}

const CLI::Validator kCacheExperts(
    [](std::string& text) -> std::string {
      auto v = ParseCacheExperts(text);
      return v.ok() ? std::string() : v.status().message();
    },
    "N[,N...]");

// The whole of a file the user named ("placement apply FILE"): a clear error if it is missing,
// a folder or unreadable.
Result<std::string> ReadUserFile(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return Status::NotFound(fmt::format("{} {}: no such file", what, path));
  }
  if (std::filesystem::is_directory(path, ec)) {
    return Status::InvalidArgument(fmt::format("{} {} is a folder, not a file", what, path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::IoError(fmt::format("{} {}: cannot open: {}", what, path, std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::IoError(fmt::format("{} {}: cannot read", what, path));
  return text.str();
}

// --plot FILE.svg: per layer, each expert rank's load under the current placement and under the
// plan (one panel per layer, in a grid), the balancedness before -> after in the titles.
std::string PlanSvg(const v1::PlanResponse& p) {
  plot::BarGrid g;
  g.series_names = {"current placement", "plan (predicted)"};
  g.x_label = "expert rank";
  g.y_label = "load (assignments)";
  double before = 0, after = 0;
  for (const auto& l : p.layers()) {
    plot::BarPanel panel;
    panel.title = fmt::format("layer {}: balancedness {:.3f} \u2192 {:.3f}", l.layer(),
                              l.balancedness_before(), l.balancedness_after());
    for (int rank : l.ranks()) panel.categories.push_back(std::to_string(rank));
    panel.values.emplace_back(l.rank_load_before().begin(), l.rank_load_before().end());
    panel.values.emplace_back(l.rank_load_after().begin(), l.rank_load_after().end());
    g.panels.push_back(std::move(panel));
    before += l.balancedness_before();
    after += l.balancedness_after();
  }
  const double n = std::max(1, p.layers_size());
  g.title = "Load per expert rank: current placement vs plan";
  g.subtitle =
      fmt::format("{} policy, {} slots per expert rank; mean balancedness {:.3f} \u2192 {:.3f}",
                  p.policy(), p.slots_per_rank(), before / n, after / n);
  return plot::BarGridSvg(g);
}

// The plan printed (or its JSON), its placement written to --out FILE, its chart to --plot.
int FinishPlan(const v1::PlanResponse& p, const PlanFlags& f) {
  if (f.json) {
    std::printf("%s\n", Json(p).c_str());
  } else {
    PrintPlan(p);
  }
  if (!f.out.empty()) {
    if (p.placement_json().empty()) return Fail("no placement to write: " + p.note());
    std::ofstream out(f.out);
    out << p.placement_json() << "\n";
    out.close();
    if (!out) return Fail("cannot write " + f.out);
    std::fprintf(stderr, "moectl: planned placement written to %s\n", f.out.c_str());
  }
  if (!f.plot.empty()) {
    if (p.layers_size() == 0) return Fail("no plan to plot: " + p.note());
    if (Status st = plot::WriteSvg(f.plot, PlanSvg(p)); !st.ok()) return Fail(st.message(), 2);
    std::fprintf(stderr, "moectl: plot written to %s\n", f.plot.c_str());
  }
  return 0;
}

// placement plan --loads FILE: no job involved (and no token read).
int PlanOffline(const PlanFlags& f) {
  auto loads = ReadLoads(f.loads_path);
  if (!loads.ok()) return Fail(loads.status().ToString(), 2);
  const int experts = static_cast<int>(loads->begin()->second.size());
  auto current = !f.placement_path.empty() ? Placement::FromFile(f.placement_path)
                 : f.ranks > 0             ? Placement::Linear(experts, f.ranks, f.routers)
                                           : Result<Placement>(Status::InvalidArgument(
                                                 "--loads needs --placement FILE or --ranks N"));
  if (!current.ok()) return Fail(current.status().ToString(), 2);
  PlanOptions o;
  o.redundant = f.planner.redundant;
  auto pol = ParsePlannerPolicy(f.planner.policy);
  if (!pol.ok()) return Fail(pol.status().ToString(), 2);
  o.policy = *pol;
  o.groups = f.planner.groups > 0 ? f.planner.groups : 1;
  o.nodes = f.planner.nodes > 0 ? f.planner.nodes : 1;
  o.incremental = f.planner.incremental;
  o.max_moves = f.planner.max_moves;
  o.target_balance = f.planner.target_balance;
  o.max_bytes = static_cast<int64_t>(f.planner.max_mib * (1 << 20));
  if (f.planner.local_share >= 0) o.local_share = f.planner.local_share;
  if (f.planner.copy_prior >= 0) o.copy_prior = f.planner.copy_prior;
  if (!f.planner.rank_slots.empty()) {
    auto slots = ParseRankSlots(f.planner.rank_slots);
    if (!slots.ok()) return Fail("--rank-slots " + slots.status().message(), 2);
    o.rank_slots = *slots;
  }
  if (f.planner.speed_measured) {
    return Fail("--speed-measured needs a running job (offline, give --rank-speed)", 2);
  }
  if (!f.planner.rank_speed.empty()) {
    auto speeds = ParseRankSpeeds(f.planner.rank_speed);
    if (!speeds.ok()) return Fail("--rank-speed " + speeds.status().message(), 2);
    o.rank_speed = *speeds;
  }
  if (!f.cache_experts.empty()) {
    auto cache = ParseCacheExperts(f.cache_experts);
    if (!cache.ok())
      return Fail("--cache-experts " + cache.status().message() + " (see --help)", 2);
    const int expert_ranks = current->num_ranks() - current->num_routers();
    if (cache->size() == 1) {
      o.cache_experts.assign(static_cast<size_t>(std::max(expert_ranks, 0)), cache->front());
    } else if (static_cast<int>(cache->size()) == expert_ranks) {
      o.cache_experts = *cache;
    } else {
      return Fail(
          fmt::format("--cache-experts gives {} values: give one (for every expert rank) or "
                      "one per expert rank ({}) (see --help)",
                      cache->size(), expert_ranks),
          2);
    }
  }
  auto rep = MakePlan(*loads, *current, f.expert_bytes, o);
  if (!rep.ok()) return Fail(rep.status().ToString(), 2);
  return FinishPlan(PlanToProto(*rep), f);
}

int RunPlan(const Session& s, const PlanFlags& f) {
  if (!f.plot.empty()) {
    if (Status st = plot::CheckSvgPath("--plot", f.plot); !st.ok()) return Fail(st.message(), 2);
  }
  if (!f.loads_path.empty()) return PlanOffline(f);
  v1::ControlRequest req;
  SetPlanRequest(f.planner, req.mutable_plan());
  v1::ControlResponse resp;
  if (int rc = Send(s, req, &resp, /*retry=*/true); rc != 0) return rc;
  return FinishPlan(resp.plan(), f);
}

// --incremental, --max-moves, --target-balance (placement plan, apply --plan, rebalance).
std::vector<CLI::Option*> AddIncrementalOptions(CLI::App* sub, PlannerFlags& f) {
  CLI::Option* inc = sub->add_flag(
      "--incremental", f.incremental,
      "Improve the current placement by single moves (swaps, re-assigned slots) instead of "
      "planning afresh: fewer experts to load");
  CLI::Option* moves =
      sub->add_option("--max-moves", f.max_moves,
                      "With --incremental: expert copies to load per layer at most (0: no limit)")
          ->check(kNonNegative)
          ->needs(inc);
  CLI::Option* target = sub->add_option("--target-balance", f.target_balance,
                                        "With --incremental: stop once a layer's predicted "
                                        "balancedness reaches this (0..1; 0: no target)")
                            ->check(CLI::Range(0.0, 1.0))
                            ->needs(inc);
  sub->add_option("--max-mib", f.max_mib,
                  "The rebalance may load at most this many MiB of expert weights in all: the "
                  "layers that gain the most balance per byte move, the others stay (0: no "
                  "limit; offline it needs --expert-bytes)")
      ->check(kNonNegative);
  sub->add_option("--local-share", f.local_share,
                  "node-local: the share of the redundant slots copied to other nodes (default "
                  "0.75)")
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--copy-prior", f.copy_prior,
                  "node-local: plan the copies on the loads + this x their mean (default 0: the "
                  "window's hot experts; large: spread evenly, for traffic unlike the window's)")
      ->check(CLI::Range(0.0, 1e6));
  sub->add_option("--rank-slots", f.rank_slots,
                  "Slots of named expert ranks (what each one's memory holds), RANK:N[,RANK:N...]; "
                  "the others share the rest evenly (default and eplb-global)")
      ->check(kRankSlots);
  CLI::Option* speed =
      sub->add_option("--rank-speed", f.rank_speed,
                      "Speeds of named expert ranks (rows per second, or any unit the same for "
                      "all), RANK:S[,RANK:S...]; the others 1: the plan balances each rank's "
                      "time (load / speed), not its load, and may give faster ranks more slots")
          ->check(kRankSpeeds);
  sub->add_flag("--speed-measured", f.speed_measured,
                "Balance time with each expert rank's measured speed (rows computed per second "
                "computing, moectl status's speed column)")
      ->excludes(speed);
  return {inc, moves, target};
}

void AddPlanCommand(CLI::App& placement, Session& s) {
  auto f = std::make_shared<PlanFlags>();  // lives as long as the callback
  CLI::App* plan = placement.add_subcommand(
      "plan", "Dry run: the planner's placement for the measured load (or --loads FILE)");
  plan->add_option("--redundant", f->planner.redundant, "Redundant expert slots per layer")
      ->default_val(0);
  plan->add_option("--policy", f->planner.policy,
                   "default, eplb-hierarchical, eplb-global, node-aware or node-local")
      ->default_val("default");
  plan->add_option("--groups", f->planner.groups,
                   "Expert groups (default: the model's gate groups)");
  plan->add_option(
      "--nodes", f->planner.nodes,
      "Nodes the expert ranks span, in rank order (default: the job's nodes from its ranks' "
      "hosts or its nodes: map; offline 1)");
  AddIncrementalOptions(plan, f->planner);
  plan->add_option("--out", f->out, "Write the planned placement JSON to FILE");
  plan->add_option("--plot", f->plot,
                   "Also draw each expert rank's load, now and planned, per layer: an SVG FILE");
  plan->add_flag("--json", f->json, "Print JSON");
  CLI::Option* loads =
      plan->add_option("--loads", f->loads_path, "Plan offline from this load matrix (JSON)");
  plan->add_option("--placement", f->placement_path, "Offline: the current placement JSON");
  plan->add_option("--ranks", f->ranks, "Offline, without --placement: ranks (linear placement)");
  plan->add_option("--routers", f->routers, "Offline, with --ranks: router ranks")->default_val(1);
  plan->add_option("--expert-bytes", f->expert_bytes, "Offline: bytes of one expert's weights");
  plan->add_option("--cache-experts", f->cache_experts,
                   "Offline: experts of each layer each expert rank's cache holds (one value for "
                   "every rank, or one per expert rank; 0: no cache)")
      ->check(kCacheExperts)
      ->needs(loads);
  plan->callback([&s, f] { s.rc = RunPlan(s, *f); });
}

// What --wait compares between polls (the elapsed time always changes: not part of it).
std::string MigrationKey(const v1::MigrationStatus& m) {
  std::string key = fmt::format("{}/{}/{}/{}", m.id(), m.state(), m.bytes_loaded(), m.error());
  for (const auto& l : m.layers()) {
    key += fmt::format("/{}:{}:{}", l.layer(), l.state(), l.bytes_loaded());
  }
  return key;
}

// --wait: polls until *m is no longer running, printing a line when something changes.
int WaitForMigration(ControlClient& client, const Waiter& w, v1::MigrationStatus* m) {
  std::string key = MigrationKey(*m);
  v1::ControlRequest poll;
  poll.mutable_progress();
  while (m->state() == "running") {
    w.Pause();
    v1::ControlResponse pr;
    if (int rc = client.Call(poll, &pr, /*retry=*/true); rc != 0) {
      std::fprintf(stderr,
                   "moectl: lost track of migration %llu: see moectl placement "
                   "progress\n",
                   static_cast<unsigned long long>(m->id()));
      return rc;
    }
    if (pr.migration().id() != m->id()) {
      return Fail(fmt::format(
          "migration {} is no longer the router's (now migration {}, {}): its outcome is "
          "unknown here",
          m->id(), pr.migration().id(), pr.migration().state()));
    }
    *m = pr.migration();
    if (std::string k = MigrationKey(*m); k != key) {
      key = std::move(k);
      w.Line(MigrationProgressLine(*m, w.Seconds()));
    }
  }
  return 0;
}

// Sends `req` (an apply, or a progress request), then follows the migration with --wait and
// prints it: 1 if it failed.
int FollowMigration(const Session& s, const MigrateFlags& f, const v1::ControlRequest& req,
                    bool retry) {
  std::unique_ptr<ControlClient> client = MakeClient(s);
  if (!client) return 2;
  v1::ControlResponse resp;
  if (int rc = client->Call(req, &resp, retry); rc != 0) return rc;
  const Waiter waiter(f.json);
  v1::MigrationStatus m = resp.migration();
  if (f.wait && m.state() == "running") {
    if (!f.json) PrintMigration(m);
    if (int rc = WaitForMigration(*client, waiter, &m); rc != 0) return rc;
  }
  if (f.json) {
    std::printf("%s\n", Json(m).c_str());
  } else {
    PrintMigration(m);
  }
  return m.state() == "failed" ? 1 : 0;
}

// placement apply FILE | apply --plan | import FILE, rebalance. FILE is read (and for import,
// checked and summed up) here before anything is sent.
int RunApply(const Session& s, const MigrateFlags& f, bool import) {
  v1::ControlRequest req;
  v1::ApplyRequest* ar = req.mutable_apply();
  if (f.from_plan) {
    ar->set_from_plan(true);
    SetPlanRequest(f.planner, ar->mutable_plan());
    ar->set_min_gain(f.min_gain);
  } else {
    auto text = ReadUserFile(f.file, "placement");
    if (!text.ok()) return Fail(text.status().message());
    if (import) {
      auto p = Placement::FromJson(*text, f.file);
      if (!p.ok()) return Fail("placement import: " + p.status().ToString());
      PrintPlacementSummary(f.json ? stderr : stdout, f.file, *p, *text);
    }
    ar->set_placement_json(*text);
  }
  ar->set_throttle_mib_s(f.throttle_mib_s);
  return FollowMigration(s, f, req, /*retry=*/false);  // a change: sent once
}

// retire RANK: the migration that empties the rank (followed with --wait), after which router 0
// sends it its shutdown.
int RunRetire(const Session& s, const MigrateFlags& f, int rank) {
  v1::ControlRequest req;
  v1::ApplyRequest* ar = req.mutable_apply();
  ar->set_retire_rank(rank);
  ar->set_throttle_mib_s(f.throttle_mib_s);
  return FollowMigration(s, f, req, /*retry=*/false);
}

int RunProgress(const Session& s, const MigrateFlags& f) {
  v1::ControlRequest req;
  req.mutable_progress();
  return FollowMigration(s, f, req, /*retry=*/true);
}

// --redundant --policy --groups --nodes --min-gain of apply --plan and rebalance.
std::vector<CLI::Option*> AddPlannerOptions(CLI::App* sub, MigrateFlags& f) {
  std::vector<CLI::Option*> options = AddIncrementalOptions(sub, f.planner);
  options.insert(
      options.end(),
      {sub->add_option("--redundant", f.planner.redundant, "Redundant expert slots per layer")
           ->check(kNonNegative),
       sub->add_option("--policy", f.planner.policy,
                       "default, eplb-hierarchical, eplb-global, node-aware or node-local"),
       sub->add_option("--groups", f.planner.groups,
                       "Expert groups (default: the model's gate groups)")
           ->check(kNonNegative),
       sub->add_option("--nodes", f.planner.nodes,
                       "Nodes the expert ranks span, in rank order (default: the job's nodes from "
                       "its ranks' "
                       "hosts or its nodes: map; offline 1)")
           ->check(kNonNegative),
       sub->add_option("--min-gain", f.min_gain,
                       "Apply only if the predicted mean balancedness gains this much "
                       "(else: skipped)")});
  return options;
}

void AddMigrationOptions(CLI::App* sub, MigrateFlags& f) {
  sub->add_option("--throttle-mib-s", f.throttle_mib_s,
                  "Loading bandwidth per expert rank, MiB/s (default: the job's config)")
      ->check(kNonNegative);
  sub->add_flag("--wait", f.wait, "Wait until the migration is done or failed, showing progress");
  sub->add_flag("--json", f.json, "Print the (final) answer as JSON");
}

void AddApplyCommand(CLI::App& placement, Session& s) {
  auto f = std::make_shared<MigrateFlags>();  // lives as long as the callback
  CLI::App* apply = placement.add_subcommand(
      "apply", "Migrate the job online to the placement in FILE, or to the planner's (--plan)");
  CLI::Option* file_opt = apply->add_option("FILE", f->file, "A moerun-placement-v1 JSON file");
  CLI::Option* plan_opt =
      apply->add_flag("--plan", f->from_plan, "Plan on the measured load and apply the plan");
  file_opt->excludes(plan_opt);
  for (CLI::Option* o : AddPlannerOptions(apply, *f)) o->needs(plan_opt);
  AddMigrationOptions(apply, *f);
  apply->callback([&s, f, file_opt] {
    if (file_opt->count() == 0 && !f->from_plan) {
      s.rc = Fail("placement apply: give a placement FILE or --plan (see --help)", 2);
      return;
    }
    s.rc = RunApply(s, *f, /*import=*/false);
  });
}

}  // namespace

void AddPlacementCommands(CLI::App& app, CLI::App& placement, Session& s) {
  AddPlanCommand(placement, s);
  AddApplyCommand(placement, s);

  auto import_flags = std::make_shared<MigrateFlags>();
  CLI::App* import_cmd = placement.add_subcommand(
      "import", "Check the placement in FILE here, then apply it (as apply FILE)");
  import_cmd->add_option("FILE", import_flags->file, "A moerun-placement-v1 JSON file")->required();
  AddMigrationOptions(import_cmd, *import_flags);
  import_cmd->callback([&s, import_flags] { s.rc = RunApply(s, *import_flags, /*import=*/true); });

  auto progress_flags = std::make_shared<MigrateFlags>();
  CLI::App* progress =
      placement.add_subcommand("progress", "The running (or last) migration, layer by layer");
  progress->add_flag("--wait", progress_flags->wait,
                     "Wait until it is no longer running, showing progress");
  progress->add_flag("--json", progress_flags->json, "Print the (final) answer as JSON");
  progress->callback([&s, progress_flags] { s.rc = RunProgress(s, *progress_flags); });

  auto rebalance_flags = std::make_shared<MigrateFlags>();
  rebalance_flags->from_plan = true;  // rebalance = placement apply --plan
  CLI::App* rebalance = app.add_subcommand(
      "rebalance", "Plan on the measured load and migrate to the plan (= placement apply --plan)");
  AddPlannerOptions(rebalance, *rebalance_flags);
  AddMigrationOptions(rebalance, *rebalance_flags);
  rebalance->callback(
      [&s, rebalance_flags] { s.rc = RunApply(s, *rebalance_flags, /*import=*/false); });

  auto retire_flags = std::make_shared<MigrateFlags>();
  auto retire_rank = std::make_shared<int>(-1);
  CLI::App* retire = app.add_subcommand(
      "retire",
      "Take an expert rank out of the job: its experts are re-placed on the others (a "
      "migration), then it is sent its shutdown and leaves");
  retire->add_option("RANK", *retire_rank, "The expert rank")->required();
  AddMigrationOptions(retire, *retire_flags);
  retire->callback(
      [&s, retire_flags, retire_rank] { s.rc = RunRetire(s, *retire_flags, *retire_rank); });
}

}  // namespace moerun::moectl
