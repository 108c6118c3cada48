// The kernel variants a test runs over: every ISA this CPU supports, plus (when the CPU has no
// AVX-512) the AVX-512 kernels' own code over emulated intrinsics, so their tiling and lane
// layout are checked on every machine.
#pragma once

#include <string>
#include <vector>

#include "experts/cpu/isa.h"
#include "experts/cpu/kernels.h"

namespace moerun::testing {

struct KernelVariant {
  std::string name;
  const CpuKernels* kernels;
};

inline std::vector<KernelVariant> TestVariants() {
  std::vector<KernelVariant> out;
  for (Isa isa : SupportedIsas()) out.push_back({IsaName(isa), &KernelsFor(isa)});
  if (BestIsa() < Isa::kAvx512) {
    out.push_back({"avx512emulated", &kernels_internal::Avx512KernelsEmulated()});
  }
  return out;
}

inline std::vector<std::string> TestVariantNames() {
  std::vector<std::string> names;
  for (const auto& v : TestVariants()) names.push_back(v.name);
  return names;
}

inline const CpuKernels& VariantKernels(const std::string& name) {
  for (const auto& v : TestVariants()) {
    if (v.name == name) return *v.kernels;
  }
  return KernelsFor(Isa::kScalar);
}

}  // namespace moerun::testing
