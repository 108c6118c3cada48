#include "base/peer_log.h"

#include <array>
#include <atomic>
#include <mutex>
#include <string>

namespace moerun {
namespace {

using Clock = std::chrono::steady_clock;

struct Kind {
  std::atomic<uint64_t> total{0};
  std::mutex mu;
  Clock::time_point last_line{};  // when its last line was written
  uint64_t unwritten = 0;         // events since then whose lines were not written
};

struct State {
  std::array<Kind, static_cast<size_t>(PeerEvent::kCount)> kinds;
  std::atomic<int64_t> interval_ms{10000};
};

State& state() {
  static State* s = new State();  // never destroyed: lines may come from threads at exit
  return *s;
}

Kind& KindOf(PeerEvent kind) { return state().kinds[static_cast<size_t>(kind)]; }

Clock::duration Interval() { return std::chrono::milliseconds(state().interval_ms.load()); }

std::string Seconds(Clock::duration d) {
  return fmt::format("{:.1f}", std::chrono::duration<double>(d).count());
}

}  // namespace

const char* PeerEventName(PeerEvent kind) {
  switch (kind) {
    case PeerEvent::kBadFrame:
      return "bad_frame";
    case PeerEvent::kSlowFrame:
      return "slow_frame";
    case PeerEvent::kSlowReader:
      return "slow_reader";
    case PeerEvent::kTlsHandshake:
      return "tls_handshake";
    case PeerEvent::kAcceptFailed:
      return "accept_failed";
    case PeerEvent::kConnectionCap:
      return "connection_cap";
    case PeerEvent::kHttpRequest:
      return "http_request";
    case PeerEvent::kControlRequest:
      return "control_request";
    case PeerEvent::kProtobuf:
      return "protobuf";
    case PeerEvent::kCount:
      break;
  }
  return "unknown";
}

uint64_t PeerEventCount(PeerEvent kind) {
  if (kind < PeerEvent::kBadFrame || kind >= PeerEvent::kCount) return 0;
  return KindOf(kind).total.load(std::memory_order_relaxed);
}

uint64_t AdmitPeerEvent(PeerEvent kind) {
  if (kind < PeerEvent::kBadFrame || kind >= PeerEvent::kCount) return 0;
  Kind& k = KindOf(kind);
  k.total.fetch_add(1, std::memory_order_relaxed);
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(k.mu);
  if (k.last_line != Clock::time_point{} && now - k.last_line < Interval()) {
    ++k.unwritten;
    return 0;
  }
  const uint64_t n = k.unwritten + 1;
  k.unwritten = 0;
  k.last_line = now;
  return n;
}

void WritePeerLine(PeerEvent kind, spdlog::level::level_enum level, uint64_t admitted,
                   std::string_view line) {
  if (admitted <= 1) {
    spdlog::log(level, "{}", line);
  } else {
    spdlog::log(level, "{} [{} such events ({}) in the last {} s; one line per {} s]", line,
                admitted, PeerEventName(kind), Seconds(Interval()), Seconds(Interval()));
  }
}

void FlushPeerLog() {
  const auto now = Clock::now();
  for (int i = 0; i < static_cast<int>(PeerEvent::kCount); ++i) {
    const auto kind = static_cast<PeerEvent>(i);
    Kind& k = KindOf(kind);
    uint64_t n = 0;
    {
      std::lock_guard<std::mutex> lock(k.mu);
      if (k.unwritten == 0 || now - k.last_line < Interval()) continue;
      n = k.unwritten;
      k.unwritten = 0;
      k.last_line = now;
    }
    spdlog::warn("peer events: {} {} in the last {} s whose lines were not written", n,
                 PeerEventName(kind), Seconds(Interval()));
  }
}

void SetPeerLogInterval(std::chrono::milliseconds interval) {
  state().interval_ms.store(interval.count());
}

}  // namespace moerun
