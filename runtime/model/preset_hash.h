// The random source of preset weights, shared by the host (runtime/model/preset.cc) and the CUDA
// backend, which generates a preset's experts on the device: element (row, col) of a preset
// tensor is Unit(Mix(RowSeed(...) + (col + 1) * kPresetStep)) * sqrt(3 / fan_in), rounded to the
// weight type. Pure functions.
#pragma once

#include <cstdint>

#include "base/host_device.h"

namespace moerun::preset_hash {

constexpr uint64_t kStep = 0x9e3779b97f4a7c15ull;

MOERUN_HD inline uint64_t Mix(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

MOERUN_HD inline uint64_t RowSeed(uint64_t seed, int layer, int tensor, int expert, int64_t row) {
  uint64_t h = Mix(seed + kStep);
  h = Mix(h ^ (static_cast<uint64_t>(layer) << 32 | static_cast<uint32_t>(tensor)));
  h = Mix(h ^ static_cast<uint64_t>(static_cast<int64_t>(expert) + 1));
  return Mix(h ^ static_cast<uint64_t>(row));
}

// Uniform in [-1, 1) from 24 random bits: exact in float.
MOERUN_HD inline float Unit(uint64_t bits) {
  return static_cast<float>(static_cast<int64_t>(bits >> 40) - (1 << 23)) * (1.0f / (1 << 23));
}

// The unrounded value of column `col` of a row whose seed is `row_seed`.
MOERUN_HD inline float Element(uint64_t row_seed, int64_t col, float scale) {
  return Unit(Mix(row_seed + static_cast<uint64_t>(col + 1) * kStep)) * scale;
}

}  // namespace moerun::preset_hash
