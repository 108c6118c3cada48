// Which vector instruction set the CPU expert kernels use, detected at run time.
//
// Every variant computes each output element with the same sequence of fp32 operations (one FMA
// chain over k, then identical elementwise math), so all variants give bitwise-identical results;
// they differ only in speed. Detection checks both the CPU (cpuid) and the OS (xgetbv: the OS must
// save the wider registers). MOERUN_ISA=scalar|avx2|avx512 in the environment lowers the choice
// (never raises it above what the machine supports).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moerun {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* IsaName(Isa isa);
std::optional<Isa> ParseIsa(std::string_view name);

struct CpuFeatures {
  bool avx2_fma = false;     // AVX2 + FMA3 + F16C, OS-enabled
  bool avx512 = false;       // AVX-512 F/BW/VL/DQ, OS-enabled
  bool avx512_bf16 = false;  // reported only (the kernels keep fp32 math)
  bool amx_bf16 = false;     // reported only
  std::string brand;         // "Intel(R) Xeon(R) Platinum 8480+" ...
};

const CpuFeatures& DetectCpu();
// The best ISA this machine supports.
Isa BestIsa();
// Every ISA variant this machine can run, scalar first.
std::vector<Isa> SupportedIsas();
// BestIsa(), lowered by MOERUN_ISA if set. Unknown or unsupported values fall back with a warning
// written to `warning` (if non-null).
Isa DefaultIsa(std::string* warning = nullptr);

}  // namespace moerun
