#include "launch/moebench/decode_chain.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/dtype.h"

namespace moerun::bench {

std::vector<MicroBatch> SplitSequences(int64_t sequences, int microbatches) {
  std::vector<MicroBatch> out;
  if (sequences < 1 || microbatches < 1 || microbatches > sequences) return out;
  const int64_t m = microbatches;
  const int64_t base = sequences / m, extra = sequences % m;
  int64_t first = 0;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t count = base + (i < extra ? 1 : 0);
    out.push_back({first, count});
    first += count;
  }
  return out;
}

void NextHidden(const float* x, const float* y, int64_t tokens, int64_t hidden, float* out) {
  constexpr double kEps = 1e-6;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xr = x + t * hidden;
    const float* yr = y + t * hidden;
    float* o = out + t * hidden;
    double sum = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      const float r = xr[i] + yr[i];
      o[i] = r;
      sum += static_cast<double>(r) * static_cast<double>(r);
    }
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(hidden) + kEps);
    for (int64_t i = 0; i < hidden; ++i) {
      o[i] = static_cast<float>(static_cast<double>(o[i]) * inv);
    }
  }
}

std::string EncodeWire(const float* x, int64_t n, bool bf16) {
  const size_t count = n > 0 ? static_cast<size_t>(n) : 0;
  std::string data;
  if (!bf16) {
    data.resize(count * 4);
    if (count > 0) std::memcpy(data.data(), x, count * 4);
    return data;
  }
  data.resize(count * 2);
  for (size_t i = 0; i < count; ++i) {
    const uint16_t v = F32ToBf16(x[i]);
    std::memcpy(data.data() + 2 * i, &v, 2);
  }
  return data;
}

void DecodeWire(const std::string& data, bool bf16, float* out) {
  if (!bf16) {
    std::memcpy(out, data.data(), data.size() / 4 * 4);
    return;
  }
  for (size_t i = 0; i < data.size() / 2; ++i) {
    uint16_t v;
    std::memcpy(&v, data.data() + 2 * i, 2);
    out[i] = Bf16ToF32(v);
  }
}

void RoundToWire(float* x, int64_t n, bool bf16) {
  if (!bf16) return;
  for (int64_t i = 0; i < n; ++i) x[i] = Bf16ToF32(F32ToBf16(x[i]));
}

Result<std::vector<int>> ParseLayerList(const std::string& list) {
  constexpr int64_t kMaxLayers = 65536;
  const auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("--layers '" + list + "': " + why +
                                   " (a list of layers and ranges: 3,5-7)");
  };
  const auto number = [](const std::string& s, int* v) {
    if (s.empty() || s.size() > 9 ||
        !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return false;
    }
    *v = std::stoi(s);
    return true;
  };
  std::vector<int> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string item = list.substr(start, comma - start);
    if (item.empty()) return bad("an empty item");
    const size_t dash = item.find('-');
    int lo = 0, hi = 0;
    if (dash == std::string::npos) {
      if (!number(item, &lo)) return bad("'" + item + "' is not a layer number");
      hi = lo;
    } else if (!number(item.substr(0, dash), &lo) || !number(item.substr(dash + 1), &hi)) {
      return bad("'" + item + "' is not a range of layer numbers");
    } else if (hi < lo) {
      return bad("the range '" + item + "' ends below its start");
    }
    if (static_cast<int64_t>(out.size()) + hi - lo >= kMaxLayers) {
      return bad("more than " + std::to_string(kMaxLayers) + " layers");
    }
    for (int l = lo; l <= hi; ++l) out.push_back(l);
    start = comma + 1;
  }
  std::sort(out.begin(), out.end());
  const auto twice = std::adjacent_find(out.begin(), out.end());
  if (twice != out.end()) return bad("layer " + std::to_string(*twice) + " is named twice");
  return out;
}

std::chrono::microseconds AttentionTime(double attention_us, int64_t count, int64_t sequences) {
  if (!(attention_us > 0) || sequences < 1) return std::chrono::microseconds(0);
  const double us = attention_us * static_cast<double>(count) / static_cast<double>(sequences);
  return std::chrono::microseconds(static_cast<int64_t>(std::llround(us)));
}

}  // namespace moerun::bench
