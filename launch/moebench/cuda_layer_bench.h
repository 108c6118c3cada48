// `moebench layer --device cuda`: times the CUDA MoE layer (runtime/layer/cuda/cuda_layer.h) at
// several token counts, on device-side CUDA events, against
//   - its floor (launch/moebench/floor.h): max(bytes of the weights the batch's routing needs ÷
//   copy
//     bandwidth, FLOPs ÷ dense matmul rate), reported as x_floor = ours ÷ floor;
//   - where PyTorch with torch._grouped_mm and CUDA is installed, the "torch grouped" path of
//     ANCHORS.md (bench/torch_grouped.py, started as a child process in the same run), reported
//     as speedup_vs_torch_grouped = torch's time ÷ ours. Without it the report says why
//     ("torch": null plus the reason); the benchmark never fails on the baseline's account.
// --anchors runs ANCHORS.md's three shapes (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 at their
// full expert count, bf16) at 1, 16, 128, 1024 and 8192 tokens.
#pragma once

#include <string>

#include "launch/moebench/layer_bench.h"

namespace moerun::bench {

// The exit code: 0, 2 for bad flags or no usable GPU, 1 for failures.
int RunCudaLayerBench(const LayerBenchFlags& f);

// The torch helper's path: `flag` if given, else <directory of this binary>/../../bench/
// torch_grouped.py (build/bin/moebench in a source tree), else "".
std::string FindTorchScript(const std::string& flag);

}  // namespace moerun::bench
