// Logging: spdlog to stderr, every line tagged with the rank and role that wrote it
// ("[r3 expert]"), so that the interleaved output of mpirun stays readable. The tag is per
// process (InitLogging) and may be overridden per thread (SetThreadLogTag: ranks that are threads
// of one process). Logging itself is thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace moerun {

// level: "trace", "debug", "info", "warn", "error", "off".
void InitLogging(int rank, const std::string& role, const std::string& level = "info");
// Tags this thread's log lines (for ranks that run as threads); an empty role clears it.
void SetThreadLogTag(int rank, const std::string& role);

// Rank from the launcher's environment (Open MPI, PMIx, Slurm), 0 when started alone.
int RankFromEnvironment();

}  // namespace moerun
