#include "launch/job_launch.h"

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>

#include "base/exit_code.h"
#include "base/log.h"
#include "launch/local_device.h"
#include "runtime/ep/protocol.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "transport/launcher_env.h"
#include "transport/registry.h"

namespace moerun {

void AddLaunchFlags(CLI::App* cmd, LaunchFlags* f) {
  cmd->add_option("--transport", f->transport,
                  "mpi, ucx, nccl or inproc (default: mpi when started by mpirun/srun, else "
                  "inproc); nccl: rows and results over NCCL, one GPU per rank, under mpirun/srun");
  cmd->add_option("--ranks", f->ranks, "inproc: number of ranks, run as threads")->default_val(1);
  cmd->add_option("--routers", f->routers, "Router ranks (the first R ranks)")->default_val(1);
  cmd->add_option("--placement", f->placement,
                  "Expert placement: linear, round_robin or a placement JSON file")
      ->default_val("linear");
  cmd->add_option("--microbatch-tokens", f->microbatch_tokens,
                  "Tokens per microbatch (0: the whole batch)")
      ->default_val(0);
  cmd->add_option("--deadline-ms", f->deadline_ms,
                  "How long a rank may take to answer before the run fails")
      ->default_val(30000);
}

namespace {

// --transport nccl, before anything starts: a build with NCCL, a GPU, ranks from an MPI launcher
// and no more local ranks than visible GPUs. Each failure is one line (InvalidArgument, exit 2).
Status CheckNcclLaunch() {
  if (Result<const TransportBackend*> nccl = RequireTransport("nccl"); !nccl.ok()) {
    return Status::InvalidArgument("--transport nccl: " + nccl.status().message());
  }
  const CudaProbe probe = ProbeCuda();
  if (probe.devices.empty()) {
    return Status::InvalidArgument(
        "--transport nccl needs one GPU per rank, and this machine has no usable GPU: " +
        (probe.built ? probe.error : std::string("this build has no CUDA backend")));
  }
  if (!LaunchedByMpiLauncher()) {
    return Status::InvalidArgument(
        "--transport nccl needs ranks started by mpirun or srun, one GPU per rank (the NCCL "
        "communicators are set up over MPI)");
  }
  return CheckOneGpuPerRank(
      ChooseLocalDevice(ProcessEnvironment(), static_cast<int>(probe.devices.size())));
}

}  // namespace

Result<std::string> DefaultTransport() {
  if (!LaunchedByMpiLauncher()) return std::string("inproc");
  if (const char* e = std::getenv("MOERUN_TRANSPORT"); e != nullptr && *e != '\0') {
    const std::string t = e;
    if (t != "mpi" && t != "ucx" && t != "nccl") {
      return Status::InvalidArgument("MOERUN_TRANSPORT must be mpi, ucx or nccl, not '" + t + "'");
    }
    return t;
  }
  return std::string(RequireTransport("ucx").ok() ? "ucx" : "mpi");
}

Status ValidateLaunchFlags(const LaunchFlags& flags) {
  const std::string& t = flags.transport;
  if (!t.empty() && t != "mpi" && t != "ucx" && t != "nccl" && t != "inproc") {
    return Status::InvalidArgument("--transport must be mpi, ucx, nccl or inproc, not '" + t + "'");
  }
  if (t == "nccl") MOERUN_RETURN_IF_ERROR(CheckNcclLaunch());
  if (t == "mpi" || t == "ucx") {
    if (Result<const TransportBackend*> b = RequireTransport(t); !b.ok()) {
      return Status::InvalidArgument("--transport " + t + ": " + b.status().message());
    }
  }
  if (flags.routers < 1) return Status::InvalidArgument("--routers must be at least 1");
  const bool inproc = t == "inproc" || (t.empty() && !LaunchedByMpiLauncher());
  if (inproc && (flags.ranks < 1 || flags.ranks > 256)) {
    return Status::InvalidArgument("--ranks must be in 1..256");
  }
  if (flags.microbatch_tokens < 0) {
    return Status::InvalidArgument("--microbatch-tokens must not be negative");
  }
  if (flags.deadline_ms <= 0 || flags.deadline_ms > 86400000) {
    return Status::InvalidArgument("--deadline-ms must be in 1..86400000");
  }
  const std::string& p = flags.placement;
  std::error_code ec;
  if (p != "linear" && p != "round_robin" && !std::filesystem::is_regular_file(p, ec)) {
    return Status::InvalidArgument(
        "--placement must be linear, round_robin or a placement "
        "JSON file; '" +
        p + "' is none of them (no such file)");
  }
  return Status::Ok();
}

Result<std::unique_ptr<JobLaunch>> JobLaunch::Create(const LaunchFlags& flags) {
  std::unique_ptr<JobLaunch> j(new JobLaunch());
  j->flags_ = flags;
  if (flags.transport.empty()) {
    MOERUN_ASSIGN_OR_RETURN(j->transport_, DefaultTransport());
  } else {
    j->transport_ = flags.transport;
  }
  LaunchFlags resolved = flags;  // the default checked as a flag would be
  resolved.transport = j->transport_;
  MOERUN_RETURN_IF_ERROR(ValidateLaunchFlags(resolved));
  if (j->transport_ == "mpi" || j->transport_ == "ucx" || j->transport_ == "nccl") {
    if (j->transport_ == "ucx" && !LaunchedByMpiLauncher()) {
      return Status::InvalidArgument(
          "--transport ucx needs ranks started by mpirun or srun (its endpoints are exchanged "
          "over MPI at start-up)");
    }
    MOERUN_ASSIGN_OR_RETURN(j->mpi_, CreateTransport("mpi"));
    if (j->transport_ == "ucx") {
      TransportRequest ucx;
      ucx.bootstrap = std::move(j->mpi_);
      MOERUN_ASSIGN_OR_RETURN(j->mpi_, CreateTransport("ucx", std::move(ucx)));
    }
    if (j->transport_ == "nccl") {
      // ValidateLaunchFlags checked the GPUs; the rows and results go over NCCL, the rest over
      // MPI (transport/nccl/nccl_transport.h).
      const LocalDeviceChoice gpu =
          ChooseLocalDevice(ProcessEnvironment(), static_cast<int>(ProbeCuda().devices.size()));
      MOERUN_RETURN_IF_ERROR(CheckOneGpuPerRank(gpu));
      TransportRequest nccl;
      nccl.bootstrap = std::move(j->mpi_);
      nccl.device = gpu.device;
      nccl.bulk_tags = {kTagRows, kTagResult};
      nccl.deadline = DeadlineIn(std::chrono::seconds(flags.startup_timeout_s));
      spdlog::debug("nccl: {}", gpu.Describe());
      MOERUN_ASSIGN_OR_RETURN(j->mpi_, CreateTransport("nccl", std::move(nccl)));
    }
    j->rank_ = j->mpi_->rank();
    j->size_ = j->mpi_->size();
    InitLogging(
        j->rank_, j->rank_ < flags.routers ? "router" : "expert",
        std::string(spdlog::level::to_string_view(spdlog::default_logger()->level()).data(),
                    spdlog::level::to_string_view(spdlog::default_logger()->level()).size()));
  } else {  // inproc: ValidateLaunchFlags checked the transport's name and --ranks
    j->size_ = flags.ranks;
    if (j->size_ > 1) j->fabric_ = InprocFabric::Create(j->size_);
  }
  if (j->size_ > 1 && flags.routers >= j->size_) {
    return Status::InvalidArgument(std::to_string(j->size_) + " ranks with " +
                                   std::to_string(flags.routers) +
                                   " routers leave no rank to host experts");
  }
  return j;
}

JobLaunch::~JobLaunch() = default;

void FillJobOptions(const LaunchFlags& flags, JobOptions* o) {
  o->routers = flags.routers;
  o->placement = flags.placement;
  o->ep.microbatch_tokens = flags.microbatch_tokens;
  o->ep.deadline = std::chrono::milliseconds(flags.deadline_ms);
  o->startup_timeout = std::chrono::milliseconds(flags.startup_timeout_s * 1000);
}

void JobLaunch::Fill(JobOptions* o) const { FillJobOptions(flags_, o); }

Status JobLaunch::Run(const JobOptions& options, const RouterWork& work,
                      const ExpertSetup& expert_setup) {
  return Run([&](Transport* t) { return RunRank(t, options, work, expert_setup); });
}

Status JobLaunch::Run(const RankMain& rank_main) {
  if (mpi_) return rank_main(mpi_.get());
  // inproc: rank 0 here, the others on threads; each gets its own endpoint and log tag.
  std::mutex mu;
  Status first;
  auto record = [&](const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (first.ok() && !s.ok()) first = s;
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < size_; ++r) {
    threads.emplace_back([&, r] {
      SetThreadLogTag(r, r < flags_.routers ? "router" : "expert");
      auto endpoint = fabric_->Endpoint(r);
      const Status s = rank_main(endpoint.get());
      if (!s.ok()) {
        spdlog::error("{}", s.ToString());
        record(s);
        // The others may wait for it (until the startup timeout, when it cannot load): the job
        // ends now with this rank's exit code, as under mpirun.
        Abort(ExitCodeOf(s));
      }
    });
  }
  SetThreadLogTag(0, "router");
  auto endpoint = fabric_->Endpoint(0);
  const Status s0 = rank_main(endpoint.get());
  if (!s0.ok()) {
    // Ranks still waiting on this one would wait forever: end the job as mpirun would.
    spdlog::error("{}", s0.ToString());
    Abort(s0.code() == StatusCode::kInvalidArgument ? 2 : 1);
  }
  for (auto& t : threads) t.join();
  SetThreadLogTag(0, "");
  return first;
}

void JobLaunch::Abort(int exit_code) {
  spdlog::default_logger()->flush();
  if (mpi_) mpi_->Abort(exit_code);
  std::fflush(stdout);
  std::_Exit(exit_code);
}

}  // namespace moerun
