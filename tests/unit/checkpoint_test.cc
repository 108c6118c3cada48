// Checkpoint: one file, a folder with model.safetensors, a sharded folder with an index (whose
// shards open lazily, only when one of their tensors is asked for), and malformed folders.
#include "runtime/model/checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/test_util.h"

namespace moerun {
namespace {

namespace fs = std::filesystem;
using ::moerun::testing::FixtureDir;
using ::moerun::testing::TempDir;
using ::moerun::testing::WriteFile;
using json = nlohmann::json;

constexpr char kFixture[] = "qwen3_moe";  // F32 weights: shards of F32 copies are byte-identical

std::string Bytes(const TensorRef& t) {
  return std::string(reinterpret_cast<const char*>(t.data), t.info->end - t.info->begin);
}

// name -> bytes of every tensor of a safetensors file.
std::map<std::string, std::string> AllTensors(const std::string& path) {
  std::map<std::string, std::string> out;
  auto f = SafetensorsFile::Open(path);
  if (!f.ok()) {
    ADD_FAILURE() << f.status().ToString();
    return out;
  }
  for (const auto& info : (*f)->header().tensors) out[info.name] = Bytes(*(*f)->Get(info.name));
  return out;
}

// The fixture's tensors as F32 (exact: they are F32 or narrower floats).
std::map<std::string, F32Tensor> FixtureAsF32(const std::string& fixture) {
  std::map<std::string, F32Tensor> out;
  auto f = SafetensorsFile::Open(FixtureDir(fixture) + "/model.safetensors");
  if (!f.ok()) {
    ADD_FAILURE() << f.status().ToString();
    return out;
  }
  for (const auto& info : (*f)->header().tensors) {
    const TensorRef t = *(*f)->Get(info.name);
    F32Tensor& dst = out[info.name];
    dst.shape = info.shape;
    dst.data.resize(static_cast<size_t>(info.numel));
    for (int64_t i = 0; i < info.numel; ++i) {
      dst.data[static_cast<size_t>(i)] = LoadAsF32(t.data, info.dtype, i);
    }
  }
  return out;
}

std::string ShardName(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i, n);
  return buf;
}

void WriteIndex(const std::string& dir, const json& weight_map) {
  const json index = {{"metadata", json::object()}, {"weight_map", weight_map}};
  WriteFile(dir + "/model.safetensors.index.json", index.dump(2));
}

// A sharded copy of a fixture: its tensors, in name order, split into `n` shards of about equal
// count, and the index. Returns shard file name -> tensor names.
std::map<std::string, std::vector<std::string>> WriteSharded(const std::string& fixture,
                                                             const std::string& dir, int n) {
  const auto tensors = FixtureAsF32(fixture);
  std::vector<std::map<std::string, F32Tensor>> shards(static_cast<size_t>(n));
  std::map<std::string, std::vector<std::string>> layout;
  json weight_map = json::object();
  size_t i = 0;
  for (const auto& [name, t] : tensors) {
    const int s = static_cast<int>(i++ * static_cast<size_t>(n) / tensors.size());
    shards[static_cast<size_t>(s)][name] = t;
    const std::string file = ShardName(s + 1, n);
    weight_map[name] = file;
    layout[file].push_back(name);
  }
  for (int s = 0; s < n; ++s) {
    const Status st = WriteSafetensorsF32(dir + "/" + ShardName(s + 1, n),
                                          shards[static_cast<size_t>(s)], {{"format", "pt"}});
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  WriteIndex(dir, weight_map);
  return layout;
}

void ExpectStatus(const Status& s, StatusCode code, const std::vector<std::string>& fragments) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), code) << s.ToString();
  for (const auto& f : fragments) {
    EXPECT_NE(s.message().find(f), std::string::npos)
        << "message \"" << s.message() << "\" lacks \"" << f << "\"";
  }
}

// --- One file ------------------------------------------------------------------------------------

TEST(CheckpointTest, OpensAFixtureFolder) {
  const std::string dir = FixtureDir(kFixture);
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->path(), dir);
  const auto want = AllTensors(dir + "/model.safetensors");
  const std::vector<std::string> names = (*ck)->Names();
  ASSERT_EQ(names.size(), want.size());
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const auto& [name, bytes] : want) {
    EXPECT_TRUE((*ck)->Has(name)) << name;
    auto t = (*ck)->Get(name);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(Bytes(*t), bytes) << name;
  }
  EXPECT_EQ((*ck)->OpenedShards(), 1u);
}

TEST(CheckpointTest, OpensEveryFixtureFolder) {
  for (const auto& name : moerun::testing::FixtureNames()) {
    SCOPED_TRACE(name);
    auto ck = Checkpoint::Open(FixtureDir(name));
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    EXPECT_FALSE((*ck)->Names().empty());
  }
}

TEST(CheckpointTest, OpensASafetensorsFilePath) {
  const std::string file = FixtureDir(kFixture) + "/model.safetensors";
  auto ck = Checkpoint::Open(file);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->path(), file);
  const auto want = AllTensors(file);
  EXPECT_EQ((*ck)->Names().size(), want.size());
  for (const auto& [name, bytes] : want) {
    auto t = (*ck)->Get(name);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(Bytes(*t), bytes) << name;
  }
}

TEST(CheckpointTest, OpensAFileInTheCurrentFolderByRelativeName) {
  TempDir dir;
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("w.safetensors"), {{"w", F32Tensor{{2}, {1, 2}}}}).ok());
  const fs::path old = fs::current_path();
  fs::current_path(dir.path());
  auto ck = Checkpoint::Open("w.safetensors");
  fs::current_path(old);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE((*ck)->Get("w").ok());
}

TEST(CheckpointTest, MissingTensorIsNotFound) {
  auto ck = Checkpoint::Open(FixtureDir(kFixture));
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_FALSE((*ck)->Has("model.layers.0.mlp.experts.99.up_proj.weight"));
  auto t = (*ck)->Get("model.layers.0.mlp.experts.99.up_proj.weight");
  ExpectStatus(t.status(), StatusCode::kNotFound,
               {"'model.layers.0.mlp.experts.99.up_proj.weight'", FixtureDir(kFixture)});
}

TEST(CheckpointTest, NonexistentPath) {
  TempDir dir;
  auto ck = Checkpoint::Open(dir.File("nowhere"));
  ExpectStatus(ck.status(), StatusCode::kNotFound, {dir.File("nowhere")});
}

TEST(CheckpointTest, CorruptSingleFileNamesTheFile) {
  TempDir dir;
  WriteFile(dir.File("model.safetensors"), moerun::testing::MakeSafetensors("{\"a\":", ""));
  auto ck = Checkpoint::Open(dir.path());
  ExpectStatus(ck.status(), StatusCode::kCorrupt, {"model.safetensors", "not valid JSON"});
}

// --- Folders without an index --------------------------------------------------------------------

TEST(CheckpointTest, FolderWithNeitherIndexNorModelFile) {
  TempDir dir;
  WriteFile(dir.File("config.json"), "{}");
  auto ck = Checkpoint::Open(dir.path());
  ExpectStatus(ck.status(), StatusCode::kNotFound,
               {dir.path(), "no model.safetensors.index.json or model.safetensors"});
}

TEST(CheckpointTest, FolderWithOneOtherSafetensorsFile) {
  TempDir dir;
  ASSERT_TRUE(
      WriteSafetensorsF32(dir.File("weights.safetensors"), {{"w", F32Tensor{{1}, {3.0f}}}}).ok());
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  auto t = (*ck)->Get("w");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  float v = 0;
  std::memcpy(&v, t->data, 4);
  EXPECT_EQ(v, 3.0f);
}

TEST(CheckpointTest, FolderWithTwoSafetensorsFilesAndNoIndex) {
  TempDir dir;
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("a.safetensors"), {{"a", F32Tensor{{1}, {1}}}}).ok());
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("b.safetensors"), {{"b", F32Tensor{{1}, {2}}}}).ok());
  auto ck = Checkpoint::Open(dir.path());
  ExpectStatus(ck.status(), StatusCode::kNotFound,
               {"no model.safetensors.index.json or model.safetensors",
                "2 other .safetensors files", "which one?"});
}

TEST(CheckpointTest, ModelSafetensorsWinsOverOtherFiles) {
  TempDir dir;
  ASSERT_TRUE(
      WriteSafetensorsF32(dir.File("model.safetensors"), {{"m", F32Tensor{{1}, {1}}}}).ok());
  ASSERT_TRUE(
      WriteSafetensorsF32(dir.File("other.safetensors"), {{"o", F32Tensor{{1}, {2}}}}).ok());
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE((*ck)->Has("m"));
  EXPECT_FALSE((*ck)->Has("o"));
}

// --- Sharded folders -----------------------------------------------------------------------------

TEST(CheckpointShardedTest, GetReturnsTheBytesOfTheUnshardedOriginal) {
  TempDir dir;
  const auto layout = WriteSharded(kFixture, dir.path(), 3);
  ASSERT_EQ(layout.size(), 3u);
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->OpenedShards(), 0u) << "opening reads the index only";

  const auto want = AllTensors(FixtureDir(kFixture) + "/model.safetensors");
  std::vector<std::string> want_names;
  for (const auto& [name, bytes] : want) want_names.push_back(name);
  EXPECT_EQ((*ck)->Names(), want_names);
  for (const auto& [name, bytes] : want) {
    auto t = (*ck)->Get(name);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(t->info->name, name);
    EXPECT_EQ(Bytes(*t), bytes) << name;
  }
  EXPECT_EQ((*ck)->OpenedShards(), 3u);
}

TEST(CheckpointShardedTest, OpensOnlyTheShardsOfRequestedTensors) {
  TempDir dir;
  const auto layout = WriteSharded(kFixture, dir.path(), 3);
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const std::vector<std::string>& first = layout.at(ShardName(1, 3));
  ASSERT_GE(first.size(), 2u);
  for (const auto& name : first) {
    ASSERT_TRUE((*ck)->Get(name).ok()) << name;
    EXPECT_EQ((*ck)->OpenedShards(), 1u) << name;
  }
  // Has() and Names() come from the index: they open nothing.
  for (const auto& [file, names] : layout) {
    for (const auto& name : names) EXPECT_TRUE((*ck)->Has(name));
  }
  EXPECT_EQ((*ck)->Names().size(), 16u * 3 + 1);
  EXPECT_EQ((*ck)->OpenedShards(), 1u);
  ASSERT_TRUE((*ck)->Get(layout.at(ShardName(3, 3)).front()).ok());
  EXPECT_EQ((*ck)->OpenedShards(), 2u);
}

TEST(CheckpointShardedTest, ConcurrentGets) {
  TempDir dir;
  const auto layout = WriteSharded(kFixture, dir.path(), 3);
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const std::vector<std::string> names = (*ck)->Names();
  std::vector<int> failures(4, 0);
  std::vector<std::thread> threads;
  for (size_t w = 0; w < failures.size(); ++w) {
    threads.emplace_back([&, w] {
      for (size_t i = 0; i < names.size(); ++i) {
        const auto& name = names[(i + w * 7) % names.size()];
        if (!(*ck)->Get(name).ok()) ++failures[w];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int f : failures) EXPECT_EQ(f, 0);
  EXPECT_EQ((*ck)->OpenedShards(), 3u);
}

TEST(CheckpointShardedTest, IndexWinsOverModelSafetensors) {
  TempDir dir;
  WriteSharded(kFixture, dir.path(), 2);
  WriteFile(dir.File("model.safetensors"), "not a safetensors file");
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE((*ck)->Get("model.layers.0.mlp.gate.weight").ok());
}

// --- Bad indexes ---------------------------------------------------------------------------------

// Opens `dir` after writing `index_text` as its index.
Result<std::unique_ptr<Checkpoint>> OpenWithIndex(const TempDir& dir,
                                                  const std::string& index_text) {
  WriteFile(dir.File("model.safetensors.index.json"), index_text);
  return Checkpoint::Open(dir.path());
}

TEST(CheckpointIndexTest, IndexNotJson) {
  TempDir dir;
  ExpectStatus(OpenWithIndex(dir, "{\"weight_map\": {").status(), StatusCode::kCorrupt,
               {"model.safetensors.index.json", "not a JSON object"});
  ExpectStatus(OpenWithIndex(dir, "").status(), StatusCode::kCorrupt, {"not a JSON object"});
  ExpectStatus(OpenWithIndex(dir, "[1, 2]").status(), StatusCode::kCorrupt, {"not a JSON object"});
}

TEST(CheckpointIndexTest, NoWeightMap) {
  TempDir dir;
  ExpectStatus(OpenWithIndex(dir, "{\"metadata\": {}}").status(), StatusCode::kCorrupt,
               {"model.safetensors.index.json", "no \"weight_map\" object"});
  ExpectStatus(OpenWithIndex(dir, "{\"weight_map\": [\"a.safetensors\"]}").status(),
               StatusCode::kCorrupt, {"no \"weight_map\" object"});
}

TEST(CheckpointIndexTest, ShardNamesMustBeFilesInTheFolder) {
  TempDir dir;
  for (const char* bad : {"../model.safetensors", "sub/model.safetensors", "/etc/passwd", "..", ".",
                          "", "a\\b.safetensors"}) {
    SCOPED_TRACE(bad);
    const json index = {{"weight_map", {{"w", bad}}}};
    ExpectStatus(OpenWithIndex(dir, index.dump()).status(), StatusCode::kCorrupt,
                 {"tensor 'w'", "something other than a file name in this folder"});
  }
  ExpectStatus(OpenWithIndex(dir, "{\"weight_map\": {\"w\": 3}}").status(), StatusCode::kCorrupt,
               {"tensor 'w'"});
  ExpectStatus(
      OpenWithIndex(dir, json({{"weight_map", {{"w", std::string(300, 'a')}}}}).dump()).status(),
      StatusCode::kCorrupt, {"tensor 'w'"});
}

TEST(CheckpointIndexTest, IndexPlacesATensorInAShardThatLacksIt) {
  TempDir dir;
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("s1.safetensors"), {{"a", F32Tensor{{1}, {1}}}}).ok());
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("s2.safetensors"), {{"b", F32Tensor{{1}, {2}}}}).ok());
  auto ck = OpenWithIndex(
      dir, json({{"weight_map", {{"a", "s1.safetensors"}, {"b", "s1.safetensors"}}}}).dump());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE((*ck)->Get("a").ok());
  ExpectStatus((*ck)->Get("b").status(), StatusCode::kCorrupt,
               {"tensor 'b'", "s1.safetensors", "does not hold it"});
}

TEST(CheckpointIndexTest, MissingShardFile) {
  TempDir dir;
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("s1.safetensors"), {{"a", F32Tensor{{1}, {1}}}}).ok());
  auto ck = OpenWithIndex(
      dir, json({{"weight_map", {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}}}}).dump());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE((*ck)->Get("a").ok());
  ExpectStatus((*ck)->Get("b").status(), StatusCode::kNotFound, {"s2.safetensors", "tensor 'b'"});
}

TEST(CheckpointIndexTest, CorruptShardNamesTheShard) {
  TempDir dir;
  WriteFile(dir.File("s1.safetensors"),
            moerun::testing::MakeSafetensors(
                "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", "1234"));
  auto ck = OpenWithIndex(dir, json({{"weight_map", {{"a", "s1.safetensors"}}}}).dump());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectStatus((*ck)->Get("a").status(), StatusCode::kCorrupt,
               {"s1.safetensors", "tensor 'a'", "truncated"});
}

TEST(CheckpointIndexTest, TensorNotInTheIndex) {
  TempDir dir;
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("s1.safetensors"),
                                  {{"a", F32Tensor{{1}, {1}}}, {"b", F32Tensor{{1}, {2}}}})
                  .ok());
  auto ck = OpenWithIndex(dir, json({{"weight_map", {{"a", "s1.safetensors"}}}}).dump());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_FALSE((*ck)->Has("b"));
  ExpectStatus((*ck)->Get("b").status(), StatusCode::kNotFound, {"tensor 'b'"});
  EXPECT_EQ((*ck)->OpenedShards(), 0u);
}

TEST(CheckpointIndexTest, EmptyWeightMap) {
  TempDir dir;
  auto ck = OpenWithIndex(dir, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {}}");
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE((*ck)->Names().empty());
}

}  // namespace
}  // namespace moerun
