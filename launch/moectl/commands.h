// moectl's command groups. Each registers its subcommands on the app, with callbacks that run the
// command once the whole command line parsed and set the exit code in the Session. Called in this
// order, they keep the order of `moectl --help`: status, stats, placement, rebalance, expert.
#pragma once

#include <CLI/CLI.hpp>

#include "launch/moectl/client.h"

namespace moerun::moectl {

// Reading the job (status_cmds.cc): status, stats, placement show, placement export. Returns the
// `placement` command, for AddPlacementCommands.
CLI::App& AddStatusCommands(CLI::App& app, Session& s);

// Planning and migrating (placement_cmds.cc): placement plan (a dry run, also offline), placement
// apply/import/progress on `placement`, and rebalance on the app.
void AddPlacementCommands(CLI::App& app, CLI::App& placement, Session& s);

// New weights for one expert (expert_cmds.cc): expert update/status/promote/rollback.
void AddExpertCommands(CLI::App& app, Session& s);

}  // namespace moerun::moectl
