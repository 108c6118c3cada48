// `moebench layer`: times one MoE layer at several token counts and, in the same run, the plain
// per-token reference loop and the OpenBLAS sgemm of the same total shape. Prints JSON to stdout
// (fields say their direction: speedup_vs_X = X's time / ours; fraction_of_X = our rate / X's)
// and a one-line summary per token count to stderr. The layer's output is checked against the
// reference on the tokens the reference ran. With several weight types (--dtype f32,bf16,fp8) it
// builds the same preset layer in each and times them in turn at every token count; each result
// names its weight_dtype, its floor counts the bytes that type holds (FP8/MXFP4: codes and
// scales), and the narrower types get speedup_vs_f32 and speedup_vs_bf16 (that type's time ÷
// ours, same run). The floor's compute rate is the best sgemm rate of the run's token counts
// (sgemm at a small T is bound by reading its own f32 matrices). --device cuda times the CUDA layer
// instead, against its physical floor and torch._grouped_mm (launch/moebench/cuda_layer_bench.h).
#pragma once

#include <string>
#include <vector>

#include "launch/layer_flags.h"

namespace moerun::bench {

struct LayerBenchFlags {
  LayerFlags layer;
  std::vector<int64_t> tokens = {1, 16, 128, 1024};
  std::string device = "cpu";
  double min_seconds = 1.0;  // per measurement
  int reference_tokens = 2;  // tokens the reference loop runs (its time is scaled to T)
  bool sgemm = true;
  bool json = false;
  std::string plot;           // --plot FILE.svg: time per token and x_floor over the token counts
  bool tokens_given = false;  // --tokens was on the command line

  // --device cuda (launch/moebench/cuda_layer_bench.h).
  std::string math = "tensor-core";  // --math tensor-core | exact
  int device_index = -1;             // --device-index (-1: the local rank modulo the GPU count)
  int torch = -1;                    // --torch 1, --no-torch 0, -1: when importable
  std::string torch_script;          // --torch-script (default: found beside the binary)
  std::string torch_python = "python3";
  bool anchors = false;       // --anchors: the three shapes of ANCHORS.md
  double floor_gbps = 4240;   // --floor-gbps: device copy bandwidth, GB/s
  double floor_tflops = 806;  // --floor-tflops: device dense matmul rate, TFLOP/s
  int max_reps = 200;         // repetitions per timing, at most
};

int RunLayerBench(const LayerBenchFlags& f);

// The benchmarks' input: [tokens][hidden] uniform values of unit variance, a function of `seed`.
std::vector<float> RandomInput(int64_t tokens, int64_t hidden, uint64_t seed);

}  // namespace moerun::bench
