// moectl: the operator's command line for a running moerun job (router 0's control endpoint).
//   moectl --target HOST:PORT [--token-file FILE] status [--json]
//   moectl ... placement show
//   moectl ... placement export FILE
//   moectl ... stats [--json]
// The token comes from --token-file or MOERUN_TOKEN_FILE. Exit: 0 ok, 1 refused or failed, 2 bad
// usage.
#include <fmt/format.h>
#include <google/protobuf/util/json_util.h>
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "launch/control_endpoint.h"
#include "launch/serve_client.h"
#include "moerun/v1/control.pb.h"

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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
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
