// The protobuf library writes some errors itself, to stderr, without our date, rank or role:
// a parse that meets a string field that is not UTF-8 (a peer's bytes: a control frame's token)
// writes one such line per message. InstallProtobufLogHandler routes them through our logger as
// peer events (base/peer_log.h: at most one line per interval, counted). Call it once at start,
// before any thread parses (protobuf's SetLogHandler is not thread-safe); idempotent.
#pragma once

namespace moerun {

void InstallProtobufLogHandler();

}  // namespace moerun
