#include "base/trace_context.h"

#include <random>

namespace moerun {
namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // uppercase is invalid too
}

bool ParseHex(std::string_view s, uint8_t* out) {
  for (size_t i = 0; i < s.size() / 2; ++i) {
    const int hi = HexDigit(s[2 * i]);
    const int lo = HexDigit(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

template <size_t N>
bool AllZero(const std::array<uint8_t, N>& a) {
  for (uint8_t b : a) {
    if (b != 0) return false;
  }
  return true;
}

std::mt19937_64& Generator() {
  thread_local std::mt19937_64 gen = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  return gen;
}

template <size_t N>
std::array<uint8_t, N> RandomId() {
  std::array<uint8_t, N> id{};
  while (AllZero(id)) {
    for (size_t i = 0; i < N; i += 8) {
      const uint64_t v = Generator()();
      for (size_t j = 0; j < 8 && i + j < N; ++j) id[i + j] = static_cast<uint8_t>(v >> (8 * j));
    }
  }
  return id;
}

}  // namespace

bool ParseTraceparent(std::string_view t, TraceContext* out) {
  constexpr size_t kLen = 55;
  if (t.size() < kLen) return false;
  uint8_t version = 0;
  if (!ParseHex(t.substr(0, 2), &version) || version == 0xff) return false;
  if (version == 0 ? t.size() != kLen : (t.size() > kLen && t[kLen] != '-')) return false;
  if (t[2] != '-' || t[35] != '-' || t[52] != '-') return false;
  TraceContext c;
  if (!ParseHex(t.substr(3, 32), c.trace_id.data()) ||
      !ParseHex(t.substr(36, 16), c.parent_id.data()) || !ParseHex(t.substr(53, 2), &c.flags)) {
    return false;
  }
  if (AllZero(c.trace_id) || AllZero(c.parent_id)) return false;
  *out = c;
  return true;
}

std::string HexOf(const uint8_t* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return s;
}

std::string FormatTraceparent(const TraceContext& c) {
  return "00-" + HexOf(c.trace_id.data(), c.trace_id.size()) + "-" +
         HexOf(c.parent_id.data(), c.parent_id.size()) + "-" + HexOf(&c.flags, 1);
}

TraceId NewTraceId() { return RandomId<16>(); }
SpanId NewSpanId() { return RandomId<8>(); }

int64_t UnixNanos(std::chrono::steady_clock::time_point t) {
  // The offset between the two clocks, taken once per process.
  static const int64_t offset = [] {
    const auto steady = std::chrono::steady_clock::now();
    const auto wall = std::chrono::system_clock::now();
    return std::chrono::duration_cast<std::chrono::nanoseconds>(wall.time_since_epoch()).count() -
           std::chrono::duration_cast<std::chrono::nanoseconds>(steady.time_since_epoch()).count();
  }();
  return offset +
         std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace moerun
