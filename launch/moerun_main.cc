// moerun: the expert-parallel MoE runtime. Subcommands: forward (one layer over an input), serve
// (the long-running runtime).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "base/log.h"
#include "experts/cpu/isa.h"
#include "launch/cli_options.h"
#include "launch/forward_cmd.h"
#include "launch/serve_cmd.h"
#include "moerun/build_info.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/serving/protobuf_log.h"

namespace {

void PrintVersion() {
  const auto& cpu = moerun::DetectCpu();
  std::printf("moerun %s (%s, %s)\n", MOERUN_VERSION, MOERUN_BUILD_TYPE, MOERUN_CXX_COMPILER);
  std::printf("backends built: cpu cuda=%d nccl=%d ucx=%d mpi=%d\n", MOERUN_HAVE_CUDA,
              MOERUN_HAVE_NCCL, MOERUN_HAVE_UCX, MOERUN_HAVE_MPI);
  std::printf("cpu: %s, kernels %s%s%s\n", cpu.brand.c_str(), moerun::IsaName(moerun::BestIsa()),
              cpu.avx512_bf16 ? ", avx512-bf16" : "", cpu.amx_bf16 ? ", amx-bf16" : "");
  const auto probe = moerun::ProbeCuda();
  if (probe.devices.empty()) {
    std::printf("gpu: none (%s)\n", probe.error.c_str());
  } else {
    for (const auto& d : probe.devices) {
      std::printf("gpu %d: %s (sm_%d%d, %.0f GiB)\n", d.index, d.name.c_str(), d.sm_major,
                  d.sm_minor, static_cast<double>(d.memory_bytes) / (1ull << 30));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    moerun::InitLogging(moerun::RankFromEnvironment(), "main");
    moerun::InstallProtobufLogHandler();  // before any thread parses a peer's bytes
    CLI::App app("moerun: expert-parallel Mixture-of-Experts runtime");
    app.require_subcommand(0, 1);
    bool version = false;
    moerun::LogOptions log;
    app.add_flag("--version", version, "Print the build, CPU and GPU this binary sees");
    moerun::AddLogOptions(app, &log);
    moerun::UseOneLineErrors(app, "moerun");
    auto forward = moerun::AddForwardCommand(app);
    auto serve = moerun::AddServeCommand(app);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return moerun::ExitForParseError(app, e);
    }
    moerun::ApplyLogOptions(log, moerun::RankFromEnvironment(), "main");
    if (version) {
      PrintVersion();
      return 0;
    }
    if (const int rc = forward(); rc >= 0) return rc;
    if (const int rc = serve(); rc >= 0) return rc;
    // No subcommand: one line, as every other bad command line.
    return moerun::ExitForParseError(app, CLI::RequiredError("A subcommand (forward or serve)"));
  } catch (const std::bad_alloc&) {
    spdlog::error("out of memory");
    return 1;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
}
