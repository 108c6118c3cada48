// Batch invariance (docs/DESIGN.md): a token's output is bitwise the same whether it is computed
// alone or in a batch of any size and order, for every ISA variant.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "tests/unit/kernel_variants.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// Checks every token of x alone, then in batches of many sizes and orders.
void CheckInvariant(const std::shared_ptr<const MoeLayerWeights>& w, const CpuKernels& k,
                    const std::vector<float>& x, int threads) {
  const int64_t h = w->spec.hidden;
  const int64_t tokens = static_cast<int64_t>(x.size()) / h;
  ThreadPool pool(threads);
  MoeLayer layer(w, k, &pool);
  std::vector<float> alone(x.size());
  for (int64_t t = 0; t < tokens; ++t) {
    ASSERT_TRUE(layer.Forward(x.data() + t * h, 1, alone.data() + t * h).ok());
  }
  std::mt19937 rng(42);
  std::vector<int64_t> order(static_cast<size_t>(tokens));
  std::iota(order.begin(), order.end(), 0);
  const std::vector<int64_t> sizes = {2, 3, 5, 7, 13, 16, 31, tokens, 3 * tokens};
  for (int pass = 0; pass < 3; ++pass) {
    if (pass == 1) std::reverse(order.begin(), order.end());
    if (pass == 2) std::shuffle(order.begin(), order.end(), rng);
    for (int64_t size : sizes) {
      // A batch of `size` tokens drawn (with repeats when size > tokens) in this pass's order.
      std::vector<int64_t> pick(static_cast<size_t>(size));
      for (int64_t i = 0; i < size; ++i)
        pick[static_cast<size_t>(i)] = order[static_cast<size_t>(i % tokens)];
      std::vector<float> batch(static_cast<size_t>(size * h)), out(batch.size());
      for (int64_t i = 0; i < size; ++i) {
        std::memcpy(&batch[static_cast<size_t>(i * h)],
                    &x[static_cast<size_t>(pick[static_cast<size_t>(i)] * h)], h * 4);
      }
      ASSERT_TRUE(layer.Forward(batch.data(), size, out.data()).ok());
      for (int64_t i = 0; i < size; ++i) {
        const int64_t t = pick[static_cast<size_t>(i)];
        ASSERT_EQ(std::memcmp(&out[static_cast<size_t>(i * h)], &alone[static_cast<size_t>(t * h)],
                              h * 4),
                  0)
            << "token " << t << " in a batch of " << size << " (pass " << pass << ")";
      }
    }
  }
}

class BatchInvarianceTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
};

TEST_P(BatchInvarianceTest, Fixture) {
  const auto& [name, variant] = GetParam();
  const CpuKernels& k = VariantKernels(variant);
  const auto w = LoadFixture(name, k);
  const auto x = ReadF32(FixtureDir(name) + "/golden.safetensors", "input");
  CheckInvariant(w, k, x, 2);
}

std::vector<std::tuple<std::string, std::string>> FixtureIsaCases() {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const auto& n : FixtureNames()) {
    for (const auto& v : TestVariantNames()) out.emplace_back(n, v);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFixtures, BatchInvarianceTest, ::testing::ValuesIn(FixtureIsaCases()),
                         [](const auto& tp) {
                           return std::get<0>(tp.param) + "_" + std::get<1>(tp.param);
                         });

// A larger layer, so that experts get many tile rows and K spans several k-blocks.
TEST(BatchInvarianceTest, LargerLayerEveryIsaAndThreadCount) {
  ModelSpec s = SmallSpec(Family::kDeepseekV3);
  s.hidden = 320;  // more than one k-block of every kernel
  s.expert_inter = 144;
  for (const auto& v : TestVariants()) {
    SCOPED_TRACE(v.name);
    const CpuKernels& k = *v.kernels;
    PresetOptions o;
    o.dtype = DType::kBF16;
    auto w = BuildPresetLayer(s, k, o);
    ASSERT_TRUE(w.ok());
    auto shared = std::make_shared<const MoeLayerWeights>(std::move(w).value());
    CheckInvariant(shared, k, RandomRows(30, s.hidden, 5), k.isa == Isa::kScalar ? 1 : 3);
  }
}

}  // namespace
}  // namespace moerun
