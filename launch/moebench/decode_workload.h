// What `moebench decode` sends and expects (launch/moebench/decode_bench.h): the layers, the
// start states of its steps, and with --verify the answer of every layer for every start state,
// computed in process before the run.
// Not thread-safe while it is built; read-only (and safe to share between threads) afterwards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "launch/layer_flags.h"

namespace moerun::bench {

struct DecodeWorkload {
  int64_t sequences = 0;
  int64_t hidden = 0;
  bool bf16 = false;        // the request and answer data: BF16 (else F32)
  std::vector<int> layers;  // ascending
  // P start states of S x hidden values each, as the wire carries them.
  std::vector<std::vector<float>> starts;
  // With --verify, [p][i]: the answer data (S x hidden, wire bytes) of layers[i] on the chain
  // from start state p; empty otherwise.
  std::vector<std::vector<std::string>> expected;

  size_t elem_bytes() const { return bf16 ? 2 : 4; }
};

// The P start states: input p of MakeInput(seed, p, S x hidden), rounded to the wire.
void MakeStarts(int inputs, uint64_t seed, DecodeWorkload* w);

// Fills w->expected: each layer of w->layers loaded in process in turn (`lf` names the model,
// its layer replaced) and run on every start state's chain (the same NextHidden and wire
// rounding as the run), then released. kInvalidArgument when the answers would take more than
// `max_bytes` (fewer --inputs or --sequences then).
Status ComputeExpected(const LayerFlags& lf, size_t max_bytes, DecodeWorkload* w);

}  // namespace moerun::bench
