// CheckKernelImages (experts/cuda/kernel_image.h): the start-up refusal of a binary that holds no
// code, or code for too old an architecture, for a kernel of the CUDA layer. Pure: no GPU needed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "experts/cuda/kernel_image.h"

namespace moerun::cuda_kernels {
namespace {

KernelImage Image(const std::string& name, int min_arch, int ptx, int binary) {
  KernelImage im;
  im.name = name;
  im.min_arch = min_arch;
  im.ptx_version = ptx;
  im.binary_version = binary;
  return im;
}

// The default build ("80-real;90") on an H200: sm_90 SASS from compute_90 for every kernel.
std::vector<KernelImage> GoodOnSm90() {
  return {Image("ExactGemm1<f32>", 0, 90, 90), Image("MmaGemm1<bf16,none>", 80, 90, 90),
          Image("MmaGemm2<bf16,none>", 80, 90, 90), Image("GatherKernel<bf16>", 0, 90, 90)};
}

void ExpectHas(const std::string& message, const std::string& part) {
  EXPECT_NE(message.find(part), std::string::npos) << "missing \"" << part << "\" in: " << message;
}

TEST(KernelImage, AllGoodIsOk) {
  EXPECT_TRUE(CheckKernelImages(GoodOnSm90(), 90, "NVIDIA H200", 0).ok());
  // sm_80 SASS on an A100.
  std::vector<KernelImage> a100 = {Image("ExactGemm1<f32>", 0, 80, 80),
                                   Image("MmaGemm1<bf16,none>", 80, 80, 80)};
  EXPECT_TRUE(CheckKernelImages(a100, 80, "NVIDIA A100", 0).ok());
  EXPECT_TRUE(CheckKernelImages({}, 90, "NVIDIA H200", 0).ok());
}

TEST(KernelImage, Compute75CodeOfAnSm80KernelIsRefused) {
  std::vector<KernelImage> images = GoodOnSm90();
  images[1] = Image("MmaGemm1<bf16,none>", 80, 75, 75);  // the CUDA 13 default: a trap body
  const Status st = CheckKernelImages(images, 90, "NVIDIA H200", 0);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  const std::string& m = st.message();
  ExpectHas(m, "compute_75 code for MmaGemm1<bf16,none>");
  ExpectHas(m, "needs sm_80 or newer");
  ExpectHas(m, "device 0 \"NVIDIA H200\" is sm_90");
  ExpectHas(m, "-DCMAKE_CUDA_ARCHITECTURES=\"80-real;90\" (or 90 for this device)");
  EXPECT_EQ(m.find("other kernel"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << "one line: " << m;
}

TEST(KernelImage, MissingImageIsRefused) {
  std::vector<KernelImage> images = GoodOnSm90();
  images[0] = Image("ExactGemm1<f32>", 0, 0, 0);
  images[0].error = "cudaErrorNoKernelImageForDevice: no kernel image is available";
  const Status st = CheckKernelImages(images, 90, "NVIDIA H200", 1);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  ExpectHas(st.message(), "no kernel image for this device");
  ExpectHas(st.message(), "ExactGemm1<f32>");
  ExpectHas(st.message(), "device 1 \"NVIDIA H200\" (sm_90) can run");
  ExpectHas(st.message(), "cudaErrorNoKernelImageForDevice");
  ExpectHas(st.message(), "-DCMAKE_CUDA_ARCHITECTURES=");
}

TEST(KernelImage, PtxJitCompiledForANewerDeviceIsAccepted) {
  // compute_90 PTX JIT-compiled on an sm_100 device: the code was written for compute_90.
  std::vector<KernelImage> images = {Image("ExactGemm1<f32>", 0, 90, 100),
                                     Image("MmaGemm1<bf16,none>", 80, 90, 100)};
  EXPECT_TRUE(CheckKernelImages(images, 100, "NVIDIA B200", 0).ok());
}

TEST(KernelImage, SeveralBadKernelsAreCountedInOneLine) {
  std::vector<KernelImage> images = GoodOnSm90();
  for (const char* name : {"MmaGemm1<f16,none>", "MmaGemm2<f16,none>", "MmaGemm1<bf16,fp8>"}) {
    images.push_back(Image(name, 80, 75, 75));
  }
  const Status st = CheckKernelImages(images, 90, "NVIDIA H200", 0);
  ASSERT_FALSE(st.ok());
  ExpectHas(st.message(), "compute_75 code for MmaGemm1<f16,none> (and 2 other kernels)");
  EXPECT_EQ(st.message().find('\n'), std::string::npos) << st.message();
  images.resize(5);  // the four good ones and MmaGemm1<f16,none>, then a second bad one
  images.push_back(Image("MmaGemm2<bf16,fp8>", 80, 75, 75));
  ExpectHas(CheckKernelImages(images, 90, "NVIDIA H200", 0).message(), "(and 1 other kernel)");
}

TEST(KernelImage, KernelsTheDeviceCannotRunAreLeftToTheLayer) {
  // A T4 (sm_75) with a build for 75: the exact kernels run there; the tensor-core ones (compute_75
  // trap bodies) are never launched on it (the layer refuses tensor-core math below sm_80).
  std::vector<KernelImage> images = {Image("ExactGemm1<f32>", 0, 75, 75),
                                     Image("MmaGemm1<bf16,none>", 80, 75, 75)};
  EXPECT_TRUE(CheckKernelImages(images, 75, "Tesla T4", 0).ok());
  // The default build holds no sm_75 code: refused, with the device's own architecture as the fix.
  images[0] = Image("ExactGemm1<f32>", 0, 0, 0);
  images[0].error = "cudaErrorNoKernelImageForDevice: no kernel image is available";
  const Status st = CheckKernelImages(images, 75, "Tesla T4", 0);
  ASSERT_FALSE(st.ok());
  ExpectHas(st.message(), "-DCMAKE_CUDA_ARCHITECTURES=75 and rebuild");
}

}  // namespace
}  // namespace moerun::cuda_kernels
