#include "base/quant_formats.h"

namespace moerun {
namespace {

// Nearest code among the non-negative codes 0..max_code of a monotone format (ties to the even
// code), by bisection on the exact values.
template <typename ToF32>
uint8_t NearestCode(float a, int max_code, ToF32 to_f32) {
  int lo = 0, hi = max_code;
  if (a >= to_f32(static_cast<uint8_t>(hi))) return static_cast<uint8_t>(hi);
  while (hi - lo > 1) {  // invariant: value(lo) <= a < value(hi)
    const int mid = (lo + hi) / 2;
    if (to_f32(static_cast<uint8_t>(mid)) <= a) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const double dlo = static_cast<double>(a) - to_f32(static_cast<uint8_t>(lo));
  const double dhi = static_cast<double>(to_f32(static_cast<uint8_t>(hi))) - a;
  if (dlo < dhi) return static_cast<uint8_t>(lo);
  if (dhi < dlo) return static_cast<uint8_t>(hi);
  return static_cast<uint8_t>((lo & 1) == 0 ? lo : hi);
}

}  // namespace

uint8_t F32ToE4m3(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  return sign | NearestCode(std::fabs(v), 0x7E, E4m3ToF32);
}

uint8_t F32ToE2m1(float v) {
  const uint8_t sign = std::signbit(v) ? 0x8 : 0;
  if (std::isnan(v)) return 0;
  return sign | NearestCode(std::fabs(v), 7, E2m1ToF32);
}

}  // namespace moerun
