// ParseSafetensorsHeader and SafetensorsFile: valid files of every shape, every kind of malformed
// file (each rejected with a Status that names the problem and the tensor), and the F32 writer.
#include "runtime/model/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using ::moerun::testing::MakeSafetensors;
using ::moerun::testing::TempDir;
using ::moerun::testing::WriteFile;

Result<SafetensorsHeader> Parse(const std::string& file) {
  return ParseSafetensorsHeader(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(file.data()), file.size()),
      file.size());
}

// The JSON of one tensor entry.
std::string Entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  uint64_t begin, uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]}";
}

// `{entries}` (built by appending: GCC 12 warns falsely on "{" + a temporary string).
std::string Braced(const std::string& entries) {
  std::string out = "{";
  out += entries;
  out += "}";
  return out;
}

// A file whose header is `{entries}` followed by `data_bytes` bytes of data.
std::string File(const std::string& entries, size_t data_bytes) {
  return MakeSafetensors(Braced(entries), std::string(data_bytes, '\x11'));
}

// Asserts that `file` is rejected with `code` and a message containing every fragment.
void ExpectRejected(const std::string& file, StatusCode code,
                    const std::vector<std::string>& fragments) {
  const auto h = Parse(file);
  ASSERT_FALSE(h.ok()) << "accepted: " << file.substr(8);
  EXPECT_EQ(h.status().code(), code) << h.status().ToString();
  for (const auto& f : fragments) {
    EXPECT_NE(h.status().message().find(f), std::string::npos)
        << "message \"" << h.status().message() << "\" lacks \"" << f << "\"";
  }
}

void ExpectCorrupt(const std::string& file, const std::vector<std::string>& fragments) {
  ExpectRejected(file, StatusCode::kCorrupt, fragments);
}

// --- Valid files ---------------------------------------------------------------------------------

TEST(SafetensorsHeaderTest, SingleTensor) {
  const std::string header = Braced(Entry("w", "F32", "[2,3]", 0, 24));
  const auto h = Parse(MakeSafetensors(header, std::string(24, '\0')));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->data_offset, 8 + header.size());
  ASSERT_EQ(h->tensors.size(), 1u);
  const TensorInfo& t = h->tensors[0];
  EXPECT_EQ(t.name, "w");
  EXPECT_EQ(t.dtype, DType::kF32);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.numel, 6);
  EXPECT_EQ(t.begin, 0u);
  EXPECT_EQ(t.end, 24u);
  EXPECT_TRUE(h->metadata.empty());
}

TEST(SafetensorsHeaderTest, SeveralTensorsAreSortedByOffset) {
  // Listed out of order in the JSON, of several dtypes.
  const std::string entries = Entry("c", "F16", "[4]", 12, 20) + "," +
                              Entry("a", "BF16", "[2,1]", 8, 12) + "," +
                              Entry("b", "I64", "[1]", 0, 8);
  const auto h = Parse(File(entries, 20));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->tensors[0].name, "b");
  EXPECT_EQ(h->tensors[0].dtype, DType::kI64);
  EXPECT_EQ(h->tensors[1].name, "a");
  EXPECT_EQ(h->tensors[1].dtype, DType::kBF16);
  EXPECT_EQ(h->tensors[2].name, "c");
  EXPECT_EQ(h->tensors[2].dtype, DType::kF16);
  EXPECT_EQ(h->tensors[2].begin, 12u);
  EXPECT_EQ(h->tensors[2].end, 20u);
}

TEST(SafetensorsHeaderTest, ZeroSizeTensors) {
  const std::string entries =
      Entry("a", "F32", "[2]", 0, 8) + "," + Entry("empty", "F32", "[0,5]", 8, 8) + "," +
      Entry("b", "F32", "[1]", 8, 12) + "," + Entry("tail", "U8", "[3,0]", 12, 12);
  const auto h = Parse(File(entries, 12));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 4u);
  for (const auto& t : h->tensors) {
    if (t.name == "empty" || t.name == "tail") {
      EXPECT_EQ(t.numel, 0);
      EXPECT_EQ(t.begin, t.end);
    }
  }
}

TEST(SafetensorsHeaderTest, OnlyZeroSizeTensorsAndNoData) {
  const auto h = Parse(File(Entry("empty", "F32", "[0]", 0, 0), 0));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 1u);
  EXPECT_EQ(h->tensors[0].numel, 0);
}

TEST(SafetensorsHeaderTest, ScalarShape) {
  const auto h = Parse(File(Entry("s", "F64", "[]", 0, 8), 8));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_TRUE(h->tensors[0].shape.empty());
  EXPECT_EQ(h->tensors[0].numel, 1);
}

TEST(SafetensorsHeaderTest, EmptyHeaderObject) {
  const auto h = Parse(MakeSafetensors("{}", ""));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_TRUE(h->tensors.empty());
  EXPECT_EQ(h->data_offset, 10u);
}

TEST(SafetensorsHeaderTest, Metadata) {
  const std::string entries =
      "\"__metadata__\":{\"format\":\"pt\",\"note\":\"a \\\"quoted\\\" word\"}," +
      Entry("w", "F32", "[1]", 0, 4);
  const auto h = Parse(File(entries, 4));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 1u);  // __metadata__ is not a tensor
  EXPECT_EQ(h->metadata.size(), 2u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  EXPECT_EQ(h->metadata.at("note"), "a \"quoted\" word");
}

TEST(SafetensorsHeaderTest, EmptyMetadataObject) {
  const auto h = Parse(File("\"__metadata__\":{}," + Entry("w", "F32", "[1]", 0, 4), 4));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_TRUE(h->metadata.empty());
}

TEST(SafetensorsHeaderTest, HeaderPaddedWithTrailingSpaces) {
  std::string header = Braced(Entry("w", "F32", "[2]", 0, 8));
  while ((8 + header.size()) % 8 != 0 || header.size() < 40) header.push_back(' ');
  const auto h = Parse(MakeSafetensors(header, std::string(8, '\0')));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->data_offset, 8 + header.size());
  EXPECT_EQ(h->data_offset % 8, 0u);
}

TEST(SafetensorsHeaderTest, WhitespaceInsideJson) {
  const std::string header =
      "{\n  \"w\" : { \"dtype\" : \"U8\" , \"shape\" : [ 3 ] , \"data_offsets\" : [ 0 , 3 ] }\n}\n";
  const auto h = Parse(MakeSafetensors(header, "abc"));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->tensors[0].numel, 3);
}

TEST(SafetensorsHeaderTest, BytesMayBeJustTheHeader) {
  // `bytes` need only hold 8 + N bytes; the file size says how large the data buffer is.
  const std::string file = File(Entry("w", "F32", "[4]", 0, 16), 16);
  const auto h = ParseSafetensorsHeader(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(file.data()), file.size() - 16),
      file.size());
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->tensors[0].end, 16u);
}

TEST(SafetensorsHeaderTest, BytesShorterThanTheHeaderIsAnInternalError) {
  const std::string file = File(Entry("w", "F32", "[4]", 0, 16), 16);
  const auto h = ParseSafetensorsHeader(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(file.data()), 12), file.size());
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kInternal);
}

// Each dtype name with the bytes that 8 elements take.
struct DTypeCase {
  const char* name;
  DType type;
  uint64_t bytes_per_8;
};

TEST(SafetensorsHeaderTest, EveryDTypeNameAndSize) {
  const DTypeCase cases[] = {
      {"BOOL", DType::kBool, 8},      {"U8", DType::kU8, 8},
      {"I8", DType::kI8, 8},          {"I16", DType::kI16, 16},
      {"U16", DType::kU16, 16},       {"F16", DType::kF16, 16},
      {"BF16", DType::kBF16, 16},     {"I32", DType::kI32, 32},
      {"U32", DType::kU32, 32},       {"F32", DType::kF32, 32},
      {"F64", DType::kF64, 64},       {"I64", DType::kI64, 64},
      {"U64", DType::kU64, 64},       {"F8_E4M3", DType::kF8E4M3, 8},
      {"F8_E5M2", DType::kF8E5M2, 8}, {"F8_E8M0", DType::kF8E8M0, 8},
      {"F4", DType::kF4, 4},          {"F6_E2M3", DType::kF6E2M3, 6},
      {"F6_E3M2", DType::kF6E3M2, 6},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto h = Parse(File(Entry("t", c.name, "[2,4]", 0, c.bytes_per_8), c.bytes_per_8));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(h->tensors[0].dtype, c.type);
    EXPECT_EQ(h->tensors[0].numel, 8);
    // One byte fewer is a mismatch naming the tensor.
    ExpectCorrupt(File(Entry("t", c.name, "[2,4]", 0, c.bytes_per_8 - 1), c.bytes_per_8 - 1),
                  {"tensor 't'", "needs " + std::to_string(c.bytes_per_8) + " bytes"});
  }
}

TEST(SafetensorsHeaderTest, SubByteDTypes) {
  EXPECT_TRUE(Parse(File(Entry("f4", "F4", "[4]", 0, 2), 2)).ok());
  EXPECT_TRUE(Parse(File(Entry("f4", "F4", "[3,2]", 0, 3), 3)).ok());
  EXPECT_TRUE(Parse(File(Entry("f6", "F6_E2M3", "[4]", 0, 3), 3)).ok());
  EXPECT_TRUE(Parse(File(Entry("f6", "F6_E3M2", "[0]", 0, 0), 0)).ok());
  ExpectCorrupt(File(Entry("f4", "F4", "[3]", 0, 2), 2),
                {"tensor 'f4'", "whole number of bytes", "F4"});
  ExpectCorrupt(File(Entry("f4", "F4", "[1,1]", 0, 1), 1), {"whole number of bytes"});
  ExpectCorrupt(File(Entry("f6", "F6_E2M3", "[2]", 0, 2), 2),
                {"tensor 'f6'", "whole number of bytes", "F6_E2M3"});
  ExpectCorrupt(File(Entry("f6", "F6_E3M2", "[5]", 0, 4), 4), {"whole number of bytes"});
}

// --- Framing -------------------------------------------------------------------------------------

TEST(SafetensorsHeaderTest, FileShorterThanEightBytes) {
  for (size_t n : {0, 1, 7}) {
    SCOPED_TRACE(n);
    const std::string file(n, '\0');
    const auto h = ParseSafetensorsHeader(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(file.data()), n), n);
    ASSERT_FALSE(h.ok());
    EXPECT_EQ(h.status().code(), StatusCode::kCorrupt);
    EXPECT_NE(h.status().message().find("too short"), std::string::npos) << h.status().message();
  }
}

TEST(SafetensorsHeaderTest, HeaderLengthOverTheLimit) {
  ExpectCorrupt(MakeSafetensors("{}", "", static_cast<int64_t>(kMaxSafetensorsHeaderBytes) + 1),
                {"not a safetensors file: invalid header length", "exceeds the limit"});
  // The length (the file's first 8 bytes) is not echoed.
  const std::string passwd = "root:x:0:0:root:/root:/bin/bash\n";
  uint64_t first8 = 0;
  for (int i = 7; i >= 0; --i) first8 = (first8 << 8) | static_cast<uint8_t>(passwd[i]);
  const auto h = ParseSafetensorsHeader(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(passwd.data()), passwd.size()),
      passwd.size());
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().message().find(std::to_string(first8)), std::string::npos)
      << h.status().message();
  EXPECT_NE(h.status().message().find("invalid header length"), std::string::npos)
      << h.status().message();
  // The largest 64-bit length must not overflow 8 + N.
  std::string file(8, '\xff');
  file += "{}";
  ExpectCorrupt(file, {"exceeds the limit"});
}

TEST(SafetensorsHeaderTest, HeaderLengthPastTheEndOfTheFile) {
  const std::string header = Braced(Entry("w", "F32", "[1]", 0, 4));
  ExpectCorrupt(MakeSafetensors(header, "", 1000), {"invalid header length", "truncated"});
  // The header itself cut short.
  const std::string whole = MakeSafetensors(header, std::string(4, '\0'));
  ExpectCorrupt(whole.substr(0, 8 + header.size() / 2), {"past the end", "truncated"});
}

TEST(SafetensorsHeaderTest, HeaderMustStartWithABrace) {
  ExpectCorrupt(MakeSafetensors("", ""), {"does not start with '{'"});
  ExpectCorrupt(MakeSafetensors(" {}", ""), {"does not start with '{'"});
  ExpectCorrupt(MakeSafetensors("\x01\x02garbage", ""), {"does not start with '{'"});
  // A top-level array is rejected before the JSON parser sees it.
  ExpectCorrupt(MakeSafetensors("[{\"a\":1}]", ""), {"does not start with '{'"});
}

TEST(SafetensorsHeaderTest, InvalidJson) {
  ExpectCorrupt(MakeSafetensors("{\"a\":", ""), {"not valid JSON"});
  ExpectCorrupt(MakeSafetensors("{\"a\" 1}", ""), {"not valid JSON"});
  ExpectCorrupt(MakeSafetensors("{}}", ""), {"not valid JSON"});
  ExpectCorrupt(MakeSafetensors("{} trailing", ""), {"not valid JSON"});
  ExpectCorrupt(MakeSafetensors("{\"\xff\xfe\":{}}", ""), {"not valid JSON"});
  // Padding with something other than whitespace.
  ExpectCorrupt(MakeSafetensors("{}xxxxxx", ""), {"not valid JSON"});
}

// nlohmann::json would end its input at the first NUL byte; the header is JSON padded with
// spaces, so anything hidden behind a NUL must be refused (as the reference implementation does).
TEST(SafetensorsHeaderTest, NulBytesInTheHeader) {
  ExpectCorrupt(MakeSafetensors(std::string("{}\0\0\0\0\0\0", 8), ""), {"NUL"});
  ExpectCorrupt(MakeSafetensors(std::string("{}\0hidden", 9), ""), {"NUL"});
  ExpectCorrupt(MakeSafetensors(std::string("{\"a\0\":{}}", 9), ""), {"NUL byte at offset 3"});
  ExpectCorrupt(MakeSafetensors(std::string("{\"__metadata__\":{}}\0{\"x\":1}", 27), ""), {"NUL"});
}

TEST(SafetensorsHeaderTest, JsonNestedTooDeep) {
  ExpectCorrupt(MakeSafetensors("{\"a\":{\"b\":{\"c\":{}}}}", ""), {"nested too deep"});
  ExpectCorrupt(MakeSafetensors("{\"a\":{\"shape\":[[1]]}}", ""), {"nested too deep"});
  // Deep enough to exhaust a recursive parser's stack if it got that far.
  ExpectCorrupt(MakeSafetensors("{\"a\":" + std::string(1'000'000, '['), ""), {"nested too deep"});
  // Brackets inside strings do not count.
  const auto h =
      Parse(File("\"__metadata__\":{\"k\":\"[[[[{{{{\"}," + Entry("w", "U8", "[1]", 0, 1), 1));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->metadata.at("k"), "[[[[{{{{");
}

// --- Tensor entries ------------------------------------------------------------------------------

TEST(SafetensorsHeaderTest, EntryNotAnObject) {
  ExpectCorrupt(File("\"w\":[1,2]", 0), {"tensor 'w'", "not an object"});
  ExpectCorrupt(File("\"w\":5", 0), {"tensor 'w'", "not an object"});
  ExpectCorrupt(File("\"w\":\"F32\"", 0), {"tensor 'w'", "not an object"});
  ExpectCorrupt(File("\"w\":null", 0), {"tensor 'w'", "not an object"});
}

TEST(SafetensorsHeaderTest, MissingKeys) {
  const char* kMissing = "needs the keys dtype, shape and data_offsets";
  ExpectCorrupt(File("\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}", 4), {"tensor 'w'", kMissing});
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}", 4),
                {"tensor 'w'", kMissing});
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1]}", 4), {"tensor 'w'", kMissing});
  ExpectCorrupt(File("\"w\":{}", 0), {"tensor 'w'", kMissing});
}

TEST(SafetensorsHeaderTest, UnexpectedKey) {
  ExpectCorrupt(
      File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"stride\":[1]}", 4),
      {"tensor 'w'", "unexpected key 'stride'"});
}

TEST(SafetensorsHeaderTest, BadDType) {
  ExpectCorrupt(File(Entry("w", "F33", "[1]", 0, 4), 4), {"tensor 'w'", "unknown dtype 'F33'"});
  ExpectCorrupt(File(Entry("w", "f32", "[1]", 0, 4), 4), {"unknown dtype 'f32'"});
  ExpectCorrupt(File(Entry("w", "", "[1]", 0, 4), 4), {"unknown dtype ''"});
  ExpectCorrupt(File("\"w\":{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}", 4),
                {"tensor 'w'", "dtype is not a string"});
}

TEST(SafetensorsHeaderTest, BadShape) {
  const char* kDims = "shape holds something other than a non-negative integer";
  ExpectCorrupt(File(Entry("w", "F32", "[-1]", 0, 4), 4), {"tensor 'w'", kDims});
  ExpectCorrupt(File(Entry("w", "F32", "[2,-3]", 0, 4), 4), {"tensor 'w'", kDims});
  ExpectCorrupt(File(Entry("w", "F32", "[1.0]", 0, 4), 4), {"tensor 'w'", kDims});
  ExpectCorrupt(File(Entry("w", "F32", "[1.5]", 0, 4), 4), {"tensor 'w'", kDims});
  ExpectCorrupt(File(Entry("w", "F32", "[\"1\"]", 0, 4), 4), {"tensor 'w'", kDims});
  ExpectCorrupt(File(Entry("w", "F32", "[true]", 0, 4), 4), {"tensor 'w'", kDims});
  ExpectCorrupt(File(Entry("w", "F32", "[null]", 0, 4), 4), {"tensor 'w'", kDims});
  ExpectCorrupt(File(Entry("w", "F32", "4", 0, 4), 4), {"tensor 'w'", "shape is not an array"});
  ExpectCorrupt(File(Entry("w", "F32", "{}", 0, 4), 4), {"tensor 'w'", "shape is not an array"});
}

TEST(SafetensorsHeaderTest, ShapeOverflow) {
  // numel 2^64 wraps to 0 in 64 bits.
  ExpectCorrupt(File(Entry("w", "F32", "[4294967296,4294967296]", 0, 0), 0),
                {"tensor 'w'", "shape overflows"});
  // numel above INT64_MAX but below 2^64.
  ExpectCorrupt(File(Entry("w", "U8", "[3037000500,3037000500]", 0, 0), 0),
                {"tensor 'w'", "shape overflows"});
  // One dimension above INT64_MAX.
  ExpectCorrupt(File(Entry("w", "U8", "[9223372036854775808]", 0, 0), 0),
                {"tensor 'w'", "shape overflows"});
  ExpectCorrupt(File(Entry("w", "U8", "[18446744073709551615,1]", 0, 0), 0),
                {"tensor 'w'", "shape overflows"});
  // A zero dimension after huge ones still counts the overflow.
  ExpectCorrupt(File(Entry("w", "U8", "[4294967296,4294967296,0]", 0, 0), 0), {"shape overflows"});
  // Numbers too large for 64 bits at all.
  const auto big = Parse(File(Entry("w", "U8", "[1e30]", 0, 0), 0));
  EXPECT_FALSE(big.ok());
  const auto huge = Parse(File(Entry("w", "U8", "[123456789012345678901234567890]", 0, 0), 0));
  EXPECT_FALSE(huge.ok());
}

TEST(SafetensorsHeaderTest, ByteSizeOverflow) {
  // numel 2^62 fits in int64 but 2^62 x 32 bits does not fit in 64 bits.
  ExpectCorrupt(File(Entry("w", "F32", "[4611686018427387904]", 0, 0), 0),
                {"tensor 'w'", "byte size overflows"});
}

TEST(SafetensorsHeaderTest, BadDataOffsets) {
  const char* kArity = "data_offsets is not [begin, end]";
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}", 4),
                {"tensor 'w'", kArity});
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}", 8),
                {"tensor 'w'", kArity});
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[]}", 4),
                {"tensor 'w'", kArity});
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":4}", 4),
                {"tensor 'w'", kArity});
  const char* kInts = "data_offsets holds something other than non-negative integers";
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}", 4),
                {"tensor 'w'", kInts});
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.0]}", 4),
                {"tensor 'w'", kInts});
  ExpectCorrupt(File("\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[\"0\",4]}", 4),
                {"tensor 'w'", kInts});
  ExpectCorrupt(File(Entry("w", "F32", "[1]", 8, 4), 8), {"tensor 'w'", "end is before begin"});
}

TEST(SafetensorsHeaderTest, ShapeTimesDTypeSizeMustEqualTheSpan) {
  ExpectCorrupt(File(Entry("w", "F32", "[3]", 0, 8), 8),
                {"tensor 'w'", "shape [3] of F32 needs 12 bytes but data_offsets span 8"});
  ExpectCorrupt(File(Entry("w", "BF16", "[2,2]", 0, 16), 16),
                {"tensor 'w'", "needs 8 bytes", "span 16"});
  ExpectCorrupt(File(Entry("w", "F32", "[0]", 0, 4), 4), {"tensor 'w'", "needs 0 bytes"});
}

// --- Layout of the data buffer -------------------------------------------------------------------

TEST(SafetensorsHeaderTest, SpanPastTheEndOfTheData) {
  ExpectCorrupt(File(Entry("w", "F32", "[4]", 0, 16), 8),
                {"tensor 'w'", "ends at data byte 16", "holds 8 bytes", "truncated"});
  ExpectCorrupt(File(Entry("a", "F32", "[1]", 0, 4) + "," + Entry("b", "F32", "[2]", 4, 12), 10),
                {"tensor 'b'", "truncated"});
  ExpectCorrupt(File(Entry("w", "U8", "[1]", 0, 1), 0), {"tensor 'w'", "truncated"});
}

TEST(SafetensorsHeaderTest, HugeOffsetsDoNotWrap) {
  ExpectCorrupt(File(Entry("w", "U8", "[0]", 18446744073709551615ull, 18446744073709551615ull), 0),
                {"tensor 'w'"});
  ExpectCorrupt(File(Entry("a", "U8", "[4]", 0, 4) + "," +
                         Entry("w", "U8", "[0]", 18446744073709551615ull, 18446744073709551615ull),
                     4),
                {"tensor 'w'"});
}

TEST(SafetensorsHeaderTest, OverlappingSpans) {
  ExpectCorrupt(File(Entry("a", "F32", "[2]", 0, 8) + "," + Entry("b", "F32", "[2]", 4, 12), 12),
                {"tensor 'b' [4, 12) overlaps tensor 'a'"});
  // Two names for the same bytes.
  ExpectCorrupt(File(Entry("a", "F32", "[2]", 0, 8) + "," + Entry("b", "F32", "[2]", 0, 8), 8),
                {"overlaps"});
  // One span inside another.
  ExpectCorrupt(File(Entry("a", "F32", "[4]", 0, 16) + "," + Entry("b", "F32", "[1]", 4, 8), 16),
                {"tensor 'b'", "overlaps tensor 'a'"});
}

TEST(SafetensorsHeaderTest, HoleBetweenSpans) {
  ExpectCorrupt(File(Entry("a", "F32", "[2]", 0, 8) + "," + Entry("b", "F32", "[2]", 12, 20), 20),
                {"data bytes [8, 12) before tensor 'b' belong to no tensor"});
  // A hole at the start.
  ExpectCorrupt(File(Entry("a", "F32", "[2]", 4, 12), 12),
                {"data bytes [0, 4) before tensor 'a' belong to no tensor"});
}

TEST(SafetensorsHeaderTest, TrailingUnindexedBytes) {
  ExpectCorrupt(File(Entry("a", "F32", "[2]", 0, 8), 12),
                {"data buffer holds 12 bytes but the tensors cover 8"});
  ExpectCorrupt(MakeSafetensors("{}", "x"), {"holds 1 bytes but the tensors cover 0"});
}

TEST(SafetensorsHeaderTest, BadMetadata) {
  ExpectCorrupt(File("\"__metadata__\":{\"format\":1}," + Entry("w", "U8", "[1]", 0, 1), 1),
                {"__metadata__ value of 'format' is not a string"});
  ExpectCorrupt(File("\"__metadata__\":{\"a\":\"ok\",\"b\":null}", 0),
                {"__metadata__ value of 'b' is not a string"});
  ExpectCorrupt(File("\"__metadata__\":{\"a\":[\"x\"]}", 0), {"__metadata__ value of 'a'"});
  ExpectCorrupt(File("\"__metadata__\":\"pt\"", 0), {"__metadata__ is not an object"});
  ExpectCorrupt(File("\"__metadata__\":[]", 0), {"__metadata__ is not an object"});
}

TEST(SafetensorsHeaderTest, DuplicateKeysDoNotCrash) {
  // JSON leaves duplicate keys undefined; whatever the parser keeps, the result must be coherent.
  const auto h =
      Parse(File(Entry("w", "F32", "[1]", 0, 4) + "," + Entry("w", "F32", "[1]", 0, 4), 4));
  if (h.ok()) {
    ASSERT_EQ(h->tensors.size(), 1u);
    EXPECT_EQ(h->tensors[0].name, "w");
  }
  const auto h2 =
      Parse(File(Entry("w", "F32", "[1]", 0, 4) + "," + Entry("w", "F32", "[2]", 4, 12), 12));
  if (h2.ok()) {
    uint64_t covered = 0;
    for (const auto& t : h2->tensors) covered += t.end - t.begin;
    EXPECT_EQ(covered, 12u);
  }
  const auto h3 = Parse(File("\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}", 0));
  if (h3.ok()) {
    EXPECT_EQ(h3->metadata.size(), 1u);
  }
}

// --- SafetensorsFile -----------------------------------------------------------------------------

TEST(SafetensorsFileTest, OpenAndGet) {
  TempDir dir;
  const std::string path = dir.File("t.safetensors");
  const std::string data = "ABCDEFGHIJKL";
  WriteFile(path,
            File(Entry("a", "U8", "[4]", 0, 4) + "," + Entry("b", "U8", "[2,4]", 4, 12), 0) + data);
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->path(), path);
  EXPECT_TRUE((*f)->Has("a"));
  EXPECT_TRUE((*f)->Has("b"));
  EXPECT_FALSE((*f)->Has("c"));
  auto b = (*f)->Get("b");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->info->name, "b");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(b->data), 8), "EFGHIJKL");
  EXPECT_NE(b->file, nullptr);
  auto a = (*f)->Get("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(a->data), 4), "ABCD");
}

TEST(SafetensorsFileTest, GetMissingTensorNamesTensorAndFile) {
  TempDir dir;
  const std::string path = dir.File("t.safetensors");
  WriteFile(path, File(Entry("a", "U8", "[1]", 0, 1), 1));
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto t = (*f)->Get("nope");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("'nope'"), std::string::npos);
  EXPECT_NE(t.status().message().find(path), std::string::npos);
}

TEST(SafetensorsFileTest, OpenErrorsNameTheFile) {
  TempDir dir;
  const std::string bad = dir.File("bad.safetensors");
  WriteFile(bad, File(Entry("w", "F32", "[4]", 0, 16), 8));
  auto f = SafetensorsFile::Open(bad);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(f.status().message().rfind(bad, 0), 0u) << f.status().message();
  EXPECT_NE(f.status().message().find("tensor 'w'"), std::string::npos);
}

TEST(SafetensorsFileTest, MissingEmptyAndShortFiles) {
  TempDir dir;
  auto missing = SafetensorsFile::Open(dir.File("missing.safetensors"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("missing.safetensors"), std::string::npos);

  WriteFile(dir.File("empty.safetensors"), "");
  auto empty = SafetensorsFile::Open(dir.File("empty.safetensors"));
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(empty.status().message().find("empty.safetensors"), std::string::npos);

  WriteFile(dir.File("short.safetensors"), "abc");
  auto shrt = SafetensorsFile::Open(dir.File("short.safetensors"));
  ASSERT_FALSE(shrt.ok());
  EXPECT_EQ(shrt.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(shrt.status().message().find("too short"), std::string::npos);

  auto folder = SafetensorsFile::Open(dir.path());
  EXPECT_FALSE(folder.ok());
}

TEST(SafetensorsFileTest, OpensEveryFixture) {
  for (const auto& name : moerun::testing::FixtureNames()) {
    for (const char* file : {"model.safetensors", "golden.safetensors"}) {
      SCOPED_TRACE(name + "/" + file);
      auto f = SafetensorsFile::Open(moerun::testing::FixtureDir(name) + "/" + file);
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      EXPECT_FALSE((*f)->header().tensors.empty());
    }
  }
}

// --- WriteSafetensorsF32 -------------------------------------------------------------------------

TEST(WriteSafetensorsF32Test, RoundTrip) {
  TempDir dir;
  const std::string path = dir.File("out.safetensors");
  std::map<std::string, F32Tensor> tensors;
  tensors["b.matrix"] = F32Tensor{{2, 3}, {1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 1e30f}};
  tensors["a.vector"] = F32Tensor{{3}, {7.0f, 8.0f, 9.0f}};
  tensors["c.scalar"] = F32Tensor{{}, {42.0f}};
  tensors["d.empty"] = F32Tensor{{0, 4}, {}};
  const std::map<std::string, std::string> meta = {{"producer", "test"}, {"note", "x \"y\" z"}};
  ASSERT_TRUE(WriteSafetensorsF32(path, tensors, meta).ok());

  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const SafetensorsHeader& h = (*f)->header();
  EXPECT_EQ(h.data_offset % 8, 0u) << "header is padded to 8 bytes";
  EXPECT_EQ(h.metadata, meta);
  ASSERT_EQ(h.tensors.size(), tensors.size());
  for (const auto& [name, want] : tensors) {
    SCOPED_TRACE(name);
    auto t = (*f)->Get(name);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(t->info->dtype, DType::kF32);
    EXPECT_EQ(t->info->shape, want.shape);
    ASSERT_EQ(t->info->numel, static_cast<int64_t>(want.data.size()));
    std::vector<float> got(want.data.size());
    if (!got.empty()) std::memcpy(got.data(), t->data, got.size() * sizeof(float));
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(std::memcmp(&got[i], &want.data[i], sizeof(float)), 0) << "element " << i;
    }
  }
}

TEST(WriteSafetensorsF32Test, NoMetadataAndNoTensors) {
  TempDir dir;
  ASSERT_TRUE(WriteSafetensorsF32(dir.File("a.safetensors"), {{"x", F32Tensor{{1}, {1.0f}}}}).ok());
  auto a = SafetensorsFile::Open(dir.File("a.safetensors"));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE((*a)->header().metadata.empty());

  ASSERT_TRUE(WriteSafetensorsF32(dir.File("b.safetensors"), {}).ok());
  auto b = SafetensorsFile::Open(dir.File("b.safetensors"));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE((*b)->header().tensors.empty());
}

TEST(WriteSafetensorsF32Test, ShapeNotMatchingData) {
  TempDir dir;
  const Status s =
      WriteSafetensorsF32(dir.File("x.safetensors"), {{"w", F32Tensor{{2, 2}, {1.0f, 2.0f}}}});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.message();
}

TEST(WriteSafetensorsF32Test, UnwritablePath) {
  TempDir dir;
  const std::string path = dir.File("no/such/folder/x.safetensors");
  const Status s = WriteSafetensorsF32(path, {{"w", F32Tensor{{1}, {1.0f}}}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
}

}  // namespace
}  // namespace moerun
