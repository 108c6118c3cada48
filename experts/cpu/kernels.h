// The per-ISA CPU kernels behind the grouped expert FFN, as a table of plain functions.
//
// Contract shared by every variant (this is what makes results batch-invariant and identical
// across variants):
//   - tile: for each row i < rows and column j < nr of one panel,
//       c[i][j] = (accumulate ? c[i][j] : 0), then for k in order: c = fma(a[k][i], B[k][j], c)
//     one fused multiply-add per k, in k order, in fp32; B widened exactly from F32/BF16/F16.
//     Block-scaled B (FP8, MXFP4: packed_matrix.h) is dequantized in registers, one k block at a
//     time, with the scale applied once per block to the block's sum:
//       for each k block:  s[i][j] = 0;  for k in the block, in order: s = fma(a[k][i], v[k][j], s)
//                          c[i][j] = fma(s[i][j], scale[j], c[i][j])
//     where v is e4m3(code) x 2^-8 and scale the header's scale_inv x 2^8 (FP8), or v = e2m1(code)
//     and scale[j] = 2^(e8m0_j - 127) (MXFP4). b then points at a block start (PanelAt) and `k`
//     covers whole blocks (the matrix's last block may be short).
//     A row's result depends on nothing but its own inputs (not on `rows` or its neighbours).
//   - the elementwise functions use only +, -, *, / and comparisons (never fused), with the same
//     exp approximation (ExpF in elementwise.h), so auto-vectorised code equals scalar code.
// All functions are reentrant; they touch only the memory they are given.
#pragma once

#include <cstdint>

#include "base/dtype.h"
#include "experts/cpu/isa.h"
#include "experts/cpu/packed_matrix.h"

namespace moerun {

// The expert activation (applied to gate g and up u, after their biases).
enum class ActKind {
  kSwiGlu,         // silu(g) * u
  kSwiGluClamped,  // min(silu(g), L) * clamp(u, -L, L)          (Step-3.5-Flash; L = 0: no clamp)
  kGptOss,         // g' = min(g, L); u' = clamp(u, -L, L); (u' + 1) * g' * sigmoid(alpha * g')
};

struct ActParams {
  ActKind kind = ActKind::kSwiGlu;
  float limit = 0.0f;
  float alpha = 1.702f;
};

struct CpuKernels {
  Isa isa;
  int mr;  // rows per tile
  int nr;  // columns per panel
  int kc;  // k block that keeps one panel block in L1

  // c (ldc floats per row) for rows 1..mr; a packed [k][mr]; b one panel [k][nr] of b_type.
  void (*tile)(int rows, int64_t k, const float* a, const void* b, DType b_type, float* c,
               int64_t ldc, bool accumulate);

  // Activation of a block of GEMM1 output. c holds, per row, `pairs` pairs of panels
  // [gate panel q | up panel q] (2*pairs*nr floats, row stride ldc). Column j = q*nr + jj of the
  // hidden layer (j0 + j overall) gets h = act(g + bias_g[j0+j], u + bias_u[j0+j]) (biases may be
  // null). Only columns with j0 + j < inter are written, into `h` at h[(j0+j)*h_stride + row].
  void (*activate)(const ActParams& p, int rows, int pairs, int nr, const float* c, int64_t ldc,
                   const float* bias_g, const float* bias_u, int64_t j0, int64_t inter, float* h,
                   int64_t h_stride);

  // y[i][0..n) += bias[0..n) for `rows` rows of stride ldy.
  void (*add_bias)(int rows, int64_t n, const float* bias, float* y, int64_t ldy);

  // Block-scaled b only, for many rows over one panel: `decode` writes the values v of k rows of
  // codes (b at a block start) to dq [k][nr] floats once; `tile_decoded` then computes exactly
  // what `tile` computes (the same bits), reading v from dq and the scales from b's headers.
  void (*decode)(int64_t k, const void* b, DType b_type, float* dq);
  void (*tile_decoded)(int rows, int64_t k, const float* a, const float* dq, const void* b,
                       DType b_type, float* c, int64_t ldc, bool accumulate);

  // `npanels` panels side by side for few rows: panel p at b + p * panel_bytes (all at the same
  // k offset), its columns at c + p * nr. Exactly `tile` per panel (the same bits); the SIMD
  // variants keep several panels' sums in flight, since for one or two rows a lone panel's FMA
  // chain, not memory, would bound a small batch.
  void (*tile_panels)(int rows, int npanels, int64_t k, const float* a, const void* b,
                      int64_t panel_bytes, DType b_type, float* c, int64_t ldc, bool accumulate);
};

const CpuKernels& KernelsFor(Isa isa);

// The k block a GEMM should hand the tiles for weights of type `t`: the kernel's kc, rounded up
// to whole scale blocks for block-scaled types (so the result does not depend on the variant).
inline int64_t KcFor(const CpuKernels& k, DType t) {
  const int64_t bk = BlockK(t);
  return (k.kc + bk - 1) / bk * bk;
}

namespace kernels_internal {
const CpuKernels& ScalarKernels();
const CpuKernels& Avx2Kernels();
const CpuKernels& Avx512Kernels();
// Test builds only: the AVX-512 kernels' code over emulated intrinsics, runnable on any CPU.
const CpuKernels& Avx512KernelsEmulated();
}  // namespace kernels_internal

}  // namespace moerun
