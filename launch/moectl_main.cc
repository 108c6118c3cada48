// moectl: the operator's command line for a running moerun job (router 0's control endpoint).
//   moectl --target HOST:PORT [--token-file FILE] status [--json]
//   moectl ... placement show
//   moectl ... placement export FILE
//   moectl ... stats [--json]
//   moectl ... placement plan [--redundant N] [--policy P] [--groups G] [--nodes N] [--json]
//                             [--out FILE]                          (a dry run on the job's load)
//   moectl placement plan --loads FILE (--placement FILE | --ranks N [--routers R]) [...]
//                                                                      (offline, no job)
// Changing the job (an online migration, run by router 0 one layer at a time between batches):
//   moectl ... placement apply FILE [--throttle-mib-s X] [--wait] [--json]
//   moectl ... placement apply --plan [--redundant N] [--policy P] [--groups G] [--nodes N]
//                                     [--min-gain G] [--throttle-mib-s X] [--wait] [--json]
//   moectl ... rebalance [...the options of apply --plan]               (= placement apply --plan)
//   moectl ... placement import FILE [...the options of apply FILE]   (checks FILE here first)
//   moectl ... placement progress [--wait] [--json]     (the running or last migration)
// New weights for one expert, with a canary share of its assignments until promote or rollback:
//   moectl ... expert update --layer L --expert E --from FILE [--canary PCT] [--wait] [--json]
//   moectl ... expert status [--layer L --expert E] [--json]              (default: every update)
//   moectl ... expert promote --layer L --expert E [--json]
//   moectl ... expert rollback --layer L --expert E [--json]
// --wait polls every 0.5 s, printing a line when something changes, until the migration is no
// longer "running" (or the update no longer "loading"); --json prints the final answer only.
// The token comes from --token-file or MOERUN_TOKEN_FILE. Exit: 0 ok (a migration done, skipped
// or still running without --wait; an update loading, canary, promoted or rolled back), 1 refused
// or failed (also: a file that cannot be read), 2 bad usage.
#include <fmt/format.h>
#include <google/protobuf/util/json_util.h>
#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "launch/rank_services.h"
#include "moerun/v1/control.pb.h"
#include "router/placement.h"
#include "router/placement_plan.h"
#include "serving/control_endpoint.h"
#include "serving/serve_client.h"

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
  if (s.has_migration() && s.migration().id() != 0) {
    const auto& m = s.migration();
    std::printf("migration %llu (%s): %s, v%llu -> v%llu, %s of %s MiB loaded, %.1f s%s%s\n",
                static_cast<unsigned long long>(m.id()), m.trigger().c_str(), m.state().c_str(),
                static_cast<unsigned long long>(m.from_version()),
                static_cast<unsigned long long>(m.to_version()),
                Mib(static_cast<uint64_t>(m.bytes_loaded())).c_str(),
                Mib(static_cast<uint64_t>(m.bytes_to_move())).c_str(), m.elapsed_s(),
                m.error().empty() ? "" : ": ", m.error().c_str());
  }
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

// The whole of a file the user named ("placement apply FILE"): a clear error if it is missing,
// a folder or unreadable.
moerun::Result<std::string> ReadUserFile(const std::string& path, const std::string& what) {
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

// "placement import": what the file holds, once Placement::FromJson accepted it.
void PrintPlacementSummary(std::FILE* out, const std::string& path, const moerun::Placement& p,
                           const std::string& text) {
  std::string layers;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.contains("layers") && j["layers"].is_object()) {
      for (const auto& [key, slots] : j["layers"].items()) {
        const int layer = key == "*" ? moerun::Placement::kAnyLayer : std::atoi(key.c_str());
        const moerun::LayerPlacement* lp = p.Layer(layer);
        layers += fmt::format("{}{} ({} slots, at most {} per rank)", layers.empty() ? "" : ", ",
                              key, slots.size(), lp ? lp->MaxSlotsPerRank() : 0);
      }
    }
  } catch (const std::exception&) {  // FromJson read it: a second parse does not fail
  }
  std::fprintf(out, "placement %s: v%llu, %d experts, %d ranks (%d router%s); layers %s\n",
               path.c_str(), static_cast<unsigned long long>(p.version()), p.num_experts(),
               p.num_ranks(), p.num_routers(), p.num_routers() == 1 ? "" : "s",
               layers.empty() ? "-" : layers.c_str());
}

std::string MibOf(int64_t bytes) { return Mib(static_cast<uint64_t>(std::max<int64_t>(bytes, 0))); }

void PrintMigration(const moerun::v1::MigrationStatus& m) {
  if (m.id() == 0) {
    std::printf("no migration has run%s%s\n", m.note().empty() ? "" : ": ", m.note().c_str());
    return;
  }
  if (m.layers_size() > 0) {
    std::printf("%-6s %-10s %6s %6s %12s %12s %8s\n", "layer", "state", "load", "free",
                "to_move_mib", "loaded_mib", "seconds");
  }
  for (const auto& l : m.layers()) {
    std::printf("%-6d %-10s %6d %6d %12s %12s %8.1f\n", l.layer(), l.state().c_str(),
                l.experts_to_load(), l.experts_to_free(), MibOf(l.bytes_to_move()).c_str(),
                MibOf(l.bytes_loaded()).c_str(), l.seconds());
  }
  if (m.has_plan()) {
    const auto& p = m.plan();
    for (const auto& l : p.layers()) {
      std::printf("plan (%s policy): layer %d balancedness %.3f -> %.3f predicted\n",
                  p.policy().c_str(), l.layer(), l.balancedness_before(), l.balancedness_after());
    }
    if (!p.note().empty()) std::printf("plan note: %s\n", p.note().c_str());
  }
  std::string line =
      fmt::format("migration {}{}: {}, v{} -> v{}, {} / {} MiB loaded, {:.1f} s, {}", m.id(),
                  m.trigger().empty() ? "" : " (" + m.trigger() + ")", m.state(), m.from_version(),
                  m.to_version(), MibOf(m.bytes_loaded()), MibOf(m.bytes_to_move()), m.elapsed_s(),
                  m.throttle_mib_s() > 0 ? fmt::format("throttle {:.1f} MiB/s", m.throttle_mib_s())
                                         : std::string("unthrottled"));
  if (!m.error().empty()) line += "; error: " + m.error();
  if (!m.note().empty()) line += "; note: " + m.note();
  std::printf("%s\n", line.c_str());
}

// What --wait compares between polls (the elapsed time always changes: not part of it).
std::string MigrationKey(const moerun::v1::MigrationStatus& m) {
  std::string key = fmt::format("{}/{}/{}/{}", m.id(), m.state(), m.bytes_loaded(), m.error());
  for (const auto& l : m.layers()) {
    key += fmt::format("/{}:{}:{}", l.layer(), l.state(), l.bytes_loaded());
  }
  return key;
}

// "[  2.5 s] migration 3 running: 1/4 layers switched, 60.0 / 120.0 MiB loaded; layer 1 loading"
std::string MigrationProgressLine(const moerun::v1::MigrationStatus& m, double waited_s) {
  int switched = 0;
  std::string current;
  for (const auto& l : m.layers()) {
    if (l.state() == "done" || l.state() == "unchanged") ++switched;
    if (current.empty() && (l.state() == "loading" || l.state() == "switching")) {
      current = fmt::format("; layer {} {}", l.layer(), l.state());
    }
  }
  return fmt::format("[{:6.1f} s] migration {} {}: {}/{} layers switched, {} / {} MiB loaded{}{}",
                     waited_s, m.id(), m.state(), switched, m.layers_size(),
                     MibOf(m.bytes_loaded()), MibOf(m.bytes_to_move()), current,
                     m.error().empty() ? "" : "; error: " + m.error());
}

void PrintExperts(const moerun::v1::ExpertResponse& r) {
  if (r.variants_size() == 0) {
    std::printf("no expert updates\n");
    return;
  }
  std::printf("%-6s %-7s %-12s %8s %10s %12s %9s %-10s %s\n", "layer", "expert", "state", "canary%",
              "rows", "canary_rows", "measured%", "ranks", "file");
  for (const auto& v : r.variants()) {
    std::string ranks;
    for (int rank : v.ranks()) ranks += fmt::format("{}{}", ranks.empty() ? "" : ",", rank);
    const std::string measured =
        v.rows() > 0 ? fmt::format("{:.1f}", 100.0 * static_cast<double>(v.canary_rows()) /
                                                 static_cast<double>(v.rows()))
                     : std::string("-");
    std::printf("%-6d %-7d %-12s %8.1f %10llu %12llu %9s %-10s %s%s%s\n", v.layer(), v.expert(),
                v.state().c_str(), v.canary_percent(), static_cast<unsigned long long>(v.rows()),
                static_cast<unsigned long long>(v.canary_rows()), measured.c_str(),
                ranks.empty() ? "-" : ranks.c_str(), v.file().c_str(),
                v.error().empty() ? "" : "  error: ", v.error().c_str());
  }
}

// The variant of (layer, expert) an answer holds: the last one with `file` if given, else the
// last one of (layer, expert); null if none.
const moerun::v1::ExpertVariant* FindVariant(const moerun::v1::ExpertResponse& r, int layer,
                                             int expert, const std::string& file) {
  const moerun::v1::ExpertVariant* any = nullptr;
  const moerun::v1::ExpertVariant* same_file = nullptr;
  for (const auto& v : r.variants()) {
    if (v.layer() != layer || v.expert() != expert) continue;
    any = &v;
    if (!file.empty() && v.file() == file) same_file = &v;
  }
  return same_file ? same_file : any;
}

// One request, one answer, on a connection kept between calls (--wait polls on it). A call that
// fails on the wire is tried again once on a fresh connection when `retry` (read-only requests).
class ControlClient {
 public:
  ControlClient(std::string target, std::string token, int timeout_ms)
      : target_(std::move(target)), token_(std::move(token)), timeout_ms_(timeout_ms) {}

  Status Call(moerun::v1::ControlRequest req, moerun::v1::ControlResponse* resp, bool retry) {
    if (!token_.empty()) req.set_token(token_);
    Status s = CallOnce(req, resp);
    if (!s.ok() && retry) {
      conn_.reset();
      s = CallOnce(req, resp);
    }
    if (!s.ok()) conn_.reset();
    return s;
  }

 private:
  Status CallOnce(const moerun::v1::ControlRequest& req, moerun::v1::ControlResponse* resp) {
    const auto deadline = moerun::DeadlineIn(std::chrono::milliseconds(timeout_ms_));
    if (!conn_) {
      moerun::ClientOptions co;
      co.connect_timeout = std::chrono::milliseconds(timeout_ms_);
      auto conn = moerun::ServeConnection::Connect(target_, co);
      if (!conn.ok()) return conn.status();
      conn_ = std::move(conn).value();
    }
    MOERUN_RETURN_IF_ERROR(conn_->Send(req, deadline));
    return conn_->Receive(resp, deadline);
  }

  std::string target_, token_;
  int timeout_ms_;
  std::unique_ptr<moerun::ServeConnection> conn_;
};

// CLI11's NonNegativeNumber prints DBL_MAX in its message: this says what is wanted.
const CLI::Validator kNonNegative(
    [](std::string& text) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(v >= 0)) return "must be a number >= 0, not " + text;
      return {};
    },
    "NUMBER >= 0");

constexpr auto kPollInterval = std::chrono::milliseconds(500);

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("moectl: inspect and steer a running moerun job");
  std::string target = "127.0.0.1:5800", token_file;
  int timeout_ms = 10000;
  bool json = false;
  app.add_option("--target", target, "Router 0's control endpoint HOST:PORT")->default_val(target);
  app.add_option("--token-file", token_file, "File holding the control token")
      ->envname("MOERUN_TOKEN_FILE");
  app.add_option("--timeout-ms", timeout_ms, "Give up on one request after this long")
      ->default_val(10000);
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

  // Migrations: apply FILE | apply --plan | rebalance | import FILE, and their progress.
  std::string apply_path;
  bool from_plan = false, wait = false;
  double throttle_mib_s = 0, min_gain = 0;
  auto add_plan_options = [&](CLI::App* sub) {
    return std::vector<CLI::Option*>{
        sub->add_option("--redundant", redundant, "Redundant expert slots per layer")
            ->check(kNonNegative),
        sub->add_option("--policy", policy, "default, eplb-hierarchical or eplb-global"),
        sub->add_option("--groups", groups, "Expert groups (default: the model's gate groups)")
            ->check(kNonNegative),
        sub->add_option("--nodes", nodes, "Nodes the expert ranks span (default 1)")
            ->check(kNonNegative),
        sub->add_option("--min-gain", min_gain,
                        "Apply only if the predicted mean balancedness gains this much "
                        "(else: skipped)")};
  };
  auto add_migration_options = [&](CLI::App* sub) {
    sub->add_option("--throttle-mib-s", throttle_mib_s,
                    "Loading bandwidth per expert rank, MiB/s (default: the job's config)")
        ->check(kNonNegative);
    sub->add_flag("--wait", wait, "Wait until the migration is done or failed, showing progress");
    sub->add_flag("--json", json, "Print the (final) answer as JSON");
  };
  CLI::App* apply = placement->add_subcommand(
      "apply", "Migrate the job online to the placement in FILE, or to the planner's (--plan)");
  CLI::Option* apply_file_opt =
      apply->add_option("FILE", apply_path, "A moerun-placement-v1 JSON file");
  CLI::Option* apply_plan_opt =
      apply->add_flag("--plan", from_plan, "Plan on the measured load and apply the plan");
  apply_file_opt->excludes(apply_plan_opt);
  for (CLI::Option* o : add_plan_options(apply)) o->needs(apply_plan_opt);
  add_migration_options(apply);
  CLI::App* import_cmd = placement->add_subcommand(
      "import", "Check the placement in FILE here, then apply it (as apply FILE)");
  import_cmd->add_option("FILE", apply_path, "A moerun-placement-v1 JSON file")->required();
  add_migration_options(import_cmd);
  CLI::App* progress =
      placement->add_subcommand("progress", "The running (or last) migration, layer by layer");
  progress->add_flag("--wait", wait, "Wait until it is no longer running, showing progress");
  progress->add_flag("--json", json, "Print the (final) answer as JSON");
  CLI::App* rebalance = app.add_subcommand(
      "rebalance", "Plan on the measured load and migrate to the plan (= placement apply --plan)");
  add_plan_options(rebalance);
  add_migration_options(rebalance);

  // Expert weight updates.
  CLI::App* expert = app.add_subcommand("expert", "New weights for one expert, with a canary");
  expert->require_subcommand(1);
  int layer = -1, expert_id = -1;
  double canary_percent = 5;
  std::string weights_path;
  CLI::App* update = expert->add_subcommand(
      "update", "Load new weights for (layer, expert) beside the old; a canary share uses them");
  update->add_option("--layer", layer, "Model layer")->required()->check(kNonNegative);
  update->add_option("--expert", expert_id, "Logical expert")->required()->check(kNonNegative);
  update
      ->add_option("--from", weights_path,
                   "A .safetensors file, readable at this path on the expert ranks' hosts")
      ->required();
  update->add_option("--canary", canary_percent, "Percent of the expert's assignments (0..100)")
      ->default_val(5)
      ->check(CLI::Range(0.0, 100.0));
  update->add_flag("--wait", wait, "Wait until the new weights are loaded (or failed)");
  update->add_flag("--json", json, "Print the (final) answer as JSON");
  CLI::App* expert_status =
      expert->add_subcommand("status", "Expert updates: state, canary share, rows served");
  expert_status->add_option("--layer", layer, "Only this layer (default: every update)")
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  expert_status->add_option("--expert", expert_id, "Only this expert (default: every update)")
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  expert_status->add_flag("--json", json, "Print JSON");
  CLI::App* promote = expert->add_subcommand("promote", "Serve every assignment with the update");
  CLI::App* rollback = expert->add_subcommand("rollback", "Drop the update, keep the old weights");
  for (CLI::App* sub : {promote, rollback}) {
    sub->add_option("--layer", layer, "Model layer")->required()->check(kNonNegative);
    sub->add_option("--expert", expert_id, "Logical expert")->required()->check(kNonNegative);
    sub->add_flag("--json", json, "Print JSON");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (apply->parsed() && apply_file_opt->count() == 0 && !from_plan) {
    return Fail("placement apply: give a placement FILE or --plan (see --help)", 2);
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

  // Local checks before anything is sent: the files named exist and read.
  std::string placement_text;
  if ((apply->parsed() && !from_plan) || import_cmd->parsed()) {
    auto text = ReadUserFile(apply_path, "placement");
    if (!text.ok()) return Fail(text.status().message());
    placement_text = std::move(text).value();
    if (import_cmd->parsed()) {
      auto p = moerun::Placement::FromJson(placement_text, apply_path);
      if (!p.ok()) return Fail("placement import: " + p.status().ToString());
      PrintPlacementSummary(json ? stderr : stdout, apply_path, *p, placement_text);
    }
  }
  if (update->parsed()) {
    std::error_code ec;
    std::filesystem::path abs = std::filesystem::absolute(weights_path, ec).lexically_normal();
    if (ec || !std::filesystem::exists(abs, ec)) {
      return Fail(fmt::format("expert weights {}: no such file", weights_path));
    }
    if (!std::filesystem::is_regular_file(abs, ec)) {
      return Fail(fmt::format("expert weights {} is not a file", abs.string()));
    }
    weights_path = abs.string();
  }

  std::string token;
  if (!token_file.empty()) {
    auto t = moerun::ReadTokenFile(token_file);
    if (!t.ok()) return Fail(t.status().ToString(), 2);
    token = std::move(t).value();
  }
  moerun::v1::ControlRequest req;
  const bool migrating = apply->parsed() || import_cmd->parsed() || rebalance->parsed();
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
  } else if (migrating) {
    moerun::v1::ApplyRequest* ar = req.mutable_apply();
    if (from_plan || rebalance->parsed()) {
      ar->set_from_plan(true);
      moerun::v1::PlanRequest* pr = ar->mutable_plan();
      pr->set_redundant(redundant);
      pr->set_policy(policy);
      pr->set_groups(groups);
      pr->set_nodes(nodes);
      ar->set_min_gain(min_gain);
    } else {
      ar->set_placement_json(placement_text);
    }
    ar->set_throttle_mib_s(throttle_mib_s);
  } else if (progress->parsed()) {
    req.mutable_progress();
  } else if (update->parsed()) {
    moerun::v1::ExpertUpdateRequest* ur = req.mutable_expert_update();
    ur->set_layer(layer);
    ur->set_expert(expert_id);
    ur->set_file(weights_path);
    ur->set_canary_percent(canary_percent);
  } else if (expert_status->parsed() || promote->parsed() || rollback->parsed()) {
    moerun::v1::ExpertActionRequest* er = req.mutable_expert_action();
    er->set_action(expert_status->parsed() ? "status" : promote->parsed() ? "promote" : "rollback");
    er->set_layer(layer);
    er->set_expert(expert_id);
  } else {
    req.mutable_placement();
  }
  ControlClient client(target, token, timeout_ms);
  // Read-only requests may be retried; an apply or an update is sent once.
  auto call = [&](const moerun::v1::ControlRequest& r, moerun::v1::ControlResponse* resp,
                  bool retry) -> int {
    Status s = client.Call(r, resp, retry);
    if (!s.ok()) return Fail(target + ": " + s.ToString());
    if (resp->code() != moerun::v1::OK) {
      return Fail(target + " refused: " + moerun::ErrorCodeKind(resp->code()) + ": " +
                  resp->message());
    }
    return 0;
  };
  const bool changes = migrating || update->parsed() || promote->parsed() || rollback->parsed();
  moerun::v1::ControlResponse resp;
  if (int rc = call(req, &resp, !changes); rc != 0) return rc;
  const auto started = std::chrono::steady_clock::now();
  auto waited_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  };
  // --wait's progress lines: stdout, or stderr when stdout is JSON.
  std::FILE* progress_out = json ? stderr : stdout;

  if (migrating || progress->parsed()) {
    moerun::v1::MigrationStatus m = resp.migration();
    if (wait && m.state() == "running") {
      if (!json) {
        PrintMigration(m);
      }
      std::string key = MigrationKey(m);
      moerun::v1::ControlRequest poll;
      poll.mutable_progress();
      while (m.state() == "running") {
        std::this_thread::sleep_for(kPollInterval);
        moerun::v1::ControlResponse pr;
        if (int rc = call(poll, &pr, true); rc != 0) {
          std::fprintf(stderr,
                       "moectl: lost track of migration %llu: see moectl placement "
                       "progress\n",
                       static_cast<unsigned long long>(m.id()));
          return rc;
        }
        if (pr.migration().id() != m.id()) {
          return Fail(fmt::format(
              "migration {} is no longer the router's (now migration {}, {}): its outcome is "
              "unknown here",
              m.id(), pr.migration().id(), pr.migration().state()));
        }
        m = pr.migration();
        if (std::string k = MigrationKey(m); k != key) {
          key = std::move(k);
          std::fprintf(progress_out, "%s\n", MigrationProgressLine(m, waited_s()).c_str());
          std::fflush(progress_out);
        }
      }
    }
    if (json) {
      std::printf("%s\n", Json(m).c_str());
    } else {
      PrintMigration(m);
    }
    return m.state() == "failed" ? 1 : 0;
  }
  if (update->parsed() || expert_status->parsed() || promote->parsed() || rollback->parsed()) {
    moerun::v1::ExpertResponse er = resp.experts();
    if (update->parsed() && wait) {
      const moerun::v1::ExpertVariant* v = FindVariant(er, layer, expert_id, weights_path);
      if (v && v->state() == "loading" && !json) PrintExperts(er);
      std::string state = v ? v->state() : "";
      moerun::v1::ControlRequest poll;
      moerun::v1::ExpertActionRequest* pa = poll.mutable_expert_action();
      pa->set_action("status");
      pa->set_layer(layer);
      pa->set_expert(expert_id);
      while (state == "loading") {
        std::this_thread::sleep_for(kPollInterval);
        moerun::v1::ControlResponse pr;
        if (int rc = call(poll, &pr, true); rc != 0) return rc;
        er = pr.experts();
        v = FindVariant(er, layer, expert_id, weights_path);
        if (!v) {
          return Fail(fmt::format("the router no longer lists an update of layer {} expert {}",
                                  layer, expert_id));
        }
        if (v->state() != state) {
          state = v->state();
          std::fprintf(progress_out, "[%6.1f s] layer %d expert %d: %s%s%s\n", waited_s(), layer,
                       expert_id, state.c_str(), v->error().empty() ? "" : ": ",
                       v->error().c_str());
          std::fflush(progress_out);
        }
      }
    }
    if (json) {
      std::printf("%s\n", Json(er).c_str());
    } else {
      PrintExperts(er);
    }
    if (expert_status->parsed()) return 0;  // a report: a failed update is shown, not an error
    const moerun::v1::ExpertVariant* v = FindVariant(er, layer, expert_id, weights_path);
    return v && v->state() == "failed" ? 1 : 0;
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
