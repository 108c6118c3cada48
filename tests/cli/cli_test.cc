// The binaries as users run them: `moerun forward` reproduces every golden fixture, and every kind
// of bad input (files, configs, tensors, flags) ends in a non-zero exit with a message that names
// the problem, never in a crash. `moebench layer` prints a JSON report.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/model/safetensors.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

namespace fs = std::filesystem;
using ::moerun::testing::FixtureDir;
using ::moerun::testing::MakeSafetensors;
using ::moerun::testing::ProcessResult;
using ::moerun::testing::ReadFile;
using ::moerun::testing::RunProcess;
using ::moerun::testing::TempDir;
using ::moerun::testing::WriteFile;
using json = nlohmann::json;

// --- Editing safetensors files by hand -----------------------------------------------------------

// A safetensors file split into its JSON header and its data buffer.
struct RawFile {
  json header;
  std::string data;
};

RawFile ReadRaw(const std::string& path) {
  const std::string bytes = ReadFile(path);
  EXPECT_GE(bytes.size(), 8u) << path;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  RawFile f;
  f.header = json::parse(bytes.substr(8, n));
  f.data = bytes.substr(8 + n);
  return f;
}

void WriteRaw(const std::string& path, const RawFile& f) {
  WriteFile(path, MakeSafetensors(f.header.dump(), f.data));
}

// One tensor with its bytes; the file's tensors by name.
struct Tensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
using Tensors = std::map<std::string, Tensor>;

Tensors ReadTensors(const std::string& path) {
  const RawFile f = ReadRaw(path);
  Tensors out;
  for (auto it = f.header.begin(); it != f.header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto begin = it->at("data_offsets")[0].get<size_t>();
    const auto end = it->at("data_offsets")[1].get<size_t>();
    out[it.key()] =
        Tensor{it->at("dtype").get<std::string>(), it->at("shape").get<std::vector<int64_t>>(),
               f.data.substr(begin, end - begin)};
  }
  return out;
}

// Lays the tensors out contiguously, in name order.
void WriteTensors(const std::string& path, const Tensors& tensors) {
  RawFile f;
  f.header = json::object();
  f.header["__metadata__"] = {{"format", "pt"}};
  for (const auto& [name, t] : tensors) {
    f.header[name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {f.data.size(), f.data.size() + t.bytes.size()}}};
    f.data += t.bytes;
  }
  WriteRaw(path, f);
}

std::string F32Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// Writes `input` [rows, cols] (F32) to `path`, values from a fixed formula.
void WriteInput(const std::string& path, int64_t rows, int64_t cols,
                const std::string& name = "input") {
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.37f * static_cast<float>(i)) * 1.5f;
  const Status s = WriteSafetensorsF32(path, {{name, F32Tensor{{rows, cols}, v}}});
  ASSERT_TRUE(s.ok()) << s.ToString();
}

json ReadJson(const std::string& path) { return json::parse(ReadFile(path)); }
void WriteJson(const std::string& path, const json& j) { WriteFile(path, j.dump(2)); }

// --- Running the binaries ------------------------------------------------------------------------

ProcessResult Moerun(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {MOERUN_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

ProcessResult Moebench(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {MOEBENCH_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

void ExpectNoCrash(const ProcessResult& r) {
  for (const char* crash : {"Segmentation", "Aborted", "terminate called", "core dumped",
                            "AddressSanitizer", "runtime error:", "test harness: killed"}) {
    EXPECT_FALSE(Contains(r.output, crash)) << "output has \"" << crash << "\":\n" << r.output;
  }
}

// A clean failure: exit status > 0 (not a signal), no crash, a message with every fragment.
void ExpectFailure(const ProcessResult& r, const std::vector<std::string>& fragments) {
  EXPECT_GT(r.exit_code, 0) << r.output;
  ExpectNoCrash(r);
  for (const auto& f : fragments) {
    EXPECT_TRUE(Contains(r.output, f)) << "output lacks \"" << f << "\":\n" << r.output;
  }
}

void ExpectSuccess(const ProcessResult& r) {
  EXPECT_EQ(r.exit_code, 0) << r.output;
  ExpectNoCrash(r);
}

constexpr char kQwen[] = "qwen3_moe";
constexpr char kExpert2Up[] = "model.layers.0.mlp.experts.2.up_proj.weight";

// Each test gets a scratch folder; models are copied into it and then broken.
class CliTest : public ::testing::Test {
 protected:
  // A copy of fixture `name` (config.json and model.safetensors) in the scratch folder.
  std::string CopyFixture(const std::string& name) {
    const std::string dst = tmp_.File(name);
    fs::create_directories(dst);
    for (const char* file : {"config.json", "model.safetensors"}) {
      fs::copy_file(FixtureDir(name) + "/" + file, dst + "/" + file);
    }
    return dst;
  }

  static std::string Golden(const std::string& name) {
    return FixtureDir(name) + "/golden.safetensors";
  }

  std::string Output() const { return tmp_.File("out.safetensors"); }

  // `moerun forward --model DIR --input <golden of fixture> --output OUT [extra...]`.
  ProcessResult Forward(const std::string& model, const std::string& fixture,
                        const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"forward", "--model", model};
    args.insert(args.end(), {"--input", Golden(fixture), "--output", Output()});
    args.insert(args.end(), extra.begin(), extra.end());
    return Moerun(args);
  }

  // Copies fixture `name`, edits its model.safetensors header with `edit`, and runs it.
  template <typename Edit>
  ProcessResult ForwardWithEditedHeader(const std::string& name, Edit edit) {
    const std::string dir = CopyFixture(name);
    RawFile f = ReadRaw(dir + "/model.safetensors");
    edit(f);
    WriteRaw(dir + "/model.safetensors", f);
    return Forward(dir, name);
  }

  // Copies fixture `name`, edits its tensors with `edit`, and runs it.
  template <typename Edit>
  ProcessResult ForwardWithEditedTensors(const std::string& name, Edit edit) {
    const std::string dir = CopyFixture(name);
    Tensors t = ReadTensors(dir + "/model.safetensors");
    edit(t);
    WriteTensors(dir + "/model.safetensors", t);
    return Forward(dir, name);
  }

  // Copies fixture `name`, edits its config.json with `edit`, and runs it.
  template <typename Edit>
  ProcessResult ForwardWithEditedConfig(const std::string& name, Edit edit) {
    const std::string dir = CopyFixture(name);
    json config = ReadJson(dir + "/config.json");
    edit(config);
    WriteJson(dir + "/config.json", config);
    return Forward(dir, name);
  }

  TempDir tmp_;
};

// --- Golden fixtures -----------------------------------------------------------------------------

class CliGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CliGoldenTest, ForwardMatchesTheGolden) {
  TempDir tmp;
  const std::string dir = FixtureDir(GetParam());
  const ProcessResult r =
      Moerun({"forward", "--model", dir, "--input", dir + "/golden.safetensors", "--output",
              tmp.File("out.safetensors"), "--check", dir + "/golden.safetensors"});
  ExpectSuccess(r);
  EXPECT_TRUE(Contains(r.output, "within")) << r.output;
  EXPECT_FALSE(Contains(r.output, "EXCEEDS")) << r.output;
  // The output file holds the same tensor, close to the golden.
  const auto out = moerun::testing::ReadF32(tmp.File("out.safetensors"), "output");
  const auto want = moerun::testing::ReadF32(dir + "/golden.safetensors", "output");
  EXPECT_LE(moerun::testing::RelativeError(out, want), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CliGoldenTest,
                         ::testing::ValuesIn(moerun::testing::FixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST_F(CliTest, CheckReportsAMismatchWithExitCode3) {
  // Mixtral's output checked against Qwen3's golden (same hidden size and token count).
  const ProcessResult r = Forward(FixtureDir("mixtral"), kQwen, {"--check", Golden(kQwen)});
  EXPECT_EQ(r.exit_code, 3) << r.output;
  ExpectNoCrash(r);
  EXPECT_TRUE(Contains(r.output, "EXCEEDS")) << r.output;
}

TEST_F(CliTest, ShardedCheckpointMatchesTheGolden) {
  const std::string dir = tmp_.File("sharded");
  fs::create_directories(dir);
  fs::copy_file(FixtureDir(kQwen) + "/config.json", dir + "/config.json");
  const Tensors all = ReadTensors(FixtureDir(kQwen) + "/model.safetensors");
  Tensors shard[2];
  json weight_map = json::object();
  int i = 0;
  for (const auto& [name, t] : all) {
    const int s = i++ % 2;
    shard[s][name] = t;
    weight_map[name] = "model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
  }
  WriteTensors(dir + "/model-00001-of-00002.safetensors", shard[0]);
  WriteTensors(dir + "/model-00002-of-00002.safetensors", shard[1]);
  WriteJson(dir + "/model.safetensors.index.json",
            {{"metadata", json::object()}, {"weight_map", weight_map}});
  const ProcessResult r = Forward(dir, kQwen, {"--check", Golden(kQwen)});
  ExpectSuccess(r);
  EXPECT_TRUE(Contains(r.output, "within")) << r.output;
}

// --- Broken model files --------------------------------------------------------------------------

TEST_F(CliTest, TruncatedModelFile) {
  const std::string dir = CopyFixture(kQwen);
  const std::string path = dir + "/model.safetensors";
  fs::resize_file(path, fs::file_size(path) / 2);
  ExpectFailure(Forward(dir, kQwen), {"model.safetensors", "truncated"});
}

TEST_F(CliTest, ModelFileCutInsideItsHeader) {
  const std::string dir = CopyFixture(kQwen);
  fs::resize_file(dir + "/model.safetensors", 100);
  ExpectFailure(Forward(dir, kQwen), {"model.safetensors", "past the end", "truncated"});
}

TEST_F(CliTest, GarbledHeaderText) {
  const std::string dir = CopyFixture(kQwen);
  std::string bytes = ReadFile(dir + "/model.safetensors");
  for (size_t i = 9; i < 40; ++i) bytes[i] = '#';
  WriteFile(dir + "/model.safetensors", bytes);
  ExpectFailure(Forward(dir, kQwen), {"model.safetensors", "not valid JSON"});
}

TEST_F(CliTest, GarbledHeaderLength) {
  const std::string dir = CopyFixture(kQwen);
  std::string bytes = ReadFile(dir + "/model.safetensors");
  for (size_t i = 0; i < 8; ++i) bytes[i] = '\x7f';
  WriteFile(dir + "/model.safetensors", bytes);
  ExpectFailure(Forward(dir, kQwen), {"model.safetensors", "header length", "exceeds the limit"});
}

TEST_F(CliTest, HeaderNotStartingWithBrace) {
  const std::string dir = CopyFixture(kQwen);
  std::string bytes = ReadFile(dir + "/model.safetensors");
  bytes[8] = '\x01';
  WriteFile(dir + "/model.safetensors", bytes);
  ExpectFailure(Forward(dir, kQwen), {"model.safetensors", "does not start with '{'"});
}

TEST_F(CliTest, TensorSpanPastTheEndOfTheData) {
  const ProcessResult r = ForwardWithEditedHeader(kQwen, [](RawFile& f) {
    f.header["extra"] = {
        {"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {f.data.size(), f.data.size() + 16}}};
  });
  ExpectFailure(r, {"model.safetensors", "tensor 'extra'", "ends at data byte", "truncated"});
}

TEST_F(CliTest, OverlappingSpans) {
  const ProcessResult r = ForwardWithEditedHeader(kQwen, [](RawFile& f) {
    // Point a tensor at the bytes of the tensor at offset 0 (same size: [48, 64] vs [64, 48]).
    std::string first;
    for (auto it = f.header.begin(); it != f.header.end(); ++it) {
      if (it.key() != "__metadata__" && it->at("data_offsets")[0].get<uint64_t>() == 0) {
        first = it.key();
      }
    }
    ASSERT_FALSE(first.empty());
    ASSERT_NE(first, kExpert2Up);
    f.header[kExpert2Up]["data_offsets"] = f.header[first]["data_offsets"];
  });
  ExpectFailure(r, {"model.safetensors", "overlaps"});
}

TEST_F(CliTest, UnknownDType) {
  const ProcessResult r =
      ForwardWithEditedHeader(kQwen, [](RawFile& f) { f.header[kExpert2Up]["dtype"] = "F33"; });
  ExpectFailure(r, {"model.safetensors", kExpert2Up, "unknown dtype 'F33'"});
}

TEST_F(CliTest, ShapeNotMatchingItsSpan) {
  const ProcessResult r = ForwardWithEditedHeader(kQwen, [](RawFile& f) {
    f.header[kExpert2Up]["shape"] = {48, 65};
  });
  ExpectFailure(r,
                {"model.safetensors", kExpert2Up, "needs 12480 bytes", "data_offsets span 12288"});
}

TEST_F(CliTest, MissingExpertTensor) {
  const ProcessResult r = ForwardWithEditedTensors(kQwen, [](Tensors& t) {
    ASSERT_EQ(t.erase("model.layers.0.mlp.experts.3.down_proj.weight"), 1u);
  });
  ExpectFailure(r, {"model.layers.0.mlp.experts.3.down_proj.weight", "missing"});
}

TEST_F(CliTest, MissingRouterTensor) {
  const ProcessResult r = ForwardWithEditedTensors(
      kQwen, [](Tensors& t) { ASSERT_EQ(t.erase("model.layers.0.mlp.gate.weight"), 1u); });
  ExpectFailure(r, {"model.layers.0.mlp.gate.weight", "missing"});
}

TEST_F(CliTest, TensorShapeWrongForTheConfig) {
  const ProcessResult r = ForwardWithEditedTensors(kQwen, [](Tensors& t) {
    t["model.layers.0.mlp.experts.5.gate_proj.weight"].shape = {64, 48};  // same bytes
  });
  ExpectFailure(r, {"model.layers.0.mlp.experts.5.gate_proj.weight", "has shape [64, 48]",
                    "the config implies [48, 64]"});
}

TEST_F(CliTest, StackedTensorShapeWrongForTheConfig) {
  const ProcessResult r = ForwardWithEditedTensors("step3p5", [](Tensors& t) {
    t["model.layers.0.moe.up_proj.weight"].shape = {16, 64, 48};
  });
  ExpectFailure(r, {"model.layers.0.moe.up_proj.weight", "has shape [16, 64, 48]",
                    "the config implies [16, 48, 64]"});
}

// --- Corrupt quantized checkpoints: exit 2, the tensor named, nothing written -------------------

constexpr const char* kFp8 = "deepseek_v3_fp8";
constexpr const char* kMx = "gpt_oss_mxfp4";
const std::string kFp8Gate = "model.layers.0.mlp.experts.2.gate_proj.weight";
const std::string kMxBlocks = "model.layers.0.mlp.experts.gate_up_proj_blocks";
const std::string kMxScales = "model.layers.0.mlp.experts.gate_up_proj_scales";

class CorruptQuantTest : public CliTest {
 protected:
  template <typename Edit>
  void ExpectRefused(const char* fixture, Edit edit, const std::vector<std::string>& fragments) {
    const ProcessResult r = ForwardWithEditedTensors(fixture, edit);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    ExpectFailure(r, fragments);
    EXPECT_FALSE(fs::exists(Output())) << "an output was written";
    fs::remove_all(tmp_.File(fixture));  // the next case copies the fixture afresh
  }
};

TEST_F(CorruptQuantTest, Fp8NanCodes) {
  for (const char code : {'\x7f', '\xff'}) {
    ExpectRefused(kFp8, [&](Tensors& t) { t.at(kFp8Gate).bytes[1000] = code; },
                  {kFp8Gate, "e4m3 NaN code", "[3, 232]", "corrupt FP8 checkpoint"});
  }
}

TEST_F(CorruptQuantTest, Fp8ScalesMissingWrongShapeWrongDtypeOrNotFinite) {
  const std::string s = kFp8Gate + "_scale_inv";
  ExpectRefused(kFp8, [&](Tensors& t) { ASSERT_EQ(t.erase(s), 1u); },
                {kFp8Gate, s, "block scales", "missing"});
  ExpectRefused(kFp8,
                [&](Tensors& t) {
                  t.at(s).shape = {4, 1};
                },
                {s, "has shape [4, 1]", "128x128 blocks", "needs [2, 2]"});
  ExpectRefused(kFp8, [&](Tensors& t) { t.at(s).dtype = "I32"; }, {s, "dtype I32", "F32"});
  ExpectRefused(kFp8,
                [&](Tensors& t) {
                  const float nan = std::nanf("");
                  std::memcpy(t.at(s).bytes.data() + 4, &nan, 4);
                },
                {s, "block [0, 1]", "finite"});
}

TEST_F(CorruptQuantTest, Fp8E5m2IsNotTheFormat) {
  ExpectRefused(kFp8, [&](Tensors& t) { t.at(kFp8Gate).dtype = "F8_E5M2"; },
                {kFp8Gate, "F8_E5M2", "F8_E4M3"});
}

TEST_F(CorruptQuantTest, Mxfp4NanScaleAndShapes) {
  ExpectRefused(kMx, [&](Tensors& t) { t.at(kMxScales).bytes[4 * 192 * 4 + 7] = '\xff'; },
                {kMxScales, "e8m0 NaN code 0xFF", "[4, 1, 3]", "corrupt MXFP4"});
  // Blocks of the right bytes but a shape the config does not imply.
  ExpectRefused(kMx,
                [&](Tensors& t) {
                  t.at(kMxBlocks).shape = {8, 192, 2, 32};
                },
                {kMxBlocks, "has shape [8, 192, 2, 32]", "implies [8, 192, 4, 16]"});
  // One scale too few per row: the wrong count.
  ExpectRefused(kMx,
                [&](Tensors& t) {
                  t.at(kMxScales).shape = {8, 192, 3};
                  t.at(kMxScales).bytes.resize(8 * 192 * 3);
                },
                {kMxScales, "has shape [8, 192, 3]", "implies [8, 192, 4]"});
  ExpectRefused(kMx, [&](Tensors& t) { ASSERT_EQ(t.erase(kMxScales), 1u); },
                {kMxBlocks, kMxScales, "missing"});
  ExpectRefused(kMx, [&](Tensors& t) { t.at(kMxScales).dtype = "I8"; },
                {kMxScales, "dtype I8", "U8"});
}

TEST_F(CorruptQuantTest, OneExpertMixingFormats) {
  const std::string up = "model.layers.0.mlp.experts.2.up_proj.weight";
  ExpectRefused(kFp8,
                [&](Tensors& t) {
                  t.at(up) = Tensor{"F32", {160, 256}, F32Bytes(std::vector<float>(160 * 256))};
                  ASSERT_EQ(t.erase(up + "_scale_inv"), 1u);
                },
                {"mixes weight formats", kFp8Gate, "F8_E4M3", up, "F32"});
}

TEST_F(CliTest, UnknownQuantMethod) {
  const ProcessResult r = ForwardWithEditedConfig(
      kFp8, [](json& c) { c["quantization_config"]["quant_method"] = "awq"; });
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ExpectFailure(r, {"config.json", "quantization_config.quant_method \"awq\" is not supported"});
  fs::remove_all(tmp_.File(kFp8));
  const ProcessResult b = ForwardWithEditedConfig(kFp8, [](json& c) {
    c["quantization_config"]["weight_block_size"] = {64, 64};
  });
  EXPECT_EQ(b.exit_code, 2) << b.output;
  ExpectFailure(b, {"weight_block_size [64,64]", "not supported"});
}

// --- Broken configs ------------------------------------------------------------------------------

TEST_F(CliTest, TopKLargerThanTheExpertCount) {
  const ProcessResult r =
      ForwardWithEditedConfig(kQwen, [](json& c) { c["num_experts_per_tok"] = 32; });
  ExpectFailure(r, {"config.json", "top-k 32 is larger than the expert count 16"});
}

TEST_F(CliTest, ConfigNotJson) {
  const std::string dir = CopyFixture(kQwen);
  WriteFile(dir + "/config.json", "{\"model_type\": \"qwen3_moe\",");
  ExpectFailure(Forward(dir, kQwen), {"config.json", "not valid JSON"});
}

TEST_F(CliTest, ConfigMissing) {
  const std::string dir = CopyFixture(kQwen);
  fs::remove(dir + "/config.json");
  ExpectFailure(Forward(dir, kQwen), {"config.json", "no such file"});
}

TEST_F(CliTest, UnknownModelType) {
  const ProcessResult r =
      ForwardWithEditedConfig(kQwen, [](json& c) { c["model_type"] = "llama4"; });
  ExpectFailure(r, {"config.json", "model_type \"llama4\" is not supported"});
}

TEST_F(CliTest, ConfigKeyOfTheWrongType) {
  const ProcessResult r =
      ForwardWithEditedConfig(kQwen, [](json& c) { c["num_experts"] = "sixteen"; });
  ExpectFailure(r, {"config.json", "\"num_experts\"", "integer"});
}

TEST_F(CliTest, ConfigHiddenSizeNotMatchingTheTensors) {
  const ProcessResult r = ForwardWithEditedConfig(kQwen, [](json& c) { c["hidden_size"] = 32; });
  ExpectFailure(
      r, {"model.layers.0.mlp.gate.weight", "has shape [16, 64]", "the config implies [16, 32]"});
}

// --- Bad inputs ----------------------------------------------------------------------------------

TEST_F(CliTest, InputOfTheWrongHiddenSize) {
  WriteInput(tmp_.File("x.safetensors"), 2, 32);
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"x.safetensors", "'input'", "hidden size 32 but the model's is 64"});
}

TEST_F(CliTest, InputTensorMissing) {
  WriteInput(tmp_.File("x.safetensors"), 2, 64, "hidden_states");
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"x.safetensors", "tensor 'input'"});
}

TEST_F(CliTest, InputWithNaN) {
  std::vector<float> v(3 * 64, 0.5f);
  v[64 + 7] = std::nanf("");
  ASSERT_TRUE(
      WriteSafetensorsF32(tmp_.File("x.safetensors"), {{"input", F32Tensor{{3, 64}, v}}}).ok());
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"x.safetensors", "non-finite", "token 1"});
}

TEST_F(CliTest, InputWithInfinity) {
  std::vector<float> v(2 * 64, 0.5f);
  v[3] = -INFINITY;
  ASSERT_TRUE(
      WriteSafetensorsF32(tmp_.File("x.safetensors"), {{"input", F32Tensor{{2, 64}, v}}}).ok());
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"non-finite", "token 0"});
}

// Finite inputs so large that the layer overflows: an error naming the token and the magnitude,
// exit 2 and no output file, in one process and with ranks (inproc); never an output of NaNs.
TEST_F(CliTest, InputSoLargeThatTheOutputIsNotFinite) {
  std::vector<float> v(3 * 64, 0.5f);
  for (int i = 64; i < 128; ++i) v[i] = 1e20f;
  ASSERT_TRUE(
      WriteSafetensorsF32(tmp_.File("x.safetensors"), {{"input", F32Tensor{{3, 64}, v}}}).ok());
  for (const std::vector<std::string>& launch :
       {std::vector<std::string>{},
        std::vector<std::string>{"--transport", "inproc", "--ranks", "3"}}) {
    std::vector<std::string> args = {
        "forward",  "--model", FixtureDir(kQwen), "--input", tmp_.File("x.safetensors"),
        "--output", Output()};
    args.insert(args.end(), launch.begin(), launch.end());
    const ProcessResult r = Moerun(args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    ExpectFailure(r, {"output is not finite at token 1", "|x| reaches 1e+20", "not written"});
    EXPECT_FALSE(std::filesystem::exists(Output())) << "an output of NaNs was written";
  }
  v.assign(v.size(), 0.5f);  // the same shape with ordinary values: answered
  ASSERT_TRUE(
      WriteSafetensorsF32(tmp_.File("x.safetensors"), {{"input", F32Tensor{{3, 64}, v}}}).ok());
  ExpectSuccess(Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                        tmp_.File("x.safetensors"), "--output", Output()}));
}

TEST_F(CliTest, InputOneDimensional) {
  ASSERT_TRUE(WriteSafetensorsF32(tmp_.File("x.safetensors"),
                                  {{"input", F32Tensor{{64}, std::vector<float>(64, 1.0f)}}})
                  .ok());
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"x.safetensors", "must be 2-D", "has 1 dimensions"});
}

TEST_F(CliTest, InputNotF32) {
  const std::string header =
      "{\"input\":{\"dtype\":\"BF16\",\"shape\":[1,64],\"data_offsets\":[0,128]}}";
  WriteFile(tmp_.File("x.safetensors"), MakeSafetensors(header, std::string(128, '\0')));
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"'input' is BF16", "must be F32"});
}

TEST_F(CliTest, InputWithZeroTokens) {
  WriteFile(tmp_.File("x.safetensors"),
            MakeSafetensors(
                "{\"input\":{\"dtype\":\"F32\",\"shape\":[0,64],\"data_offsets\":[0,0]}}", ""));
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectSuccess(r);
  auto out = SafetensorsFile::Open(Output());
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  auto t = (*out)->Get("output");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->info->shape, (std::vector<int64_t>{0, 64}));
}

TEST_F(CliTest, InputFileMissing) {
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("nope.safetensors"), "--output", Output()});
  ExpectFailure(r, {"nope.safetensors", "no such file"});
}

TEST_F(CliTest, InputFileCorrupt) {
  WriteFile(tmp_.File("x.safetensors"), "garbage");
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"x.safetensors", "too short"});
}

// --- Layers --------------------------------------------------------------------------------------

TEST_F(CliTest, LayerBeyondTheModel) {
  ExpectFailure(Forward(FixtureDir(kQwen), kQwen, {"--layer", "5"}),
                {"layer 5 is beyond the model's 1 layers"});
}

TEST_F(CliTest, NegativeLayerIsTheFirstMoeLayer) {
  const ProcessResult r =
      Forward(FixtureDir(kQwen), kQwen, {"--layer", "-1", "--check", Golden(kQwen)});
  ExpectSuccess(r);
  EXPECT_TRUE(Contains(r.output, "within")) << r.output;
}

// DeepSeek-V3 with one dense layer first: the fixture's MoE layer becomes layer 1 of 2.
class CliDenseLayerTest : public CliTest {
 protected:
  void SetUp() override {
    dir_ = CopyFixture("deepseek_v3");
    json config = ReadJson(dir_ + "/config.json");
    config["num_hidden_layers"] = 2;
    config["first_k_dense_replace"] = 1;
    WriteJson(dir_ + "/config.json", config);
    Tensors renamed;
    for (auto& [name, t] : ReadTensors(dir_ + "/model.safetensors")) {
      const std::string from = "model.layers.0.";
      ASSERT_EQ(name.rfind(from, 0), 0u) << name;
      renamed["model.layers.1." + name.substr(from.size())] = t;
    }
    WriteTensors(dir_ + "/model.safetensors", renamed);
  }
  std::string dir_;
};

TEST_F(CliDenseLayerTest, DenseLayerIsRejected) {
  ExpectFailure(Forward(dir_, "deepseek_v3", {"--layer", "0"}),
                {"layer 0 is a dense layer, not an MoE layer"});
}

TEST_F(CliDenseLayerTest, DefaultIsTheFirstMoeLayer) {
  const ProcessResult r = Forward(dir_, "deepseek_v3", {"--check", Golden("deepseek_v3")});
  ExpectSuccess(r);
  EXPECT_TRUE(Contains(r.output, "layer 1")) << r.output;
  EXPECT_TRUE(Contains(r.output, "within")) << r.output;
}

TEST_F(CliDenseLayerTest, ExplicitMoeLayer) {
  const ProcessResult r =
      Forward(dir_, "deepseek_v3", {"--layer", "1", "--check", Golden("deepseek_v3")});
  ExpectSuccess(r);
  EXPECT_TRUE(Contains(r.output, "within")) << r.output;
}

// --- Flags ---------------------------------------------------------------------------------------

TEST_F(CliTest, DeviceCuda) {
  const ProcessResult r =
      Forward(FixtureDir(kQwen), kQwen, {"--device", "cuda", "--check", Golden(kQwen)});
  if (r.exit_code == 0) {  // a GPU: exact math (f32 fixture) matches the reference at 1e-5
    EXPECT_TRUE(Contains(r.output, "cuda")) << r.output;
    EXPECT_TRUE(Contains(r.output, "within")) << r.output;
    return;
  }
  // Without one (or in a build without CUDA): a clear error, exit 2, before any work.
  ExpectFailure(r, {"--device cuda", "no usable GPU"});
  EXPECT_EQ(r.exit_code, 2);
}

TEST_F(CliTest, DeviceCudaFlags) {
  ExpectFailure(Forward(FixtureDir(kQwen), kQwen, {"--device", "cuda", "--math", "fast"}),
                {"--math must be auto, exact or tensor-core"});
  ExpectFailure(Forward(FixtureDir(kQwen), kQwen, {"--device", "cuda", "--max-tokens", "0"}),
                {"--max-tokens must be in 1..1048576"});
}

TEST_F(CliTest, UnknownDevice) {
  ExpectFailure(Forward(FixtureDir(kQwen), kQwen, {"--device", "tpu"}),
                {"--device must be cpu or cuda"});
}

TEST_F(CliTest, UnknownIsa) {
  ExpectFailure(Forward(FixtureDir(kQwen), kQwen, {"--isa", "neon"}),
                {"--isa must be scalar, avx2 or avx512", "neon"});
}

TEST_F(CliTest, UnknownPreset) {
  WriteInput(tmp_.File("x.safetensors"), 1, 64);
  const ProcessResult r = Moerun({"forward", "--preset", "gpt-5", "--input",
                                  tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"no preset named 'gpt-5'", "qwen3-30b-a3b"});
}

TEST_F(CliTest, PresetWithFewerExpertsThanTopK) {
  WriteInput(tmp_.File("x.safetensors"), 3, 2048);
  const ProcessResult r = Moerun({"forward", "--preset", "qwen3-30b-a3b", "--experts", "4",
                                  "--input", tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"top-k 8", "expert count 4"});
}

TEST_F(CliTest, PresetWithMoreExpertsThanTheModel) {
  WriteInput(tmp_.File("x.safetensors"), 3, 2048);
  const ProcessResult r = Moerun({"forward", "--preset", "qwen3-30b-a3b", "--experts", "1000",
                                  "--input", tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"qwen3-30b-a3b has 128 experts", "--experts 1000"});
}

TEST_F(CliTest, PresetUnknownDType) {
  WriteInput(tmp_.File("x.safetensors"), 3, 2048);
  const ProcessResult r =
      Moerun({"forward", "--preset", "qwen3-30b-a3b", "--experts", "8", "--dtype", "int3",
              "--input", tmp_.File("x.safetensors"), "--output", Output()});
  ExpectFailure(r, {"--dtype must be f32, bf16, f16, fp8 or mxfp4", "int3"});
}

// Presets quantized on the fly: FP8 (128 x 128 blocks) and MXFP4 (gpt-oss's format) run.
TEST_F(CliTest, PresetQuantizedDTypesRun) {
  struct Case {
    const char* preset;
    const char* experts;
    const char* dtype;
    int64_t hidden;
    const char* held;
  };
  for (const Case& c : {Case{"qwen3-30b-a3b", "8", "fp8", 2048, "FP8 weights"},
                        Case{"gpt-oss-20b", "4", "mxfp4", 2880, "MXFP4 weights"}}) {
    SCOPED_TRACE(c.dtype);
    WriteInput(tmp_.File("x.safetensors"), 3, c.hidden);
    const ProcessResult r =
        Moerun({"forward", "--preset", c.preset, "--experts", c.experts, "--dtype", c.dtype,
                "--input", tmp_.File("x.safetensors"), "--output", Output()});
    ExpectSuccess(r);
    EXPECT_TRUE(Contains(r.output, c.held)) << r.output;
    int64_t rows = 0, cols = 0;
    const std::vector<float> out = moerun::testing::ReadF32(Output(), "output", &rows, &cols);
    EXPECT_EQ(rows, 3);
    EXPECT_EQ(cols, c.hidden);
    double norm = 0;
    for (float v : out) {
      ASSERT_TRUE(std::isfinite(v));
      norm += static_cast<double>(v) * v;
    }
    EXPECT_GT(norm, 0.0);
  }
}

TEST_F(CliTest, PresetRuns) {
  WriteInput(tmp_.File("x.safetensors"), 3, 2048);
  const ProcessResult r = Moerun({"forward", "--preset", "qwen3-30b-a3b", "--experts", "8",
                                  "--input", tmp_.File("x.safetensors"), "--output", Output()});
  ExpectSuccess(r);
  int64_t rows = 0, cols = 0;
  const std::vector<float> out = moerun::testing::ReadF32(Output(), "output", &rows, &cols);
  EXPECT_EQ(rows, 3);
  EXPECT_EQ(cols, 2048);
  double norm = 0;
  for (float v : out) {
    ASSERT_TRUE(std::isfinite(v));
    norm += static_cast<double>(v) * v;
  }
  EXPECT_GT(norm, 0.0);
}

TEST_F(CliTest, MissingInputFlag) {
  ExpectFailure(Moerun({"forward", "--model", FixtureDir(kQwen), "--output", Output()}),
                {"--input"});
}

TEST_F(CliTest, ModelAndPresetBoth) {
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir(kQwen), "--preset",
                                  "qwen3-30b-a3b", "--input", Golden(kQwen), "--output", Output()});
  ExpectFailure(r, {"--model", "--preset"});
}

TEST_F(CliTest, NeitherModelNorPreset) {
  ExpectFailure(Moerun({"forward", "--input", Golden(kQwen), "--output", Output()}),
                {"give exactly one of --model DIR and --preset NAME"});
}

TEST_F(CliTest, NonexistentModelFolder) {
  const std::string dir = tmp_.File("no-such-model");
  ExpectFailure(Forward(dir, kQwen), {dir, "no such file"});
}

TEST_F(CliTest, ModelFolderWithoutWeights) {
  const std::string dir = CopyFixture(kQwen);
  fs::remove(dir + "/model.safetensors");
  ExpectFailure(Forward(dir, kQwen), {"no model.safetensors.index.json or model.safetensors"});
}

TEST_F(CliTest, OutputInANonexistentFolder) {
  const std::string out = tmp_.File("no/such/folder/out.safetensors");
  const ProcessResult r =
      Moerun({"forward", "--model", FixtureDir(kQwen), "--input", Golden(kQwen), "--output", out});
  ExpectFailure(r, {out});
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(CliTest, FlagsThatMakeNoSense) {
  const std::string m = FixtureDir(kQwen);
  ExpectFailure(Forward(m, kQwen, {"--check", Golden(kQwen), "--tolerance", "nan"}),
                {"--tolerance"});
  ExpectFailure(Forward(m, kQwen, {"--check", Golden(kQwen), "--tolerance", "-1"}),
                {"--tolerance"});
  ExpectFailure(Forward(m, kQwen, {"--threads", "5000"}), {"--threads"});
  ExpectFailure(Forward(m, kQwen, {"--threads", "-2"}), {"--threads"});
  ExpectFailure(Forward(m, kQwen, {"--layer", "-7"}), {"--layer"});
  ExpectFailure(Moerun({"forward", "--preset", "qwen3-30b-a3b", "--experts", "-1", "--input",
                        Golden(kQwen), "--output", Output()}),
                {"--experts"});
}

// Bad inputs and outputs are found before the (possibly long) weight loading starts.
TEST_F(CliTest, InputAndOutputCheckedBeforeLoading) {
  const std::string m = FixtureDir(kQwen);
  const std::string missing = tmp_.File("missing.safetensors");
  ProcessResult r = Moerun({"forward", "--model", m, "--input", missing, "--output", Output()});
  ExpectFailure(r, {missing});
  EXPECT_FALSE(Contains(r.output, "experts,")) << "loaded weights first:\n" << r.output;
  r = Moerun({"forward", "--model", m, "--input", Golden(kQwen), "--output",
              tmp_.File("nope/out.safetensors")});
  ExpectFailure(r, {"does not exist"});
  EXPECT_FALSE(Contains(r.output, "experts,")) << "loaded weights first:\n" << r.output;
}

TEST_F(CliTest, UnknownSubcommandAndFlag) {
  ExpectFailure(Moerun({"backward"}), {"backward"});
  ExpectFailure(Moerun({"forward", "--model", FixtureDir(kQwen), "--input", Golden(kQwen),
                        "--output", Output(), "--bogus"}),
                {"--bogus"});
}

TEST_F(CliTest, Version) {
  const ProcessResult r = Moerun({"--version"});
  ExpectSuccess(r);
  EXPECT_TRUE(Contains(r.output, "moerun ")) << r.output;
}

// --- moebench ------------------------------------------------------------------------------------

// The JSON document in `output`: from the first line that starts with '{' to the last line that
// starts with '}' (stderr's log lines come before it).
json JsonReport(const std::string& output) {
  const size_t begin = output[0] == '{' ? 0 : output.find("\n{");
  const size_t end = output.rfind("\n}");
  if (begin == std::string::npos || end == std::string::npos || end < begin) return json();
  const size_t from = output[begin] == '{' ? begin : begin + 1;
  return json::parse(output.substr(from, end + 2 - from), nullptr, /*allow_exceptions=*/false);
}

TEST(MoebenchTest, LayerPresetJson) {
  const ProcessResult r =
      Moebench({"layer", "--preset", "qwen3-30b-a3b", "--experts", "8", "--tokens", "1,4",
                "--min-time", "0.01", "--no-sgemm", "--json"});
  ExpectSuccess(r);
  const json report = JsonReport(r.output);
  ASSERT_TRUE(report.is_object()) << r.output;
  EXPECT_EQ(report.value("bench", ""), "layer");
  EXPECT_EQ(report.value("experts", 0), 8);
  EXPECT_EQ(report.value("top_k", 0), 8);
  ASSERT_TRUE(report.contains("results") && report["results"].is_array()) << r.output;
  ASSERT_EQ(report["results"].size(), 2u);
  const int64_t tokens[] = {1, 4};
  for (size_t i = 0; i < 2; ++i) {
    const json& res = report["results"][i];
    EXPECT_EQ(res.value("tokens", int64_t{0}), tokens[i]);
    ASSERT_TRUE(res.contains("speedup_vs_reference")) << res.dump();
    EXPECT_TRUE(res["speedup_vs_reference"].is_number()) << res.dump();
    EXPECT_GT(res["speedup_vs_reference"].get<double>(), 0.0);
    EXPECT_LT(res.value("check_rel_err_vs_reference", 1.0), 1e-4) << res.dump();
    EXPECT_FALSE(res.contains("sgemm")) << "--no-sgemm";
  }
}

// Several weight types in one run: a result per type and token count, each with its rate and
// floor; the quantized type is compared with F32 of the same run.
TEST(MoebenchTest, LayerSeveralDTypesJson) {
  const ProcessResult r =
      Moebench({"layer", "--preset", "qwen3-30b-a3b", "--experts", "8", "--dtype", "f32,fp8",
                "--tokens", "1,4", "--min-time", "0.01", "--no-sgemm", "--json"});
  ExpectSuccess(r);
  const json report = JsonReport(r.output);
  ASSERT_TRUE(report.is_object()) << r.output;
  EXPECT_EQ(report.value("experts", 0), 8);
  EXPECT_EQ(report["weight_dtypes"], json::array({"F32", "F8_E4M3"})) << report.dump();
  ASSERT_TRUE(report.contains("results") && report["results"].is_array()) << r.output;
  ASSERT_EQ(report["results"].size(), 4u);
  const int64_t tokens[] = {1, 1, 4, 4};
  const char* types[] = {"F32", "F8_E4M3", "F32", "F8_E4M3"};
  for (size_t i = 0; i < 4; ++i) {
    const json& res = report["results"][i];
    SCOPED_TRACE(res.dump());
    EXPECT_EQ(res.value("tokens", int64_t{0}), tokens[i]);
    EXPECT_EQ(res.value("weight_dtype", ""), types[i]);
    for (const char* field : {"tokens_per_s", "x_floor", "weight_bytes", "ms"}) {
      ASSERT_TRUE(res.contains(field) && res[field].is_number()) << field;
      EXPECT_GT(res[field].get<double>(), 0.0) << field;
    }
    EXPECT_LT(res.value("check_rel_err_vs_reference", 1.0), 1e-4);
    EXPECT_FALSE(res.contains("speedup_vs_bf16"));  // no BF16 in this run
    if (i % 2 == 1) {
      ASSERT_TRUE(res.contains("speedup_vs_f32") && res["speedup_vs_f32"].is_number());
      EXPECT_GT(res["speedup_vs_f32"].get<double>(), 0.0);
      // The same experts, a quarter of the bytes (and a little for the scales).
      const double ratio = res["weight_bytes"].get<double>() /
                           report["results"][i - 1]["weight_bytes"].get<double>();
      EXPECT_GT(ratio, 0.25);
      EXPECT_LT(ratio, 0.28);
    } else {
      EXPECT_FALSE(res.contains("speedup_vs_f32"));
    }
  }
}

TEST(MoebenchTest, LayerRejectsBadDTypeLists) {
  const std::vector<std::string> base = {"layer",    "--preset", "qwen3-30b-a3b", "--experts", "8",
                                         "--tokens", "1",        "--no-sgemm",    "--dtype"};
  auto with = [&](const std::string& list) {
    std::vector<std::string> args = base;
    args.push_back(list);
    return Moebench(args);
  };
  ExpectFailure(with("f32,fp8,f32"), {"--dtype names f32 twice"});
  ExpectFailure(with("f32,int3"), {"--dtype must be", "int3"});
}

TEST(MoebenchTest, LayerRejectsZeroTokens) {
  ExpectFailure(Moebench({"layer", "--tokens", "0"}), {"--tokens must be in 1..1048576"});
}

TEST(MoebenchTest, LayerRejectsNonNumericTokens) {
  ExpectFailure(Moebench({"layer", "--preset", "qwen3-30b-a3b", "--tokens", "1,x"}),
                {"'x' is not a number"});
}

TEST(MoebenchTest, LayerOnABrokenModel) {
  TempDir tmp;
  const std::string dir = tmp.File("m");
  fs::create_directories(dir);
  fs::copy_file(FixtureDir(kQwen) + "/config.json", dir + "/config.json");
  WriteFile(dir + "/model.safetensors", MakeSafetensors("{\"a\":", ""));
  ExpectFailure(Moebench({"layer", "--model", dir, "--tokens", "1", "--min-time", "0.01"}),
                {"model.safetensors", "not valid JSON"});
}

TEST(MoebenchTest, LayerRejectsFlagsThatMakeNoSense) {
  const std::vector<std::string> base = {"layer",    "--preset", "qwen3-30b-a3b", "--experts", "8",
                                         "--tokens", "1",        "--no-sgemm"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return Moebench(args);
  };
  ExpectFailure(with({"--threads", "5000"}), {"--threads"});
  ExpectFailure(with({"--min-time", "-1"}), {"--min-time"});
  ExpectFailure(with({"--reference-tokens", "0"}), {"--reference-tokens"});
  ExpectFailure(with({"--experts", "-3"}), {"--experts"});
}

TEST(MoebenchTest, NoSubcommand) { ExpectFailure(Moebench({}), {"subcommand"}); }

// --- Every binary keeps its word: bad arguments exit 2 with one line; logging options -----------

ProcessResult Moectl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {MOECTL_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

// Exit 2, no crash, and exactly one line: "<binary>: ... (see --help)".
void ExpectBadArguments(const ProcessResult& r, const std::string& binary,
                        const std::string& fragment) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ExpectNoCrash(r);
  std::string out = r.output;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  EXPECT_EQ(out.find('\n'), std::string::npos) << "more than one line:\n" << r.output;
  EXPECT_EQ(out.rfind(binary + ": ", 0), 0u) << r.output;
  EXPECT_TRUE(Contains(out, fragment)) << "lacks \"" << fragment << "\": " << r.output;
  EXPECT_TRUE(Contains(out, "(see --help)")) << r.output;
}

// moebench decode: flags that make no sense end at the parse (exit 2, one line) before anything
// connects; the sizes of S and M, the layer list, the duration, what --verify needs.
TEST(MoebenchTest, DecodeBadFlagsExit2WithOneLine) {
  const auto decode = [](std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "decode", "--target", "127.0.0.1:1", "--preset", "qwen3-30b-a3b", "--experts", "8"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Moebench(args);
  };
  ExpectBadArguments(decode({"--sequences", "0"}), "moebench", "--sequences");
  ExpectBadArguments(decode({"--sequences", "2", "--pingpong", "3"}), "moebench", "--pingpong 3");
  ExpectBadArguments(decode({"--pingpong", "0"}), "moebench", "--pingpong");
  ExpectBadArguments(decode({"--layers", "3,x"}), "moebench", "--layers");
  ExpectBadArguments(decode({"--layers", "5-2"}), "moebench", "ends below its start");
  ExpectBadArguments(decode({"--steps", "5", "--duration", "2"}), "moebench", "not both");
  ExpectBadArguments(decode({"--attention-us", "-1"}), "moebench", "--attention-us");
  ExpectBadArguments(decode({"--dtype", "f16"}), "moebench", "--dtype");
  ExpectBadArguments(decode({"--intermediate", "-32"}), "moebench", "--intermediate");
  ExpectBadArguments(decode({"--inputs", "0"}), "moebench", "--inputs");
  ExpectBadArguments(Moebench({"decode", "--target", "127.0.0.1:1", "--verify"}), "moebench",
                     "--verify needs the model");
  ExpectBadArguments(Moebench({"decode", "--target", "127.0.0.1:1", "--hidden", "64"}), "moebench",
                     "--layers");
  ExpectBadArguments(Moebench({"decode", "--sequences", "4"}), "moebench", "--target");
  ExpectBadArguments(Moebench({"decode", "--target", "nohost"}), "moebench", "nohost");
}

// No job at the target: a clear error naming it, exit 1, before any layer is computed.
TEST(MoebenchTest, DecodeWithNoJobNamesTheTarget) {
  const ProcessResult r = Moebench({"decode", "--target", "127.0.0.1:1", "--preset",
                                    "qwen3-30b-a3b", "--experts", "8", "--verify"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  ExpectFailure(r, {"127.0.0.1:1"});
  EXPECT_FALSE(Contains(r.output, "generating")) << "built the layers first:\n" << r.output;
}

TEST(CommandLineTest, BadArgumentsExit2WithOneLineInEveryBinary) {
  const std::string m = FixtureDir(kQwen);
  const std::string in = m + "/golden.safetensors";
  ExpectBadArguments(
      Moerun({"forward", "--model", m, "--input", in, "--output", "/tmp/x", "--bogus"}), "moerun",
      "--bogus");
  ExpectBadArguments(Moerun({"forward", "--model", m}), "moerun", "--input is required");
  ExpectBadArguments(Moerun({"forward", "--model", m, "--preset", "mixtral-8x7b", "--input", in,
                             "--output", "/tmp/x"}),
                     "moerun", "excludes");
  ExpectBadArguments(Moerun({"serve"}), "moerun", "--config is required");
  ExpectBadArguments(Moerun({"--bogus"}), "moerun", "--bogus");
  ExpectBadArguments(Moebench({"layer", "--bogus"}), "moebench", "--bogus");
  ExpectBadArguments(Moebench({"serve", "--concurrency", "x"}), "moebench", "--concurrency");
  ExpectBadArguments(Moectl({"--bogus", "status"}), "moectl", "--bogus");
  ExpectBadArguments(Moectl({}), "moectl", "subcommand");
  // --help still exits 0.
  for (const auto& r : {Moerun({"--help"}), Moerun({"forward", "--help"}), Moebench({"--help"}),
                        Moectl({"--help"})}) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
}

TEST(CommandLineTest, UnknownLogLevelOrFormatIsRefused) {
  const std::string m = FixtureDir(kQwen);
  const std::string in = m + "/golden.safetensors";
  const std::vector<std::string> fwd = {"forward", "--model",  m,       "--input",
                                        in,        "--output", "/tmp/x"};
  auto moerun_with = [&](std::vector<std::string> pre) {
    pre.insert(pre.end(), fwd.begin(), fwd.end());
    return Moerun(pre);
  };
  // Before, "verbose" was taken as "off": every later message, errors included, was silenced.
  ExpectBadArguments(moerun_with({"--log-level", "verbose"}), "moerun", "verbose");
  ExpectBadArguments(moerun_with({"--log-format", "xml"}), "moerun", "xml");
  ExpectBadArguments(Moebench({"--log-level", "loud", "layer"}), "moebench", "loud");
  // And the config key.
  TempDir tmp;
  const std::string cfg = tmp.File("c.yaml");
  WriteFile(cfg, "model: " + m + "\nlog_level: verbose\n");
  const ProcessResult r = Moerun({"serve", "--config", cfg, "--transport", "inproc"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(Contains(r.output, "log_level: unknown log level 'verbose'")) << r.output;
}

TEST(CommandLineTest, LogLinesCarryTheDateAndJsonLinesParse) {
  const std::string m = FixtureDir(kQwen);
  const std::string in = m + "/golden.safetensors";
  TempDir tmp;
  // Text: an error's line starts with the date and carries the rank and role.
  ProcessResult r = Moerun({"forward", "--model", tmp.File("none"), "--input", in, "--output",
                            tmp.File("o.safetensors")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  ASSERT_GE(r.output.size(), 30u) << r.output;
  EXPECT_EQ(r.output[0], '[') << r.output;
  const std::string date = r.output.substr(1, 10);  // YYYY-MM-DD
  EXPECT_TRUE(date.size() == 10 && date[4] == '-' && date[7] == '-' && std::isdigit(date[0]) &&
              std::isdigit(date[9]))
      << r.output;
  EXPECT_TRUE(Contains(r.output, "[r0 main] error:")) << r.output;
  // JSON: every stderr line of a successful run and of a failing one is an object with the keys.
  for (const std::string& model : {m, tmp.File("none")}) {
    r = Moerun({"--log-format", "json", "--log-level", "debug", "forward", "--model", model,
                "--input", in, "--output", tmp.File("o.safetensors")});
    int objects = 0;
    std::stringstream ss(r.output);
    std::string line;
    while (std::getline(ss, line)) {
      if (line.empty() || line[0] != '{') continue;  // the result line on stdout
      const json j = json::parse(line);
      for (const char* key : {"time", "level", "rank", "role", "msg"}) {
        EXPECT_TRUE(j.contains(key)) << key << " in " << line;
      }
      EXPECT_EQ(j["role"], "main");
      EXPECT_EQ(j["time"].get<std::string>().back(), 'Z') << line;
      ++objects;
    }
    EXPECT_GE(objects, 1) << r.output;
    if (model != m) {
      EXPECT_TRUE(Contains(r.output, "\"level\":\"error\"")) << r.output;
    }
  }
}

}  // namespace
}  // namespace moerun
