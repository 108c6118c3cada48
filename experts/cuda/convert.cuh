// Conversions between float and the 16-bit element types on the device (round to nearest even).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moerun::cuda_kernels {

template <typename T>
__device__ inline float ToFloat(T v);
template <>
__device__ inline float ToFloat<float>(float v) {
  return v;
}
template <>
__device__ inline float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ inline float ToFloat<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ inline __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

}  // namespace moerun::cuda_kernels
