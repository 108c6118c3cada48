#include "router/replay/routing_trace.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/unit/test_util.h"

namespace moerun {
namespace {

std::string RtData(const std::string& rel) { return testing::DataDir() + "/routing/" + rel; }

double RtRowSum(const std::vector<double>& row) {
  return std::accumulate(row.begin(), row.end(), 0.0);
}

RoutingTrace RtReadOk(const std::string& path, const RoutingTraceOptions& o = {}) {
  Result<RoutingTrace> t = ReadRoutingTrace(path, o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : RoutingTrace{};
}

TEST(RoutingTraceTest, DeepSeekRowsAreTopEightTimesTheTokens) {
  for (const char* name : {"prefill_in1024.json", "decode_in1000out1000.json"}) {
    const RoutingTrace t = RtReadOk(RtData(std::string("deepseek-r1/") + name));
    SCOPED_TRACE(name);
    EXPECT_EQ(t.num_experts, 256);
    EXPECT_EQ(t.top_k, 0);
    EXPECT_FALSE(t.token_level());
    ASSERT_EQ(t.num_layers(), 58);  // rows 0-2 (the dense layers) dropped
    EXPECT_EQ(t.layers.front(), 3);
    EXPECT_EQ(t.layers.back(), 60);
    for (int l = 0; l < t.num_layers(); ++l) {
      const double sum = RtRowSum(t.counts[static_cast<size_t>(l)]);
      EXPECT_GT(sum, 0);
      EXPECT_EQ(std::fmod(sum, 8.0), 0.0) << "layer " << t.layers[static_cast<size_t>(l)];
    }
  }
  // SOURCE.txt: prefill_in1024 saw 8,388,608 tokens in every layer.
  const RoutingTrace p = RtReadOk(RtData("deepseek-r1/prefill_in1024.json"));
  for (const auto& row : p.counts) EXPECT_EQ(RtRowSum(row), 8.0 * 8388608);
}

TEST(RoutingTraceTest, QwenNpyLayerCountsEqualTheCsv) {
  const RoutingTrace npy =
      RtReadOk(RtData("qwen3-30b-a3b/batch_8_topk_ids_layers48_x_tokens_x_top8.npy"));
  const RoutingTrace csv = RtReadOk(RtData("qwen3-30b-a3b/batch_8_counts_48x128.csv"));
  EXPECT_EQ(npy.num_experts, 128);
  EXPECT_EQ(npy.top_k, 8);
  ASSERT_EQ(npy.num_layers(), 48);
  ASSERT_EQ(npy.streams.size(), 1u);
  EXPECT_EQ(npy.streams[0].tokens, 2050);
  ASSERT_EQ(npy.streams[0].ids.size(), 48u);
  EXPECT_EQ(npy.streams[0].ids[0].size(), 2050u * 8);
  EXPECT_EQ(csv.num_experts, 128);
  EXPECT_EQ(csv.top_k, 0);
  EXPECT_FALSE(csv.token_level());
  EXPECT_EQ(npy.counts, csv.counts);
  EXPECT_EQ(npy.layers, csv.layers);
  for (const auto& row : csv.counts) EXPECT_EQ(RtRowSum(row), 8.0 * 2050);
  // Every token names 8 distinct experts.
  for (const auto& layer : npy.streams[0].ids) {
    for (size_t t = 0; t < 2050; ++t) {
      const std::set<int32_t> distinct(layer.begin() + static_cast<std::ptrdiff_t>(t * 8),
                                       layer.begin() + static_cast<std::ptrdiff_t>(t * 8 + 8));
      ASSERT_EQ(distinct.size(), 8u);
    }
  }
}

TEST(RoutingTraceTest, MixtralJsonlIsOneStreamPerProblem) {
  const std::string path = RtData("mixtral-8x7b/gsm8k_2_routing.jsonl");
  const RoutingTrace t = RtReadOk(path);
  EXPECT_EQ(t.num_experts, 8);
  EXPECT_EQ(t.top_k, 2);
  ASSERT_EQ(t.num_layers(), 32);
  ASSERT_EQ(t.streams.size(), 2u);
  EXPECT_EQ(t.streams[0].name, "problem_id 0");
  EXPECT_EQ(t.streams[1].name, "problem_id 1");
  EXPECT_EQ(t.streams[0].tokens, 168);
  EXPECT_EQ(t.streams[1].tokens, 79);
  // Counts from the records themselves, and the missing (token, layer) records are -1: layer 0 of
  // problem 0 has 167 records for 168 tokens.
  std::ifstream in(path);
  std::string line;
  std::vector<double> per_layer(32, 0.0);
  int64_t records = 0;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"layer\": ");
    ASSERT_NE(at, std::string::npos);
    per_layer[static_cast<size_t>(std::stoi(line.substr(at + 9)))] += 2;
    ++records;
  }
  EXPECT_EQ(records, 7889);
  for (size_t l = 0; l < 32; ++l) EXPECT_EQ(RtRowSum(t.counts[l]), per_layer[l]) << "layer " << l;
  EXPECT_EQ(per_layer[0], 2.0 * (167 + 79));
  EXPECT_EQ(t.streams[0].ids[0][167 * 2], -1);
  EXPECT_EQ(t.streams[0].ids[0][167 * 2 + 1], -1);
  EXPECT_GE(t.streams[0].ids[1][167 * 2], 0);  // layer 1 has token 167
  // The model's expert count, where given: a larger one stands, a smaller one is an error.
  RoutingTraceOptions o;
  o.num_experts = 16;
  EXPECT_EQ(RtReadOk(path, o).num_experts, 16);
  o.num_experts = 4;
  const Result<RoutingTrace> bad = ReadRoutingTrace(path, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("names expert 7, but the model has 4"), std::string::npos)
      << bad.status().message();
}

TEST(RoutingTraceTest, OlmoeCountsAndCrossLayerRefused) {
  const RoutingTrace t = RtReadOk(RtData("olmoe/olmoe-1b-7b/expert_counts/arxiv.json"));
  EXPECT_EQ(t.num_experts, 64);
  EXPECT_EQ(t.top_k, 0);
  EXPECT_EQ(t.layers, (std::vector<int>{0, 7, 15}));
  // SOURCE.txt: every stored layer sums to 8 x 208,896 tokens.
  for (const auto& row : t.counts) EXPECT_EQ(RtRowSum(row), 1671168.0);
  const std::string cross =
      RtData("olmoe/mixtral-8x7b-domains/expert_counts_crosslayer/arxiv.json");
  const Result<RoutingTrace> c = ReadRoutingTrace(cross);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(cross), std::string::npos);
  EXPECT_NE(c.status().message().find("cross-layer"), std::string::npos);
  EXPECT_NE(c.status().message().find("not per-expert counts"), std::string::npos);
}

// An NPY file: magic, version, header dict padded to 64 bytes, data.
std::string RtNpy(const std::string& dict, const std::string& data, int major = 1) {
  std::string header = dict;
  const size_t pre = major == 1 ? 10 : 12;
  while ((pre + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const size_t n = header.size();
  out += static_cast<char>(n & 0xff);
  out += static_cast<char>((n >> 8) & 0xff);
  if (major != 1) out += std::string(2, '\0');
  return out + header + data;
}

std::string RtInt16s(const std::vector<int16_t>& v) {
  std::string s;
  for (int16_t x : v) {
    s += static_cast<char>(x & 0xff);
    s += static_cast<char>((x >> 8) & 0xff);
  }
  return s;
}

TEST(RoutingTraceTest, SmallNpyOfEveryDtypeAndVersion) {
  testing::TempDir dir;
  // (2 layers, 3 tokens, 2 experts each).
  const std::vector<int16_t> ids = {0, 1, 2, 3, 4, 0, 1, 1, -1, -1, 3, 2};
  testing::WriteFile(
      dir.File("a.npy"),
      RtNpy("{'descr': '<i2', 'fortran_order': False, 'shape': (2, 3, 2), }", RtInt16s(ids)));
  RoutingTrace t = RtReadOk(dir.File("a.npy"));
  EXPECT_EQ(t.num_experts, 5);
  EXPECT_EQ(t.top_k, 2);
  ASSERT_EQ(t.streams.size(), 1u);
  EXPECT_EQ(t.streams[0].tokens, 3);
  EXPECT_EQ(t.streams[0].ids[1], (std::vector<int32_t>{1, 1, -1, -1, 3, 2}));
  EXPECT_EQ(t.counts[0], (std::vector<double>{2, 1, 1, 1, 1}));
  EXPECT_EQ(t.counts[1], (std::vector<double>{0, 2, 1, 1, 0}));
  // <i4 and <i8, format 2.0: the same ids.
  std::string i4, i8;
  for (int16_t x : ids) {
    const auto u = static_cast<uint64_t>(static_cast<int64_t>(x));
    for (int b = 0; b < 4; ++b) i4 += static_cast<char>((u >> (8 * b)) & 0xff);
    for (int b = 0; b < 8; ++b) i8 += static_cast<char>((u >> (8 * b)) & 0xff);
  }
  testing::WriteFile(
      dir.File("b.npy"),
      RtNpy("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3, 2), }", i4, 2));
  testing::WriteFile(dir.File("c.npy"),
                     RtNpy("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3, 2)}", i8));
  EXPECT_EQ(RtReadOk(dir.File("b.npy")).streams[0].ids, t.streams[0].ids);
  EXPECT_EQ(RtReadOk(dir.File("c.npy")).streams[0].ids, t.streams[0].ids);
}

// A raw hook's output without token_idx (the Mixtral set's routing_raw.jsonl: a prefill batch's
// rows, then one row per decode step): the n-th record of a layer is its token n.
TEST(RoutingTraceTest, JsonlWithoutTokenIdxIsInFileOrder) {
  testing::TempDir dir;
  testing::WriteFile(dir.File("raw.jsonl"),
                     "{\"layer\": 0, \"experts\": [1, 2], \"token_pos\": 0}\n"
                     "{\"layer\": 0, \"experts\": [3, 0], \"token_pos\": 1}\n"
                     "{\"layer\": 1, \"experts\": [2, 3], \"token_pos\": 0}\n"
                     "{\"layer\": 1, \"experts\": [0, 1], \"token_pos\": 1}\n"
                     "{\"layer\": 0, \"experts\": [2, 1], \"token_pos\": 0}\n"
                     "{\"layer\": 1, \"experts\": [3, 2], \"token_pos\": 0}\n");
  const RoutingTrace t = RtReadOk(dir.File("raw.jsonl"));
  ASSERT_EQ(t.streams.size(), 1u);
  EXPECT_EQ(t.streams[0].tokens, 3);
  EXPECT_EQ(t.streams[0].ids[0], (std::vector<int32_t>{1, 2, 3, 0, 2, 1}));
  EXPECT_EQ(t.streams[0].ids[1], (std::vector<int32_t>{2, 3, 0, 1, 3, 2}));
}

// Each malformed file (34 cases): an InvalidArgument that names the file and says what is wrong.
TEST(RoutingTraceTest, MalformedFilesAreClearErrors) {
  testing::TempDir dir;
  const std::string good_dict = "{'descr': '<i2', 'fortran_order': False, 'shape': (1, 2, 2), }";
  const std::string good_data = RtInt16s({0, 1, 2, 3});
  const std::string full = RtNpy(good_dict, good_data);
  struct Case {
    std::string name, content, fragment;
  };
  const std::vector<Case> cases = {
      {"truncated.npy", full.substr(0, full.size() - 3), "truncated"},
      {"long.npy", full + "xx", "needs 8"},
      {"cut_header.npy", full.substr(0, 40), "header runs past"},
      {"magic.npy", "NUMPY" + full, "magic"},
      {"float.npy",
       RtNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 2), }",
             good_data + good_data),
       "dtype '<f4'"},
      {"big_endian.npy",
       RtNpy("{'descr': '>i2', 'fortran_order': False, 'shape': (1, 2, 2), }", good_data),
       "dtype '>i2'"},
      {"fortran.npy",
       RtNpy("{'descr': '<i2', 'fortran_order': True, 'shape': (1, 2, 2), }", good_data),
       "Fortran"},
      {"two_d.npy", RtNpy("{'descr': '<i2', 'fortran_order': False, 'shape': (2, 2), }", good_data),
       "2-D shape"},
      {"bad_dict.npy", RtNpy("{'descr': '<i2', 'shape': (1, 2, 2), }", good_data),
       "lacks 'descr', 'fortran_order' or 'shape'"},
      {"bad_id.npy", RtNpy(good_dict, RtInt16s({0, 1, -2, 3})), "names expert -2"},
      {"version.npy", RtNpy(good_dict, good_data, 9), "format 9"},
      {"ragged.csv", "1,2,3\n4,5\n", "ragged"},
      {"negative.csv", "1,2\n-4,5\n", "'-4' is not a count"},
      {"header.csv", "a,b\n1,2\n", "'a' is not a count"},
      {"blank.csv", "\n\n", "no counts"},
      {"not.json", "{\"logical_count\": [[1, 2]", "not valid JSON"},
      {"ragged.json", "{\"logical_count\": [[1, 2], [1]]}", "ragged"},
      {"zero.json", "{\"logical_count\": [[0, 0], [0, 0]]}", "all zero"},
      {"negative.json", "{\"logical_count\": [[1, -2]]}", "negative"},
      {"string.json", "{\"logical_count\": [[1, \"x\"]]}", "not a number"},
      {"other.json", "{\"hello\": 1}", "neither"},
      {"array.json", "[1, 2]", "not a JSON object"},
      {"olmoe_layers.json", "{\"counts\": [[1, 2]], \"layers\": [0, 7]}", "one per \"counts\" row"},
      {"olmoe_experts.json", "{\"counts\": [[1, 2]], \"layers\": [0], \"num_experts\": 3}",
       "\"num_experts\" is 3"},
      {"cross.json", "{\"kind\": \"expert_counts_crosslayer\", \"matrices\": [[[1]]]}",
       "cross-layer"},
      {"bad_line.jsonl", "{\"layer\": 0, \"experts\": [1, 2], \"token_idx\": 0}\nnope\n",
       "line 2 is not a JSON object"},
      {"no_layer.jsonl", "{\"experts\": [1, 2], \"token_idx\": 0}\n", "no \"layer\""},
      {"topk.jsonl",
       "{\"layer\": 0, \"experts\": [1, 2], \"token_idx\": 0}\n"
       "{\"layer\": 0, \"experts\": [1], \"token_idx\": 1}\n",
       "top_k differs"},
      {"twice.jsonl",
       "{\"layer\": 0, \"experts\": [1, 2], \"token_idx\": 0}\n"
       "{\"layer\": 0, \"experts\": [1, 3], \"token_idx\": 0}\n",
       "two records for token 0 of layer 0"},
      {"neg_id.jsonl", "{\"layer\": 0, \"experts\": [1, -3], \"token_idx\": 0}\n", "expert id -3"},
      {"neg_token.jsonl", "{\"layer\": 0, \"experts\": [1, 3], \"token_idx\": -1}\n",
       "\"token_idx\" is -1"},
      {"huge_token.jsonl", "{\"layer\": 0, \"experts\": [1, 3], \"token_idx\": 4000000000}\n",
       "implausible token_idx"},
      {"empty.jsonl", "", "is empty"},
      {"counts.txt", "1,2\n", "unknown routing format"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.File(c.name);
    testing::WriteFile(path, c.content);
    const Result<RoutingTrace> t = ReadRoutingTrace(path);
    ASSERT_FALSE(t.ok()) << c.name;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(t.status().message().find(path), std::string::npos) << t.status().message();
    EXPECT_NE(t.status().message().find(c.fragment), std::string::npos)
        << c.name << ": " << t.status().message();
  }
  const Result<RoutingTrace> missing = ReadRoutingTrace(dir.File("missing.npy"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("missing.npy"), std::string::npos);
  // A window file with the wrong expert count asked for.
  RoutingTraceOptions o;
  o.num_experts = 3;
  testing::WriteFile(dir.File("ok.csv"), "1,2\n3,4\n");
  const Result<RoutingTrace> wrong = ReadRoutingTrace(dir.File("ok.csv"), o);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("not the 3 asked for"), std::string::npos);
}

}  // namespace
}  // namespace moerun
