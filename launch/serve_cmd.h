// `moerun serve --config FILE.yaml`: the long-running runtime. Every rank loads its weights; the
// routers then batch requests until SIGTERM or SIGINT, finish what is queued, and shut the
// expert ranks down. (Requests reach the routers through the network front end.)
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace moerun {

std::function<int()> AddServeCommand(CLI::App& app);

}  // namespace moerun
