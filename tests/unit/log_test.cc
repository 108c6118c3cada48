// Logging (base/log.h): the rank and role tag of the process and of a thread, both formats, the
// level names, and a pinned level surviving a later InitLogging.
#include "base/log.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

namespace moerun {
namespace {

// Captures what the moerun logger writes, in the format set after it was attached.
class LogCapture {
 public:
  LogCapture() {
    InitLogging(7, "expert", "info");
    sink_ = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    spdlog::default_logger()->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    SetLogFormat(LogFormat::kText);
    InitLogging(0, "main", "info");
  }
  std::string Take() {
    spdlog::default_logger()->flush();
    std::string s = out_.str();
    out_.str("");
    return s;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

TEST(LogTest, TextLinesCarryTheDateAndTheTags) {
  LogCapture cap;
  SetLogFormat(LogFormat::kText);
  spdlog::info("hello");
  std::string line = cap.Take();
  ASSERT_GE(line.size(), 26u) << line;
  EXPECT_EQ(line[0], '[');
  EXPECT_EQ(line[5], '-') << line;  // [YYYY-MM-DD
  EXPECT_EQ(line[8], '-') << line;
  EXPECT_NE(line.find("[r7 expert] info: hello"), std::string::npos) << line;
  // A thread's own tag; other threads keep the process's.
  std::thread([] {
    SetThreadLogTag(3, "router");
    spdlog::warn("from a thread");
  }).join();
  spdlog::info("after");
  line = cap.Take();
  EXPECT_NE(line.find("[r3 router] warning: from a thread"), std::string::npos) << line;
  EXPECT_NE(line.find("[r7 expert] info: after"), std::string::npos) << line;
}

TEST(LogTest, JsonLinesAreObjectsWithEscapedMessages) {
  LogCapture cap;
  SetLogFormat(LogFormat::kJson);
  spdlog::error("a \"quoted\" \\ path\nnext\tline \x01");
  const std::string line = cap.Take();
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["level"], "error");
  EXPECT_EQ(j["rank"], 7);
  EXPECT_EQ(j["role"], "expert");
  EXPECT_EQ(j["msg"], "a \"quoted\" \\ path\nnext\tline \x01");
  const std::string t = j["time"];
  ASSERT_EQ(t.size(), 24u) << t;  // 2026-12-02T19:44:01.123Z
  EXPECT_EQ(t[10], 'T');
  EXPECT_EQ(t.back(), 'Z');
}

TEST(LogTest, LevelNamesAndAPinnedLevel) {
  for (const char* ok : {"trace", "debug", "info", "warn", "error", "off"}) {
    EXPECT_TRUE(IsLogLevel(ok)) << ok;
    EXPECT_TRUE(CheckLogLevel(ok, "--log-level").ok());
  }
  for (const char* bad : {"verbose", "", "INFO", "loud"}) {
    EXPECT_FALSE(IsLogLevel(bad)) << bad;
    const Status s = CheckLogLevel(bad, "log_level");
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("log_level: unknown log level"), std::string::npos) << s.message();
  }
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_FALSE(ParseLogFormat("xml").ok());
  LogCapture cap;
  SetLogFormat(LogFormat::kText);
  // An unknown level never silences: it logs at info and says so.
  InitLogging(7, "expert", "verbose");
  spdlog::info("still here");
  std::string out = cap.Take();
  EXPECT_NE(out.find("unknown log level 'verbose'"), std::string::npos) << out;
  EXPECT_NE(out.find("still here"), std::string::npos) << out;
  // Pinned (the command line's --log-level): a later InitLogging (a config's level) keeps it.
  PinLogLevel("error");
  InitLogging(7, "expert", "debug");
  spdlog::info("hidden");
  spdlog::error("shown");
  out = cap.Take();
  EXPECT_EQ(out.find("hidden"), std::string::npos) << out;
  EXPECT_NE(out.find("shown"), std::string::npos) << out;
  PinLogLevel("");
}

}  // namespace
}  // namespace moerun
