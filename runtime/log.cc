#include "runtime/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

namespace moerun {

void InitLogging(int rank, const std::string& role, const std::string& level) {
  auto logger = spdlog::get("moerun");
  if (!logger) {
    logger = spdlog::stderr_color_mt("moerun");
    spdlog::set_default_logger(logger);
  }
  logger->set_pattern("[%H:%M:%S.%e] [r" + std::to_string(rank) + " " + role + "] %^%l%$: %v");
  logger->set_level(spdlog::level::from_str(level));
}

int RankFromEnvironment() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && r >= 0 && r < (1 << 24)) return static_cast<int>(r);
    }
  }
  return 0;
}

}  // namespace moerun
