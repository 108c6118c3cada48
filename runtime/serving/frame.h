// Framing of the serving and control protocols: every message on the TCP stream is a 4-byte
// unsigned length in network order (big-endian) followed by that many bytes of one Protobuf
// message. EncodeFrame builds one frame; FrameDecoder cuts a byte stream back into frame bodies.
//
// A decoder refuses a length prefix over its limit as soon as the prefix arrives, before any of
// the body is buffered, so a peer cannot make it hold more than one header + max_frame_bytes of
// a frame it has not finished. After an error it stays failed (the stream has lost sync).
// Thread-safety: a FrameDecoder is used by one thread at a time; the free functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/status.h"

namespace google::protobuf {
class MessageLite;
}  // namespace google::protobuf

namespace moerun {

inline constexpr size_t kFrameHeaderBytes = 4;
inline constexpr uint32_t kDefaultMaxFrameBytes = 64u << 20;  // the server's default

// The 4-byte big-endian length prefix.
void PutFrameLength(uint32_t n, uint8_t out[4]);
uint32_t GetFrameLength(const uint8_t in[4]);

// Header + serialized message. Fails (kInvalidArgument) if the message is over 4 GiB - 1 bytes or
// cannot be serialized (Protobuf refuses messages of 2 GiB and more).
Result<std::string> EncodeFrame(const google::protobuf::MessageLite& m);
// Appends header + serialized message to *out (several frames can share one write).
Status AppendFrame(const google::protobuf::MessageLite& m, std::string* out);

class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

  // Appends bytes from the stream. Every length prefix is checked as soon as it is complete: once
  // one is over the limit, the bytes after it (its body and anything later) are dropped, here and
  // in every later Feed.
  void Feed(const void* data, size_t n);
  // true: one whole frame body was moved into *frame; false: more bytes are needed; error
  // (kInvalidArgument "frame of N bytes is over the limit of M") when the next frame is the one
  // over the limit (the whole frames before it are returned first). After an error the stream is
  // unusable, and every later call returns the same error.
  Result<bool> Next(std::string* frame);

  // Bytes held: the unfinished frame, and any whole frames Next has not taken yet.
  size_t buffered() const { return buf_.size() - pos_; }
  // Bytes still missing before Next can return the next frame (at least 1 when it would return
  // false; 0 when a whole frame is buffered). Readers use it to size their reads.
  size_t missing() const;
  uint32_t max_frame_bytes() const { return max_; }
  // A length prefix over the limit has been seen (Next returns its error once it gets there).
  bool failed() const { return poisoned_; }

 private:
  void ScanHeaders();

  uint32_t max_;
  std::string buf_;
  size_t pos_ = 0;         // first byte Next has not taken
  size_t scan_ = 0;        // next length prefix Feed has not checked yet
  bool poisoned_ = false;  // buf_ ends with a prefix over the limit
};

}  // namespace moerun
