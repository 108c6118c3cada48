// The tensors of one decoder layer in a checkpoint, as the expert matrices they hold: plain
// (F32, BF16, F16), FP8 (F8_E4M3 `X.weight` with F32 `X.weight_scale_inv` per 128 x 128 block)
// or MXFP4 (gpt-oss's U8 `X_blocks` [.., out, in/32, 16], two e2m1 codes a byte, low nibble first,
// with U8 e8m0 `X_scales` [.., out, in/32]).
//
// Every tensor is checked before a byte of it is used: present, a dtype that can feed the
// kernels, the shape the config implies; quantized ones also their scales' presence, dtype and
// shape, and every code and scale for the formats' NaN encodings (e4m3 0x7F/0xFF, e8m0 0xFF) and
// scales for finiteness. Errors are kInvalidArgument (exit 2) or kNotFound and name the tensor.
// Readers stay valid while the checkpoint lives. Thread-safe after construction.
#pragma once

#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "experts/cpu/packed_matrix.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/quant_config.h"

namespace moerun {

// One logical matrix W [rows][cols] (out x in) of one expert, however the checkpoint stores it.
struct MatrixSource {
  std::string name;            // the tensor it comes from, for errors
  DType stored = DType::kF32;  // F32, BF16, F16, or kF8E4M3 (FP8) / kF4 (MXFP4)
  RowReader rows;              // float rows (dequantized for the block-scaled types)
  QuantRowReader codes;        // block-scaled types: codes and scales
};

std::string ShapeStr(const std::vector<int64_t>& s);

class TensorSource {
 public:
  TensorSource(const Checkpoint& ck, std::string prefix, QuantSpec quant)
      : ck_(ck), prefix_(std::move(prefix)), quant_(quant) {}

  std::string Name(const std::string& suffix) const { return prefix_ + suffix; }
  bool Has(const std::string& suffix) const { return ck_.Has(Name(suffix)); }

  // The tensor `suffix`, checked for a plain kernel dtype and for `shape`.
  Result<TensorRef> Get(const std::string& suffix, const std::vector<int64_t>& shape) const;
  Result<std::vector<float>> Vector(const std::string& suffix, int64_t n) const;

  // `suffix` (an "X.weight") of shape [rows, cols], or of [experts, rows, cols] of which slice
  // `expert` (experts > 0: Step-3.5-Flash's stacked tensors). Plain or FP8.
  Result<MatrixSource> Matrix(const std::string& suffix, int64_t rows, int64_t cols,
                              int experts = 0, int expert = 0) const;
  // gpt-oss: expert `expert`'s gate (part 0), up (1) or down (2) projection from the stacked
  // mlp.experts.{gate_up_proj, down_proj} ([E, in, out], gate/up interleaved on the last axis)
  // or their MXFP4 _blocks/_scales ([E, out, ...]).
  Result<MatrixSource> GptOss(int part, int experts, int expert, int64_t hidden,
                              int64_t inter) const;

 private:
  Result<TensorRef> Tensor(const std::string& name) const;

  const Checkpoint& ck_;
  std::string prefix_;
  QuantSpec quant_;
};

}  // namespace moerun
