#include "base/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace moerun {
namespace {

struct Tag {
  int rank = 0;
  std::string role;  // empty: no tag (a thread's: use the process's)
  std::string text;  // "r<rank> <role>"
};

std::mutex g_mu;
Tag g_process_tag{0, "main", "r0 main"};
LogFormat g_format = LogFormat::kText;
std::string g_pinned_level;  // empty: not pinned
thread_local Tag t_tag;      // role empty: the process's

Tag CurrentTag() {
  if (!t_tag.role.empty()) return t_tag;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_process_tag;
}

// %* in the text pattern: this thread's tag, else the process's.
class TagFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const Tag tag = CurrentTag();
    dest.append(tag.text.data(), tag.text.data() + tag.text.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<TagFlag>();
  }
};

void AppendJsonString(std::string_view s, spdlog::memory_buf_t& dest) {
  dest.push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        dest.append(std::string_view("\\\""));
        break;
      case '\\':
        dest.append(std::string_view("\\\\"));
        break;
      case '\n':
        dest.append(std::string_view("\\n"));
        break;
      case '\r':
        dest.append(std::string_view("\\r"));
        break;
      case '\t':
        dest.append(std::string_view("\\t"));
        break;
      default:
        if (c < 0x20) {
          std::array<char, 8> u{};
          std::snprintf(u.data(), u.size(), "\\u%04x", c);
          dest.append(std::string_view(u.data(), 6));
        } else {
          dest.push_back(ch);
        }
    }
  }
  dest.push_back('"');
}

// One JSON object a line: time (UTC, ms), level, rank, role, msg.
class JsonFormatter : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    using std::chrono::duration_cast;
    using std::chrono::milliseconds;
    const auto since = msg.time.time_since_epoch();
    const std::time_t secs = std::chrono::system_clock::to_time_t(msg.time);
    const long ms = static_cast<long>(duration_cast<milliseconds>(since).count() % 1000);
    std::tm utc{};
    gmtime_r(&secs, &utc);
    std::array<char, 40> when{};
    const size_t n = std::strftime(when.data(), when.size(), "%Y-%m-%dT%H:%M:%S", &utc);
    const Tag tag = CurrentTag();
    const auto level = spdlog::level::to_string_view(msg.level);
    dest.append(std::string_view("{\"time\":\""));
    dest.append(std::string_view(when.data(), n));
    std::array<char, 8> frac{};
    std::snprintf(frac.data(), frac.size(), ".%03ldZ", ms < 0 ? 0 : ms);
    dest.append(std::string_view(frac.data()));
    dest.append(std::string_view("\",\"level\":\""));
    dest.append(std::string_view(level.data(), level.size()));
    dest.append(std::string_view("\",\"rank\":"));
    const std::string rank = std::to_string(tag.rank);
    dest.append(std::string_view(rank));
    dest.append(std::string_view(",\"role\":"));
    AppendJsonString(tag.role, dest);
    dest.append(std::string_view(",\"msg\":"));
    AppendJsonString(std::string_view(msg.payload.data(), msg.payload.size()), dest);
    dest.append(std::string_view("}\n"));
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

std::unique_ptr<spdlog::formatter> MakeFormatter(LogFormat f) {
  if (f == LogFormat::kJson) return std::make_unique<JsonFormatter>();
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<TagFlag>('*').set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%*] %^%l%$: %v");
  return formatter;
}

std::shared_ptr<spdlog::logger> Logger() {
  auto logger = spdlog::get("moerun");
  if (!logger) {
    logger = spdlog::stderr_color_mt("moerun");
    spdlog::set_default_logger(logger);
    logger->set_formatter(MakeFormatter(g_format));
  }
  return logger;
}

}  // namespace

bool IsLogLevel(std::string_view name) {
  // spdlog's own names too ("warning", "critical"): what to_string_view of a level gives.
  for (const char* n : {"trace", "debug", "info", "warn", "warning", "error", "critical", "off"}) {
    if (name == n) return true;
  }
  return false;
}

Status CheckLogLevel(std::string_view name, std::string_view what) {
  if (IsLogLevel(name)) return Status::Ok();
  return Status::InvalidArgument(std::string(what) + ": unknown log level '" + std::string(name) +
                                 "' (use " + kLogLevelNames + ")");
}

Result<LogFormat> ParseLogFormat(std::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return Status::InvalidArgument("unknown log format '" + std::string(name) +
                                 "' (use text or json)");
}

void InitLogging(int rank, const std::string& role, const std::string& level) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_process_tag = Tag{rank, role, fmt::format("r{} {}", rank, role)};
  }
  auto logger = Logger();
  std::string pinned;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    pinned = g_pinned_level;
  }
  if (!pinned.empty()) {
    logger->set_level(spdlog::level::from_str(pinned));
  } else if (IsLogLevel(level)) {
    logger->set_level(spdlog::level::from_str(level));
  } else {
    logger->set_level(spdlog::level::info);
    logger->warn("unknown log level '{}' (use {}): logging at info", level, kLogLevelNames);
  }
}

void PinLogLevel(const std::string& level) {
  if (level.empty()) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_pinned_level.clear();
    return;
  }
  if (!IsLogLevel(level)) return;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_pinned_level = level;
  }
  Logger()->set_level(spdlog::level::from_str(level));
}

void SetLogFormat(LogFormat format) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_format = format;
  }
  Logger()->set_formatter(MakeFormatter(format));
}

void SetThreadLogTag(int rank, const std::string& role) {
  t_tag = role.empty() ? Tag{} : Tag{rank, role, fmt::format("r{} {}", rank, role)};
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
