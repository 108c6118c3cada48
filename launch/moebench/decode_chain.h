// The pure parts of `moebench decode` (launch/moebench/decode_bench.h): how S sequences split
// into M micro-batches, how the hidden state flows from one MoE layer to the next (the residual
// added, then RMS normalisation, so that values stay in range over 58 layers), the request data
// as the wire carries it (F32, or BF16 rounded to nearest even), a --layers list, and the
// attention time of a micro-batch. Every function is deterministic (the same bits on every run:
// the in-process chain that --verify checks against and the chain of the run agree bit for bit)
// and works row by row, so a micro-batch's rows flow exactly as they would in the whole batch.
// No state; thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace moerun::bench {

// Sequences [first, first + count) of the S.
struct MicroBatch {
  int64_t first = 0;
  int64_t count = 0;
};

// S sequences in M contiguous micro-batches (1 <= M <= S) whose sizes differ by at most one,
// the larger ones first: 10 in 3 -> [0, 4), [4, 7), [7, 10).
std::vector<MicroBatch> SplitSequences(int64_t sequences, int microbatches);

// The next MoE layer's input from this one's input x and output y, row by row (tokens rows of
// `hidden`): r = x + y, out = r / sqrt(mean(r^2) + 1e-6) (RMS normalisation with unit weight;
// the mean summed in double, in index order). `out` may be x.
void NextHidden(const float* x, const float* y, int64_t tokens, int64_t hidden, float* out);

// `n` values as the request or answer data carries them: F32 (4 bytes each, little-endian) or
// BF16 (2 bytes each, rounded to nearest even as the server rounds).
std::string EncodeWire(const float* x, int64_t n, bool bf16);
// The data's values widened to float (`out` holds data.size() / (bf16 ? 2 : 4) values).
void DecodeWire(const std::string& data, bool bf16, float* out);
// x as the wire carries it, in place (BF16: rounded and widened; F32: unchanged).
void RoundToWire(float* x, int64_t n, bool bf16);

// "3,5-7,10" -> {3, 5, 6, 7, 10}, ascending. kInvalidArgument for an empty list or item, a
// number that does not parse or is negative, a range whose end is below its start, a layer
// named twice, or more than 65536 layers.
Result<std::vector<int>> ParseLayerList(const std::string& list);

// The attention time of a micro-batch of `count` of the `sequences`: attention_us (one layer's
// attention for all S sequences) times its share, to the microsecond.
std::chrono::microseconds AttentionTime(double attention_us, int64_t count, int64_t sequences);

}  // namespace moerun::bench
