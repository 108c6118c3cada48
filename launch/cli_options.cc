#include "launch/cli_options.h"

#include <cstdio>

#include "base/log.h"

namespace moerun {

void AddLogOptions(CLI::App& app, LogOptions* o) {
  o->level_option = app.add_option("--log-level", o->level, kLogLevelNames)
                        ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  app.add_option("--log-format", o->format,
                 "text (with the date, rank and role) or json (one object a line)")
      ->check(CLI::IsMember({"text", "json"}));
}

void ApplyLogOptions(const LogOptions& o, int rank, const std::string& role) {
  const auto format = ParseLogFormat(o.format);
  SetLogFormat(format.ok() ? *format : LogFormat::kText);
  InitLogging(rank, role, o.level);
  if (o.level_option != nullptr && o.level_option->count() > 0) PinLogLevel(o.level);
}

void UseOneLineErrors(CLI::App& app, const std::string& binary) {
  app.failure_message([binary](const CLI::App*, const CLI::Error& e) {
    return binary + ": " + e.what() + " (see --help)\n";
  });
}

int ExitForParseError(CLI::App& app, const CLI::ParseError& e) {
  const int rc = app.exit(e);  // prints the help, the version or the one-line error
  return rc == 0 ? 0 : 2;
}

}  // namespace moerun
