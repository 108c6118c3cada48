// Logging: spdlog to stderr, every line tagged with the process's rank and role
// ("[r3 expert]"), so that the interleaved output of mpirun stays readable.
// InitLogging may be called again (e.g. once the rank is known); logging itself is thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace moerun {

// level: "trace", "debug", "info", "warn", "error", "off".
void InitLogging(int rank, const std::string& role, const std::string& level = "info");

// Rank from the launcher's environment (Open MPI, PMIx, Slurm), 0 when started alone.
int RankFromEnvironment();

}  // namespace moerun
