// Logging (base/log.h): the rank and role tag of the process and of a thread, both formats, the
// level names, and a pinned level surviving a later InitLogging.
#include "base/log.h"

#include <google/protobuf/stubs/logging.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "base/peer_log.h"
#include "moerun/v1/control.pb.h"
#include "runtime/serving/protobuf_log.h"

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

size_t Count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// A peer's events: one line per kind and interval, carrying the count since the kind's last
// line; every event counted; another kind has its own interval; a flush writes what was held.
TEST(PeerLogTest, OneLineAKindAnIntervalWithTheCount) {
  LogCapture cap;
  SetLogFormat(LogFormat::kText);
  SetPeerLogInterval(std::chrono::milliseconds(300));
  // Start from a quiet interval whatever earlier tests logged.
  std::this_thread::sleep_for(std::chrono::milliseconds(310));
  FlushPeerLog();
  std::this_thread::sleep_for(std::chrono::milliseconds(310));
  cap.Take();
  const uint64_t before = PeerEventCount(PeerEvent::kBadFrame);
  for (int i = 0; i < 1000; ++i) {
    PeerLog(PeerEvent::kBadFrame, spdlog::level::warn, "bad frame number {}", i);
  }
  PeerLog(PeerEvent::kSlowReader, spdlog::level::warn, "slow reader");
  std::string out = cap.Take();
  EXPECT_EQ(Count(out, "bad frame number"), 1u) << out;
  EXPECT_NE(out.find("bad frame number 0"), std::string::npos) << out;
  EXPECT_EQ(Count(out, "slow reader"), 1u) << out;
  EXPECT_EQ(PeerEventCount(PeerEvent::kBadFrame) - before, 1000u);

  std::this_thread::sleep_for(std::chrono::milliseconds(320));
  PeerLog(PeerEvent::kBadFrame, spdlog::level::warn, "bad frame number {}", 1000);
  out = cap.Take();
  EXPECT_NE(out.find("bad frame number 1000 [1000 such events (bad_frame)"), std::string::npos)
      << out;

  for (int i = 0; i < 5; ++i) PeerLog(PeerEvent::kBadFrame, spdlog::level::warn, "held");
  FlushPeerLog();  // within the interval: nothing yet
  EXPECT_EQ(cap.Take().find("held"), std::string::npos);
  std::this_thread::sleep_for(std::chrono::milliseconds(320));
  FlushPeerLog();
  out = cap.Take();
  EXPECT_NE(out.find("peer events: 5 bad_frame"), std::string::npos) << out;
  EXPECT_EQ(out.find("held"), std::string::npos) << out;
  SetPeerLogInterval(std::chrono::seconds(10));
}

// The protobuf library's own error for a string field that is not UTF-8 (a control frame's
// token) goes through our logger, tagged, and as a peer event: not one line a frame.
TEST(PeerLogTest, ProtobufsOwnMessagesAreTaggedAndLimited) {
  LogCapture cap;
  SetLogFormat(LogFormat::kText);
  InstallProtobufLogHandler();
  SetPeerLogInterval(std::chrono::seconds(10));
  const uint64_t before = PeerEventCount(PeerEvent::kProtobuf);
  const std::string body("\x0a\x04\xff\xfe\xfd\xfc\x12\x00", 8);
  for (int i = 0; i < 50; ++i) {
    moerun::v1::ControlRequest req;
    EXPECT_FALSE(req.ParseFromString(body));
  }
  const std::string out = cap.Take();
  EXPECT_EQ(PeerEventCount(PeerEvent::kProtobuf) - before, 50u);
  EXPECT_LE(Count(out, "protobuf:"), 1u) << out;  // 0 when an earlier test wrote this interval's
  if (Count(out, "protobuf:") == 1) {
    EXPECT_NE(out.find("[r7 expert]"), std::string::npos) << out;
    EXPECT_NE(out.find("UTF-8"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace moerun
