// FrameDecoder and EncodeFrame: the 4-byte big-endian length prefix, frames cut at every byte,
// several frames per read, empty frames, and prefixes over the limit refused before their body.
#include "runtime/serving/frame.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moerun/v1/control.pb.h"
#include "moerun/v1/serving.pb.h"

namespace moerun {
namespace {

std::string Frame(const std::string& body) {
  uint8_t h[kFrameHeaderBytes];
  PutFrameLength(static_cast<uint32_t>(body.size()), h);
  return std::string(reinterpret_cast<const char*>(h), kFrameHeaderBytes) + body;
}

std::string Header(uint32_t n) {
  uint8_t h[kFrameHeaderBytes];
  PutFrameLength(n, h);
  return std::string(reinterpret_cast<const char*>(h), kFrameHeaderBytes);
}

v1::InferRequest SampleRequest(uint64_t id, int64_t tokens) {
  v1::InferRequest r;
  r.set_id(id);
  r.set_layer(3);
  r.set_dtype(v1::F32);
  r.add_shape(tokens);
  r.add_shape(4);
  r.set_data(std::string(static_cast<size_t>(tokens * 16), static_cast<char>('a' + id % 26)));
  r.set_deadline_ms(250);
  return r;
}

TEST(FrameTest, LengthIsBigEndian) {
  uint8_t b[4];
  PutFrameLength(0x01020304u, b);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[1], 2);
  EXPECT_EQ(b[2], 3);
  EXPECT_EQ(b[3], 4);
  EXPECT_EQ(GetFrameLength(b), 0x01020304u);
  PutFrameLength(0xffffffffu, b);
  EXPECT_EQ(GetFrameLength(b), 0xffffffffu);
  EXPECT_EQ(kDefaultMaxFrameBytes, 64u << 20);
}

TEST(FrameTest, EncodeFrameRoundTrip) {
  const v1::InferRequest req = SampleRequest(42, 3);
  auto frame = EncodeFrame(req);
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  ASSERT_EQ(frame->size(), kFrameHeaderBytes + req.ByteSizeLong());
  EXPECT_EQ(GetFrameLength(reinterpret_cast<const uint8_t*>(frame->data())), req.ByteSizeLong());

  FrameDecoder d;
  d.Feed(frame->data(), frame->size());
  std::string body;
  auto got = d.Next(&body);
  ASSERT_TRUE(got.ok());
  ASSERT_TRUE(*got);
  v1::InferRequest back;
  ASSERT_TRUE(back.ParseFromString(body));
  EXPECT_EQ(back.SerializeAsString(), req.SerializeAsString());
  EXPECT_EQ(back.id(), 42u);
  EXPECT_EQ(d.buffered(), 0u);

  std::string two;
  ASSERT_TRUE(AppendFrame(req, &two).ok());
  ASSERT_TRUE(AppendFrame(v1::ControlRequest(), &two).ok());
  EXPECT_EQ(two, *frame + Header(0));
}

TEST(FrameTest, ByteByByte) {
  const std::vector<std::string> bodies = {SampleRequest(1, 1).SerializeAsString(), "",
                                           SampleRequest(2, 5).SerializeAsString(), "x"};
  std::string stream;
  for (const auto& b : bodies) stream += Frame(b);
  FrameDecoder d(1024);
  std::vector<std::string> out;
  for (size_t i = 0; i < stream.size(); ++i) {
    d.Feed(&stream[i], 1);
    std::string body;
    for (;;) {
      auto r = d.Next(&body);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      if (!*r) break;
      out.push_back(body);
    }
    EXPECT_LE(d.buffered(), kFrameHeaderBytes + 1024);
  }
  EXPECT_EQ(out, bodies);
  EXPECT_EQ(d.buffered(), 0u);
}

TEST(FrameTest, SeveralFramesInOneFeed) {
  std::string stream =
      Frame("first") + Frame("second") + Frame("third") + Frame("four").substr(0, 6);
  FrameDecoder d(64);
  d.Feed(stream.data(), stream.size());
  std::string body;
  for (const char* want : {"first", "second", "third"}) {
    auto r = d.Next(&body);
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE(*r);
    EXPECT_EQ(body, want);
  }
  auto r = d.Next(&body);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
  EXPECT_EQ(d.buffered(), 6u);
  EXPECT_EQ(d.missing(), 2u);
  d.Feed("ur", 2);
  EXPECT_EQ(d.missing(), 0u);
  r = d.Next(&body);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(*r);
  EXPECT_EQ(body, "four");
  EXPECT_EQ(d.missing(), kFrameHeaderBytes);
}

TEST(FrameTest, ZeroLengthFrame) {
  FrameDecoder d(16);
  const std::string h = Header(0);
  d.Feed(h.data(), h.size());
  std::string body = "stale";
  auto r = d.Next(&body);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(*r);
  EXPECT_TRUE(body.empty());
  v1::InferRequest req;
  EXPECT_TRUE(req.ParseFromString(body));  // every field at its default
  EXPECT_EQ(req.id(), 0u);
  r = d.Next(&body);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
}

TEST(FrameTest, FrameAtTheLimitIsAccepted) {
  FrameDecoder d(10);
  const std::string f = Frame(std::string(10, 'z'));
  d.Feed(f.data(), f.size());
  std::string body;
  auto r = d.Next(&body);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r);
  EXPECT_EQ(body.size(), 10u);
}

TEST(FrameTest, OverLimitPrefixRejectedBeforeTheBody) {
  FrameDecoder d(100);
  const std::string h = Header(101);
  d.Feed(h.data(), 2);
  std::string body;
  auto r = d.Next(&body);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
  EXPECT_FALSE(d.failed());
  d.Feed(h.data() + 2, 2);  // the prefix is complete: refused now, no body byte needed
  EXPECT_TRUE(d.failed());
  r = d.Next(&body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "frame of 101 bytes is over the limit of 100");
  // The body that follows is never buffered, and the decoder stays failed.
  const std::string junk(1000, 'j');
  d.Feed(junk.data(), junk.size());
  EXPECT_LE(d.buffered(), kFrameHeaderBytes);
  const std::string ok = Frame("fine");
  d.Feed(ok.data(), ok.size());
  r = d.Next(&body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "frame of 101 bytes is over the limit of 100");
}

TEST(FrameTest, HugePrefixAfterGoodFramesInOneFeed) {
  FrameDecoder d(100);
  const std::string stream = Frame("a") + Frame("bb") + Header(0xffffffffu) + std::string(500, 'j');
  d.Feed(stream.data(), stream.size());
  EXPECT_TRUE(d.failed());
  EXPECT_LE(d.buffered(), 2 * kFrameHeaderBytes + 3 + kFrameHeaderBytes);
  std::string body;
  auto r = d.Next(&body);
  ASSERT_TRUE(r.ok() && *r);
  EXPECT_EQ(body, "a");
  r = d.Next(&body);
  ASSERT_TRUE(r.ok() && *r);
  EXPECT_EQ(body, "bb");
  r = d.Next(&body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "frame of 4294967295 bytes is over the limit of 100");
}

TEST(FrameTest, NeverHoldsMoreThanOneFrameWhileWaiting) {
  // A frame at the limit fed in small pieces: the decoder holds exactly what arrived.
  FrameDecoder d(1000);
  const std::string f = Frame(std::string(1000, 'q'));
  std::string body;
  for (size_t i = 0; i < f.size(); i += 7) {
    const size_t n = std::min<size_t>(7, f.size() - i);
    d.Feed(f.data() + i, n);
    EXPECT_EQ(d.buffered(), i + n);
    auto r = d.Next(&body);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, i + n == f.size());
  }
  EXPECT_EQ(body, std::string(1000, 'q'));
}

}  // namespace
}  // namespace moerun
