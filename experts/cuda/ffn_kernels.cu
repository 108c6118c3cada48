// The grouped expert FFN on the GPU: GEMM1 (x W13^T) with the activation fused into its epilogue,
// then GEMM2 (h W2^T) + bias. Blocks map to (m-tile of a group, n-tile) through the tile schedule
// (device_plan.h), read from device memory, so nothing here needs the host to know the counts.
//
// Exact: fp32 on CUDA cores; each output is one fmaf chain in k order from +0 (the CPU kernels'
// contract), activation and bias as the CPU does them: bitwise the CPU backend.
// Mma: bf16/f16 tensor cores (wmma 16x16x16, fp32 accumulators); each output accumulates its
// k-tiles in order, whatever the tile's other rows: batch-invariant.
// The tensor-core constants are used only in the device pass (sm_80+).
#pragma nv_diag_suppress 177
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "experts/cpu/elementwise.h"
#include "experts/cuda/convert.cuh"
#include "experts/cuda/ffn_kernels.h"
#include "experts/cuda/tile_layout.h"

namespace moerun::cuda_kernels {
namespace {

using cuda_plan::FindGroup;
using cuda_plan::GateRow;
using cuda_plan::UpRow;

// The tile's group and its row range, or false when the tile is past the batch's last one.
__device__ inline bool TileRows(const FfnArgs& a, int bm, int* g, int32_t* m0, int32_t* m_end) {
  const int32_t tile = static_cast<int32_t>(blockIdx.x);
  if (tile >= a.rows.tile_off[a.n_groups]) return false;
  *g = FindGroup(a.rows.tile_off, a.n_groups, tile);
  // An expert this process has not loaded: the route kernel has flagged the error; its rows are
  // left alone (the forward fails).
  if (a.groups[*g].w13 == nullptr) return false;
  *m0 = a.rows.row_off[*g] + (tile - a.rows.tile_off[*g]) * bm;
  *m_end = a.rows.row_off[*g + 1];
  return true;
}

// ---- exact (fp32, CUDA cores) ----
constexpr int kEb = kExactBm;  // rows per tile
constexpr int kEn = 32;        // columns per tile
constexpr int kEk = 32;        // k per shared-memory stage

template <typename W>
__global__ void ExactGemm1(FfnArgs a) {
  int g;
  int32_t m0, m_end;
  if (!TileRows(a, kEb, &g, &m0, &m_end)) return;
  const DevGroup& grp = a.groups[g];
  const int32_t n0 = static_cast<int32_t>(blockIdx.y) * kEn;
  if (n0 >= grp.inter) return;
  const int64_t hidden = a.hidden;
  const float* in = static_cast<const float*>(a.in);
  const W* w13 = static_cast<const W*>(grp.w13);
  __shared__ float as[kEk][kEb + 1], gs[kEk][kEn + 1], us[kEk][kEn + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  float gacc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, uacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t k0 = 0; k0 < hidden; k0 += kEk) {
    for (int i = ty * 32 + tx; i < kEk * kEb; i += 256) {
      const int r = i / kEk, kk = i % kEk;
      const int64_t k = k0 + kk;
      const bool kin = k < hidden;
      as[kk][r] = (m0 + r < m_end && kin) ? in[static_cast<int64_t>(m0 + r) * hidden + k] : 0.0f;
      const int32_t j = n0 + r;
      const bool jin = j < grp.inter && kin;
      gs[kk][r] = jin ? ToFloat(w13[GateRow(j) * hidden + k]) : 0.0f;
      us[kk][r] = jin ? ToFloat(w13[UpRow(j) * hidden + k]) : 0.0f;
    }
    __syncthreads();
    const int kn = hidden - k0 < kEk ? static_cast<int>(hidden - k0) : kEk;
    for (int kk = 0; kk < kn; ++kk) {
      const float gw = gs[kk][tx], uw = us[kk][tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float x = as[kk][ty + 8 * i];
        gacc[i] = fmaf(x, gw, gacc[i]);
        uacc[i] = fmaf(x, uw, uacc[i]);
      }
    }
    __syncthreads();
  }
  const int32_t j = n0 + tx;
  if (j >= grp.inter) return;
  float* act = static_cast<float*>(a.act);
  for (int i = 0; i < 4; ++i) {
    const int32_t row = m0 + ty + 8 * i;
    if (row >= m_end) break;
    float gv = gacc[i], uv = uacc[i];
    if (grp.bias_g != nullptr) {
      gv = gv + grp.bias_g[j];
      uv = uv + grp.bias_u[j];
    }
    act[static_cast<int64_t>(row) * a.inter_pad_max + j] = elementwise::Act(grp.act, gv, uv);
  }
}

template <typename W>
__global__ void ExactGemm2(FfnArgs a) {
  int g;
  int32_t m0, m_end;
  if (!TileRows(a, kEb, &g, &m0, &m_end)) return;
  const DevGroup& grp = a.groups[g];
  const int64_t hidden = a.hidden;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kEn;
  const float* act = static_cast<const float*>(a.act);
  const W* w2 = static_cast<const W*>(grp.w2);
  const int64_t inter = grp.inter, ldw = grp.inter_pad, ldh = a.inter_pad_max;
  __shared__ float hs[kEk][kEb + 1], ws[kEk][kEn + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t k0 = 0; k0 < inter; k0 += kEk) {
    for (int i = ty * 32 + tx; i < kEk * kEb; i += 256) {
      const int r = i / kEk, kk = i % kEk;
      const int64_t k = k0 + kk;
      const bool kin = k < inter;
      hs[kk][r] = (m0 + r < m_end && kin) ? act[static_cast<int64_t>(m0 + r) * ldh + k] : 0.0f;
      ws[kk][r] = (n0 + r < hidden && kin) ? ToFloat(w2[(n0 + r) * ldw + k]) : 0.0f;
    }
    __syncthreads();
    const int kn = inter - k0 < kEk ? static_cast<int>(inter - k0) : kEk;
    for (int kk = 0; kk < kn; ++kk) {
      const float w = ws[kk][tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = fmaf(hs[kk][ty + 8 * i], w, acc[i]);
    }
    __syncthreads();
  }
  const int64_t n = n0 + tx;
  if (n >= hidden) return;
  for (int i = 0; i < 4; ++i) {
    const int32_t row = m0 + ty + 8 * i;
    if (row >= m_end) break;
    float v = acc[i];
    if (grp.bias_d != nullptr) v = v + grp.bias_d[n];
    a.y[static_cast<int64_t>(row) * hidden + n] = v;
  }
}

// ---- tensor cores (wmma) ----
namespace wmma = nvcuda::wmma;
constexpr int kMb = kMmaBm;    // rows per tile
constexpr int kMn = 64;        // columns per tile (GEMM1: 64 gate + 64 up)
constexpr int kMk = 32;        // k per stage
constexpr int kLd = kMk + 8;   // shared-memory row stride (elements) of the 16-bit tiles
constexpr int kCld = kMn + 4;  // shared-memory row stride (floats) of the accumulator tiles

// Loads a [rows][kMk] tile (k contiguous) of 16-bit values with 16-byte loads; rows past
// `valid_rows` and k past `k_end` read as zero. `src` points at row 0, k0; ld in elements.
template <typename T>
__device__ inline void LoadTile16(T* dst, const T* src, int64_t ld, int rows, int valid_rows,
                                  int64_t k_left) {
  const int chunks = rows * (kMk / 8);
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int r = c / (kMk / 8), kc = (c % (kMk / 8)) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < valid_rows && kc < k_left) v = *reinterpret_cast<const uint4*>(src + r * ld + kc);
    *reinterpret_cast<uint4*>(dst + r * kLd + kc) = v;
  }
}

template <typename T>
__global__ void __launch_bounds__(128) MmaGemm1(FfnArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // bf16 fragments exist from sm_80
  int g;
  int32_t m0, m_end;
  if (!TileRows(a, kMb, &g, &m0, &m_end)) return;
  const DevGroup& grp = a.groups[g];
  const int32_t n0 = static_cast<int32_t>(blockIdx.y) * kMn;
  if (n0 >= grp.inter_pad) return;
  const int64_t hidden = a.hidden;
  const T* in = static_cast<const T*>(a.in) + static_cast<int64_t>(m0) * hidden;
  const T* w13 = static_cast<const T*>(grp.w13);
  const T* wg = w13 + GateRow(n0) * hidden;  // 64 gate rows, then 64 up rows (n0 % 64 == 0)
  const T* wu = w13 + UpRow(n0) * hidden;
  constexpr int kTileBytes = (kMb + 2 * kMn) * kLd * 2;
  constexpr int kAccBytes = 2 * kMb * kCld * 4;
  __shared__ __align__(128) unsigned char smem[kTileBytes > kAccBytes ? kTileBytes : kAccBytes];
  T* as = reinterpret_cast<T*>(smem);
  T* gs = as + kMb * kLd;
  T* us = gs + kMn * kLd;
  const int warp = threadIdx.x / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> gacc[2][2], uacc[2][2];
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(gacc[i][j], 0.0f);
      wmma::fill_fragment(uacc[i][j], 0.0f);
    }
  }
  const int valid = m_end - m0;
  for (int64_t k0 = 0; k0 < hidden; k0 += kMk) {
    LoadTile16(as, in + k0, hidden, kMb, valid, hidden - k0);
    LoadTile16(gs, wg + k0, hidden, kMn, kMn, hidden - k0);
    LoadTile16(us, wu + k0, hidden, kMn, kMn, hidden - k0);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kMk; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bg[2], bu[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(af[i], as + (wm + 16 * i) * kLd + kk, kLd);
      for (int j = 0; j < 2; ++j) {
        wmma::load_matrix_sync(bg[j], gs + (wn + 16 * j) * kLd + kk, kLd);
        wmma::load_matrix_sync(bu[j], us + (wn + 16 * j) * kLd + kk, kLd);
      }
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {
          wmma::mma_sync(gacc[i][j], af[i], bg[j], gacc[i][j]);
          wmma::mma_sync(uacc[i][j], af[i], bu[j], uacc[i][j]);
        }
      }
    }
    __syncthreads();
  }
  float* cg = reinterpret_cast<float*>(smem);
  float* cu = cg + kMb * kCld;
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      const int off = (wm + 16 * i) * kCld + wn + 16 * j;
      wmma::store_matrix_sync(cg + off, gacc[i][j], kCld, wmma::mem_row_major);
      wmma::store_matrix_sync(cu + off, uacc[i][j], kCld, wmma::mem_row_major);
    }
  }
  __syncthreads();
  T* act = static_cast<T*>(a.act);
  for (int e = threadIdx.x; e < kMb * kMn; e += blockDim.x) {
    const int r = e / kMn, c = e % kMn;
    if (r >= valid) break;
    const int32_t j = n0 + c;
    float h = 0.0f;  // padded columns stay zero: GEMM2 reads them
    if (j < grp.inter) {
      float gv = cg[r * kCld + c], uv = cu[r * kCld + c];
      if (grp.bias_g != nullptr) {
        gv = gv + grp.bias_g[j];
        uv = uv + grp.bias_u[j];
      }
      h = elementwise::Act(grp.act, gv, uv);
    }
    act[static_cast<int64_t>(m0 + r) * a.inter_pad_max + j] = FromFloat<T>(h);
  }
#endif
}

template <typename T>
__global__ void __launch_bounds__(128) MmaGemm2(FfnArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // bf16 fragments exist from sm_80
  int g;
  int32_t m0, m_end;
  if (!TileRows(a, kMb, &g, &m0, &m_end)) return;
  const DevGroup& grp = a.groups[g];
  const int64_t hidden = a.hidden;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kMn;
  const int64_t inter_pad = grp.inter_pad;
  const T* act = static_cast<const T*>(a.act) + static_cast<int64_t>(m0) * a.inter_pad_max;
  const T* w2 = static_cast<const T*>(grp.w2) + n0 * inter_pad;
  constexpr int kTileBytes = (kMb + kMn) * kLd * 2;
  constexpr int kAccBytes = kMb * kCld * 4;
  __shared__ __align__(128) unsigned char smem[kTileBytes > kAccBytes ? kTileBytes : kAccBytes];
  T* hs = reinterpret_cast<T*>(smem);
  T* ws = hs + kMb * kLd;
  const int warp = threadIdx.x / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }
  const int valid = m_end - m0;
  const int valid_n = hidden - n0 < kMn ? static_cast<int>(hidden - n0) : kMn;
  for (int64_t k0 = 0; k0 < inter_pad; k0 += kMk) {
    LoadTile16(hs, act + k0, a.inter_pad_max, kMb, valid, inter_pad - k0);
    LoadTile16(ws, w2 + k0, inter_pad, kMn, valid_n, inter_pad - k0);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kMk; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(af[i], hs + (wm + 16 * i) * kLd + kk, kLd);
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(bf[j], ws + (wn + 16 * j) * kLd + kk, kLd);
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], af[i], bf[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
  float* c = reinterpret_cast<float*>(smem);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(c + (wm + 16 * i) * kCld + wn + 16 * j, acc[i][j], kCld,
                              wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kMb * kMn; e += blockDim.x) {
    const int r = e / kMn, col = e % kMn;
    if (r >= valid) break;
    if (col >= valid_n) continue;
    float v = c[r * kCld + col];
    if (grp.bias_d != nullptr) v = v + grp.bias_d[n0 + col];
    a.y[static_cast<int64_t>(m0 + r) * hidden + n0 + col] = v;
  }
#endif
}

unsigned Tiles(const FfnArgs& a, int bm) {
  return static_cast<unsigned>(cuda_plan::MaxTiles(a.rows_bound, a.n_groups, bm));
}
unsigned Cols(int64_t n, int tile) { return static_cast<unsigned>((n + tile - 1) / tile); }

}  // namespace

void LaunchFfnExact(const FfnArgs& a, cudaStream_t s) {
  if (a.rows_bound == 0) return;
  const dim3 block(32, 8);
  const dim3 grid1(Tiles(a, kEb), Cols(a.inter_pad_max, kEn));
  const dim3 grid2(Tiles(a, kEb), Cols(a.hidden, kEn));
  switch (a.wtype) {
    case WType::kF32:
      ExactGemm1<float><<<grid1, block, 0, s>>>(a);
      ExactGemm2<float><<<grid2, block, 0, s>>>(a);
      break;
    case WType::kBF16:
      ExactGemm1<__nv_bfloat16><<<grid1, block, 0, s>>>(a);
      ExactGemm2<__nv_bfloat16><<<grid2, block, 0, s>>>(a);
      break;
    case WType::kF16:
      ExactGemm1<__half><<<grid1, block, 0, s>>>(a);
      ExactGemm2<__half><<<grid2, block, 0, s>>>(a);
      break;
  }
}

void LaunchFfnMma(const FfnArgs& a, cudaStream_t s) {
  if (a.rows_bound == 0) return;
  const dim3 grid1(Tiles(a, kMb), Cols(a.inter_pad_max, kMn));
  const dim3 grid2(Tiles(a, kMb), Cols(a.hidden, kMn));
  if (a.wtype == WType::kF16) {
    MmaGemm1<__half><<<grid1, 128, 0, s>>>(a);
    MmaGemm2<__half><<<grid2, 128, 0, s>>>(a);
  } else {
    MmaGemm1<__nv_bfloat16><<<grid1, 128, 0, s>>>(a);
    MmaGemm2<__nv_bfloat16><<<grid2, 128, 0, s>>>(a);
  }
}

}  // namespace moerun::cuda_kernels
