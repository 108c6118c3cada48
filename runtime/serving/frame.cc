#include "runtime/serving/frame.h"

#include <google/protobuf/message_lite.h>

#include <cstring>
#include <limits>

namespace moerun {
namespace {

constexpr size_t kKeepCapacity = 1 << 20;

Status OverLimit(uint32_t n, uint32_t max) {
  return Status::InvalidArgument("frame of " + std::to_string(n) + " bytes is over the limit of " +
                                 std::to_string(max));
}

}  // namespace

void PutFrameLength(uint32_t n, uint8_t out[4]) {
  out[0] = static_cast<uint8_t>(n >> 24);
  out[1] = static_cast<uint8_t>(n >> 16);
  out[2] = static_cast<uint8_t>(n >> 8);
  out[3] = static_cast<uint8_t>(n);
}

uint32_t GetFrameLength(const uint8_t in[4]) {
  return (static_cast<uint32_t>(in[0]) << 24) | (static_cast<uint32_t>(in[1]) << 16) |
         (static_cast<uint32_t>(in[2]) << 8) | static_cast<uint32_t>(in[3]);
}

Status AppendFrame(const google::protobuf::MessageLite& m, std::string* out) {
  const size_t bytes = m.ByteSizeLong();
  if (bytes > std::numeric_limits<uint32_t>::max()) {
    return Status::InvalidArgument(m.GetTypeName() + " of " + std::to_string(bytes) +
                                   " bytes does not fit in one frame (at most 4 GiB - 1)");
  }
  const size_t start = out->size();
  uint8_t header[kFrameHeaderBytes];
  PutFrameLength(static_cast<uint32_t>(bytes), header);
  out->append(reinterpret_cast<const char*>(header), kFrameHeaderBytes);
  if (!m.AppendToString(out) || out->size() - start != kFrameHeaderBytes + bytes) {
    out->resize(start);
    return Status::InvalidArgument(m.GetTypeName() + " of " + std::to_string(bytes) +
                                   " bytes cannot be serialized");
  }
  return Status::Ok();
}

Result<std::string> EncodeFrame(const google::protobuf::MessageLite& m) {
  std::string out;
  MOERUN_RETURN_IF_ERROR(AppendFrame(m, &out));
  return out;
}

FrameDecoder::FrameDecoder(uint32_t max_frame_bytes) : max_(max_frame_bytes) {}

void FrameDecoder::Feed(const void* data, size_t n) {
  if (poisoned_ || n == 0) return;
  if (pos_ == buf_.size()) {
    buf_.clear();
    scan_ -= pos_;
    pos_ = 0;
  } else if (pos_ > 0) {
    buf_.erase(0, pos_);
    scan_ -= pos_;
    pos_ = 0;
  }
  buf_.append(static_cast<const char*>(data), n);
  ScanHeaders();
}

void FrameDecoder::ScanHeaders() {
  // Walks the length prefixes of the whole frames buffered; stops at the first unfinished one.
  while (buf_.size() - scan_ >= kFrameHeaderBytes) {
    const uint32_t len = GetFrameLength(reinterpret_cast<const uint8_t*>(buf_.data() + scan_));
    if (len > max_) {
      buf_.resize(scan_ + kFrameHeaderBytes);  // drop its body and whatever follows
      poisoned_ = true;
      return;
    }
    const size_t end = scan_ + kFrameHeaderBytes + len;
    if (end > buf_.size()) return;
    scan_ = end;
  }
}

size_t FrameDecoder::missing() const {
  const size_t have = buffered();
  if (have < kFrameHeaderBytes) return kFrameHeaderBytes - have;
  const uint32_t len = GetFrameLength(reinterpret_cast<const uint8_t*>(buf_.data() + pos_));
  if (len > max_) return 0;  // Next reports the error now
  const size_t want = kFrameHeaderBytes + static_cast<size_t>(len);
  return have >= want ? 0 : want - have;
}

Result<bool> FrameDecoder::Next(std::string* frame) {
  const size_t have = buffered();
  if (have < kFrameHeaderBytes) return false;
  const uint32_t len = GetFrameLength(reinterpret_cast<const uint8_t*>(buf_.data() + pos_));
  if (len > max_) {
    // Stays here: buf_ ends with this prefix and Feed ignores everything after it.
    return OverLimit(len, max_);
  }
  if (have - kFrameHeaderBytes < len) return false;
  frame->assign(buf_.data() + pos_ + kFrameHeaderBytes, len);
  pos_ += kFrameHeaderBytes + len;
  if (pos_ == buf_.size()) {
    // Empty again: give a big frame's memory back rather than hold it while the peer idles.
    if (buf_.capacity() > kKeepCapacity) {
      std::string().swap(buf_);
    } else {
      buf_.clear();
    }
    scan_ = 0;
    pos_ = 0;
  }
  return true;
}

}  // namespace moerun
