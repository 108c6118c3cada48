// The serving codec reads requests in place and writes answers in place: what it reads must be
// what Protobuf's own parser reads (any field order, unknown fields, packed or unpacked shapes,
// malformed bytes), the data it hands on must be the body's own bytes (no copy), and the answer
// frames it writes must parse as the InferResponse they stand for.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

#include "moerun/v1/serving.pb.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/infer_codec.h"
#include "runtime/serving/serve_client.h"

namespace moerun {
namespace {

ServedModel Model() {
  ServedModel m;
  m.layers = {3, 5};
  m.hidden = 4;
  m.max_request_tokens = 64;
  return m;
}

std::vector<float> Rows(int64_t tokens, int64_t hidden) {
  std::vector<float> x(static_cast<size_t>(tokens * hidden));
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * static_cast<float>(i) - 3.0f;
  return x;
}

std::string Body(const v1::InferRequest& r) { return r.SerializeAsString(); }

std::string Hex(const std::string& b) {
  std::string hex;
  for (unsigned char c : b) {
    hex += "0123456789abcdef"[c >> 4];
    hex += "0123456789abcdef"[c & 15];
  }
  return hex;
}

// Field bytes by hand: tag, then a varint or a length-delimited payload.
std::string Varint(uint64_t v) {
  std::string s;
  while (v >= 0x80) {
    s.push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
  return s;
}
std::string Tag(int field, int wire) { return Varint(static_cast<uint64_t>(field) << 3 | wire); }
std::string VarintField(int field, uint64_t v) { return Tag(field, 0) + Varint(v); }
std::string BytesField(int field, const std::string& b) {
  return Tag(field, 2) + Varint(b.size()) + b;
}

TEST(InferCodecTest, ReadsTheFieldsAndLeavesTheDataInTheBody) {
  for (const v1::DType dtype : {v1::F32, v1::BF16}) {
    const auto x = Rows(3, 4);
    v1::InferRequest r;
    r.set_id(77);
    r.set_layer(5);
    r.set_deadline_ms(1500);
    SetRequestData(&r, x.data(), 3, 4, dtype);
    const std::string body = Body(r);
    ParsedRequest p;
    RequestError e;
    ASSERT_TRUE(ParseInferRequest(body, Model(), &p, &e)) << e.message;
    EXPECT_EQ(p.id, 77u);
    EXPECT_EQ(p.layer, 5);
    EXPECT_EQ(p.dtype, dtype);
    EXPECT_EQ(p.tokens, 3);
    EXPECT_EQ(p.deadline_ms, 1500u);
    EXPECT_EQ(p.data, r.data());
    // No copy: the data is a view of the body's own bytes.
    EXPECT_GE(p.data.data(), body.data());
    EXPECT_LE(p.data.data() + p.data.size(), body.data() + body.size());
  }
}

TEST(InferCodecTest, ReadsTheWireFormatAsProtobufDoes) {
  const auto x = Rows(2, 4);
  const std::string data(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  // Out of order, unpacked shape, unknown fields of every wire type, repeated singular fields
  // (the last one wins), a group.
  const std::string body =
      BytesField(5, "stale") + VarintField(6, 9) + VarintField(4, 2) + Tag(99, 1) +
      std::string(8, 'x') + VarintField(1, 5) + Tag(98, 5) + std::string(4, 'y') +
      VarintField(3, v1::F32) + BytesField(97, "unknown") + Tag(96, 3) + VarintField(1, 1) +
      Tag(96, 4) + VarintField(4, 4) + VarintField(1, 6) + BytesField(5, data) + VarintField(2, 3);
  v1::InferRequest pb;
  ASSERT_TRUE(pb.ParseFromString(body));
  ParsedRequest p;
  RequestError e;
  ASSERT_TRUE(ParseInferRequest(body, Model(), &p, &e)) << e.message;
  EXPECT_EQ(p.id, pb.id());
  EXPECT_EQ(p.id, 6u);
  EXPECT_EQ(p.layer, pb.layer());
  EXPECT_EQ(p.tokens, pb.shape(0));
  EXPECT_EQ(p.data, pb.data());
  EXPECT_EQ(p.deadline_ms, pb.deadline_ms());
  // A known field with another wire type is an unknown field, for both.
  const std::string odd = body + Tag(1, 2) + Varint(3) + "abc";
  ASSERT_TRUE(pb.ParseFromString(odd));
  ASSERT_TRUE(ParseInferRequest(odd, Model(), &p, &e)) << e.message;
  EXPECT_EQ(p.id, pb.id());
}

TEST(InferCodecTest, MalformedBytesAreMalformedForBoth) {
  const auto x = Rows(1, 4);
  v1::InferRequest r;
  r.set_id(1);
  SetRequestData(&r, x.data(), 1, 4, v1::F32);
  const std::string good = Body(r);
  const std::vector<std::string> bad = {
      good.substr(0, good.size() - 1),     // the data cut short
      good + std::string(1, '\x80'),       // a varint that never ends
      good + std::string(1, '\0'),         // tag 0
      good + Tag(7, 4),                    // an end-group with no group
      good + Tag(7, 6),                    // wire type 6
      good + Tag(7, 3),                    // a group that never ends
      Tag(4, 2) + Varint(5) + "\x01\x02",  // a packed shape past the end
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    v1::InferRequest pb;
    EXPECT_FALSE(pb.ParseFromString(bad[i])) << i;
    ParsedRequest p;
    RequestError e;
    EXPECT_FALSE(ParseInferRequest(bad[i], Model(), &p, &e)) << i;
    EXPECT_EQ(e.code, v1::MALFORMED_FRAME) << i << ": " << e.message;
  }
}

TEST(InferCodecTest, ContentErrorsNameWhatIsWrong) {
  const auto x = Rows(2, 4);
  auto check = [](const v1::InferRequest& r, const std::string& want) {
    ParsedRequest p;
    RequestError e;
    EXPECT_FALSE(ParseInferRequest(Body(r), Model(), &p, &e));
    EXPECT_EQ(e.code, v1::INVALID_ARGUMENT);
    EXPECT_NE(e.message.find(want), std::string::npos) << e.message;
  };
  v1::InferRequest r;
  SetRequestData(&r, x.data(), 2, 4, v1::F32);
  v1::InferRequest l = r;
  l.set_layer(4);
  check(l, "layer 4 is not served (served: 3, 5)");
  v1::InferRequest d = r;
  d.set_dtype(v1::DTYPE_UNSPECIFIED);
  check(d, "dtype must be F32 or BF16");
  v1::InferRequest s = r;
  s.add_shape(1);
  check(s, "got 3 dimensions");
  v1::InferRequest h = r;
  h.set_shape(1, 5);
  check(h, "hidden size 5");
  v1::InferRequest n = r;
  n.mutable_data()->resize(12);
  check(n, "data has 12 bytes");
  auto nan = x;
  nan[6] = std::nanf("");
  v1::InferRequest f;
  SetRequestData(&f, nan.data(), 2, 4, v1::F32);
  check(f, "not finite at token 1, column 2");
  auto inf = x;
  inf[1] = INFINITY;
  v1::InferRequest b;
  SetRequestData(&b, inf.data(), 2, 4, v1::BF16);
  check(b, "not finite at token 0, column 1");
}

// Random bytes and mutations of good requests: both parsers agree on what is malformed, and on
// every field of what is not.
TEST(InferCodecTest, AgreesWithProtobufOnMutatedRequests) {
  std::mt19937 rng(7);
  const auto x = Rows(2, 4);
  v1::InferRequest r;
  r.set_id(12345678901ull);
  r.set_layer(3);
  r.set_deadline_ms(70000);
  SetRequestData(&r, x.data(), 2, 4, v1::BF16);
  const std::string good = Body(r);
  int parsed = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string b = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits && !b.empty(); ++k) {
      const size_t at = rng() % b.size();
      switch (rng() % 3) {
        case 0:
          b[at] = static_cast<char>(rng());
          break;
        case 1:
          b.erase(at, 1 + rng() % 3);
          break;
        default:
          b.insert(at, 1, static_cast<char>(rng()));
      }
    }
    v1::InferRequest pb;
    const bool pb_ok = pb.ParseFromString(b);
    ParsedRequest p;
    RequestError e;
    const bool ok = ParseInferRequest(b, Model(), &p, &e);
    ASSERT_EQ(pb_ok, ok || e.code != v1::MALFORMED_FRAME)
        << i << ": " << e.message << " " << Hex(b);
    if (ok) {
      ++parsed;
      ASSERT_EQ(p.id, pb.id());
      ASSERT_EQ(p.dtype, pb.dtype());
      ASSERT_EQ(p.tokens, pb.shape(0));
      ASSERT_EQ(p.data, pb.data());
      ASSERT_EQ(p.deadline_ms, pb.deadline_ms());
    }
  }
  EXPECT_GT(parsed, 100);  // the mutations reach the accepted side too
}

TEST(InferCodecTest, AnswersWrittenInPlaceParseAsTheirMessage) {
  for (const v1::DType dtype : {v1::F32, v1::BF16}) {
    for (const uint64_t id : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 40}) {
      const int64_t tokens = 3, hidden = 4;
      const AnswerLayout l = LayoutAnswer(dtype, tokens, hidden);
      std::string buffer(l.capacity, '\xee');
      for (size_t i = 0; i < l.data_bytes; ++i) {
        buffer[l.data_offset + i] = static_cast<char>(i * 31);
      }
      BatchInfo info;
      info.queue_us = id == 0 ? 0 : 1234;
      info.compute_us = 987654321;
      size_t offset = 0, size = 0;
      FinishAnswer(buffer.data(), l, id, dtype, tokens, hidden, info, &offset, &size);
      ASSERT_LE(offset + size, l.capacity);
      FrameDecoder d;
      d.Feed(buffer.data() + offset, size);
      std::string body;
      ASSERT_TRUE(d.Next(&body).value());
      EXPECT_EQ(d.buffered(), 0u);
      v1::InferResponse resp;
      ASSERT_TRUE(resp.ParseFromString(body));
      EXPECT_EQ(resp.id(), id);
      EXPECT_EQ(resp.code(), v1::OK);
      EXPECT_EQ(resp.dtype(), dtype);
      ASSERT_EQ(resp.shape_size(), 2);
      EXPECT_EQ(resp.shape(0), tokens);
      EXPECT_EQ(resp.shape(1), hidden);
      EXPECT_EQ(resp.data(), buffer.substr(l.data_offset, l.data_bytes));
      EXPECT_EQ(resp.queue_us(), static_cast<uint64_t>(info.queue_us));
      EXPECT_EQ(resp.compute_us(), static_cast<uint64_t>(info.compute_us));
    }
  }
}

}  // namespace
}  // namespace moerun
