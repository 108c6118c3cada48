#include "runtime/layer/cuda/device_weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "base/quant_formats.h"

namespace moerun::cuda_plan {
namespace {

size_t ElemBytes(WeightFormat f) { return f == WeightFormat::kF32 ? 4 : 2; }

DType SourceType(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32:
      return DType::kF32;
    case WeightFormat::kBF16:
      return DType::kBF16;
    case WeightFormat::kF16:
      return DType::kF16;
    case WeightFormat::kFp8:
      return DType::kF8E4M3;
    case WeightFormat::kMxfp4:
      return DType::kF4;
  }
  return DType::kF32;
}

// Stores v (a value of the source type, widened) as element i of a buffer of plain format f.
void StoreAs(WeightFormat f, uint8_t* base, size_t i, float v) {
  uint16_t h = 0;
  switch (f) {
    case WeightFormat::kF32:
      std::memcpy(base + i * 4, &v, 4);
      return;
    case WeightFormat::kBF16:
      h = F32ToBf16(v);
      break;
    case WeightFormat::kF16:
      h = F32ToF16(v);
      break;
    default:
      return;
  }
  std::memcpy(base + i * 2, &h, 2);
}

// One matrix of the device image: `rows` device rows of `ld` weights; src_row(r) is the packed
// CPU row holding device row r (-1: padding, left zero) and `k` its weights.
struct MatrixSpec {
  int64_t rows = 0, ld = 0, k = 0;
};

template <typename SrcRow>
void FillPlain(const PackedMatrix& m, WeightFormat f, const MatrixSpec& s, SrcRow src_row,
               std::vector<uint8_t>* out) {
  out->assign(static_cast<size_t>(s.rows * s.ld) * ElemBytes(f), 0);
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t n = src_row(r);
    if (n < 0) continue;
    for (int64_t k = 0; k < s.k; ++k) {
      StoreAs(f, out->data(), static_cast<size_t>(r * s.ld + k), m.At(n, k));
    }
  }
}

// Codes and scales of a block-scaled matrix (quant_layout.h).
template <typename SrcRow>
Status FillQuant(const PackedMatrix& m, WQuant q, const MatrixSpec& s, SrcRow src_row,
                 const std::string& what, const char* name, std::vector<uint8_t>* codes,
                 std::vector<uint8_t>* scales) {
  const int64_t row_bytes = CodeRowBytes(q, s.ld);
  const int64_t n_scales = ScaleRows(q, s.rows) * ScaleCols(q, s.ld);
  const int bk = BlockK(q);
  codes->assign(static_cast<size_t>(s.rows * row_bytes), 0);
  scales->assign(static_cast<size_t>(n_scales) * static_cast<size_t>(ScaleBytes(q)), 0);
  std::vector<float> fp8(q == WQuant::kFp8 ? static_cast<size_t>(n_scales) : 0, 0.0f);
  std::vector<bool> fp8_set(fp8.size(), false);
  if (q == WQuant::kMxfp4) std::fill(scales->begin(), scales->end(), uint8_t{127});  // padding: 1
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t n = src_row(r);
    if (n < 0) continue;
    uint8_t* row = codes->data() + r * row_bytes;
    if (q == WQuant::kFp8) {
      for (int64_t k = 0; k < s.k; ++k) row[k] = m.CodeAt(n, k);
    } else {
      for (int64_t k = 0; k < s.k; ++k) {
        row[k / 2] = static_cast<uint8_t>(row[k / 2] | ((m.CodeAt(n, k) & 0xF) << (k % 2 ? 4 : 0)));
      }
    }
    for (int64_t k0 = 0; k0 < s.k; k0 += bk) {
      const float scale = m.ScaleAt(n, k0);
      const auto i = static_cast<size_t>(ScaleIndex(q, r, k0, s.ld));
      if (q == WQuant::kMxfp4) {
        const int e = F32ToE8m0(scale);
        if (e < 0) {
          return Status::Corrupt(fmt::format(
              "CUDA layer: {} {}: MXFP4 scale {} of row {} at input {} is not a power of two", what,
              name, scale, n, k0));
        }
        (*scales)[i] = static_cast<uint8_t>(e);
        continue;
      }
      const float v = scale * 256.0f;  // the CPU kernels' scale_inv x 2^8 (exact)
      if (!fp8_set[i]) {
        fp8[i] = v;
        fp8_set[i] = true;
      } else if (std::memcmp(&fp8[i], &v, 4) != 0) {
        return Status::Unsupported(fmt::format(
            "CUDA layer: {} {}: FP8 scales differ within device rows {}..{} at inputs {}..{} "
            "({} vs {}); the CUDA layer takes one scale per {} rows x {} inputs (DeepSeek-V3's "
            "128 x 128 blocks)",
            what, name, r / kFp8ScaleRows * kFp8ScaleRows, r / kFp8ScaleRows * kFp8ScaleRows + 63,
            k0, k0 + bk - 1, fp8[i] / 256.0f, scale, kFp8ScaleRows, kFp8BlockK));
      }
    }
  }
  if (q == WQuant::kFp8) std::memcpy(scales->data(), fp8.data(), fp8.size() * 4);
  return Status::Ok();
}

}  // namespace

const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32:
      return "f32";
    case WeightFormat::kBF16:
      return "bf16";
    case WeightFormat::kF16:
      return "f16";
    case WeightFormat::kFp8:
      return "fp8";
    case WeightFormat::kMxfp4:
      return "mxfp4";
  }
  return "?";
}

WQuant QuantOf(WeightFormat f) {
  return f == WeightFormat::kFp8     ? WQuant::kFp8
         : f == WeightFormat::kMxfp4 ? WQuant::kMxfp4
                                     : WQuant::kNone;
}

Result<WeightFormat> ChooseWeightFormat(DType source, bool tensor_cores, DType mma) {
  WeightFormat src;
  switch (source) {
    case DType::kF32:
      src = WeightFormat::kF32;
      break;
    case DType::kBF16:
      src = WeightFormat::kBF16;
      break;
    case DType::kF16:
      src = WeightFormat::kF16;
      break;
    case DType::kF8E4M3:
      src = WeightFormat::kFp8;
      break;
    case DType::kF4:
      src = WeightFormat::kMxfp4;
      break;
    default:
      return Status::InvalidArgument(std::string("CUDA layer: unsupported weight type ") +
                                     DTypeName(source));
  }
  if (!tensor_cores) return src;
  if (mma != DType::kBF16 && mma != DType::kF16) {
    return Status::InvalidArgument("tensor-core math takes bf16 or f16");
  }
  const WeightFormat mma_format = mma == DType::kBF16 ? WeightFormat::kBF16 : WeightFormat::kF16;
  switch (src) {
    case WeightFormat::kF32:
      return mma_format;
    case WeightFormat::kFp8:
      return src;
    case WeightFormat::kMxfp4:
      if (mma == DType::kF16) {
        return Status::Unsupported(
            "MXFP4 (F4) weights on f16 tensor cores: their e8m0 scales (2^-127..2^127) do not fit "
            "f16; use bf16 tensor cores or exact math");
      }
      return src;
    default:
      if (src != mma_format) {
        return Status::InvalidArgument(fmt::format(
            "{} weights on {} tensor cores would be rounded twice: use exact math or matching "
            "types",
            DTypeName(source), DTypeName(mma)));
      }
      return src;
  }
}

ExpertBytes DeviceExpertBytes(WeightFormat f, int64_t hidden, int64_t inter) {
  const int64_t ip = PaddedInter(inter), rows13 = 2 * ip;
  ExpertBytes b;
  const WQuant q = QuantOf(f);
  if (q == WQuant::kNone) {
    b.w13 = static_cast<size_t>(rows13 * hidden) * ElemBytes(f);
    b.w2 = static_cast<size_t>(hidden * ip) * ElemBytes(f);
    return b;
  }
  b.w13 = static_cast<size_t>(rows13 * CodeRowBytes(q, hidden));
  b.w2 = static_cast<size_t>(hidden * CodeRowBytes(q, ip));
  b.s13 = static_cast<size_t>(ScaleRows(q, rows13) * ScaleCols(q, hidden) * ScaleBytes(q));
  b.s2 = static_cast<size_t>(ScaleRows(q, hidden) * ScaleCols(q, ip) * ScaleBytes(q));
  return b;
}

double DeviceBytesPerWeight(WeightFormat f, int64_t hidden, int64_t inter) {
  const double weights = 3.0 * static_cast<double>(hidden) * static_cast<double>(inter);
  return weights > 0 ? static_cast<double>(DeviceExpertBytes(f, hidden, inter).total()) / weights
                     : 0.0;
}

Result<ExpertImage> BuildExpertImage(const ExpertWeights& ew, WeightFormat f, bool round_f32,
                                     const std::string& what) {
  const DType want = SourceType(f);
  for (DType t : {ew.w13.dtype(), ew.w2.dtype()}) {
    if (t == want || (round_f32 && t == DType::kF32 && !IsQuantized(f) && f != WeightFormat::kF32))
      continue;
    return Status::Unsupported(fmt::format(
        "CUDA layer: {} holds {} weights, the layer's device format is {} ({}); the device "
        "holds one weight type per layer and converts none silently: convert the checkpoint to "
        "one type",
        what, DTypeName(t), WeightFormatName(f), DTypeName(want)));
  }
  const int64_t h = ew.hidden, inter = ew.inter, ip = PaddedInter(inter);
  const int nr = ew.w13.nr();
  // Device row r of W13 is W_gate or W_up row j; the CPU's W13 alternates gate and up panels.
  auto src13 = [&](int64_t r) -> int64_t {
    const int64_t block = r / (2 * kColBlock), within = r % (2 * kColBlock);
    const bool up = within >= kColBlock;
    const int64_t j = block * kColBlock + (up ? within - kColBlock : within);
    if (j >= inter) return -1;
    const int64_t gate_row = 2 * (j / nr) * nr + j % nr;
    return up ? gate_row + nr : gate_row;
  };
  auto src2 = [](int64_t r) -> int64_t { return r; };
  const MatrixSpec m13{2 * ip, h, h}, m2{h, ip, inter};
  ExpertImage img;
  img.format = f;
  img.hidden = h;
  img.inter = inter;
  const WQuant q = QuantOf(f);
  if (q == WQuant::kNone) {
    FillPlain(ew.w13, f, m13, src13, &img.w13);
    FillPlain(ew.w2, f, m2, src2, &img.w2);
  } else {
    MOERUN_RETURN_IF_ERROR(FillQuant(ew.w13, q, m13, src13, what, "W13", &img.w13, &img.s13));
    MOERUN_RETURN_IF_ERROR(FillQuant(ew.w2, q, m2, src2, what, "W2", &img.w2, &img.s2));
  }
  return img;
}

}  // namespace moerun::cuda_plan
