// Logging: spdlog to stderr, every line tagged with the rank and role that wrote it
// ("[r3 expert]"), so that the interleaved output of mpirun stays readable. The tag is per
// process (InitLogging) and may be overridden per thread (SetThreadLogTag: ranks that are threads
// of one process). Logging itself is thread-safe.
//
// Two formats (SetLogFormat, `--log-format`): text, "[2026-12-02 20:44:01.123] [r3 expert]
// info: message" (local time), and json, one object a line for log shippers:
// {"time":"2026-12-02T19:44:01.123Z","level":"info","rank":3,"role":"expert","msg":"message"}
// (UTC; msg escaped as JSON strings are).
#pragma once

#include <spdlog/spdlog.h>

#include <string>
#include <string_view>

#include "base/status.h"

namespace moerun {

enum class LogFormat { kText, kJson };

// The level names: "trace", "debug", "info", "warn", "error", "off".
inline constexpr const char* kLogLevelNames = "trace, debug, info, warn, error, off";
bool IsLogLevel(std::string_view name);
// kInvalidArgument naming `what` (a flag or config key) and the accepted names.
Status CheckLogLevel(std::string_view name, std::string_view what);
// "text" or "json"; kInvalidArgument otherwise.
Result<LogFormat> ParseLogFormat(std::string_view name);

// Sets the process's tag and level. An unknown level (callers check with CheckLogLevel first)
// keeps "info" and says so, never silencing the log.
void InitLogging(int rank, const std::string& role, const std::string& level = "info");
// The line format of every later message (text until called).
void SetLogFormat(LogFormat format);
// The command line's --log-level: once pinned, InitLogging keeps it whatever level it is given
// (a config's log_level applies only when the flag was not given). "" unpins.
void PinLogLevel(const std::string& level);
// Tags this thread's log lines (for ranks that run as threads); an empty role clears it.
void SetThreadLogTag(int rank, const std::string& role);

// Rank from the launcher's environment (Open MPI, PMIx, Slurm), 0 when started alone.
int RankFromEnvironment();

}  // namespace moerun
