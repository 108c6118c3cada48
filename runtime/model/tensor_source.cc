#include "runtime/model/tensor_source.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "base/quant_formats.h"

namespace moerun {
namespace {

// Element (n, k) of a logical matrix W [rows][cols] is at data[n*rs + k*cs] (elements).
struct MatrixView {
  const uint8_t* data = nullptr;
  DType dtype = DType::kF32;
  int64_t cols = 0, rs = 0, cs = 0;
};

RowReader Reader(const MatrixView& v) {
  return [v](int64_t n, float* out) {
    if (v.cs == 1 && v.dtype == DType::kF32) {
      std::memcpy(out, v.data + n * v.rs * 4, static_cast<size_t>(v.cols) * 4);
      return;
    }
    for (int64_t k = 0; k < v.cols; ++k) out[k] = LoadAsF32(v.data, v.dtype, n * v.rs + k * v.cs);
  };
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string Hex(unsigned v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%02X", v);
  return buf;
}

// A float reader over any block-scaled source: the codes dequantized (rounded once to f32).
RowReader Dequantizing(DType t, int64_t cols, QuantRowReader codes) {
  return [t, cols, codes = std::move(codes)](int64_t n, float* out) {
    std::vector<uint8_t> c(static_cast<size_t>(cols));
    std::vector<float> s(static_cast<size_t>(CeilDiv(cols, BlockK(t))));
    codes(n, c.data(), s.data());
    for (int64_t k = 0; k < cols; ++k) {
      const float v = t == DType::kF8E4M3 ? E4m3ToF32(c[static_cast<size_t>(k)])
                                          : E2m1ToF32(c[static_cast<size_t>(k)]);
      out[k] = v * s[static_cast<size_t>(k / BlockK(t))];
    }
  };
}

}  // namespace

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Result<TensorRef> TensorSource::Tensor(const std::string& name) const {
  if (!ck_.Has(name)) {
    return Status::NotFound("tensor '" + name + "' is missing from the checkpoint " + ck_.path());
  }
  return ck_.Get(name);
}

Result<TensorRef> TensorSource::Get(const std::string& suffix,
                                    const std::vector<int64_t>& shape) const {
  const std::string name = Name(suffix);
  MOERUN_ASSIGN_OR_RETURN(TensorRef t, Tensor(name));
  const DType dt = t.info->dtype;
  if (!IsKernelWeightType(dt)) {
    return Status::InvalidArgument("tensor '" + name + "' has dtype " + DTypeName(dt) +
                                   ": F32, BF16 or F16 is expected here");
  }
  if (t.info->shape != shape) {
    return Status::InvalidArgument("tensor '" + name + "' has shape " + ShapeStr(t.info->shape) +
                                   " but the config implies " + ShapeStr(shape));
  }
  return t;
}

Result<std::vector<float>> TensorSource::Vector(const std::string& suffix, int64_t n) const {
  MOERUN_ASSIGN_OR_RETURN(TensorRef t, Get(suffix, {n}));
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = LoadAsF32(t.data, t.info->dtype, i);
  return v;
}

Result<MatrixSource> TensorSource::Matrix(const std::string& suffix, int64_t rows, int64_t cols,
                                          int experts, int expert) const {
  const std::string name = Name(suffix);
  MOERUN_ASSIGN_OR_RETURN(TensorRef t, Tensor(name));
  const DType dt = t.info->dtype;
  std::vector<int64_t> shape{rows, cols};
  if (experts > 0) shape.insert(shape.begin(), experts);
  if (dt != DType::kF8E4M3 && !IsKernelWeightType(dt)) {
    return Status::InvalidArgument(
        "tensor '" + name + "' has dtype " + DTypeName(dt) +
        (dt == DType::kF8E5M2 ? ": FP8 expert weights must be F8_E4M3 (with weight_scale_inv)"
                              : ": expert weights must be F32, BF16, F16 or F8_E4M3"));
  }
  if (t.info->shape != shape) {
    return Status::InvalidArgument("tensor '" + name + "' has shape " + ShapeStr(t.info->shape) +
                                   " but the config implies " + ShapeStr(shape));
  }
  const int64_t slice = static_cast<int64_t>(expert) * rows * cols;  // elements before ours
  MatrixSource m;
  m.name = name;
  m.stored = dt;
  if (dt != DType::kF8E4M3) {
    const int eb = dt == DType::kF32 ? 4 : 2;
    m.rows = Reader(MatrixView{t.data + slice * eb, dt, cols, cols, 1});
    return m;
  }

  // FP8: codes, and the F32 (or BF16) scale_inv of every 128 x 128 block.
  const std::string sname = name + "_scale_inv";
  if (!ck_.Has(sname)) {
    return Status::InvalidArgument("tensor '" + name + "' is F8_E4M3 but its block scales '" +
                                   sname + "' are missing from the checkpoint " + ck_.path());
  }
  MOERUN_ASSIGN_OR_RETURN(TensorRef s, ck_.Get(sname));
  if (s.info->dtype != DType::kF32 && s.info->dtype != DType::kBF16) {
    return Status::InvalidArgument("tensor '" + sname + "' has dtype " + DTypeName(s.info->dtype) +
                                   ": FP8 block scales must be F32");
  }
  const int64_t rb = CeilDiv(rows, quant_.block_n), cb = CeilDiv(cols, quant_.block_k);
  std::vector<int64_t> sshape{rb, cb};
  if (experts > 0) sshape.insert(sshape.begin(), experts);
  if (s.info->shape != sshape) {
    return Status::InvalidArgument(
        "tensor '" + sname + "' has shape " + ShapeStr(s.info->shape) + " but '" + name +
        "' of shape " + ShapeStr(t.info->shape) + " in " + std::to_string(quant_.block_n) + "x" +
        std::to_string(quant_.block_k) + " blocks (weight_block_size) needs " + ShapeStr(sshape));
  }
  // Every scale of this expert finite and in range, every code a number.
  auto scales = std::make_shared<std::vector<float>>(static_cast<size_t>(rb * cb));
  for (int64_t i = 0; i < rb * cb; ++i) {
    const float v = LoadAsF32(s.data, s.info->dtype, static_cast<int64_t>(expert) * rb * cb + i);
    if (!std::isfinite(v) || std::fabs(v) >= 0x1p100f) {
      return Status::InvalidArgument("tensor '" + sname + "' holds the scale " + std::to_string(v) +
                                     " at block [" + std::to_string(i / cb) + ", " +
                                     std::to_string(i % cb) +
                                     "]: a corrupt FP8 checkpoint (scales must be finite)");
    }
    (*scales)[static_cast<size_t>(i)] = v;
  }
  const uint8_t* codes = t.data + slice;
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (IsE4m3NaN(codes[i])) {
      return Status::InvalidArgument(
          "tensor '" + name + "' holds the e4m3 NaN code " + Hex(codes[i]) + " at [" +
          (experts > 0 ? std::to_string(expert) + ", " : "") + std::to_string(i / cols) + ", " +
          std::to_string(i % cols) + "]: a corrupt FP8 checkpoint");
    }
  }
  const int bn = quant_.block_n;
  m.codes = [codes, scales, cols, cb, bn](int64_t n, uint8_t* out, float* sc) {
    std::memcpy(out, codes + n * cols, static_cast<size_t>(cols));
    for (int64_t b = 0; b < cb; ++b) sc[b] = (*scales)[static_cast<size_t>((n / bn) * cb + b)];
    return true;
  };
  m.rows = Dequantizing(dt, cols, m.codes);
  return m;
}

Result<MatrixSource> TensorSource::GptOss(int part, int experts, int expert, int64_t hidden,
                                          int64_t inter) const {
  const bool down = part == 2;
  const std::string base = down ? "mlp.experts.down_proj" : "mlp.experts.gate_up_proj";
  const int64_t out = down ? hidden : 2 * inter;  // rows of the stacked tensor's W [out][in]
  const int64_t in = down ? inter : hidden;
  MatrixSource m;
  if (Has(base) || !Has(base + "_blocks")) {
    // Plain: [E, in, out], x @ W; gate = even outputs, up = odd outputs.
    MOERUN_ASSIGN_OR_RETURN(TensorRef t, Get(base, {experts, in, out}));
    const DType dt = t.info->dtype;
    const int eb = dt == DType::kF32 ? 4 : 2;
    const uint8_t* data = t.data + static_cast<int64_t>(expert) * in * out * eb;
    m.name = Name(base);
    m.stored = dt;
    if (down) {
      m.rows = Reader(MatrixView{data, dt, in, 1, out});
    } else {
      m.rows = Reader(MatrixView{data + part * eb, dt, in, 2, out});
    }
    return m;
  }
  // MXFP4: blocks [E, out, in/32, 16], scales [E, out, in/32].
  const std::string bname = Name(base + "_blocks"), sname = Name(base + "_scales");
  MOERUN_ASSIGN_OR_RETURN(TensorRef b, Tensor(bname));
  if (!ck_.Has(sname)) {
    return Status::InvalidArgument("tensor '" + bname + "' is MXFP4 but its scales '" + sname +
                                   "' are missing from the checkpoint " + ck_.path());
  }
  MOERUN_ASSIGN_OR_RETURN(TensorRef s, ck_.Get(sname));
  const int64_t groups = CeilDiv(in, kMxGroup);
  const std::vector<int64_t> bshape{experts, out, groups, 16}, sshape{experts, out, groups};
  for (const auto& [ref, name, shape] :
       {std::tuple{&b, &bname, &bshape}, std::tuple{&s, &sname, &sshape}}) {
    if (ref->info->dtype != DType::kU8) {
      return Status::InvalidArgument("tensor '" + *name + "' has dtype " +
                                     DTypeName(ref->info->dtype) + ": MXFP4 " +
                                     (ref == &b ? "blocks" : "scales") + " must be U8");
    }
    if (ref->info->shape != *shape || in % kMxGroup != 0) {
      return Status::InvalidArgument(
          "tensor '" + *name + "' has shape " + ShapeStr(ref->info->shape) +
          " but the config (hidden " + std::to_string(hidden) + ", intermediate " +
          std::to_string(inter) + ", " + std::to_string(experts) + " experts) implies " +
          ShapeStr(*shape) + (in % kMxGroup ? " (and inputs a multiple of 32)" : ""));
    }
  }
  const uint8_t* scales = s.data + static_cast<int64_t>(expert) * out * groups;
  for (int64_t i = 0; i < out * groups; ++i) {
    if (IsE8m0NaN(scales[i])) {
      return Status::InvalidArgument("tensor '" + sname + "' holds the e8m0 NaN code 0xFF at [" +
                                     std::to_string(expert) + ", " + std::to_string(i / groups) +
                                     ", " + std::to_string(i % groups) +
                                     "]: a corrupt MXFP4 checkpoint");
    }
  }
  const uint8_t* blocks = b.data + static_cast<int64_t>(expert) * out * groups * 16;
  // Row n of this part is output row (gate: 2n, up: 2n + 1, down: n) of the stacked tensor.
  const int64_t stride = down ? 1 : 2, first = down ? 0 : part;
  m.name = bname;
  m.stored = DType::kF4;
  m.codes = [blocks, scales, in, groups, stride, first](int64_t n, uint8_t* codes, float* sc) {
    const int64_t row = n * stride + first;
    const uint8_t* src = blocks + row * groups * 16;
    for (int64_t k = 0; k < in; k += 2) {
      codes[k] = src[k / 2] & 0xF;
      codes[k + 1] = src[k / 2] >> 4;
    }
    for (int64_t g = 0; g < groups; ++g) sc[g] = E8m0ToF32(scales[row * groups + g]);
    return true;
  };
  m.rows = Dequantizing(DType::kF4, in, m.codes);
  return m;
}

}  // namespace moerun
