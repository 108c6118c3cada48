// Grouping rows by expert, gathering them, and the weighted combine. Deterministic: counts come
// from atomics (exact whatever the order), positions from an in-order scan per expert, so the
// row order is the CPU's (router/expert_groups.h) and never depends on scheduling.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "experts/cuda/convert.cuh"
#include "experts/cuda/kernel_image.cuh"
#include "experts/cuda/tile_layout.h"
#include "router/cuda/group_kernels.h"

namespace moerun::cuda_kernels {
namespace {

__global__ void CountKernel(const int32_t* ids, int k, int32_t* counts, const int32_t* ntok) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < static_cast<int64_t>(*ntok) * k) atomicAdd(&counts[ids[i]], 1);
}

__global__ void ScanKernel(int experts, bool shared, int bm, DevRows r, const int32_t* ntok) {
  if (threadIdx.x != 0) return;
  const int groups = experts + (shared ? 1 : 0);
  if (shared) r.counts[experts] = *ntok;
  cuda_plan::ScanGroups(r.counts, groups, bm, r.row_off, r.tile_off);
}

// Block e: the assignments to expert e in (token, slot) order, 32 at a time per warp.
__global__ void PlaceKernel(const int32_t* ids, int k, DevRows r, const int32_t* ntok) {
  const int e = blockIdx.x;
  const int64_t n = static_cast<int64_t>(*ntok) * k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __shared__ int32_t warp_count[32];
  int32_t base = r.row_off[e];
  for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {
    const int64_t i = i0 + threadIdx.x;
    const bool mine = i < n && ids[i] == e;
    const uint32_t mask = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_count[warp] = __popc(mask);
    __syncthreads();
    int32_t before = base;
    for (int w = 0; w < warp; ++w) before += warp_count[w];
    if (mine) {
      const int32_t row = before + __popc(mask & ((1u << lane) - 1u));
      r.row_token[row] = static_cast<int32_t>(i / k);
      r.slot_row[i] = row;
    }
    for (int w = 0; w < warps; ++w) base += warp_count[w];
    __syncthreads();
  }
}

__global__ void SharedRowsKernel(int experts, DevRows r, const int32_t* ntok) {
  const int32_t t = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (t < *ntok) r.row_token[r.row_off[experts] + t] = t;
}

// v converted to T; f16 only: a finite v that rounds to inf (|v| >= 65520) sets *overflow (when
// not null) to 1.
template <typename T>
__device__ inline T Narrow(float v, int32_t* overflow) {
  const T out = FromFloat<T>(v);
  if constexpr (std::is_same_v<T, __half>) {
    if (overflow != nullptr && isfinite(v) && __hisinf(out) != 0) *overflow = 1;
  }
  return out;
}

template <typename T>
__global__ void GatherKernel(const float* x, int64_t hidden, DevRows r, int groups, T* rows,
                             int32_t* overflow) {
  const int64_t row = blockIdx.x;
  if (row >= r.row_off[groups]) return;
  const float* src = x + static_cast<int64_t>(r.row_token[row]) * hidden;
  T* dst = rows + row * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) dst[h] = Narrow<T>(src[h], overflow);
}

template <typename T>
__global__ void ConvertKernel(const float* in, int64_t n, T* out, int32_t* overflow) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = Narrow<T>(in[i], overflow);
  }
}

__global__ void CombineKernel(const float* y, int64_t hidden, DevRows r, int experts, bool shared,
                              const float* weights, const float* shared_scale, int k, float* out,
                              const int32_t* ntok) {
  const int64_t t = blockIdx.x;
  if (t >= *ntok) return;
  const int32_t* slots = r.slot_row + t * k;
  const float* w = weights + t * k;
  const float* sh = shared ? y + (static_cast<int64_t>(r.row_off[experts]) + t) * hidden : nullptr;
  const float c = shared_scale[t];
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < k; ++s) acc = acc + w[s] * y[static_cast<int64_t>(slots[s]) * hidden + h];
    if (sh != nullptr) acc = acc + c * sh[h];
    out[t * hidden + h] = acc;
  }
}

unsigned Blocks(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace

void LaunchGroupRows(const int32_t* ids, int64_t tokens_bound, int k, int experts, bool shared,
                     int bm, const DevRows& r, const int32_t* ntok, cudaStream_t s) {
  const int groups = experts + (shared ? 1 : 0);
  cudaMemsetAsync(r.counts, 0, sizeof(int32_t) * static_cast<size_t>(groups), s);
  CountKernel<<<Blocks(tokens_bound * k, 256), 256, 0, s>>>(ids, k, r.counts, ntok);
  ScanKernel<<<1, 32, 0, s>>>(experts, shared, bm, r, ntok);
  PlaceKernel<<<static_cast<unsigned>(experts), 256, 0, s>>>(ids, k, r, ntok);
  if (shared) SharedRowsKernel<<<Blocks(tokens_bound, 256), 256, 0, s>>>(experts, r, ntok);
}

void LaunchGather(const float* x, int64_t hidden, const DevRows& r, int groups, int64_t rows_bound,
                  WType row_type, void* rows, cudaStream_t s, int32_t* overflow) {
  const auto grid = static_cast<unsigned>(rows_bound);
  switch (row_type) {
    case WType::kF32:
      GatherKernel<<<grid, 256, 0, s>>>(x, hidden, r, groups, static_cast<float*>(rows), overflow);
      break;
    case WType::kBF16:
      GatherKernel<<<grid, 256, 0, s>>>(x, hidden, r, groups, static_cast<__nv_bfloat16*>(rows),
                                        overflow);
      break;
    case WType::kF16:
      GatherKernel<<<grid, 256, 0, s>>>(x, hidden, r, groups, static_cast<__half*>(rows), overflow);
      break;
  }
}

void LaunchConvertRows(const float* in, int64_t n, WType row_type, void* out, cudaStream_t s,
                       int32_t* overflow) {
  const unsigned grid = Blocks(n, 256) < 4096 ? Blocks(n, 256) : 4096;
  if (n == 0) return;
  switch (row_type) {
    case WType::kF32:
      cudaMemcpyAsync(out, in, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, s);
      break;
    case WType::kBF16:
      ConvertKernel<<<grid, 256, 0, s>>>(in, n, static_cast<__nv_bfloat16*>(out), overflow);
      break;
    case WType::kF16:
      ConvertKernel<<<grid, 256, 0, s>>>(in, n, static_cast<__half*>(out), overflow);
      break;
  }
}

void LaunchCombine(const float* y, int64_t hidden, const DevRows& r, int experts, bool shared,
                   const float* weights, const float* shared_scale, int k, int64_t tokens_bound,
                   float* out, const int32_t* ntok, cudaStream_t s) {
  CombineKernel<<<static_cast<unsigned>(tokens_bound), 256, 0, s>>>(
      y, hidden, r, experts, shared, weights, shared_scale, k, out, ntok);
}

void AppendGroupKernelImages(std::vector<KernelImage>& out) {
  // Plain CUDA-core code (ballot, popc, atomics): no architecture of its own.
  out.push_back(ImageOf(CountKernel, "CountKernel", 0));
  out.push_back(ImageOf(ScanKernel, "ScanKernel", 0));
  out.push_back(ImageOf(PlaceKernel, "PlaceKernel", 0));
  out.push_back(ImageOf(SharedRowsKernel, "SharedRowsKernel", 0));
  out.push_back(ImageOf(GatherKernel<float>, "GatherKernel<f32>", 0));
  out.push_back(ImageOf(GatherKernel<__nv_bfloat16>, "GatherKernel<bf16>", 0));
  out.push_back(ImageOf(GatherKernel<__half>, "GatherKernel<f16>", 0));
  out.push_back(ImageOf(ConvertKernel<__nv_bfloat16>, "ConvertKernel<bf16>", 0));
  out.push_back(ImageOf(ConvertKernel<__half>, "ConvertKernel<f16>", 0));
  out.push_back(ImageOf(CombineKernel, "CombineKernel", 0));
}

}  // namespace moerun::cuda_kernels
