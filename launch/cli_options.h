// What every binary's command line shares (moerun, moectl, moebench): the logging options and
// how a bad command line ends. CLI11 types only; no state.
//
//   --log-level trace|debug|info|warn|error|off  (any other value is a parse error)
//   --log-format text|json                       (log.h: json is one object a line)
// A bad command line prints one line, "<binary>: <what is wrong> (see --help)", and exits 2;
// --help and --version print and exit 0.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace moerun {

struct LogOptions {
  std::string level = "info";
  std::string format = "text";
  CLI::Option* level_option = nullptr;  // set by AddLogOptions: whether --log-level was given
};

// Adds --log-level and --log-format to `app` (checked while parsing).
void AddLogOptions(CLI::App& app, LogOptions* o);
// After parsing: the format, and the level for this process (pinned when --log-level was given,
// so that a config's log_level does not override the command line).
void ApplyLogOptions(const LogOptions& o, int rank, const std::string& role);
// Parse errors of `app` and its subcommands print one line naming the binary ("moerun").
void UseOneLineErrors(CLI::App& app, const std::string& binary);
// The exit code for a parse error: 0 for --help / --version, 2 for everything else (after
// printing, as app.exit does).
int ExitForParseError(CLI::App& app, const CLI::ParseError& e);

}  // namespace moerun
