// Turning serving frames into work and answers: InferRequest bodies are parsed and checked
// against what the server serves (layer, hidden size, dtype, byte count, token limit, finite
// values) before any of it reaches the runtime; answers are encoded as whole frames.
//
// NaN and Inf inputs are rejected (INVALID_ARGUMENT naming the first bad token and column): the
// gate would turn them into an arbitrary expert choice, and the same rule holds in
// `moerun forward`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "moerun/v1/serving.pb.h"
#include "serving/batcher.h"

namespace moerun {

struct ServedModel {
  std::vector<int> layers;  // MoE layers served; the first is the default
  int64_t hidden = 0;
  int64_t max_request_tokens = 65536;
};

struct ParsedRequest {
  uint64_t id = 0;
  int layer = 0;
  moerun::v1::DType dtype = moerun::v1::F32;
  int64_t tokens = 0;
  uint32_t deadline_ms = 0;
  std::vector<float> x;  // tokens x hidden, widened to F32
};

struct RequestError {
  uint64_t id = 0;  // 0 when the body could not be parsed
  moerun::v1::ErrorCode code = moerun::v1::INTERNAL;
  std::string message;
};

// Parses and checks one InferRequest body. On failure fills *error and returns false.
bool ParseInferRequest(std::string_view body, const ServedModel& model, ParsedRequest* out,
                       RequestError* error);

// Whole frames (length prefix included).
std::string EncodeInferError(uint64_t id, moerun::v1::ErrorCode code, const std::string& message);
std::string EncodeInferAnswer(uint64_t id, moerun::v1::DType dtype, int64_t tokens, int64_t hidden,
                              const float* out, const BatchInfo& info);

// The wire error code for a runtime status.
moerun::v1::ErrorCode ErrorCodeOf(const Status& s);

}  // namespace moerun
