// Block-scaled weights (FP8 e4m3 with 128 x 128 block scales, MXFP4 e2m1 with e8m0 scales per 32
// inputs): the number formats, packing, and the kernels dequantizing in registers: every ISA
// variant bitwise equal to the portable one, close to a double reference over the exactly
// dequantized weights, rows independent of the tile height.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "base/quant_formats.h"
#include "base/thread_pool.h"
#include "experts/cpu/gemm.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"
#include "tests/unit/kernel_variants.h"

namespace moerun {
namespace {

TEST(QuantFormatsTest, E4m3DecodesEveryCode) {
  EXPECT_EQ(E4m3ToF32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(E4m3ToF32(0x80)));
  EXPECT_EQ(E4m3ToF32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(E4m3ToF32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4m3ToF32(0x38), 1.0f);
  EXPECT_EQ(E4m3ToF32(0x7E), 448.0f);
  EXPECT_EQ(E4m3ToF32(0xFE), -448.0f);
  EXPECT_TRUE(std::isnan(E4m3ToF32(0x7F)));
  EXPECT_TRUE(std::isnan(E4m3ToF32(0xFF)));
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    if (IsE4m3NaN(code)) continue;
    EXPECT_EQ(F32ToE4m3(E4m3ToF32(code)), code == 0x80 ? 0x80 : code) << c;
  }
  EXPECT_EQ(F32ToE4m3(1000.0f), 0x7E);  // saturates
  EXPECT_EQ(F32ToE4m3(1.0625f), 0x38);  // tie between 1 and 1.125 -> even mantissa
  EXPECT_EQ(F32ToE4m3(1.1875f), 0x3A);  // tie between 1.125 and 1.25 -> even (1.25)
}

TEST(QuantFormatsTest, E2m1AndE8m0) {
  const float want[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(E2m1ToF32(static_cast<uint8_t>(c)), c < 8 ? want[c] : -want[c - 8]);
    EXPECT_EQ(F32ToE2m1(E2m1ToF32(static_cast<uint8_t>(c))), c);
  }
  EXPECT_EQ(F32ToE2m1(2.5f), 4);  // tie between 2 (code 4) and 3 (code 5) -> even
  EXPECT_EQ(F32ToE2m1(100.0f), 7);
  EXPECT_EQ(E8m0ToF32(127), 1.0f);
  EXPECT_EQ(E8m0ToF32(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(E8m0ToF32(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(E8m0ToF32(255)));
  for (int s = 0; s < 255; ++s) EXPECT_EQ(F32ToE8m0(E8m0ToF32(static_cast<uint8_t>(s))), s);
  EXPECT_EQ(F32ToE8m0(3.0f), -1);
  EXPECT_EQ(F32ToE8m0(-1.0f), -1);
}

// A random block-scaled W [n][k] in checkpoint form: codes and per-block scales.
struct QuantMatrix {
  DType type;
  int64_t n, k;
  std::vector<uint8_t> codes;  // [n][k]
  std::vector<float> scales;   // FP8: [ceil(n/128)][ceil(k/128)]; MXFP4: [n][ceil(k/32)]
  int64_t kblocks() const { return (k + BlockK(type) - 1) / BlockK(type); }

  float Scale(int64_t row, int64_t b) const {
    const int64_t r = type == DType::kF8E4M3 ? row / 128 : row;
    return scales[static_cast<size_t>(r * kblocks() + b)];
  }
  double Value(int64_t row, int64_t col) const {
    const uint8_t c = codes[static_cast<size_t>(row * k + col)];
    const double v = type == DType::kF8E4M3 ? E4m3ToF32(c) : E2m1ToF32(c);
    return v * Scale(row, col / BlockK(type));
  }
  QuantRowReader Reader() const {
    return [this](int64_t row, uint8_t* out, float* s) {
      std::memcpy(out, &codes[static_cast<size_t>(row * k)], static_cast<size_t>(k));
      for (int64_t b = 0; b < kblocks(); ++b) s[b] = Scale(row, b);
      return true;
    };
  }
};

QuantMatrix RandomQuant(DType type, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  QuantMatrix m{type, n, k, {}, {}};
  m.codes.resize(static_cast<size_t>(n * k));
  for (auto& c : m.codes) {
    do {
      c = static_cast<uint8_t>(rng() & (type == DType::kF8E4M3 ? 0xFF : 0x0F));
    } while (type == DType::kF8E4M3 && IsE4m3NaN(c));
  }
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  const int64_t rows = type == DType::kF8E4M3 ? (n + 127) / 128 : n;
  m.scales.resize(static_cast<size_t>(rows * m.kblocks()));
  for (auto& s : m.scales) {
    s = type == DType::kF8E4M3 ? u(rng) * 1e-3f
                               : std::ldexp(1.0f, -6 + static_cast<int>(rng() % 5));
  }
  return m;
}

PackedMatrix Pack(const QuantMatrix& q, int nr) {
  PackedMatrix m(q.type, q.n, q.k, nr);
  m.FillQuant(q.Reader(), 2);
  return m;
}

TEST(QuantPackingTest, AtIsTheExactlyDequantizedWeight) {
  for (DType t : {DType::kF8E4M3, DType::kF4}) {
    const QuantMatrix q = RandomQuant(t, 200, 300, 7);
    for (int nr : {16, 32}) {
      SCOPED_TRACE(std::string(DTypeName(t)) + " nr " + std::to_string(nr));
      const PackedMatrix m = Pack(q, nr);
      for (int64_t n = 0; n < q.n; ++n) {
        for (int64_t k = 0; k < q.k; ++k) {
          ASSERT_EQ(m.CodeAt(n, k), q.codes[static_cast<size_t>(n * q.k + k)]) << n << "," << k;
          ASSERT_EQ(m.ScaleAt(n, k), q.Scale(n, k / BlockK(t)));
          ASSERT_EQ(m.At(n, k), static_cast<float>(q.Value(n, k)));
        }
      }
      for (int64_t n = q.n; n < m.n_padded(); ++n) EXPECT_EQ(m.At(n, 5), 0.0f);
      // Resident bytes: the codes plus the scales and headers, within 10% of the codes for FP8
      // (headers of 64 bytes per 128 x nr codes; the partial k block and panel padding add more
      // on this small matrix) and of codes + e8m0 scales for MXFP4.
      const double codes =
          static_cast<double>(m.n_padded() * q.k) * (t == DType::kF8E4M3 ? 1 : 0.5);
      EXPECT_LT(static_cast<double>(m.bytes()), codes * 1.1);
    }
  }
}

// Every variant computes C = A W^T with the same bits as the portable kernels, for every tile
// height, partial blocks at both edges, and both formats; close to the double reference.
TEST(QuantKernelsTest, GemmBitwiseEqualAcrossIsasAndCloseToDouble) {
  const int64_t m = 29, n = 200, k = 300;  // k: 2 FP8 blocks + 44; 9 MXFP4 groups + 12
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(m * k));
  for (auto& x : a) x = d(rng);
  ThreadPool pool(2);
  for (DType t : {DType::kF8E4M3, DType::kF4}) {
    const QuantMatrix q = RandomQuant(t, n, k, 11);
    std::vector<float> scalar_out;
    for (const auto& v : testing::TestVariants()) {
      SCOPED_TRACE(v.name + " " + DTypeName(t));
      const CpuKernels& kern = *v.kernels;
      const PackedMatrix b = Pack(q, kern.nr);
      std::vector<float> c(static_cast<size_t>(m * b.n_padded()));
      AlignedBuffer apack;
      GemmPacked(kern, &pool, m, a.data(), k, b, c.data(), b.n_padded(), &apack);
      std::vector<float> out(static_cast<size_t>(m * n));
      double worst = 0;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const float got = c[static_cast<size_t>(i * b.n_padded() + j)];
          out[static_cast<size_t>(i * n + j)] = got;
          double ref = 0, mag = 0;
          for (int64_t kk = 0; kk < k; ++kk) {
            const double p =
                static_cast<double>(a[static_cast<size_t>(i * k + kk)]) * q.Value(j, kk);
            ref += p;
            mag += std::fabs(p);
          }
          worst = std::max(worst, std::fabs(got - ref) / mag);
        }
      }
      EXPECT_LT(worst, 1e-6);
      if (v.name == "scalar") {
        scalar_out = out;
      } else {
        EXPECT_EQ(std::memcmp(out.data(), scalar_out.data(), out.size() * 4), 0);
      }
    }
  }
}

// Activations at the edges of the float range give the same bits on every variant too: the
// AVX-512 FP8 path for few rows scales a by 2^112 and must fall back for |a| >= 2^16 (and for inf
// and NaN), and subnormal a and e4m3 codes must stay exact. Every e4m3 code is in the weights.
TEST(QuantKernelsTest, ExtremeActivationsSameBitsOnEveryVariant) {
  const int64_t m = 7, n = 70, k = 302;  // the last block's 46 k rows: 44 by vectors, 2 by rows
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(m * k));
  for (auto& x : a) x = d(rng);
  const float edge[] = {65535.0f, 65536.0f, -70000.0f, 3e38f, 1e-40f, -1e-45f, 1e-30f, 0.0f};
  for (int64_t i = 0; i < m; ++i) {
    // Row i: one edge value in its first block (row 6: none, and row 5 an infinity later on).
    if (i < 6) a[static_cast<size_t>(i * k + 3 + i)] = edge[i];
    if (i == 4) a[static_cast<size_t>(i * k + 200)] = edge[6];
  }
  a[static_cast<size_t>(5 * k + 290)] = std::numeric_limits<float>::infinity();
  a[static_cast<size_t>(2 * k + 301)] = -70000.0f;  // in the last block's row-by-row tail
  ThreadPool pool(1);
  for (DType t : {DType::kF8E4M3, DType::kF4}) {
    QuantMatrix q = RandomQuant(t, n, k, 17);
    if (t == DType::kF8E4M3) {
      for (size_t c = 0; c < 256 && c < q.codes.size(); ++c) {
        const uint8_t code = static_cast<uint8_t>(c);
        q.codes[c * 7 % q.codes.size()] = IsE4m3NaN(code) ? 0 : code;
      }
    }
    std::vector<uint32_t> want;
    for (const auto& v : testing::TestVariants()) {
      SCOPED_TRACE(v.name + " " + DTypeName(t));
      const CpuKernels& kern = *v.kernels;
      const PackedMatrix b = Pack(q, kern.nr);
      const int64_t ldc = b.n_padded();
      std::vector<float> c(static_cast<size_t>(m * ldc));
      AlignedBuffer apack;
      GemmPacked(kern, &pool, m, a.data(), k, b, c.data(), ldc, &apack);
      std::vector<uint32_t> bits(static_cast<size_t>(m * n));
      for (int64_t i = 0; i < m; ++i) {
        std::memcpy(&bits[static_cast<size_t>(i * n)], &c[static_cast<size_t>(i * ldc)], n * 4);
      }
      if (want.empty()) {
        want = bits;
      } else {
        EXPECT_EQ(bits, want);
      }
      // The few-row path over several panels: the same bits as the GEMM's rows.
      for (int rows = 1; rows <= std::min(4, kern.mr); ++rows) {
        std::vector<float> got(static_cast<size_t>(kern.mr * ldc));
        kern.tile_panels(rows, static_cast<int>(b.panels()), k, apack.as<float>(), b.panel(0),
                         b.panel_bytes(), t, got.data(), ldc, false);
        for (int i = 0; i < rows; ++i) {
          EXPECT_EQ(std::memcmp(&got[static_cast<size_t>(i * ldc)],
                                &c[static_cast<size_t>(i * ldc)], n * 4),
                    0)
              << rows << " rows, row " << i;
        }
      }
    }
  }
}

TEST(QuantKernelsTest, TileRowsAreIndependent) {
  const int64_t k = 300;
  for (DType t : {DType::kF8E4M3, DType::kF4}) {
    for (const auto& v : testing::TestVariants()) {
      const CpuKernels& kern = *v.kernels;
      SCOPED_TRACE(v.name + " " + DTypeName(t));
      const QuantMatrix q = RandomQuant(t, kern.nr, k, 5);
      const PackedMatrix b = Pack(q, kern.nr);
      std::mt19937 rng(9);
      std::uniform_real_distribution<float> d(-1.0f, 1.0f);
      std::vector<float> apack(static_cast<size_t>(kern.mr * k));
      for (auto& x : apack) x = d(rng);
      std::vector<float> full(static_cast<size_t>(kern.mr * kern.nr));
      kern.tile(kern.mr, k, apack.data(), b.panel(0), t, full.data(), kern.nr, false);
      for (int r = 1; r < kern.mr; ++r) {
        std::vector<float> part(static_cast<size_t>(kern.mr * kern.nr), -1.0f);
        kern.tile(r, k, apack.data(), b.panel(0), t, part.data(), kern.nr, false);
        EXPECT_EQ(std::memcmp(part.data(), full.data(), static_cast<size_t>(r * kern.nr) * 4), 0)
            << r;
        EXPECT_EQ(part[static_cast<size_t>(r * kern.nr)], -1.0f) << "wrote past its rows";
      }
      // Decoding once and reading the floats gives the same bits as decoding in the tile.
      std::vector<float> dq(static_cast<size_t>(k * kern.nr), -7.0f);
      kern.decode(k, b.panel(0), t, dq.data());
      for (int r = 1; r <= kern.mr; ++r) {
        std::vector<float> dec(static_cast<size_t>(kern.mr * kern.nr), -1.0f);
        kern.tile_decoded(r, k, apack.data(), dq.data(), b.panel(0), t, dec.data(), kern.nr, false);
        EXPECT_EQ(std::memcmp(dec.data(), full.data(), static_cast<size_t>(r * kern.nr) * 4), 0)
            << "decoded, " << r << " rows";
      }
      // Splitting k at a block boundary into two accumulating calls gives the same bits.
      const int64_t k1 = BlockK(t) * 2;
      std::vector<float> split(static_cast<size_t>(kern.mr * kern.nr));
      kern.tile(kern.mr, k1, apack.data(), b.PanelAt(0, 0), t, split.data(), kern.nr, false);
      kern.tile(kern.mr, k - k1, apack.data() + k1 * kern.mr, b.PanelAt(0, k1), t, split.data(),
                kern.nr, true);
      EXPECT_EQ(std::memcmp(split.data(), full.data(), full.size() * 4), 0);
    }
  }
}

// tile_panels computes what `tile` computes panel by panel (the same bits, every type, every row
// count, panel counts around the widths the variants group by), and writes only its panels.
TEST(TilePanelsTest, SameBitsAsTileByTile) {
  const int64_t k = 300;
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF4}) {
    for (const auto& v : testing::TestVariants()) {
      const CpuKernels& kern = *v.kernels;
      SCOPED_TRACE(v.name + " " + DTypeName(t));
      const int64_t n = 9 * kern.nr - 3;  // 9 panels, the last one partial
      PackedMatrix b;
      if (IsBlockScaled(t)) {
        b = Pack(RandomQuant(t, n, k, 17), kern.nr);
      } else {
        b = PackedMatrix(t, n, k, kern.nr);
        b.Fill([&](int64_t, float* row) {
          for (int64_t j = 0; j < k; ++j) row[j] = d(rng);
        });
      }
      std::vector<float> apack(static_cast<size_t>(kern.mr * k));
      for (auto& x : apack) x = d(rng);
      const int64_t ldc = b.n_padded() + 5;
      for (int rows = 1; rows <= kern.mr; ++rows) {
        for (int np : {1, 2, 3, 4, 5, 7, 9}) {
          SCOPED_TRACE(std::to_string(rows) + " rows, " + std::to_string(np) + " panels");
          for (bool accumulate : {false, true}) {
            std::vector<float> want(static_cast<size_t>(kern.mr * ldc), 0.25f);
            std::vector<float> got = want;
            for (int p = 0; p < np; ++p) {
              kern.tile(rows, k, apack.data(), b.panel(p), t, want.data() + p * kern.nr, ldc,
                        accumulate);
            }
            kern.tile_panels(rows, np, k, apack.data(), b.panel(0), b.panel_bytes(), t, got.data(),
                             ldc, accumulate);
            ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << accumulate;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace moerun
