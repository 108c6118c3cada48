#include "experts/cpu/isa.h"

#include <cpuid.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace moerun {
namespace {

uint64_t Xgetbv() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures Probe() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return f;
  const bool osxsave = (c & (1u << 27)) != 0;
  const bool avx = (c & (1u << 28)) != 0;
  const bool fma = (c & (1u << 12)) != 0;
  const bool f16c = (c & (1u << 29)) != 0;
  uint64_t xcr0 = osxsave ? Xgetbv() : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  __get_cpuid_count(7, 0, &a7, &b7, &c7, &d7);
  const bool avx2 = (b7 & (1u << 5)) != 0;
  const bool avx512f = (b7 & (1u << 16)) != 0;
  const bool avx512dq = (b7 & (1u << 17)) != 0;
  const bool avx512bw = (b7 & (1u << 30)) != 0;
  const bool avx512vl = (b7 & (1u << 31)) != 0;
  f.avx2_fma = avx && avx2 && fma && f16c && os_ymm;
  f.avx512 = f.avx2_fma && avx512f && avx512dq && avx512bw && avx512vl && os_zmm;
  f.amx_bf16 = (d7 & (1u << 22)) != 0;
  unsigned a71 = 0, b71 = 0, c71 = 0, d71 = 0;
  __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
  f.avx512_bf16 = f.avx512 && (a71 & (1u << 5)) != 0;
  unsigned max_ext = __get_cpuid_max(0x80000000u, nullptr);
  if (max_ext >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      unsigned r[4];
      __get_cpuid(0x80000002u + i, &r[0], &r[1], &r[2], &r[3]);
      std::memcpy(brand + 16 * i, r, 16);
    }
    f.brand = brand;
    while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
    while (!f.brand.empty() && f.brand.front() == ' ') f.brand.erase(f.brand.begin());
  }
#endif
  return f;
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

std::optional<Isa> ParseIsa(std::string_view name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  return std::nullopt;
}

const CpuFeatures& DetectCpu() {
  static const CpuFeatures features = Probe();
  return features;
}

Isa BestIsa() {
  const auto& f = DetectCpu();
  if (f.avx512) return Isa::kAvx512;
  if (f.avx2_fma) return Isa::kAvx2;
  return Isa::kScalar;
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out{Isa::kScalar};
  const Isa best = BestIsa();
  if (best >= Isa::kAvx2) out.push_back(Isa::kAvx2);
  if (best >= Isa::kAvx512) out.push_back(Isa::kAvx512);
  return out;
}

Isa DefaultIsa(std::string* warning) {
  const Isa best = BestIsa();
  const char* env = std::getenv("MOERUN_ISA");
  if (env == nullptr || *env == '\0') return best;
  const auto want = ParseIsa(env);
  if (!want) {
    if (warning)
      *warning =
          std::string("MOERUN_ISA=") + env + " is not scalar|avx2|avx512; using " + IsaName(best);
    return best;
  }
  if (*want > best) {
    if (warning)
      *warning =
          std::string("MOERUN_ISA=") + env + " is not supported here; using " + IsaName(best);
    return best;
  }
  return *want;
}

}  // namespace moerun
