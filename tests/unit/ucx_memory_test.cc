#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "moerun/build_info.h"
#include "transport/registry.h"
#if MOERUN_HAVE_UCX
#include "transport/ucx/ucx_transport.h"
#endif

namespace moerun {
namespace {

// Whether a UCX CUDA module (libuct_cuda*, libucm_cuda*) is installed where UCX looks for modules.
[[maybe_unused]] bool UcxCudaModuleInstalled() {
  std::vector<std::filesystem::path> dirs = {"/usr/lib/x86_64-linux-gnu/ucx",
                                             "/usr/lib/aarch64-linux-gnu/ucx", "/usr/lib/ucx",
                                             "/usr/lib64/ucx", "/usr/local/lib/ucx"};
  if (const char* d = std::getenv("UCX_MODULE_DIR")) dirs.emplace_back(d);
  for (const auto& dir : dirs) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("libuct_cuda", 0) == 0 || name.rfind("libucm_cuda", 0) == 0) return true;
    }
  }
  return false;
}

TEST(UcxCudaMemoryTest, ReportsWhetherUcxHandlesCudaMemory) {
#if !MOERUN_HAVE_UCX
  // No ucx transport in this build: the registry says so by name.
  EXPECT_EQ(FindTransport("ucx"), nullptr);
  GTEST_SKIP() << RequireTransport("ucx").status().message();
#else
  const Result<bool> cuda = UcxSupportsCudaMemory();
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  const std::string note = UcxCudaMemoryNote(*cuda);
  std::printf("%s\n", note.c_str());
  RecordProperty("ucx_cuda_memory", *cuda ? "yes" : "no");
  if (!UcxCudaModuleInstalled()) {
    // Debian's UCX: no CUDA module, so no CUDA memory, and the note says device buffers are
    // staged through host memory.
    EXPECT_FALSE(*cuda);
    EXPECT_NE(note.find("staged through pinned host memory"), std::string::npos) << note;
  }
#endif
}

}  // namespace
}  // namespace moerun
