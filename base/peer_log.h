// Log lines a remote peer can cause: its frames, tokens, deadlines, handshakes, HTTP requests and
// connections. Each kind is written at most once per interval (10 s), carrying how many such
// events there were since the kind's last line, so that a stranger cannot fill the log; every
// event is counted (PeerEventCount; `moerun_peer_events_total{kind}` on /metrics), whether its
// line was written or not. Lines that only the operator or the job itself can cause are logged
// as usual. The protobuf library's own messages come here too
// (runtime/serving/protobuf_log.h): its parser reports a peer's malformed bytes.
//
// Thread-safe; an event costs an atomic increment and, once an interval, a mutex and a line.
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <string_view>
#include <utility>

namespace moerun {

enum class PeerEvent : int {
  kBadFrame = 0,    // a frame that does not parse, is too large or is refused unread
  kSlowFrame,       // a connection that did not complete a frame within the frame timeout
  kSlowReader,      // a connection that did not read its answers
  kTlsHandshake,    // a TLS handshake that failed or timed out
  kAcceptFailed,    // accept() failed (descriptors or memory exhausted by many connections)
  kConnectionCap,   // a connection closed to make room for a new one (the cap was reached)
  kHttpRequest,     // an HTTP request whose handler failed or was refused
  kControlRequest,  // a control request refused before or after its token was checked
  kProtobuf,        // the protobuf library's own messages (a peer's malformed bytes)
  kCount
};

// "bad_frame", "slow_frame", ...: the metric's label value and the summary's name.
const char* PeerEventName(PeerEvent kind);
// Events of `kind` since the process started.
uint64_t PeerEventCount(PeerEvent kind);

// Counts one event of `kind`; returns the number of events the line to write now stands for
// (this one and those not written since the kind's last line), or 0 when the kind's interval
// has not passed (then nothing is to be written). The interval starts at the written line.
uint64_t AdmitPeerEvent(PeerEvent kind);

// Writes `line` at `level` when admitted (AdmitPeerEvent), with " [N such events in the last
// S s]" appended when it stands for more than itself.
void WritePeerLine(PeerEvent kind, spdlog::level::level_enum level, uint64_t admitted,
                   std::string_view line);

// Counts the event and logs the formatted line when the kind's interval allows (the line is
// formatted only then).
template <typename... Args>
void PeerLog(PeerEvent kind, spdlog::level::level_enum level, fmt::format_string<Args...> format,
             Args&&... args) {
  const uint64_t n = AdmitPeerEvent(kind);
  if (n == 0 || !spdlog::should_log(level)) return;
  WritePeerLine(kind, level, n, fmt::format(format, std::forward<Args>(args)...));
}

// Writes, for every kind whose interval has passed with events not written, one summary line
// ("peer events: 1,234 bad_frame in the last 10.0 s, not written"). Call it now and then (the
// endpoints' timers do); without it such counts wait for the kind's next line.
void FlushPeerLog();

// The interval (tests shorten it); 10 s by default.
void SetPeerLogInterval(std::chrono::milliseconds interval);

}  // namespace moerun
