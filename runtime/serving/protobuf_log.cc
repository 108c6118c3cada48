#include "runtime/serving/protobuf_log.h"

#include <google/protobuf/stubs/logging.h>

#include <string>

#include "base/peer_log.h"

namespace moerun {
namespace {

void OnProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                   const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    // A bug of ours (the library aborts next), never a peer's: written whatever the interval.
    spdlog::critical("protobuf {}:{}: {}", filename, line, message);
    return;
  }
  const auto lvl =
      level == google::protobuf::LOGLEVEL_INFO ? spdlog::level::info : spdlog::level::warn;
  PeerLog(PeerEvent::kProtobuf, lvl, "protobuf: {}", message);
}

}  // namespace

void InstallProtobufLogHandler() { google::protobuf::SetLogHandler(&OnProtobufLog); }

}  // namespace moerun
