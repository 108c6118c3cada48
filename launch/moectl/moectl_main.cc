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
// The token comes from --token-file or MOERUN_TOKEN_FILE. A job with serving.tls: --tls-ca-file
// FILE (or MOERUN_TLS_CA_FILE; --tls alone: the system's CA store), --tls-server-name NAME when
// --target's host is not a name or address in the server's certificate. Exit: 0 ok (a migration
// done, skipped or still running without --wait; an update loading, canary, promoted or rolled
// back), 1 refused or failed (also: a file that cannot be read), 2 bad usage.
#include <CLI/CLI.hpp>

#include "launch/cli_options.h"
#include "launch/moectl/client.h"
#include "launch/moectl/commands.h"

int main(int argc, char** argv) {
  namespace mc = moerun::moectl;
  CLI::App app("moectl: inspect and steer a running moerun job");
  mc::Session s;
  mc::AddConnectionOptions(app, s);
  app.require_subcommand(1);
  moerun::UseOneLineErrors(app, "moectl");
  CLI::App& placement = mc::AddStatusCommands(app, s);  // status, stats, placement show/export
  mc::AddPlacementCommands(app, placement, s);  // placement plan/apply/import/progress, rebalance
  mc::AddExpertCommands(app, s);                // expert update/status/promote/rollback
  try {
    app.parse(argc, argv);  // runs the command's callback, which sets s.rc
  } catch (const CLI::ParseError& e) {
    return moerun::ExitForParseError(app, e);
  }
  return s.rc;
}
