// libFuzzer target for FrameDecoder, the serving/control messages and the server's request checks.
// The first input byte sets the size of the pieces the rest is fed in (0: all at once); every frame
// the decoder returns is parsed as an InferRequest and as a ControlRequest (arbitrary bytes must
// never crash the parser) and an InferRequest that parses is re-encoded and decoded again.
// Invariants checked against a plain walk of the length prefixes:
//   - the frames come out whole, in order, byte for byte, none over the limit;
//   - a prefix over the limit is an error right after the frames before it, and stays one;
//   - the decoder never holds more than what it was fed, nor, once drained, more than one
//     header + one maximal frame.
// A violation aborts so that the fuzzer reports it with the input that broke it.
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "moerun/v1/control.pb.h"
#include "moerun/v1/serving.pb.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/infer_codec.h"

namespace {

constexpr uint32_t kMaxFrame = 1u << 20;

void Check(bool invariant) {
  if (!invariant) std::abort();
}

void ParseFrame(const std::string& body) {
  // The server's own checks: an answer or an error with a message, never a crash; what passes
  // holds exactly tokens x hidden finite values.
  moerun::ServedModel model;
  model.layers = {0, 3};
  model.hidden = 4;
  model.max_request_tokens = 64;
  moerun::ParsedRequest parsed;
  moerun::RequestError error;
  const bool ok = moerun::ParseInferRequest(body, model, &parsed, &error);
  if (ok) {
    Check(parsed.tokens >= 1 && parsed.tokens <= 64);
    Check(parsed.data.size() ==
          static_cast<size_t>(parsed.tokens * 4) * (parsed.dtype == moerun::v1::BF16 ? 2 : 4));
    Check(parsed.layer == 0 || parsed.layer == 3);
  } else {
    Check(!error.message.empty() && error.code != moerun::v1::OK);
  }
  // The in-place parser reads the wire format exactly as Protobuf's parser does.
  moerun::v1::InferRequest pb;
  const bool pb_ok = pb.ParseFromString(body);
  Check(pb_ok == (ok || error.code != moerun::v1::MALFORMED_FRAME));
  if (ok) {
    Check(pb.id() == parsed.id && pb.dtype() == parsed.dtype && pb.shape_size() == 2 &&
          pb.shape(0) == parsed.tokens && pb.data() == parsed.data &&
          pb.deadline_ms() == parsed.deadline_ms);
    Check(pb.has_layer() ? pb.layer() == parsed.layer : parsed.layer == 0);
  }
  moerun::v1::InferRequest req;
  if (req.ParseFromString(body)) {
    const std::string again = req.SerializeAsString();
    moerun::v1::InferRequest back;
    Check(back.ParseFromString(again));
    Check(back.SerializeAsString() == again);
    auto frame = moerun::EncodeFrame(req);
    Check(frame.ok());
    moerun::FrameDecoder d(kMaxFrame);
    d.Feed(frame->data(), frame->size());
    std::string got;
    auto r = d.Next(&got);
    Check(r.ok() && *r && got == again && d.buffered() == 0);
  }
  moerun::v1::ControlRequest control;
  if (control.ParseFromString(body)) Check(control.ByteSizeLong() <= body.size() * 2 + 16);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Strings with invalid UTF-8 make Protobuf log an error per parse: noise, not a finding.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  if (size == 0) return 0;
  const size_t piece = data[0] == 0 ? size : data[0];
  const uint8_t* stream = data + 1;
  const size_t n = size - 1;

  // What a correct decoder yields: the whole frames before the first prefix over the limit.
  std::vector<std::string> expect;
  bool expect_error = false;
  for (size_t pos = 0; n - pos >= moerun::kFrameHeaderBytes;) {
    const uint32_t len = moerun::GetFrameLength(stream + pos);
    if (len > kMaxFrame) {
      expect_error = true;
      break;
    }
    if (n - pos - moerun::kFrameHeaderBytes < len) break;
    expect.emplace_back(reinterpret_cast<const char*>(stream + pos + moerun::kFrameHeaderBytes),
                        len);
    pos += moerun::kFrameHeaderBytes + len;
  }

  moerun::FrameDecoder decoder(kMaxFrame);
  size_t got = 0;
  bool failed = false;
  std::string body;
  for (size_t off = 0; off < n && !failed; off += piece) {
    const size_t take = piece < n - off ? piece : n - off;
    const size_t before = decoder.buffered();
    decoder.Feed(stream + off, take);
    Check(decoder.buffered() <= before + take);
    for (;;) {
      auto r = decoder.Next(&body);
      if (!r.ok()) {
        Check(expect_error && got == expect.size());
        Check(decoder.failed());
        Check(!r.status().message().empty());
        Check(!decoder.Next(&body).ok());  // sticky
        failed = true;
        break;
      }
      if (!*r) {
        Check(decoder.missing() >= 1);
        break;
      }
      Check(body.size() <= kMaxFrame);
      Check(got < expect.size() && body == expect[got]);
      ++got;
      ParseFrame(body);
    }
    Check(decoder.buffered() <= moerun::kFrameHeaderBytes + kMaxFrame);
  }
  Check(got == expect.size());
  Check(failed == expect_error);
  return 0;
}
