#include "runtime/serving/infer_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "runtime/serving/control_auth.h"
#include "runtime/serving/frame.h"

namespace moerun {

using moerun::v1::ErrorCode;

namespace {

bool Fail(RequestError* e, uint64_t id, ErrorCode code, std::string message) {
  e->id = id;
  e->code = code;
  e->message = std::move(message);
  return false;
}

// The fields of an InferRequest as they are on the wire.
struct WireRequest {
  uint64_t id = 0;
  bool has_layer = false;
  int32_t layer = 0;
  int32_t dtype = 0;
  int64_t shape[2] = {0, 0};  // the first two entries
  size_t dims = 0;            // entries seen
  std::string_view data;
  uint32_t deadline_ms = 0;
  std::string_view key;
  bool timing = false;
  int32_t probe = 0;
  std::string_view traceparent;
};

// The wire format as Protobuf 3's parser reads it (parse_context.h): a tag is a varint of at
// most 5 bytes, a length at most 5 bytes and below 2^31, any other varint at most 10 bytes; an
// unknown field is skipped by its wire type, groups nested at most 100 deep and closed by their
// own end-group.
class WireReader {
 public:
  explicit WireReader(std::string_view b)
      : p_(reinterpret_cast<const uint8_t*>(b.data())), end_(p_ + b.size()), begin_(p_) {}
  bool done() const { return p_ == end_; }
  size_t offset() const { return static_cast<size_t>(p_ - begin_); }

  bool Tag(uint32_t* tag) {
    uint64_t v = 0;
    if (!Varint(5, &v)) return false;
    *tag = static_cast<uint32_t>(v);
    return true;
  }
  bool Varint64(uint64_t* v) { return Varint(10, v); }
  bool Size(uint32_t* n) {
    uint64_t v = 0;
    if (!Varint(5, &v) || v >= (uint64_t{1} << 31)) return false;
    *n = static_cast<uint32_t>(v);
    return true;
  }
  bool Skip(size_t n) {
    if (n > static_cast<size_t>(end_ - p_)) return false;
    p_ += n;
    return true;
  }
  // An unknown field's value, after its tag.
  bool SkipField(uint32_t tag, int depth = 100) {
    uint64_t v = 0;
    uint32_t n = 0;
    switch (tag & 7) {
      case 0:
        return Varint64(&v);
      case 1:
        return Skip(8);
      case 2:
        return Size(&n) && Skip(n);
      case 5:
        return Skip(4);
      case 3:  // a group: fields up to the end-group of the same number
        if (depth == 0) return false;
        for (;;) {
          uint32_t inner = 0;
          if (!Tag(&inner) || (inner >> 3) == 0) return false;
          if ((inner & 7) == 4) return (inner >> 3) == (tag >> 3);
          if (!SkipField(inner, depth - 1)) return false;
        }
      default:  // 4 (an end-group with no group), 6, 7
        return false;
    }
  }

 private:
  bool Varint(int max_bytes, uint64_t* out) {
    uint64_t v = 0;
    for (int i = 0; i < max_bytes; ++i) {
      if (p_ == end_) return false;
      const uint8_t b = *p_++;
      v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if (b < 0x80) {
        *out = v;
        return true;
      }
    }
    return false;
  }

  const uint8_t* p_;
  const uint8_t* end_;
  const uint8_t* begin_;
};

// Reads the body's fields (last value wins for singular fields; a known field with another wire
// type is an unknown field; a tag 0 or a stray end-group is malformed). Nothing is allocated.
bool ReadWire(std::string_view body, WireRequest* r) {
  WireReader in(body);
  auto add_dim = [r](uint64_t v) {
    if (r->dims < 2) r->shape[r->dims] = static_cast<int64_t>(v);
    ++r->dims;
  };
  while (!in.done()) {
    uint32_t tag = 0;
    if (!in.Tag(&tag)) return false;
    const uint32_t field = tag >> 3, wire = tag & 7;
    if (field == 0 || wire == 4) return false;
    uint64_t v = 0;
    uint32_t len = 0;
    if (field == 1 && wire == 0) {
      if (!in.Varint64(&r->id)) return false;
    } else if (field == 2 && wire == 0) {
      if (!in.Varint64(&v)) return false;
      r->has_layer = true;
      r->layer = static_cast<int32_t>(v);
    } else if (field == 3 && wire == 0) {
      if (!in.Varint64(&v)) return false;
      r->dtype = static_cast<int32_t>(v);
    } else if (field == 4 && wire == 0) {
      if (!in.Varint64(&v)) return false;
      add_dim(v);
    } else if (field == 4 && wire == 2) {  // packed
      if (!in.Size(&len)) return false;
      const size_t at = in.offset();
      if (!in.Skip(len)) return false;
      WireReader packed(body.substr(at, len));
      while (!packed.done()) {
        if (!packed.Varint64(&v)) return false;
        add_dim(v);
      }
    } else if (field == 5 && wire == 2) {
      if (!in.Size(&len)) return false;
      const size_t at = in.offset();
      if (!in.Skip(len)) return false;
      r->data = body.substr(at, len);
    } else if (field == 6 && wire == 0) {
      if (!in.Varint64(&v)) return false;
      r->deadline_ms = static_cast<uint32_t>(v);
    } else if (field == 7 && wire == 2) {
      if (!in.Size(&len)) return false;
      const size_t at = in.offset();
      if (!in.Skip(len)) return false;
      r->key = body.substr(at, len);
    } else if (field == 8 && wire == 0) {
      if (!in.Varint64(&v)) return false;
      r->timing = v != 0;
    } else if (field == 9 && wire == 0) {
      if (!in.Varint64(&v)) return false;
      r->probe = static_cast<int32_t>(v);
    } else if (field == 10 && wire == 2) {
      if (!in.Size(&len)) return false;
      const size_t at = in.offset();
      if (!in.Skip(len)) return false;
      r->traceparent = body.substr(at, len);
    } else if (!in.SkipField(tag)) {
      return false;
    }
  }
  return true;
}

// The first value that is not finite, as (index, true); (0, false) when all are.
std::pair<size_t, bool> FirstNonFinite(std::string_view data, size_t elem) {
  const size_t n = data.size() / elem;
  for (size_t i = 0; i < n; ++i) {
    bool finite;
    if (elem == 4) {
      uint32_t bits;
      std::memcpy(&bits, data.data() + 4 * i, 4);
      finite = (bits & 0x7f800000u) != 0x7f800000u;
    } else {
      uint16_t bits;
      std::memcpy(&bits, data.data() + 2 * i, 2);
      finite = (bits & 0x7f80u) != 0x7f80u;
    }
    if (!finite) return {i, true};
  }
  return {0, false};
}

uint8_t* PutVarint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

size_t VarintBytes(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

constexpr int kVarint = 0, kDelimited = 2;
uint8_t* PutTag(uint8_t* p, int field, int wire) {
  return PutVarint(p, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire));
}

// A varint field, left out when zero (as proto3 serializes).
uint8_t* PutVarintField(uint8_t* p, int field, uint64_t v) {
  if (v == 0) return p;
  return PutVarint(PutTag(p, field, kVarint), v);
}

constexpr size_t kMaxTrailer = 64;  // id, code, dtype, packed shape, queue_us, compute_us
// A Timing: its tag and length, ten varint fields; per rank a RankTiming (tag, length, four
// varint fields).
constexpr size_t kMaxTimingFixed = 1 + 5 + 10 * (1 + 10);
constexpr size_t kMaxRankTiming = 1 + 5 + 4 * (1 + 10);

uint64_t NonNegative(int64_t v) { return static_cast<uint64_t>(std::max<int64_t>(0, v)); }

// Timing's fields (InferResponse.timing, field 9), in field order, at p.
uint8_t* PutTimingBody(uint8_t* p, const AnswerTiming& t) {
  p = PutVarintField(p, 1, NonNegative(t.queue_us));
  p = PutVarintField(p, 2, NonNegative(t.batch.gate_us));
  p = PutVarintField(p, 3, NonNegative(t.batch.dispatch_us));
  p = PutVarintField(p, 4, NonNegative(t.batch.wait_us));
  p = PutVarintField(p, 5, NonNegative(t.batch.combine_us));
  p = PutVarintField(p, 6, NonNegative(t.batch.shared_us));
  for (const RankTiming& r : t.batch.ranks) {
    uint8_t body[4 * (1 + 10)];
    uint8_t* b = PutVarintField(body, 1, static_cast<uint64_t>(r.rank));
    b = PutVarintField(b, 2, NonNegative(r.rows));
    b = PutVarintField(b, 3, NonNegative(r.round_trip_us));
    b = PutVarintField(b, 4, NonNegative(r.compute_us));
    p = PutTag(p, 7, kDelimited);
    p = PutVarint(p, static_cast<uint64_t>(b - body));
    std::memcpy(p, body, static_cast<size_t>(b - body));
    p += b - body;
  }
  p = PutVarintField(p, 8, NonNegative(t.reply_us));
  p = PutVarintField(p, 9, NonNegative(t.server_us));
  p = PutVarintField(p, 10, NonNegative(t.batch_tokens));
  return p;
}

}  // namespace

bool ParseInferRequest(std::string_view body, const ServedModel& model, ParsedRequest* out,
                       RequestError* error, std::string_view required_key) {
  WireRequest req;
  if (!ReadWire(body, &req)) {
    return Fail(error, 0, moerun::v1::MALFORMED_FRAME,
                "the frame is not a valid moerun.v1.InferRequest (" + std::to_string(body.size()) +
                    " bytes)");
  }
  const uint64_t id = req.id;
  out->id = id;
  out->key = req.key;
  if (!required_key.empty() && !ConstantTimeEqual(req.key, required_key)) {
    return Fail(error, id, moerun::v1::UNAUTHENTICATED,
                req.key.empty() ? "this server requires a key (InferRequest.key); none was sent"
                                : "wrong key (InferRequest.key)");
  }
  if (req.has_layer) {
    if (std::find(model.layers.begin(), model.layers.end(), req.layer) == model.layers.end()) {
      std::string list;
      for (int l : model.layers) list += (list.empty() ? "" : ", ") + std::to_string(l);
      return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                  "layer " + std::to_string(req.layer) + " is not served (served: " + list + ")");
    }
    out->layer = req.layer;
  } else {
    if (model.layers.empty()) return Fail(error, id, moerun::v1::INTERNAL, "no layer is served");
    out->layer = model.layers.front();
  }
  size_t elem = 0;
  switch (req.dtype) {
    case moerun::v1::F32:
      elem = 4;
      break;
    case moerun::v1::BF16:
      elem = 2;
      break;
    default:
      return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                  "dtype must be F32 or BF16 (got " + std::to_string(req.dtype) + ")");
  }
  out->dtype = static_cast<moerun::v1::DType>(req.dtype);
  if (req.dims != 2) {
    return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                "shape must be [tokens, hidden] (got " + std::to_string(req.dims) + " dimensions)");
  }
  const int64_t tokens = req.shape[0], hidden = req.shape[1];
  if (hidden != model.hidden) {
    return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                "hidden size " + std::to_string(hidden) + " does not match the model's " +
                    std::to_string(model.hidden));
  }
  if (tokens < 1 || tokens > model.max_request_tokens) {
    return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                "tokens must be in [1, " + std::to_string(model.max_request_tokens) + "] (got " +
                    std::to_string(tokens) + ")");
  }
  const size_t want = static_cast<size_t>(tokens * hidden) * elem;
  if (req.data.size() != want) {
    return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                "data has " + std::to_string(req.data.size()) + " bytes; shape [" +
                    std::to_string(tokens) + ", " + std::to_string(hidden) + "] in " +
                    moerun::v1::DType_Name(out->dtype) + " needs " + std::to_string(want));
  }
  const auto [bad, found] = FirstNonFinite(req.data, elem);
  if (found) {
    return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                "input is not finite at token " + std::to_string(bad / hidden) + ", column " +
                    std::to_string(bad % hidden) + " (NaN and Inf are rejected)");
  }
  out->tokens = tokens;
  out->deadline_ms = req.deadline_ms;
  out->data = req.data;
  out->timing = req.timing;
  if (req.probe < 0 || req.probe > moerun::v1::PROBE_TRANSPORT) {
    return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                "probe must be PROBE_NONE, PROBE_CLIENT or PROBE_TRANSPORT (got " +
                    std::to_string(req.probe) + ")");
  }
  out->probe = static_cast<moerun::v1::Probe>(req.probe);
  out->traceparent = req.traceparent;
  return true;
}

DType RowTypeOf(moerun::v1::DType dtype) {
  return dtype == moerun::v1::BF16 ? DType::kBF16 : DType::kF32;
}

AnswerLayout LayoutAnswer(moerun::v1::DType dtype, int64_t tokens, int64_t hidden,
                          int timing_ranks) {
  AnswerLayout l;
  l.data_bytes = static_cast<size_t>(tokens * hidden) * (dtype == moerun::v1::BF16 ? 2 : 4);
  // Frame length, the data field's tag (1 byte) and its length (a varint of up to 5 bytes).
  l.data_offset = kFrameHeaderBytes + 1 + 5;
  l.capacity = l.data_offset + l.data_bytes + kMaxTrailer;
  if (timing_ranks >= 0) {
    l.capacity += kMaxTimingFixed + static_cast<size_t>(timing_ranks) * kMaxRankTiming;
  }
  return l;
}

void FinishAnswer(char* buffer, const AnswerLayout& layout, uint64_t id, moerun::v1::DType dtype,
                  int64_t tokens, int64_t hidden, const BatchInfo& info, size_t* offset,
                  size_t* size, const AnswerTiming* timing) {
  auto* base = reinterpret_cast<uint8_t*>(buffer);
  // After the data: the other fields, in field order.
  uint8_t* p = base + layout.data_offset + layout.data_bytes;
  p = PutVarintField(p, 1, id);
  p = PutVarintField(p, 4, static_cast<uint64_t>(dtype));
  const size_t shape_bytes =
      VarintBytes(static_cast<uint64_t>(tokens)) + VarintBytes(static_cast<uint64_t>(hidden));
  p = PutTag(p, 5, kDelimited);
  p = PutVarint(p, shape_bytes);
  p = PutVarint(p, static_cast<uint64_t>(tokens));
  p = PutVarint(p, static_cast<uint64_t>(hidden));
  p = PutVarintField(p, 7, static_cast<uint64_t>(std::max<int64_t>(0, info.queue_us)));
  p = PutVarintField(p, 8, static_cast<uint64_t>(std::max<int64_t>(0, info.compute_us)));
  if (timing != nullptr) {
    // The body at its longest length's room, then its tag and length before it, the body moved
    // up to them.
    uint8_t* body = p + 1 + 5;
    const size_t n = static_cast<size_t>(PutTimingBody(body, *timing) - body);
    p = PutVarint(PutTag(p, 9, kDelimited), n);
    std::memmove(p, body, n);
    p += n;
  }
  // Before the data: the frame length, the data field's tag and length, right-aligned to it.
  uint8_t head[1 + 5];
  uint8_t* h = PutTag(head, 6, kDelimited);
  h = PutVarint(h, layout.data_bytes);
  const size_t head_bytes = static_cast<size_t>(h - head);
  const size_t start = layout.data_offset - head_bytes - kFrameHeaderBytes;
  std::memcpy(base + layout.data_offset - head_bytes, head, head_bytes);
  const size_t body = static_cast<size_t>(p - (base + layout.data_offset)) + head_bytes;
  PutFrameLength(static_cast<uint32_t>(body), base + start);
  *offset = start;
  *size = kFrameHeaderBytes + body;
}

std::string EncodeInferError(uint64_t id, ErrorCode code, const std::string& message) {
  moerun::v1::InferResponse r;
  r.set_id(id);
  r.set_code(code);
  r.set_message(message);
  return EncodeFrame(r).value();  // an error answer is small: it always fits in a frame
}

ErrorCode ErrorCodeOf(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
      return moerun::v1::OK;
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kUnsupported:
      return moerun::v1::INVALID_ARGUMENT;
    case StatusCode::kDeadlineExceeded:
      return moerun::v1::DEADLINE_EXCEEDED;
    case StatusCode::kResourceExhausted:
      return moerun::v1::OVERLOADED;
    case StatusCode::kUnavailable:
      return moerun::v1::UNAVAILABLE;
    default:
      return moerun::v1::INTERNAL;
  }
}

}  // namespace moerun
