// Turning serving frames into work and answers, without copying the hidden states:
//   - ParseInferRequest reads an InferRequest body's fields in place (the wire format, as
//     Protobuf's parser reads it: any field order, unknown fields skipped, packed or unpacked
//     shape) and checks them against what the server serves (layer, hidden size, dtype, byte
//     count, token limit, finite values) before any of it reaches the runtime; `data` is left
//     where it is, in the body, for the batcher to decode once into its batch;
//   - an OK answer is written in place: the batcher writes the layer's output straight into the
//     answer buffer at AnswerLayout::data_offset, and FinishAnswer writes the frame header and
//     the other fields around it (the data field first, then the rest: Protobuf parsers accept
//     fields in any order).
//
// NaN and Inf inputs are rejected (INVALID_ARGUMENT naming the first bad token and column): the
// gate would turn them into an arbitrary expert choice, and the same rule holds in
// `moerun forward`. Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "moerun/v1/serving.pb.h"
#include "runtime/serving/batcher.h"

namespace moerun {

struct ServedModel {
  std::vector<int> layers;  // MoE layers served; the first is the default
  int64_t hidden = 0;
  int64_t max_request_tokens = 65536;
  // The job's expert ranks (first_expert_rank onwards): the per-rank parts of a request's time
  // (InferResponse.timing, and the /metrics histograms by rank).
  int first_expert_rank = 0;
  int expert_ranks = 0;
};

struct ParsedRequest {
  uint64_t id = 0;
  int layer = 0;
  moerun::v1::DType dtype = moerun::v1::F32;
  int64_t tokens = 0;
  uint32_t deadline_ms = 0;
  std::string_view data;  // tokens x hidden finite values of dtype, inside the parsed body
  std::string_view key;   // the serving key sent (InferRequest.key), inside the parsed body
  bool timing = false;    // InferRequest.timing: the answer carries its Timing
  moerun::v1::Probe probe = moerun::v1::PROBE_NONE;
  // InferRequest.traceparent as sent (W3C Trace Context; checked by the tracer, not here: a bad
  // one is ignored and counted, never a refusal), inside the parsed body.
  std::string_view traceparent;
};

// Where a request's time went on the server (InferResponse.timing).
struct AnswerTiming {
  int64_t queue_us = 0, reply_us = 0, server_us = 0, batch_tokens = 0;
  BatchTiming batch;  // gate, dispatch, wait, combine, shared expert, and by expert rank
};

struct RequestError {
  uint64_t id = 0;  // 0 when the body could not be parsed
  moerun::v1::ErrorCode code = moerun::v1::INTERNAL;
  std::string message;
};

// Parses and checks one InferRequest body. On failure fills *error and returns false.
// `required_key` non-empty: the request's key must equal it (constant time in the content), else
// UNAUTHENTICATED with the request's id, checked first, so that a client without the key learns
// nothing of the model (layers, hidden size) from the other refusals.
bool ParseInferRequest(std::string_view body, const ServedModel& model, ParsedRequest* out,
                       RequestError* error, std::string_view required_key = {});

// The wire dtype as the batcher's row type (F32 or BF16; the request was checked).
DType RowTypeOf(moerun::v1::DType dtype);

// Where an OK answer's parts go in its buffer.
struct AnswerLayout {
  size_t data_offset = 0;  // the output values start here
  size_t data_bytes = 0;
  size_t capacity = 0;  // bytes the buffer needs
};
// `timing_ranks` >= 0: room for a Timing that lists up to that many expert ranks.
AnswerLayout LayoutAnswer(moerun::v1::DType dtype, int64_t tokens, int64_t hidden,
                          int timing_ranks = -1);
// Writes the frame header before the data and the other fields after it; the frame is then
// buffer[*offset, *offset + *size). `timing` (null: none) needs the layout's room for its ranks.
void FinishAnswer(char* buffer, const AnswerLayout& layout, uint64_t id, moerun::v1::DType dtype,
                  int64_t tokens, int64_t hidden, const BatchInfo& info, size_t* offset,
                  size_t* size, const AnswerTiming* timing = nullptr);

// Whole frames (length prefix included).
std::string EncodeInferError(uint64_t id, moerun::v1::ErrorCode code, const std::string& message);

// The wire error code for a runtime status.
moerun::v1::ErrorCode ErrorCodeOf(const Status& s);

}  // namespace moerun
