// Loading a layer touches only what it needs: with the experts split over shards, a process that
// hosts some experts opens only the shards that hold them.
#include "runtime/model/layer_loader.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// Splits the qwen3_moe fixture: the router and experts 0-7 in one shard, experts 8-15 in another.
std::string ShardFixture(const TempDir& tmp) {
  auto src = SafetensorsFile::Open(FixtureDir("qwen3_moe") + "/model.safetensors");
  EXPECT_TRUE(src.ok());
  std::map<std::string, F32Tensor> a, b;
  nlohmann::json index = {{"metadata", nlohmann::json::object()},
                          {"weight_map", nlohmann::json::object()}};
  for (const TensorInfo& t : (*src)->header().tensors) {
    auto ref = (*src)->Get(t.name);
    F32Tensor copy{t.shape, std::vector<float>(static_cast<size_t>(t.numel))};
    std::memcpy(copy.data.data(), ref->data, copy.data.size() * 4);
    const auto pos = t.name.find(".experts.");
    const bool high = pos != std::string::npos && std::stoi(t.name.substr(pos + 9)) >= 8;
    (high ? b : a)[t.name] = std::move(copy);
    index["weight_map"][t.name] =
        high ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  EXPECT_TRUE(WriteSafetensorsF32(tmp.File("model-00001-of-00002.safetensors"), a).ok());
  EXPECT_TRUE(WriteSafetensorsF32(tmp.File("model-00002-of-00002.safetensors"), b).ok());
  WriteFile(tmp.File("model.safetensors.index.json"), index.dump(2));
  WriteFile(tmp.File("config.json"), ReadFile(FixtureDir("qwen3_moe") + "/config.json"));
  return tmp.path();
}

TEST(LayerLoaderTest, OpensOnlyTheShardsOfTheRequestedExperts) {
  TempDir tmp;
  const std::string dir = ShardFixture(tmp);
  auto spec = LoadModelSpec(dir);
  ASSERT_TRUE(spec.ok());
  const CpuKernels& k = KernelsFor(BestIsa());

  auto some = Checkpoint::Open(dir);
  ASSERT_TRUE(some.ok());
  EXPECT_EQ((*some)->OpenedShards(), 0u);
  LoadOptions opts;
  opts.load_expert.assign(16, false);
  for (int e = 0; e < 8; ++e) opts.load_expert[static_cast<size_t>(e)] = true;
  auto w = LoadLayer(**some, *spec, k, opts);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ((*some)->OpenedShards(), 1u);
  EXPECT_FALSE(w->experts[7].w13.empty());
  EXPECT_TRUE(w->experts[8].w13.empty());

  auto all = Checkpoint::Open(dir);
  auto full = LoadLayer(**all, *spec, k, LoadOptions{});
  ASSERT_TRUE(full.ok());
  EXPECT_EQ((*all)->OpenedShards(), 2u);
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("qwen3_moe") + "/golden.safetensors", "input", &tokens);
  const auto want = ReadF32(FixtureDir("qwen3_moe") + "/golden.safetensors", "output");
  ThreadPool pool(2);
  MoeLayer layer(std::make_shared<const MoeLayerWeights>(std::move(full).value()), k, &pool);
  std::vector<float> out(x.size());
  ASSERT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
  EXPECT_LE(RelativeError(out, want), 1e-5);
}

TEST(LayerLoaderTest, ResolveMoeLayer) {
  auto spec = LoadModelSpec(DataDir() + "/hf-configs/deepseek-v3");
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(*ResolveMoeLayer(*spec, -1), 3);
  EXPECT_EQ(*ResolveMoeLayer(*spec, 60), 60);
  EXPECT_NE(ResolveMoeLayer(*spec, 2).status().message().find("dense layer"), std::string::npos);
  EXPECT_NE(ResolveMoeLayer(*spec, 61).status().message().find("beyond"), std::string::npos);
}

}  // namespace
}  // namespace moerun
