// W3C Trace Context (https://www.w3.org/TR/trace-context/): the `traceparent` a client may send
// with a request, and the ids of the spans moerun makes for it.
//
//   traceparent = version "-" trace-id "-" parent-id "-" trace-flags
//                 "00"      32 hex       16 hex        2 hex          (lowercase; 55 characters)
//
// Parsed strictly as the recommendation says: lowercase hex only, neither id all zeros, version
// "ff" invalid; a version above 00 is read by its first 55 characters when a '-' or the end
// follows them (what a version-00 reader does with a later version). Clock: `UnixNanos` is the
// process's own wall clock, anchored once to the steady clock so that spans of one process never
// go backwards. Thread-safety: pure functions; NewSpanId and NewTraceId use a per-thread
// generator.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace moerun {

using TraceId = std::array<uint8_t, 16>;
using SpanId = std::array<uint8_t, 8>;

struct TraceContext {
  TraceId trace_id{};
  SpanId parent_id{};  // the caller's span: the parent of the spans made for the request
  uint8_t flags = 0;   // bit 0: the caller sampled it
  bool sampled() const { return (flags & 1u) != 0; }
};

// False for anything the recommendation calls invalid (the caller then ignores the header).
bool ParseTraceparent(std::string_view text, TraceContext* out);
// "00-<trace>-<parent>-<flags>".
std::string FormatTraceparent(const TraceContext& c);
std::string HexOf(const uint8_t* bytes, size_t n);

// Random, never all zeros.
TraceId NewTraceId();
SpanId NewSpanId();

// Nanoseconds since the Unix epoch of a steady-clock time point, on this process's clock.
int64_t UnixNanos(std::chrono::steady_clock::time_point t);
inline int64_t UnixNanosNow() { return UnixNanos(std::chrono::steady_clock::now()); }

}  // namespace moerun
