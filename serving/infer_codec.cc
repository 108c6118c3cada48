#include "serving/infer_codec.h"

#include <cmath>
#include <cstring>

#include "base/dtype.h"
#include "serving/frame.h"

namespace moerun {

using moerun::v1::ErrorCode;

namespace {

bool Fail(RequestError* e, uint64_t id, ErrorCode code, std::string message) {
  e->id = id;
  e->code = code;
  e->message = std::move(message);
  return false;
}

}  // namespace

bool ParseInferRequest(std::string_view body, const ServedModel& model, ParsedRequest* out,
                       RequestError* error) {
  moerun::v1::InferRequest req;
  if (!req.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return Fail(error, 0, moerun::v1::MALFORMED_FRAME,
                "the frame is not a valid moerun.v1.InferRequest (" + std::to_string(body.size()) +
                    " bytes)");
  }
  const uint64_t id = req.id();
  out->id = id;
  if (req.has_layer()) {
    bool served = false;
    for (int l : model.layers) served = served || l == req.layer();
    if (!served) {
      std::string list;
      for (int l : model.layers) list += (list.empty() ? "" : ", ") + std::to_string(l);
      return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                  "layer " + std::to_string(req.layer()) + " is not served (served: " + list + ")");
    }
    out->layer = req.layer();
  } else {
    if (model.layers.empty()) return Fail(error, id, moerun::v1::INTERNAL, "no layer is served");
    out->layer = model.layers.front();
  }
  size_t elem = 0;
  switch (req.dtype()) {
    case moerun::v1::F32:
      elem = 4;
      break;
    case moerun::v1::BF16:
      elem = 2;
      break;
    default:
      return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                  "dtype must be F32 or BF16 (got " + std::to_string(req.dtype()) + ")");
  }
  out->dtype = req.dtype();
  if (req.shape_size() != 2) {
    return Fail(
        error, id, moerun::v1::INVALID_ARGUMENT,
        "shape must be [tokens, hidden] (got " + std::to_string(req.shape_size()) + " dimensions)");
  }
  const int64_t tokens = req.shape(0), hidden = req.shape(1);
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
  if (req.data().size() != want) {
    return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                "data has " + std::to_string(req.data().size()) + " bytes; shape [" +
                    std::to_string(tokens) + ", " + std::to_string(hidden) + "] in " +
                    moerun::v1::DType_Name(req.dtype()) + " needs " + std::to_string(want));
  }
  out->tokens = tokens;
  out->deadline_ms = req.deadline_ms();
  const size_t n = static_cast<size_t>(tokens * hidden);
  out->x.resize(n);
  const char* src = req.data().data();
  if (elem == 4) {
    std::memcpy(out->x.data(), src, n * 4);
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, src + 2 * i, 2);
      out->x[i] = Bf16ToF32(v);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(out->x[i])) {
      return Fail(error, id, moerun::v1::INVALID_ARGUMENT,
                  "input is not finite at token " + std::to_string(i / hidden) + ", column " +
                      std::to_string(i % hidden) + " (NaN and Inf are rejected)");
    }
  }
  return true;
}

std::string EncodeInferError(uint64_t id, ErrorCode code, const std::string& message) {
  moerun::v1::InferResponse r;
  r.set_id(id);
  r.set_code(code);
  r.set_message(message);
  return EncodeFrame(r).value();  // an error answer is small: it always fits in a frame
}

std::string EncodeInferAnswer(uint64_t id, moerun::v1::DType dtype, int64_t tokens, int64_t hidden,
                              const float* out, const BatchInfo& info) {
  moerun::v1::InferResponse r;
  r.set_id(id);
  r.set_code(moerun::v1::OK);
  r.set_dtype(dtype);
  r.add_shape(tokens);
  r.add_shape(hidden);
  r.set_queue_us(static_cast<uint64_t>(std::max<int64_t>(0, info.queue_us)));
  r.set_compute_us(static_cast<uint64_t>(std::max<int64_t>(0, info.compute_us)));
  const size_t n = static_cast<size_t>(tokens * hidden);
  std::string* data = r.mutable_data();
  if (dtype == moerun::v1::BF16) {
    data->resize(2 * n);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t v = F32ToBf16(out[i]);
      std::memcpy(data->data() + 2 * i, &v, 2);
    }
  } else {
    data->assign(reinterpret_cast<const char*>(out), 4 * n);
  }
  Result<std::string> frame = EncodeFrame(r);
  if (!frame.ok()) return EncodeInferError(id, moerun::v1::INTERNAL, frame.status().message());
  return std::move(*frame);
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
