#include "runtime/model/quant_config.h"

#include <nlohmann/json.hpp>

namespace moerun {

const char* QuantMethodName(QuantMethod m) {
  switch (m) {
    case QuantMethod::kNone:
      return "none";
    case QuantMethod::kFp8:
      return "fp8";
    case QuantMethod::kMxfp4:
      return "mxfp4";
  }
  return "?";
}

Result<QuantSpec> ParseQuantConfig(const std::string& json_text, const std::string& source) {
  using json = nlohmann::json;
  const json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return Status::Corrupt(source + ": not valid JSON");
  QuantSpec q;
  if (!doc.contains("quantization_config") || doc.at("quantization_config").is_null()) return q;
  const json& c = doc.at("quantization_config");
  const std::string key = source + ": quantization_config";
  if (!c.is_object()) return Status::InvalidArgument(key + " must be an object");
  if (!c.contains("quant_method") || !c.at("quant_method").is_string()) {
    return Status::InvalidArgument(key + " has no \"quant_method\" string");
  }
  const std::string method = c.at("quant_method").get<std::string>();
  if (method == "mxfp4") {
    q.method = QuantMethod::kMxfp4;
    return q;
  }
  if (method != "fp8") {
    return Status::InvalidArgument(key + ".quant_method \"" + method +
                                   "\" is not supported (fp8 with 128x128 blocks, mxfp4)");
  }
  q.method = QuantMethod::kFp8;
  if (c.contains("fmt") && !c.at("fmt").is_null()) {
    if (!c.at("fmt").is_string() || c.at("fmt").get<std::string>() != "e4m3") {
      return Status::InvalidArgument(key + ".fmt " + c.at("fmt").dump() +
                                     " is not supported (FP8 weights must be e4m3)");
    }
  }
  if (!c.contains("weight_block_size") || c.at("weight_block_size").is_null()) {
    return Status::InvalidArgument(
        key +
        " has no weight_block_size: only block-scaled FP8 "
        "(weight_block_size [128, 128], with weight_scale_inv) is supported");
  }
  const json& b = c.at("weight_block_size");
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer()) {
    return Status::InvalidArgument(key + ".weight_block_size must be two integers, not " +
                                   b.dump());
  }
  q.block_n = b[0].get<int>();
  q.block_k = b[1].get<int>();
  if (q.block_n != 128 || q.block_k != 128) {
    return Status::InvalidArgument(key + ".weight_block_size " + b.dump() +
                                   " is not supported (the kernels take [128, 128] blocks, as "
                                   "DeepSeek-V3 and Qwen3 publish)");
  }
  return q;
}

}  // namespace moerun
