// The `quantization_config` of a Hugging Face config.json: which block-scaled format a
// checkpoint's expert weights are published in.
//
//   {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}  DeepSeek-V3/R1,
//                                                                                  Qwen3-FP8
//   {"quant_method": "mxfp4", "modules_to_not_convert": [...]}                    gpt-oss
// No key: the weights are plain (F32, BF16, F16). Anything else (another method, another block
// size, another FP8 format) is refused with the key and the value in the error. Pure function.
#pragma once

#include <string>

#include "base/status.h"

namespace moerun {

enum class QuantMethod { kNone, kFp8, kMxfp4 };

struct QuantSpec {
  QuantMethod method = QuantMethod::kNone;
  int block_n = 128;  // FP8: rows (outputs) and columns (inputs) per scale
  int block_k = 128;
};

const char* QuantMethodName(QuantMethod m);  // "none", "fp8", "mxfp4"

// `json_text` is the whole config.json; `source` names it in errors.
Result<QuantSpec> ParseQuantConfig(const std::string& json_text, const std::string& source);

}  // namespace moerun
