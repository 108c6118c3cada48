// Portable kernels: plain C++ with std::fma, for any CPU. Bitwise equal to the SIMD variants.
#include <array>
#include <cmath>
#include <cstring>

#include "base/quant_formats.h"
#include "experts/cpu/elementwise.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"

namespace moerun::kernels_internal {
namespace {

constexpr int kMr = 4;
constexpr int kNr = 16;

void PlainTile(int rows, int64_t k, const float* a, const void* b, DType bt, float* c, int64_t ldc,
               bool accumulate) {
  float acc[kMr][kNr];
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < kNr; ++j) acc[i][j] = accumulate ? c[i * ldc + j] : 0.0f;
  }
  int slot[kNr];
  for (int j = 0; j < kNr; ++j) slot[j] = PanelSlot(bt, kNr, j);
  float bv[kNr];
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int j = 0; j < kNr; ++j) bv[j] = LoadAsF32(b, bt, kk * kNr + slot[j]);
    const float* ak = a + kk * kMr;
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < kNr; ++j) acc[i][j] = std::fma(ak[i], bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < kNr; ++j) c[i * ldc + j] = acc[i][j];
  }
}

// e4m3(code) x 2^-8, what the F16 converter yields for the code moved into F16's bit positions.
const std::array<float, 256>& Fp8Values() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c)
      v[static_cast<size_t>(c)] = E4m3ToF32(static_cast<uint8_t>(c)) / 256.0f;
    return v;
  }();
  return t;
}

// The values of row kk of a block's codes into bv.
void DecodeRow(bool fp8, const uint8_t* codes, int64_t kk, float* bv) {
  if (fp8) {
    const std::array<float, 256>& fp8_values = Fp8Values();
    for (int j = 0; j < kNr; ++j) bv[j] = fp8_values[codes[kk * kNr + j]];
  } else {
    for (int j = 0; j < kNr; ++j) bv[j] = E2m1ToF32(F4CodeAt(codes, kNr, kk, j));
  }
}

// dq: null, or the codes' values [k][kNr] (written by Decode).
void QuantTile(int rows, int64_t k, const float* a, const uint8_t* b, DType bt, float* c,
               int64_t ldc, bool accumulate, const float* dq = nullptr) {
  const bool fp8 = bt == DType::kF8E4M3;
  const int bk = BlockK(bt);
  const int header = QuantHeaderBytes(bt, kNr);
  const int row_bytes = QuantRowBytes(bt, kNr);
  float scale[kNr], bv[kNr], s[kMr][kNr];
  for (int64_t k0 = 0; k0 < k; k0 += bk, b += header + bk * row_bytes) {
    const int64_t len = std::min<int64_t>(bk, k - k0);
    if (fp8) {
      float v;
      std::memcpy(&v, b, 4);
      for (float& x : scale) x = v;
    } else {
      for (int j = 0; j < kNr; ++j) scale[j] = E8m0ToF32(b[j]);
    }
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < kNr; ++j) s[i][j] = 0.0f;
    }
    for (int64_t kk = 0; kk < len; ++kk) {
      if (dq != nullptr) {
        std::memcpy(bv, dq + (k0 + kk) * kNr, sizeof bv);
      } else {
        DecodeRow(fp8, b + header, kk, bv);
      }
      const float* ak = a + (k0 + kk) * kMr;
      for (int i = 0; i < rows; ++i) {
        for (int j = 0; j < kNr; ++j) s[i][j] = std::fma(ak[i], bv[j], s[i][j]);
      }
    }
    const bool acc = accumulate || k0 > 0;
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < kNr; ++j) {
        float& out = c[i * ldc + j];
        out = std::fma(s[i][j], scale[j], acc ? out : 0.0f);
      }
    }
  }
}

void Tile(int rows, int64_t k, const float* a, const void* b, DType bt, float* c, int64_t ldc,
          bool accumulate) {
  if (IsBlockScaled(bt)) {
    QuantTile(rows, k, a, static_cast<const uint8_t*>(b), bt, c, ldc, accumulate);
  } else {
    PlainTile(rows, k, a, b, bt, c, ldc, accumulate);
  }
}

void Decode(int64_t k, const void* b, DType bt, float* dq) {
  const bool fp8 = bt == DType::kF8E4M3;
  const int bk = BlockK(bt);
  const int header = QuantHeaderBytes(bt, kNr);
  const int row_bytes = QuantRowBytes(bt, kNr);
  const auto* bb = static_cast<const uint8_t*>(b);
  for (int64_t k0 = 0; k0 < k; k0 += bk, bb += header + bk * row_bytes) {
    const int64_t len = std::min<int64_t>(bk, k - k0);
    for (int64_t kk = 0; kk < len; ++kk) {
      DecodeRow(fp8, bb + header, kk, dq + (k0 + kk) * kNr);
    }
  }
}

void TileDecoded(int rows, int64_t k, const float* a, const float* dq, const void* b, DType bt,
                 float* c, int64_t ldc, bool accumulate) {
  QuantTile(rows, k, a, static_cast<const uint8_t*>(b), bt, c, ldc, accumulate, dq);
}

// The reference: one panel after another.
void TilePanels(int rows, int npanels, int64_t k, const float* a, const void* b,
                int64_t panel_bytes, DType bt, float* c, int64_t ldc, bool accumulate) {
  for (int p = 0; p < npanels; ++p) {
    Tile(rows, k, a, static_cast<const uint8_t*>(b) + p * panel_bytes, bt, c + p * kNr, ldc,
         accumulate);
  }
}

}  // namespace

const CpuKernels& ScalarKernels() {
  static const CpuKernels k{
      Isa::kScalar,          kMr,     kNr,          256,        &Tile, &elementwise::Activate,
      &elementwise::AddBias, &Decode, &TileDecoded, &TilePanels};
  return k;
}

}  // namespace moerun::kernels_internal
