// The grouped expert FFN on the GPU: GEMM1 (x W13^T) with the activation fused into its epilogue,
// then GEMM2 (h W2^T) + bias. Blocks map to (m-tile of a group, n-tile) through the tile schedule
// (device_plan.h), read from device memory, so nothing here needs the host to know the counts.
//
// Exact: fp32 on CUDA cores; each output is one fmaf chain in k order from +0 (the CPU kernels'
// contract), activation and bias as the CPU does them: bitwise the CPU backend.
// Mma: bf16/f16 tensor cores (wmma 16x16x16, fp32 accumulators); each output accumulates its
// k-tiles in order, whatever the tile's other rows: batch-invariant.
// Block-scaled weights (FP8, MXFP4: quant_layout.h) stay quantized in device memory and are
// decoded in the global -> shared loads:
//   exact  codes to fp32 (FP8: e4m3 x 2^-8, MXFP4: e2m1, both exact); the products are summed per
//          scale block from +0 and each block sum enters the output with one fmaf by the block's
//          scale (the CPU kernels' contract for these types: bitwise the CPU backend again);
//   mma    FP8 codes to e4m3 x 2^-8 in bf16/f16 (exact in both); a 64-row tile shares one scale
//          per 128-input block, so each block is multiplied into its own fp32 accumulators and
//          added to the output's with one fmaf by the scale (as DeepGEMM promotes). MXFP4 codes to
//          e2m1 x 2^(s-127) in bf16 (exact: bf16 has f32's exponent range; f16 has not, so the
//          host refuses MXFP4 on f16 tensor cores).
// The tensor-core constants are used only in the device pass (sm_80+).
#pragma nv_diag_suppress 177
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

#include "experts/cpu/elementwise.h"
#include "experts/cuda/convert.cuh"
#include "experts/cuda/ffn_kernels.h"
#include "experts/cuda/kernel_image.cuh"
#include "experts/cuda/tile_layout.h"

namespace moerun::cuda_kernels {
namespace {

using cuda_plan::FindGroup;
using cuda_plan::GateRow;
using cuda_plan::UpRow;
using cuda_plan::WQuant;

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

// Weight (row, k) of a matrix of row length ld as the exact kernels multiply it: plain types
// widened, block-scaled codes decoded (their scale comes once per block: BlockScale).
template <typename W, WQuant Q>
__device__ inline float LoadWeight(const void* w, int64_t row, int64_t k, int64_t ld) {
  if constexpr (Q == WQuant::kNone) {
    return ToFloat(static_cast<const W*>(w)[row * ld + k]);
  } else if constexpr (Q == WQuant::kFp8) {
    return cuda_plan::Fp8Value(static_cast<const uint8_t*>(w)[row * ld + k]);
  } else {
    const uint8_t* codes = static_cast<const uint8_t*>(w) + row * cuda_plan::CodeRowBytes(Q, ld);
    return cuda_plan::E2m1Value(cuda_plan::MxCode(codes, k));
  }
}

// The scale of the block holding element (row, k): FP8 the f32 scale_inv x 2^8, MXFP4 2^(s-127).
template <WQuant Q>
__device__ inline float BlockScale(const void* scales, int64_t row, int64_t k, int64_t ld) {
  const int64_t i = cuda_plan::ScaleIndex(Q, row, k, ld);
  if constexpr (Q == WQuant::kFp8) {
    return static_cast<const float*>(scales)[i];
  } else {
    return cuda_plan::E8m0Value(static_cast<const uint8_t*>(scales)[i]);
  }
}

// Whether the stage [k0, k0 + stage) ends a scale block of a k range of `kdim` (stage divides the
// block size, so a stage lies in one block).
template <WQuant Q>
__device__ inline bool EndsBlock(int64_t k0, int stage, int64_t kdim) {
  return (k0 + stage) % cuda_plan::BlockK(Q) == 0 || k0 + stage >= kdim;
}

// ---- exact (fp32, CUDA cores) ----
constexpr int kEb = kExactBm;  // rows per tile
constexpr int kEn = 32;        // columns per tile
constexpr int kEk = 32;        // k per shared-memory stage (divides both scale blocks)
// The exact kernels promote a block's sums after the stage that ends it (EndsBlock): a stage
// must lie in one scale block of either type.
static_assert(cuda_plan::kFp8BlockK % kEk == 0 && cuda_plan::kMxBlockK % kEk == 0,
              "an ExactGemm k stage lies in one scale block");

template <typename W, WQuant Q>
__global__ void ExactGemm1(FfnArgs a) {
  int g;
  int32_t m0, m_end;
  if (!TileRows(a, kEb, &g, &m0, &m_end)) return;
  const DevGroup& grp = a.groups[g];
  const int32_t n0 = static_cast<int32_t>(blockIdx.y) * kEn;
  if (n0 >= grp.inter) return;
  const int64_t hidden = a.hidden;
  const float* in = static_cast<const float*>(a.in);
  __shared__ float as[kEk][kEb + 1], gs[kEk][kEn + 1], us[kEk][kEn + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  float gacc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, uacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float gsum[4] = {0.0f, 0.0f, 0.0f, 0.0f}, usum[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // this block's
  const int32_t jt = n0 + tx;  // this thread's column
  for (int64_t k0 = 0; k0 < hidden; k0 += kEk) {
    for (int i = ty * 32 + tx; i < kEk * kEb; i += 256) {
      const int r = i / kEk, kk = i % kEk;
      const int64_t k = k0 + kk;
      const bool kin = k < hidden;
      as[kk][r] = (m0 + r < m_end && kin) ? in[static_cast<int64_t>(m0 + r) * hidden + k] : 0.0f;
      const int32_t j = n0 + r;
      const bool jin = j < grp.inter && kin;
      gs[kk][r] = jin ? LoadWeight<W, Q>(grp.w13, GateRow(j), k, hidden) : 0.0f;
      us[kk][r] = jin ? LoadWeight<W, Q>(grp.w13, UpRow(j), k, hidden) : 0.0f;
    }
    __syncthreads();
    const int kn = hidden - k0 < kEk ? static_cast<int>(hidden - k0) : kEk;
    for (int kk = 0; kk < kn; ++kk) {
      const float gw = gs[kk][tx], uw = us[kk][tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float x = as[kk][ty + 8 * i];
        if constexpr (Q == WQuant::kNone) {
          gacc[i] = fmaf(x, gw, gacc[i]);
          uacc[i] = fmaf(x, uw, uacc[i]);
        } else {
          gsum[i] = fmaf(x, gw, gsum[i]);
          usum[i] = fmaf(x, uw, usum[i]);
        }
      }
    }
    __syncthreads();
    if constexpr (Q != WQuant::kNone) {
      if (EndsBlock<Q>(k0, kEk, hidden)) {
        const bool jin = jt < grp.inter;
        const float sg = jin ? BlockScale<Q>(grp.s13, GateRow(jt), k0, hidden) : 0.0f;
        const float su = jin ? BlockScale<Q>(grp.s13, UpRow(jt), k0, hidden) : 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          gacc[i] = fmaf(gsum[i], sg, gacc[i]);
          uacc[i] = fmaf(usum[i], su, uacc[i]);
          gsum[i] = 0.0f;
          usum[i] = 0.0f;
        }
      }
    }
  }
  const int32_t j = jt;
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

template <typename W, WQuant Q>
__global__ void ExactGemm2(FfnArgs a) {
  int g;
  int32_t m0, m_end;
  if (!TileRows(a, kEb, &g, &m0, &m_end)) return;
  const DevGroup& grp = a.groups[g];
  const int64_t hidden = a.hidden;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kEn;
  const float* act = static_cast<const float*>(a.act);
  const int64_t inter = grp.inter, ldw = grp.inter_pad, ldh = a.inter_pad_max;
  __shared__ float hs[kEk][kEb + 1], ws[kEk][kEn + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // block-scaled: this block's sums
  const int64_t nt = n0 + tx;               // this thread's column
  for (int64_t k0 = 0; k0 < inter; k0 += kEk) {
    for (int i = ty * 32 + tx; i < kEk * kEb; i += 256) {
      const int r = i / kEk, kk = i % kEk;
      const int64_t k = k0 + kk;
      const bool kin = k < inter;
      hs[kk][r] = (m0 + r < m_end && kin) ? act[static_cast<int64_t>(m0 + r) * ldh + k] : 0.0f;
      ws[kk][r] = (n0 + r < hidden && kin) ? LoadWeight<W, Q>(grp.w2, n0 + r, k, ldw) : 0.0f;
    }
    __syncthreads();
    const int kn = inter - k0 < kEk ? static_cast<int>(inter - k0) : kEk;
    for (int kk = 0; kk < kn; ++kk) {
      const float w = ws[kk][tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (Q == WQuant::kNone) {
          acc[i] = fmaf(hs[kk][ty + 8 * i], w, acc[i]);
        } else {
          sum[i] = fmaf(hs[kk][ty + 8 * i], w, sum[i]);
        }
      }
    }
    __syncthreads();
    if constexpr (Q != WQuant::kNone) {
      if (EndsBlock<Q>(k0, kEk, inter)) {
        const float sc = nt < hidden ? BlockScale<Q>(grp.s2, nt, k0, ldw) : 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[i] = fmaf(sum[i], sc, acc[i]);
          sum[i] = 0.0f;
        }
      }
    }
  }
  const int64_t n = nt;
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

// What the tiles assume of the weight layouts (tile_layout.h, quant_layout.h):
// - GEMM1 reads 64 gate rows and the 64 up rows of one kColBlock block of W13 (GateRow(n0) and
//   UpRow(n0) with n0 % kMn == 0 start contiguous runs of kMn rows).
static_assert(kMn == cuda_plan::kColBlock, "an MmaGemm1 tile is one gate/up block of W13");
// - FP8 on tensor cores: a tile's kMn weight rows share one scale per 128-input block
//   (BlockScale reads the scale of the tile's first row, row0 = GateRow(n0), UpRow(n0) or n0 of
//   W2, all multiples of kMn), so the tile must lie in one 64-row scale block...
static_assert(cuda_plan::kFp8ScaleRows % kMn == 0, "an MmaGemm tile spans one FP8 scale row");
// - ...and a k stage in one 128-input block: EndsBlock promotes the block's accumulators after the
//   stage that ends it, so a stage must never straddle two scales.
static_assert(cuda_plan::kFp8BlockK % kMk == 0, "an MmaGemm k stage lies in one FP8 scale block");
// - MXFP4 on tensor cores: LoadQuantTile decodes 8 codes with the scale of the first, at k
//   multiples of 8 (k0 % kMk == 0), so 8 consecutive codes share a 32-input scale block.
static_assert(cuda_plan::kMxBlockK % 8 == 0 && kMk % 8 == 0, "8 MXFP4 codes share one scale");
// - wmma: 16x16x16 fragments over the tile, 4 warps of 32x32.
static_assert(kMk % 16 == 0 && kMb == 64 && kMn == 64, "the warp layout covers the 64x64 tile");

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

// Loads a [rows][kMk] tile of block-scaled weights decoded to T (FP8: e4m3 x 2^-8; MXFP4: e2m1
// x 2^(s-127), both exact in T where the host allows them), 8 codes per load; rows past
// `valid_rows` and k past ld read as zero. Row r of the tile is device row row0 + r of a matrix of
// row length ld (quant_layout.h).
template <typename T, WQuant Q>
__device__ inline void LoadQuantTile(T* dst, const void* codes, const void* scales, int64_t row0,
                                     int64_t ld, int64_t k0, int rows, int valid_rows) {
  const int chunks = rows * (kMk / 8);
  const int64_t row_bytes = cuda_plan::CodeRowBytes(Q, ld);
  const uint8_t* base = static_cast<const uint8_t*>(codes);
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int r = c / (kMk / 8), kc = (c % (kMk / 8)) * 8;
    const int64_t k = k0 + kc;
    T* d = dst + r * kLd + kc;
    if (r >= valid_rows || k >= ld) {
#pragma unroll
      for (int b = 0; b < 8; ++b) d[b] = FromFloat<T>(0.0f);
      continue;
    }
    const uint8_t* row = base + (row0 + r) * row_bytes;
    if constexpr (Q == WQuant::kFp8) {
      const uint2 raw = *reinterpret_cast<const uint2*>(row + k);  // ld % 8 == 0: aligned
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const uint32_t word = b < 4 ? raw.x : raw.y;
        d[b] = FromFloat<T>(cuda_plan::Fp8Value(static_cast<uint8_t>(word >> (8 * (b % 4)))));
      }
    } else {
      const uint32_t raw = *reinterpret_cast<const uint32_t*>(row + k / 2);  // 8 nibbles
      const float s = cuda_plan::E8m0Value(
          static_cast<const uint8_t*>(scales)[cuda_plan::ScaleIndex(Q, row0 + r, k, ld)]);
#pragma unroll
      for (int b = 0; b < 8; ++b) d[b] = FromFloat<T>(cuda_plan::E2m1Value(raw >> (4 * b)) * s);
    }
  }
}

// FP8 on tensor cores: adds one scale block's accumulators into the output's, times its scale.
template <typename Frag>
__device__ inline void Promote(Frag& acc, Frag& part, float scale) {
  for (int t = 0; t < acc.num_elements; ++t) {
    acc.x[t] = fmaf(part.x[t], scale, acc.x[t]);
    part.x[t] = 0.0f;
  }
}

template <typename T, WQuant Q>
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
  const int64_t g_row0 = GateRow(n0);  // 64 gate rows, then 64 up rows (n0 % 64 == 0)
  const int64_t u_row0 = UpRow(n0);
  constexpr int kTileBytes = (kMb + 2 * kMn) * kLd * 2;
  constexpr int kAccBytes = 2 * kMb * kCld * 4;
  __shared__ __align__(128) unsigned char smem[kTileBytes > kAccBytes ? kTileBytes : kAccBytes];
  T* as = reinterpret_cast<T*>(smem);
  T* gs = as + kMb * kLd;
  T* us = gs + kMn * kLd;
  const int warp = threadIdx.x / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  // FP8: gpart/upart hold the current scale block's products.
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> gacc[2][2], uacc[2][2], gpart[2][2],
      upart[2][2];
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(gacc[i][j], 0.0f);
      wmma::fill_fragment(uacc[i][j], 0.0f);
      if constexpr (Q == WQuant::kFp8) {
        wmma::fill_fragment(gpart[i][j], 0.0f);
        wmma::fill_fragment(upart[i][j], 0.0f);
      }
    }
  }
  const int valid = m_end - m0;
  for (int64_t k0 = 0; k0 < hidden; k0 += kMk) {
    LoadTile16(as, in + k0, hidden, kMb, valid, hidden - k0);
    if constexpr (Q == WQuant::kNone) {
      const T* w13 = static_cast<const T*>(grp.w13);
      LoadTile16(gs, w13 + g_row0 * hidden + k0, hidden, kMn, kMn, hidden - k0);
      LoadTile16(us, w13 + u_row0 * hidden + k0, hidden, kMn, kMn, hidden - k0);
    } else {
      LoadQuantTile<T, Q>(gs, grp.w13, grp.s13, g_row0, hidden, k0, kMn, kMn);
      LoadQuantTile<T, Q>(us, grp.w13, grp.s13, u_row0, hidden, k0, kMn, kMn);
    }
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
          if constexpr (Q == WQuant::kFp8) {
            wmma::mma_sync(gpart[i][j], af[i], bg[j], gpart[i][j]);
            wmma::mma_sync(upart[i][j], af[i], bu[j], upart[i][j]);
          } else {
            wmma::mma_sync(gacc[i][j], af[i], bg[j], gacc[i][j]);
            wmma::mma_sync(uacc[i][j], af[i], bu[j], uacc[i][j]);
          }
        }
      }
    }
    __syncthreads();
    if constexpr (Q == WQuant::kFp8) {
      if (EndsBlock<Q>(k0, kMk, hidden)) {
        const float sg = BlockScale<Q>(grp.s13, g_row0, k0, hidden);
        const float su = BlockScale<Q>(grp.s13, u_row0, k0, hidden);
        for (int i = 0; i < 2; ++i) {
          for (int j = 0; j < 2; ++j) {
            Promote(gacc[i][j], gpart[i][j], sg);
            Promote(uacc[i][j], upart[i][j], su);
          }
        }
      }
    }
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
    const T v = FromFloat<T>(h);
    if constexpr (std::is_same_v<T, __half>) {
      // f16 holds the activations: a finite h that rounds to inf (|h| >= 65520) is flagged for
      // the layer, which turns it into an error instead of a silently infinite output.
      if (a.overflow != nullptr && isfinite(h) && __hisinf(v) != 0) *a.overflow = 1;
    }
    act[static_cast<int64_t>(m0 + r) * a.inter_pad_max + j] = v;
  }
#else
  __trap();  // compiled for an architecture without bf16/f16 fragments: never return unwritten
#endif
}

template <typename T, WQuant Q>
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
  constexpr int kTileBytes = (kMb + kMn) * kLd * 2;
  constexpr int kAccBytes = kMb * kCld * 4;
  __shared__ __align__(128) unsigned char smem[kTileBytes > kAccBytes ? kTileBytes : kAccBytes];
  T* hs = reinterpret_cast<T*>(smem);
  T* ws = hs + kMb * kLd;
  const int warp = threadIdx.x / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2], part[2][2];  // part: FP8
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(acc[i][j], 0.0f);
      if constexpr (Q == WQuant::kFp8) wmma::fill_fragment(part[i][j], 0.0f);
    }
  }
  const int valid = m_end - m0;
  const int valid_n = hidden - n0 < kMn ? static_cast<int>(hidden - n0) : kMn;
  for (int64_t k0 = 0; k0 < inter_pad; k0 += kMk) {
    LoadTile16(hs, act + k0, a.inter_pad_max, kMb, valid, inter_pad - k0);
    if constexpr (Q == WQuant::kNone) {
      const T* w2 = static_cast<const T*>(grp.w2) + n0 * inter_pad;
      LoadTile16(ws, w2 + k0, inter_pad, kMn, valid_n, inter_pad - k0);
    } else {
      LoadQuantTile<T, Q>(ws, grp.w2, grp.s2, n0, inter_pad, k0, kMn, valid_n);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kMk; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(af[i], hs + (wm + 16 * i) * kLd + kk, kLd);
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(bf[j], ws + (wn + 16 * j) * kLd + kk, kLd);
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {
          if constexpr (Q == WQuant::kFp8) {
            wmma::mma_sync(part[i][j], af[i], bf[j], part[i][j]);
          } else {
            wmma::mma_sync(acc[i][j], af[i], bf[j], acc[i][j]);
          }
        }
      }
    }
    __syncthreads();
    if constexpr (Q == WQuant::kFp8) {
      if (EndsBlock<Q>(k0, kMk, inter_pad)) {
        const float sc = BlockScale<Q>(grp.s2, n0, k0, inter_pad);
        for (int i = 0; i < 2; ++i) {
          for (int j = 0; j < 2; ++j) Promote(acc[i][j], part[i][j], sc);
        }
      }
    }
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
#else
  __trap();  // compiled for an architecture without bf16/f16 fragments: never return unwritten
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
  switch (a.quant) {
    case WQuant::kFp8:
      ExactGemm1<uint8_t, WQuant::kFp8><<<grid1, block, 0, s>>>(a);
      ExactGemm2<uint8_t, WQuant::kFp8><<<grid2, block, 0, s>>>(a);
      return;
    case WQuant::kMxfp4:
      ExactGemm1<uint8_t, WQuant::kMxfp4><<<grid1, block, 0, s>>>(a);
      ExactGemm2<uint8_t, WQuant::kMxfp4><<<grid2, block, 0, s>>>(a);
      return;
    case WQuant::kNone:
      break;
  }
  switch (a.wtype) {
    case WType::kF32:
      ExactGemm1<float, WQuant::kNone><<<grid1, block, 0, s>>>(a);
      ExactGemm2<float, WQuant::kNone><<<grid2, block, 0, s>>>(a);
      break;
    case WType::kBF16:
      ExactGemm1<__nv_bfloat16, WQuant::kNone><<<grid1, block, 0, s>>>(a);
      ExactGemm2<__nv_bfloat16, WQuant::kNone><<<grid2, block, 0, s>>>(a);
      break;
    case WType::kF16:
      ExactGemm1<__half, WQuant::kNone><<<grid1, block, 0, s>>>(a);
      ExactGemm2<__half, WQuant::kNone><<<grid2, block, 0, s>>>(a);
      break;
  }
}

namespace {
template <typename T, WQuant Q>
void LaunchMma(const FfnArgs& a, cudaStream_t s) {
  const dim3 grid1(Tiles(a, kMb), Cols(a.inter_pad_max, kMn));
  const dim3 grid2(Tiles(a, kMb), Cols(a.hidden, kMn));
  MmaGemm1<T, Q><<<grid1, 128, 0, s>>>(a);
  MmaGemm2<T, Q><<<grid2, 128, 0, s>>>(a);
}
}  // namespace

void LaunchFfnMma(const FfnArgs& a, cudaStream_t s) {
  if (a.rows_bound == 0) return;
  if (a.wtype == WType::kF16) {
    switch (a.quant) {
      case WQuant::kNone:
        LaunchMma<__half, WQuant::kNone>(a, s);
        break;
      case WQuant::kFp8:
        LaunchMma<__half, WQuant::kFp8>(a, s);
        break;
      case WQuant::kMxfp4:  // e8m0 scales do not fit f16: the layer refuses this at upload
        break;
    }
    return;
  }
  switch (a.quant) {
    case WQuant::kNone:
      LaunchMma<__nv_bfloat16, WQuant::kNone>(a, s);
      break;
    case WQuant::kFp8:
      LaunchMma<__nv_bfloat16, WQuant::kFp8>(a, s);
      break;
    case WQuant::kMxfp4:
      LaunchMma<__nv_bfloat16, WQuant::kMxfp4>(a, s);
      break;
  }
}

void AppendFfnKernelImages(std::vector<KernelImage>& out) {
  // Exact math: plain fp32 CUDA-core code, no architecture of its own (0: any the toolkit builds).
  out.push_back(ImageOf(ExactGemm1<uint8_t, WQuant::kFp8>, "ExactGemm1<fp8>", 0));
  out.push_back(ImageOf(ExactGemm2<uint8_t, WQuant::kFp8>, "ExactGemm2<fp8>", 0));
  out.push_back(ImageOf(ExactGemm1<uint8_t, WQuant::kMxfp4>, "ExactGemm1<mxfp4>", 0));
  out.push_back(ImageOf(ExactGemm2<uint8_t, WQuant::kMxfp4>, "ExactGemm2<mxfp4>", 0));
  out.push_back(ImageOf(ExactGemm1<float, WQuant::kNone>, "ExactGemm1<f32>", 0));
  out.push_back(ImageOf(ExactGemm2<float, WQuant::kNone>, "ExactGemm2<f32>", 0));
  out.push_back(ImageOf(ExactGemm1<__nv_bfloat16, WQuant::kNone>, "ExactGemm1<bf16>", 0));
  out.push_back(ImageOf(ExactGemm2<__nv_bfloat16, WQuant::kNone>, "ExactGemm2<bf16>", 0));
  out.push_back(ImageOf(ExactGemm1<__half, WQuant::kNone>, "ExactGemm1<f16>", 0));
  out.push_back(ImageOf(ExactGemm2<__half, WQuant::kNone>, "ExactGemm2<f16>", 0));
  // Tensor cores: bf16/f16 wmma fragments from sm_80 (below, the bodies trap).
  constexpr int kMmaArch = 80;
  out.push_back(ImageOf(MmaGemm1<__half, WQuant::kNone>, "MmaGemm1<f16,none>", kMmaArch));
  out.push_back(ImageOf(MmaGemm2<__half, WQuant::kNone>, "MmaGemm2<f16,none>", kMmaArch));
  out.push_back(ImageOf(MmaGemm1<__half, WQuant::kFp8>, "MmaGemm1<f16,fp8>", kMmaArch));
  out.push_back(ImageOf(MmaGemm2<__half, WQuant::kFp8>, "MmaGemm2<f16,fp8>", kMmaArch));
  out.push_back(ImageOf(MmaGemm1<__nv_bfloat16, WQuant::kNone>, "MmaGemm1<bf16,none>", kMmaArch));
  out.push_back(ImageOf(MmaGemm2<__nv_bfloat16, WQuant::kNone>, "MmaGemm2<bf16,none>", kMmaArch));
  out.push_back(ImageOf(MmaGemm1<__nv_bfloat16, WQuant::kFp8>, "MmaGemm1<bf16,fp8>", kMmaArch));
  out.push_back(ImageOf(MmaGemm2<__nv_bfloat16, WQuant::kFp8>, "MmaGemm2<bf16,fp8>", kMmaArch));
  out.push_back(ImageOf(MmaGemm1<__nv_bfloat16, WQuant::kMxfp4>, "MmaGemm1<bf16,mxfp4>", kMmaArch));
  out.push_back(ImageOf(MmaGemm2<__nv_bfloat16, WQuant::kMxfp4>, "MmaGemm2<bf16,mxfp4>", kMmaArch));
}

}  // namespace moerun::cuda_kernels
