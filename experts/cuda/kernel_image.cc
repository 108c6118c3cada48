// CheckKernelImages (kernel_image.h): plain C++, built with or without CUDA.
#include "experts/cuda/kernel_image.h"

#include <fmt/format.h>

#include <algorithm>

namespace moerun::cuda_kernels {
namespace {

// The default architectures of cmake/Backends.cmake, for the fix the message suggests.
constexpr const char* kDefaultArchs = "\"80-real;90\"";

std::string Others(size_t n) {
  if (n == 0) return "";
  return fmt::format(" (and {} other kernel{})", n, n == 1 ? "" : "s");
}

std::string Device(const std::string& name, int index) {
  return index >= 0 ? fmt::format("device {} \"{}\"", index, name)
                    : fmt::format("device \"{}\"", name);
}

// The configure flag that builds code this device runs: the default set when it covers the
// device (sm_80 SASS, compute_90 PTX for anything newer), with the device's own as the short one.
std::string Fix(int sm) {
  if (sm >= 80) {
    return fmt::format(
        "reconfigure with -DCMAKE_CUDA_ARCHITECTURES={} (or {} for this device) "
        "and rebuild",
        kDefaultArchs, sm);
  }
  return fmt::format("reconfigure with -DCMAKE_CUDA_ARCHITECTURES={} and rebuild", sm);
}

}  // namespace

Status CheckKernelImages(const std::vector<KernelImage>& images, int device_sm,
                         const std::string& device_name, int device_index) {
  std::vector<const KernelImage*> missing, old;
  for (const KernelImage& im : images) {
    if (im.min_arch > device_sm) continue;  // never launched on this device
    if (!im.error.empty()) {
      missing.push_back(&im);
    } else if (im.ptx_version < im.min_arch) {
      old.push_back(&im);
    }
  }
  const size_t bad = missing.size() + old.size();
  if (bad == 0) return Status::Ok();
  const std::string dev = Device(device_name, device_index);
  if (!missing.empty()) {
    return Status::InvalidArgument(fmt::format(
        "CUDA: no kernel image for this device: this build of moerun holds no code for {}{} that "
        "{} (sm_{}) can run ({}): {}",
        missing.front()->name, Others(bad - 1), dev, device_sm, missing.front()->error,
        Fix(device_sm)));
  }
  int need = 0;
  for (const KernelImage* im : old) need = std::max(need, im->min_arch);
  return Status::InvalidArgument(fmt::format(
      "CUDA: this build of moerun holds compute_{} code for {}{}, but that code needs sm_{} or "
      "newer; {} is sm_{}: {}",
      old.front()->ptx_version, old.front()->name, Others(bad - 1), need, dev, device_sm,
      Fix(device_sm)));
}

}  // namespace moerun::cuda_kernels
