// moectl status, stats, placement show, placement export: read-only requests, printed as tables
// or JSON (or written to a file).
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "launch/moectl/client.h"
#include "launch/moectl/commands.h"
#include "launch/moectl/print.h"

namespace moerun::moectl {

namespace {

struct StatusFlags {
  bool json = false;        // status, stats: --json
  std::string export_path;  // placement export FILE
};

int RunStatus(const Session& s, const StatusFlags& f) {
  v1::ControlRequest req;
  req.mutable_status();
  v1::ControlResponse resp;
  if (int rc = Send(s, req, &resp, /*retry=*/true); rc != 0) return rc;
  if (f.json) {
    std::printf("%s\n", Json(resp.status()).c_str());
  } else {
    PrintStatus(resp.status());
  }
  return 0;
}

int RunStats(const Session& s, const StatusFlags& f) {
  v1::ControlRequest req;
  req.mutable_stats();
  v1::ControlResponse resp;
  if (int rc = Send(s, req, &resp, /*retry=*/true); rc != 0) return rc;
  if (f.json) {
    std::printf("%s\n", Json(resp.stats()).c_str());
  } else {
    PrintStats(resp.stats());
  }
  return 0;
}

// placement show, or placement export FILE (to_file).
int RunPlacement(const Session& s, const StatusFlags& f, bool to_file) {
  v1::ControlRequest req;
  req.mutable_placement();
  v1::ControlResponse resp;
  if (int rc = Send(s, req, &resp, /*retry=*/true); rc != 0) return rc;
  if (!to_file) {
    std::printf("%s\n", resp.placement().json().c_str());
    return 0;
  }
  std::ofstream out(f.export_path);
  out << resp.placement().json() << "\n";
  out.close();
  if (!out) return Fail("cannot write " + f.export_path);
  std::fprintf(stderr, "moectl: placement v%llu written to %s\n",
               static_cast<unsigned long long>(resp.placement().version()), f.export_path.c_str());
  return 0;
}

}  // namespace

CLI::App& AddStatusCommands(CLI::App& app, Session& s) {
  // The flags live as long as the callbacks, which the app keeps.
  auto f = std::make_shared<StatusFlags>();
  CLI::App* status = app.add_subcommand("status", "Ranks, roles, experts, load, balancedness");
  status->add_flag("--json", f->json, "Print JSON");
  status->callback([&s, f] { s.rc = RunStatus(s, *f); });
  CLI::App* stats = app.add_subcommand("stats", "Assignments per (layer, expert)");
  stats->add_flag("--json", f->json, "Print JSON");
  stats->callback([&s, f] { s.rc = RunStats(s, *f); });

  CLI::App* placement = app.add_subcommand("placement", "The expert placement");
  placement->require_subcommand(1);
  CLI::App* show = placement->add_subcommand("show", "Print the placement JSON");
  show->callback([&s, f] { s.rc = RunPlacement(s, *f, /*to_file=*/false); });
  CLI::App* exp = placement->add_subcommand("export", "Write the placement JSON to FILE");
  exp->add_option("FILE", f->export_path, "Output file")->required();
  exp->callback([&s, f] { s.rc = RunPlacement(s, *f, /*to_file=*/true); });
  return *placement;
}

}  // namespace moerun::moectl
