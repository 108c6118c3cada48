// Compile-time dispatch shared by the SIMD kernel variants: one compiled tile per row count and
// weight type. ISA-neutral (only forwards calls), so each variant's file includes it under its
// own target flags.
#pragma once

#include "base/dtype.h"

namespace moerun::kernels_internal {

// Calls fn.template operator()<R>() for R = rows (1..Mr): one compiled tile per height.
template <int Mr, int R = 1, typename Fn>
inline void ForRows(int rows, Fn&& fn) {
  if constexpr (R < Mr) {
    if (rows != R) return ForRows<Mr, R + 1>(rows, fn);
  }
  fn.template operator()<R>();
}

// Calls fn.template operator()<T>() with the weight type t as T (F32 for the types not listed:
// the kernels are handed only packable types).
template <typename Fn>
inline void ForWeightType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF8E4M3:
      return fn.template operator()<DType::kF8E4M3>();
    case DType::kF4:
      return fn.template operator()<DType::kF4>();
    case DType::kBF16:
      return fn.template operator()<DType::kBF16>();
    case DType::kF16:
      return fn.template operator()<DType::kF16>();
    default:
      return fn.template operator()<DType::kF32>();
  }
}

}  // namespace moerun::kernels_internal
