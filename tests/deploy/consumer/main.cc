// A user of the installed moerun client library (find_package(moerun), moerun::client).
//   moerun_consumer                                       encode and decode a request frame
//   moerun_consumer HOST:PORT IN.f32 TOKENS HIDDEN OUT.f32   send IN (raw float32 rows) to a
//                                                         running `moerun serve`, write the answer
// Prints what it did; exits non-zero with a one-line error when anything fails.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "moerun/build_info.h"
#include "moerun/v1/serving.pb.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/serve_client.h"

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "moerun_consumer: %s\n", what.c_str());
  return 1;
}

// Encodes a request frame with the library, cuts it back out of a byte stream, and checks that
// the values survive.
int RoundTrip() {
  const std::vector<float> x = {1.0f, -2.5f, 3.25f, 0.0f, 7.0f, -0.125f};
  moerun::v1::InferRequest req;
  req.set_id(42);
  moerun::SetRequestData(&req, x.data(), 2, 3, moerun::v1::F32);
  auto frame = moerun::EncodeFrame(req);
  if (!frame.ok()) return Fail("EncodeFrame: " + frame.status().ToString());
  moerun::FrameDecoder dec;
  dec.Feed(frame.value().data(), frame.value().size());
  std::string body;
  auto got = dec.Next(&body);
  if (!got.ok() || !got.value()) return Fail("FrameDecoder did not return the frame");
  moerun::v1::InferRequest back;
  if (!back.ParseFromString(body)) return Fail("the decoded frame is not an InferRequest");
  if (back.id() != 42 || back.shape_size() != 2 || back.shape(0) != 2 || back.shape(1) != 3 ||
      back.data().size() != x.size() * sizeof(float)) {
    return Fail("the decoded request differs from the one encoded");
  }
  std::printf("moerun client %s: request frame of %zu bytes (shape [2, 3]) encoded and decoded\n",
              MOERUN_VERSION, frame.value().size());
  return 0;
}

int Serve(const std::string& target, const std::string& in_path, int64_t tokens, int64_t hidden,
          const std::string& out_path) {
  std::ifstream in(in_path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) return Fail("cannot read " + in_path);
  if (tokens <= 0 || hidden <= 0 ||
      raw.size() != static_cast<size_t>(tokens * hidden) * sizeof(float)) {
    return Fail(in_path + " does not hold TOKENS x HIDDEN float32 values");
  }
  auto conn = moerun::ServeConnection::Connect(target);
  if (!conn.ok()) return Fail(conn.status().ToString());
  moerun::v1::InferRequest req;
  req.set_id(7);
  moerun::SetRequestData(&req, reinterpret_cast<const float*>(raw.data()), tokens, hidden,
                         moerun::v1::F32);
  moerun::v1::InferResponse resp;
  moerun::Status s = conn.value()->Call(req, &resp, moerun::DeadlineIn(std::chrono::seconds(30)));
  if (!s.ok()) return Fail(s.ToString());
  if (resp.code() != moerun::v1::OK) {
    return Fail(moerun::StatusFromResponse(resp.code(), resp.message()).ToString());
  }
  auto y = moerun::ResponseFloats(resp);
  if (!y.ok()) return Fail(y.status().ToString());
  std::ofstream out(out_path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(y.value().data()),
            static_cast<std::streamsize>(y.value().size() * sizeof(float)));
  if (!out) return Fail("cannot write " + out_path);
  std::printf("moerun client %s: %lld x %lld answered by %s (compute %llu us)\n", MOERUN_VERSION,
              static_cast<long long>(tokens), static_cast<long long>(hidden), target.c_str(),
              static_cast<unsigned long long>(resp.compute_us()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 1) return RoundTrip();
  if (argc == 6) {
    char* end = nullptr;
    const long long tokens = std::strtoll(argv[3], &end, 10);
    if (*end != '\0') return Fail(std::string("TOKENS is not a number: ") + argv[3]);
    const long long hidden = std::strtoll(argv[4], &end, 10);
    if (*end != '\0') return Fail(std::string("HIDDEN is not a number: ") + argv[4]);
    return Serve(argv[1], argv[2], tokens, hidden, argv[5]);
  }
  return Fail("usage: moerun_consumer [HOST:PORT IN.f32 TOKENS HIDDEN OUT.f32]");
}
