// The CPU kernels: every ISA variant against the portable one (bitwise) and against a double
// reference (closely), for every weight type and tile height.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/fast_exp.h"
#include "base/thread_pool.h"
#include "experts/cpu/gemm.h"
#include "experts/cpu/isa.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"
#include "tests/unit/kernel_variants.h"

namespace moerun {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

PackedMatrix Pack(DType dt, int64_t n, int64_t k, int nr, const std::vector<float>& w) {
  PackedMatrix m(dt, n, k, nr);
  m.Fill(
      [&](int64_t row, float* out) { std::memcpy(out, &w[static_cast<size_t>(row * k)], k * 4); });
  return m;
}

bool BitwiseEqual(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

TEST(IsaTest, DetectionIsConsistent) {
  const auto isas = SupportedIsas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), Isa::kScalar);
  EXPECT_EQ(isas.back(), BestIsa());
  EXPECT_EQ(ParseIsa("avx512"), Isa::kAvx512);
  EXPECT_FALSE(ParseIsa("sse").has_value());
}

TEST(FastExpTest, AccurateAndSafe) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(ExpF(x) - want) / want);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(ExpF(0.0f), 1.0f);
  EXPECT_GT(ExpF(-1000.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(ExpF(1000.0f)));
  EXPECT_TRUE(std::isnan(ExpF(std::nanf(""))));
}

TEST(PackedMatrixTest, AtReadsWhatWasPacked) {
  const auto w = Random(37 * 19, 1);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int nr : {16, 32}) {
      const PackedMatrix m = Pack(dt, 37, 19, nr, w);
      EXPECT_EQ(m.n_padded() % nr, 0);
      for (int64_t n = 0; n < 37; ++n) {
        for (int64_t k = 0; k < 19; ++k) {
          float want = w[static_cast<size_t>(n * 19 + k)];
          if (dt == DType::kBF16) want = Bf16ToF32(F32ToBf16(want));
          if (dt == DType::kF16) want = F16ToF32(F32ToF16(want));
          ASSERT_EQ(m.At(n, k), want);
        }
      }
      for (int64_t n = 37; n < m.n_padded(); ++n) EXPECT_EQ(m.At(n, 3), 0.0f);
    }
  }
}

// Every variant computes C = A W^T with the same bits as the portable kernels, for every tile
// height, k not a multiple of the k-block, and all three weight types.
TEST(KernelsTest, GemmBitwiseEqualAcrossIsasAndCloseToDouble) {
  const int64_t m = 29, n = 70, k = 300;
  const auto a = Random(static_cast<size_t>(m * k), 2);
  const auto w = Random(static_cast<size_t>(n * k), 3, 0.1f);
  ThreadPool pool(2);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<float> scalar_out;
    for (const auto& v : testing::TestVariants()) {
      SCOPED_TRACE(v.name + " " + DTypeName(dt));
      const CpuKernels& kern = *v.kernels;
      const PackedMatrix b = Pack(dt, n, k, kern.nr, w);
      std::vector<float> c(static_cast<size_t>(m * b.n_padded()));
      AlignedBuffer apack;
      GemmPacked(kern, &pool, m, a.data(), k, b, c.data(), b.n_padded(), &apack);
      // Compact to [m][n] for comparison across panel widths.
      std::vector<float> out(static_cast<size_t>(m * n));
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j)
          out[static_cast<size_t>(i * n + j)] = c[static_cast<size_t>(i * b.n_padded() + j)];
      }
      double worst = 0;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double ref = 0, mag = 0;
          for (int64_t kk = 0; kk < k; ++kk) {
            const double p = static_cast<double>(a[static_cast<size_t>(i * k + kk)]) * b.At(j, kk);
            ref += p;
            mag += std::fabs(p);
          }
          worst = std::max(worst, std::fabs(out[static_cast<size_t>(i * n + j)] - ref) / mag);
        }
      }
      EXPECT_LT(worst, 1e-5);
      if (v.name == "scalar") {
        scalar_out = out;
      } else {
        EXPECT_TRUE(BitwiseEqual(out.data(), scalar_out.data(), out.size()));
      }
    }
  }
}

// A row's result does not depend on the tile height it was computed in.
TEST(KernelsTest, TileRowsAreIndependent) {
  const int64_t k = 77;
  for (const auto& v : testing::TestVariants()) {
    const CpuKernels& kern = *v.kernels;
    SCOPED_TRACE(v.name);
    const auto w = Random(static_cast<size_t>(kern.nr * k), 4);
    const PackedMatrix b = Pack(DType::kF32, kern.nr, k, kern.nr, w);
    const auto rows = Random(static_cast<size_t>(kern.mr * k), 5);
    std::vector<float> apack(static_cast<size_t>(kern.mr * k));
    for (int i = 0; i < kern.mr; ++i) {
      for (int64_t kk = 0; kk < k; ++kk)
        apack[static_cast<size_t>(kk * kern.mr + i)] = rows[static_cast<size_t>(i * k + kk)];
    }
    std::vector<float> full(static_cast<size_t>(kern.mr * kern.nr));
    kern.tile(kern.mr, k, apack.data(), b.panel(0), DType::kF32, full.data(), kern.nr, false);
    for (int r = 1; r < kern.mr; ++r) {
      std::vector<float> part(static_cast<size_t>(kern.mr * kern.nr), -1.0f);
      kern.tile(r, k, apack.data(), b.panel(0), DType::kF32, part.data(), kern.nr, false);
      EXPECT_TRUE(BitwiseEqual(part.data(), full.data(), static_cast<size_t>(r * kern.nr))) << r;
      EXPECT_EQ(part[static_cast<size_t>(r * kern.nr)], -1.0f) << "wrote past its rows";
    }
    // Splitting k into two accumulating calls gives the same bits as one call.
    std::vector<float> split(static_cast<size_t>(kern.mr * kern.nr));
    kern.tile(kern.mr, 40, apack.data(), b.panel(0), DType::kF32, split.data(), kern.nr, false);
    kern.tile(kern.mr, k - 40, apack.data() + 40 * kern.mr, b.panel(0) + 40 * kern.nr * 4,
              DType::kF32, split.data(), kern.nr, true);
    EXPECT_TRUE(BitwiseEqual(split.data(), full.data(), full.size()));
  }
}

TEST(KernelsTest, ActivationsBitwiseEqualAcrossIsas) {
  // Logical gate/up values and biases, laid out per variant as its panel pairs.
  const int rows = 3;
  const int64_t inter = 59;  // not a multiple of any panel width
  const auto g_in = Random(static_cast<size_t>(rows * inter), 6, 12.0f);
  const auto u_in = Random(static_cast<size_t>(rows * inter), 7, 12.0f);
  const auto bg = Random(static_cast<size_t>(inter), 8);
  const auto bu = Random(static_cast<size_t>(inter), 9);
  for (ActKind kind : {ActKind::kSwiGlu, ActKind::kSwiGluClamped, ActKind::kGptOss}) {
    std::vector<float> first;
    for (const auto& v : testing::TestVariants()) {
      const CpuKernels& kern = *v.kernels;
      const int nr = kern.nr;
      const int pairs = static_cast<int>((inter + nr - 1) / nr);
      const int64_t ldc = 2 * pairs * nr;
      std::vector<float> c(static_cast<size_t>(rows * ldc), 0.0f);
      std::vector<float> bgp(static_cast<size_t>(pairs * nr), 0.0f), bup(bgp.size(), 0.0f);
      for (int i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < inter; ++j) {
          const int64_t q = j / nr, jj = j % nr;
          c[static_cast<size_t>(i * ldc + 2 * q * nr + jj)] =
              g_in[static_cast<size_t>(i * inter + j)];
          c[static_cast<size_t>(i * ldc + (2 * q + 1) * nr + jj)] =
              u_in[static_cast<size_t>(i * inter + j)];
        }
      }
      std::copy(bg.begin(), bg.end(), bgp.begin());
      std::copy(bu.begin(), bu.end(), bup.begin());
      std::vector<float> h(static_cast<size_t>(inter * rows), 0.0f);
      ActParams p{kind, 7.0f, 1.702f};
      kern.activate(p, rows, pairs, nr, c.data(), ldc, bgp.data(), bup.data(), 0, inter, h.data(),
                    rows);
      std::vector<float> logical;
      for (int i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < inter; ++j) {
          const float g = g_in[static_cast<size_t>(i * inter + j)] + bg[static_cast<size_t>(j)];
          const float u = u_in[static_cast<size_t>(i * inter + j)] + bu[static_cast<size_t>(j)];
          double want = 0;
          const double silu = g / (1 + std::exp(-static_cast<double>(g)));
          if (kind == ActKind::kSwiGlu) want = silu * u;
          if (kind == ActKind::kSwiGluClamped) {
            want = std::min(silu, 7.0) * std::clamp<double>(u, -7, 7);
          }
          if (kind == ActKind::kGptOss) {
            const double gc = std::min<double>(g, 7.0);
            want = (std::clamp<double>(u, -7, 7) + 1) * gc / (1 + std::exp(-1.702 * gc));
          }
          const float got = h[static_cast<size_t>(j * rows + i)];
          EXPECT_NEAR(got, want, 2e-6 * (1 + std::fabs(want))) << v.name;
          logical.push_back(got);
        }
      }
      if (first.empty()) {
        first = logical;
      } else {
        EXPECT_TRUE(BitwiseEqual(first.data(), logical.data(), first.size())) << v.name;
      }
    }
  }
}

}  // namespace
}  // namespace moerun
