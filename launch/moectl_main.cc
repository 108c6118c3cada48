// moectl: the operator's command line for a running moerun job (router 0's control endpoint).
//   moectl --target HOST:PORT [--token-file FILE] status [--json]
//   moectl ... placement show
//   moectl ... placement export FILE
//   moectl ... stats [--json]
//   moectl ... placement plan [--redundant N] [--policy P] [--groups G] [--nodes N] [--json]
//                             [--out FILE]                          (a dry run on the job's load)
//   moectl placement plan --loads FILE (--placement FILE | --ranks N [--routers R]) [...]
//                                                                      (offline, no job)
// The token comes from --token-file or MOERUN_TOKEN_FILE. Exit: 0 ok, 1 refused or failed, 2 bad
// usage.
#include <fmt/format.h>
#include <google/protobuf/util/json_util.h>
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "launch/control_endpoint.h"
#include "launch/rank_services.h"
#include "launch/serve_client.h"
#include "moerun/v1/control.pb.h"
#include "router/placement_plan.h"

namespace {

using moerun::Status;

int Fail(const std::string& message, int code = 1) {
  std::fprintf(stderr, "moectl: %s\n", message.c_str());
  return code;
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;  // layer 0, 0 copies: printed, not left out
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::string Mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

void PrintStatus(const moerun::v1::StatusResponse& s) {
  std::printf("model %s: %d ranks (%d router%s), placement v%llu, %s, up %.0f s, %llu batches\n",
              s.model().c_str(), s.num_ranks(), s.num_routers(), s.num_routers() == 1 ? "" : "s",
              static_cast<unsigned long long>(s.placement_version()),
              s.ready() ? "ready" : "NOT READY", s.uptime_s(),
              static_cast<unsigned long long>(s.batches()));
  for (const auto& l : s.layers()) {
    std::printf(
        "layer %d: %llu assignments, balancedness %.3f; last %.0f s: %llu assignments, "
        "balancedness %.3f\n",
        l.layer(), static_cast<unsigned long long>(l.assignments()), l.balancedness(), l.window_s(),
        static_cast<unsigned long long>(l.window_assignments()), l.window_balancedness());
  }
  std::printf("%-5s %-7s %-20s %-8s %-22s %12s %12s %9s %s\n", "rank", "role", "host", "pid",
              "state", "assignments", "rows_served", "rss_mib", "experts");
  for (const auto& r : s.ranks()) {
    std::string experts;
    for (const auto& le : r.layers()) {
      if (s.layers_size() > 1) experts += fmt::format("L{}:", le.layer());
      std::string list;
      for (int e : le.experts()) list += fmt::format("{}{}", list.empty() ? "" : ",", e);
      experts += fmt::format("{} ", list.empty() ? "-" : list);
    }
    std::printf("%-5d %-7s %-20s %-8lld %-22s %12llu %12llu %9s %s\n", r.rank(), r.role().c_str(),
                r.host().empty() ? "?" : r.host().c_str(), static_cast<long long>(r.pid()),
                r.state().c_str(), static_cast<unsigned long long>(r.assignments()),
                static_cast<unsigned long long>(r.rows_served()), Mib(r.resident_bytes()).c_str(),
                experts.c_str());
  }
}

void PrintPlan(const moerun::v1::PlanResponse& p) {
  std::printf(
      "plan (%s policy, %d slots per expert rank%s): a dry run, nothing changed\n",
      p.policy().c_str(), p.slots_per_rank(),
      p.window_s() > 0 ? fmt::format(", loads of the last {:.0f} s", p.window_s()).c_str() : "");
  std::printf("%-6s %12s %10s %10s %8s %12s\n", "layer", "assignments", "balanced", "planned",
              "copies", "bytes");
  for (const auto& l : p.layers()) {
    std::printf(
        "%-6d %12llu %10.3f %10.3f %8d %12s\n", l.layer(),
        static_cast<unsigned long long>(l.load()), l.balancedness_before(), l.balancedness_after(),
        l.experts_to_load(),
        fmt::format("{:.1f} MiB", static_cast<double>(l.bytes_to_move()) / (1 << 20)).c_str());
  }
  if (!p.note().empty()) std::printf("note: %s\n", p.note().c_str());
}

// --loads FILE: {"layers": {"0": [loads...], ...}} or [[loads of layer 0], [layer 1], ...].
moerun::Result<std::map<int, std::vector<double>>> ReadLoads(const std::string& path) {
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("moectl: inspect a running moerun job");
  std::string target = "127.0.0.1:5800", token_file;
  int timeout_ms = 10000;
  bool json = false;
  app.add_option("--target", target, "Router 0's control endpoint HOST:PORT")->default_val(target);
  app.add_option("--token-file", token_file, "File holding the control token")
      ->envname("MOERUN_TOKEN_FILE");
  app.add_option("--timeout-ms", timeout_ms, "Give up after this long")->default_val(10000);
  app.require_subcommand(1);
  CLI::App* status = app.add_subcommand("status", "Ranks, roles, experts, load, balancedness");
  status->add_flag("--json", json, "Print JSON");
  CLI::App* stats = app.add_subcommand("stats", "Assignments per (layer, expert)");
  stats->add_flag("--json", json, "Print JSON");
  CLI::App* placement = app.add_subcommand("placement", "The expert placement");
  placement->require_subcommand(1);
  CLI::App* show = placement->add_subcommand("show", "Print the placement JSON");
  std::string export_path;
  CLI::App* exp = placement->add_subcommand("export", "Write the placement JSON to FILE");
  exp->add_option("FILE", export_path, "Output file")->required();
  CLI::App* plan = placement->add_subcommand(
      "plan", "Dry run: the planner's placement for the measured load (or --loads FILE)");
  int redundant = 0, groups = 0, nodes = 0, ranks = 0, routers = 1;
  int64_t expert_bytes = 0;
  std::string policy = "default", loads_path, placement_path, plan_out;
  plan->add_option("--redundant", redundant, "Redundant expert slots per layer")->default_val(0);
  plan->add_option("--policy", policy, "default, eplb-hierarchical or eplb-global")
      ->default_val("default");
  plan->add_option("--groups", groups, "Expert groups (default: the model's gate groups)");
  plan->add_option("--nodes", nodes, "Nodes the expert ranks span (default 1)");
  plan->add_option("--out", plan_out, "Write the planned placement JSON to FILE");
  plan->add_flag("--json", json, "Print JSON");
  plan->add_option("--loads", loads_path, "Plan offline from this load matrix (JSON)");
  plan->add_option("--placement", placement_path, "Offline: the current placement JSON");
  plan->add_option("--ranks", ranks, "Offline, without --placement: ranks (linear placement)");
  plan->add_option("--routers", routers, "Offline, with --ranks: router ranks")->default_val(1);
  plan->add_option("--expert-bytes", expert_bytes, "Offline: bytes of one expert's weights");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  auto finish_plan = [&](const moerun::v1::PlanResponse& p) -> int {
    if (json) {
      std::printf("%s\n", Json(p).c_str());
    } else {
      PrintPlan(p);
    }
    if (!plan_out.empty()) {
      if (p.placement_json().empty()) return Fail("no placement to write: " + p.note());
      std::ofstream out(plan_out);
      out << p.placement_json() << "\n";
      out.close();
      if (!out) return Fail("cannot write " + plan_out);
      std::fprintf(stderr, "moectl: planned placement written to %s\n", plan_out.c_str());
    }
    return 0;
  };
  if (plan->parsed() && !loads_path.empty()) {  // offline: no job involved
    auto loads = ReadLoads(loads_path);
    if (!loads.ok()) return Fail(loads.status().ToString(), 2);
    const int experts = static_cast<int>(loads->begin()->second.size());
    auto current = !placement_path.empty() ? moerun::Placement::FromFile(placement_path)
                   : ranks > 0             ? moerun::Placement::Linear(experts, ranks, routers)
                               : moerun::Result<moerun::Placement>(Status::InvalidArgument(
                                     "--loads needs --placement FILE or --ranks N"));
    if (!current.ok()) return Fail(current.status().ToString(), 2);
    moerun::PlanOptions o;
    o.redundant = redundant;
    auto pol = moerun::ParsePlannerPolicy(policy);
    if (!pol.ok()) return Fail(pol.status().ToString(), 2);
    o.policy = *pol;
    o.groups = groups > 0 ? groups : 1;
    o.nodes = nodes > 0 ? nodes : 1;
    auto rep = moerun::MakePlan(*loads, *current, expert_bytes, o);
    if (!rep.ok()) return Fail(rep.status().ToString(), 2);
    return finish_plan(moerun::PlanToProto(*rep));
  }

  moerun::v1::ControlRequest req;
  if (!token_file.empty()) {
    auto token = moerun::ReadTokenFile(token_file);
    if (!token.ok()) return Fail(token.status().ToString(), 2);
    req.set_token(*token);
  }
  if (status->parsed()) {
    req.mutable_status();
  } else if (stats->parsed()) {
    req.mutable_stats();
  } else if (plan->parsed()) {
    moerun::v1::PlanRequest* pr = req.mutable_plan();
    pr->set_redundant(redundant);
    pr->set_policy(policy);
    pr->set_groups(groups);
    pr->set_nodes(nodes);
  } else {
    req.mutable_placement();
  }
  const auto deadline = moerun::DeadlineIn(std::chrono::milliseconds(timeout_ms));
  moerun::ClientOptions co;
  co.connect_timeout = std::chrono::milliseconds(timeout_ms);
  auto conn = moerun::ServeConnection::Connect(target, co);
  if (!conn.ok()) return Fail(conn.status().ToString());
  Status s = (*conn)->Send(req, deadline);
  moerun::v1::ControlResponse resp;
  if (s.ok()) s = (*conn)->Receive(&resp, deadline);
  if (!s.ok()) return Fail(target + ": " + s.ToString());
  if (resp.code() != moerun::v1::OK) {
    return Fail(target + " refused: " + moerun::ErrorCodeKind(resp.code()) + ": " + resp.message());
  }
  if (status->parsed()) {
    if (json) {
      std::printf("%s\n", Json(resp.status()).c_str());
    } else {
      PrintStatus(resp.status());
    }
  } else if (stats->parsed()) {
    if (json) {
      std::printf("%s\n", Json(resp.stats()).c_str());
    } else {
      std::printf("%-6s %-7s %s\n", "layer", "expert", "assignments");
      for (const auto& e : resp.stats().experts()) {
        std::printf("%-6d %-7d %llu\n", e.layer(), e.expert(),
                    static_cast<unsigned long long>(e.assignments()));
      }
    }
  } else if (plan->parsed()) {
    return finish_plan(resp.plan());
  } else if (show->parsed()) {
    std::printf("%s\n", resp.placement().json().c_str());
  } else {
    std::ofstream out(export_path);
    out << resp.placement().json() << "\n";
    out.close();
    if (!out) return Fail("cannot write " + export_path);
    std::fprintf(stderr, "moectl: placement v%llu written to %s\n",
                 static_cast<unsigned long long>(resp.placement().version()), export_path.c_str());
  }
  return 0;
}
