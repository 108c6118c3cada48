#include "base/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>

namespace moerun {
namespace {

std::mutex g_mu;
std::string g_process_tag = "r0 main";
thread_local std::string t_tag;

// %* in the pattern: this thread's tag, else the process's.
class TagFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    if (!t_tag.empty()) {
      dest.append(t_tag.data(), t_tag.data() + t_tag.size());
      return;
    }
    std::lock_guard<std::mutex> lock(g_mu);
    dest.append(g_process_tag.data(), g_process_tag.data() + g_process_tag.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<TagFlag>();
  }
};

}  // namespace

void InitLogging(int rank, const std::string& role, const std::string& level) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_process_tag = fmt::format("r{} {}", rank, role);
  }
  auto logger = spdlog::get("moerun");
  if (!logger) {
    logger = spdlog::stderr_color_mt("moerun");
    spdlog::set_default_logger(logger);
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<TagFlag>('*').set_pattern("[%H:%M:%S.%e] [%*] %^%l%$: %v");
    logger->set_formatter(std::move(formatter));
  }
  logger->set_level(spdlog::level::from_str(level));
}

void SetThreadLogTag(int rank, const std::string& role) {
  t_tag = role.empty() ? std::string() : fmt::format("r{} {}", rank, role);
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
