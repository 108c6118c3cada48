#include "launch/forward_cmd.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "base/exit_code.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "launch/cuda_setup.h"
#include "launch/job_launch.h"
#include "launch/layer_flags.h"
#include "router/placement.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/layer/moe_layer.h"
#include "runtime/model/layer_loader.h"
#include "runtime/model/safetensors.h"
#include "runtime/model/weight_source.h"

namespace moerun {
namespace {

struct ForwardFlags {
  LayerFlags layer;
  LaunchFlags launch;
  std::string input, output, check;
  DeviceFlags dev;
  double tolerance = 1e-5;
  bool plan_memory = false;  // print each rank's device memory plan and exit
  bool json = false;         // --plan-memory as JSON
};

// An F32 matrix tensor [rows, cols] of a safetensors file, checked before any work starts.
struct MatrixInput {
  std::unique_ptr<SafetensorsFile> file;
  TensorRef tensor;
  std::string path, name;
  int64_t rows = 0, cols = 0;
};

Result<MatrixInput> OpenMatrix(const std::string& path, const std::string& name) {
  MatrixInput in;
  in.path = path;
  in.name = name;
  MOERUN_ASSIGN_OR_RETURN(in.file, SafetensorsFile::Open(path));
  MOERUN_ASSIGN_OR_RETURN(in.tensor, in.file->Get(name));
  const TensorInfo& info = *in.tensor.info;
  if (info.dtype != DType::kF32) {
    return Status::InvalidArgument(path + ": tensor '" + name + "' is " + DTypeName(info.dtype) +
                                   "; it must be F32");
  }
  if (info.shape.size() != 2) {
    return Status::InvalidArgument(path + ": tensor '" + name +
                                   "' must be 2-D [tokens, hidden], has " +
                                   std::to_string(info.shape.size()) + " dimensions");
  }
  in.rows = info.shape[0];
  in.cols = info.shape[1];
  return in;
}

// The values, once the hidden size is known; every value must be finite.
Result<std::vector<float>> ReadMatrix(const MatrixInput& in, int64_t hidden) {
  if (in.cols != hidden) {
    return Status::InvalidArgument(in.path + ": tensor '" + in.name + "' has hidden size " +
                                   std::to_string(in.cols) + " but the model's is " +
                                   std::to_string(hidden));
  }
  std::vector<float> v(static_cast<size_t>(in.rows * in.cols));
  if (!v.empty()) std::memcpy(v.data(), in.tensor.data, v.size() * sizeof(float));
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      return Status::InvalidArgument(
          in.path + ": tensor '" + in.name + "' holds a non-finite value (" + std::to_string(v[i]) +
          ") at token " + std::to_string(i / static_cast<size_t>(hidden)));
    }
  }
  return v;
}

// Flags that parse but make no sense are refused before anything is loaded.
Status CheckFlags(const ForwardFlags& f) {
  if (!std::isfinite(f.tolerance) || f.tolerance < 0) {
    return Status::InvalidArgument("--tolerance must be a finite number >= 0");
  }
  MOERUN_RETURN_IF_ERROR(ValidateLayerFlags(f.layer));
  MOERUN_RETURN_IF_ERROR(ValidateDeviceFlags(f.dev));
  namespace fs = std::filesystem;
  const fs::path parent = fs::path(f.output).parent_path();
  std::error_code ec;
  if (!parent.empty() && !fs::is_directory(parent, ec)) {
    return Status::InvalidArgument("--output " + f.output + ": folder " + parent.string() +
                                   " does not exist");
  }
  return Status::Ok();
}

// The input and the expected output, opened and checked before any weights are loaded.
struct ForwardIo {
  MatrixInput input;
  std::optional<MatrixInput> expected;
};

Result<ForwardIo> OpenIo(const ForwardFlags& f) {
  MOERUN_RETURN_IF_ERROR(CheckFlags(f));
  ForwardIo io;
  MOERUN_ASSIGN_OR_RETURN(io.input, OpenMatrix(f.input, "input"));
  if (!f.check.empty()) {
    MOERUN_ASSIGN_OR_RETURN(MatrixInput ref, OpenMatrix(f.check, "output"));
    if (ref.rows != io.input.rows) {
      return Status::InvalidArgument(f.check + ": 'output' has " + std::to_string(ref.rows) +
                                     " rows, the input " + std::to_string(io.input.rows));
    }
    io.expected = std::move(ref);
  }
  return io;
}

// An output that is not finite although the input is (ReadMatrix refuses NaN and Inf): the input
// is so large that the layer's float32 arithmetic overflows. An error naming the first such token
// and the input's largest magnitude there; nothing is written.
Status CheckFiniteOutput(const std::vector<float>& x, const std::vector<float>& out, int64_t hidden,
                         const std::string& output) {
  const auto h = static_cast<size_t>(hidden);
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isfinite(out[i])) continue;
    const size_t token = i / h;
    float max_abs = 0;
    for (size_t j = token * h; j < (token + 1) * h && j < x.size(); ++j) {
      max_abs = std::max(max_abs, std::fabs(x[j]));
    }
    return Status::InvalidArgument(fmt::format(
        "the layer's output is not finite at token {} (its input's |x| reaches {:.2g}): inputs "
        "this large overflow the layer's float32 arithmetic; scale them down ({} not written)",
        token, max_abs, output));
  }
  return Status::Ok();
}

// Writes the output, compares it with --check, prints the one-line result; the exit code. An
// output that is not finite is an error (exit 2), never written.
int Finish(const ForwardFlags& f, const ForwardIo& io, const MoeLayerWeights& w,
           const std::vector<float>& x, const std::vector<float>& out, const std::string& how,
           double ms) {
  const int64_t tokens = io.input.rows;
  const int64_t hidden = w.spec.hidden;
  if (Status s = CheckFiniteOutput(x, out, hidden, f.output); !s.ok()) return FailWith(s);
  std::map<std::string, F32Tensor> tensors;
  tensors["output"] = F32Tensor{{tokens, hidden}, out};
  const std::map<std::string, std::string> meta = {
      {"producer", "moerun forward"},
      {"layer", std::to_string(w.layer)},
      {"model", f.layer.model.empty() ? "preset:" + f.layer.preset : f.layer.model}};
  if (Status s = WriteSafetensorsF32(f.output, tensors, meta); !s.ok()) return FailWith(s);
  std::string line = "moerun forward: " + DescribeLayer(w) + " | " + std::to_string(tokens) +
                     " tokens | " + how + " | " +
                     fmt::format("{:.3f} ms, {:.0f} tokens/s", ms,
                                 ms > 0 ? static_cast<double>(tokens) / (ms / 1e3) : 0.0) +
                     " | " + f.output;
  int rc = 0;
  if (io.expected) {
    auto ref = ReadMatrix(*io.expected, hidden);
    if (!ref.ok()) return FailWith(ref.status());
    double num = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double d = static_cast<double>(out[i]) - (*ref)[i];
      num += d * d;
      den += static_cast<double>((*ref)[i]) * (*ref)[i];
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    const bool pass = rel <= f.tolerance;
    line += fmt::format(" | rel err vs {} {:.2e} ({} {:.0e})", f.check, rel,
                        pass ? "within" : "EXCEEDS", f.tolerance);
    rc = pass ? 0 : 3;
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  return rc;
}

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One process holds the whole layer.
int RunLocal(const ForwardFlags& f, Isa isa) {
  auto io = OpenIo(f);
  if (!io.ok()) return FailWith(io.status());
  const CpuKernels& kernels = KernelsFor(isa);
  ThreadPool pool(f.layer.threads);
  auto weights = LoadLayerFromFlags(f.layer, kernels, pool.size());
  if (!weights.ok()) return FailWith(weights.status());
  const MoeLayerWeights& w = **weights;
  auto x = ReadMatrix(io->input, w.spec.hidden);
  if (!x.ok()) return FailWith(x.status());
  std::vector<float> out(x->size());
  if (f.dev.device == "cuda") {
    // The whole layer's buffers hold --max-tokens tokens (as --plan-memory plans them).
    if (io->input.rows > f.dev.max_tokens) {
      return FailWith(Status::InvalidArgument(
          fmt::format("the input has {} tokens, more than --max-tokens {} (the GPU buffers' size)",
                      io->input.rows, f.dev.max_tokens)));
    }
    auto opts = CudaOptionsFor(f.dev, w.dtype, 0);
    if (!opts.ok()) return FailWith(opts.status());
    auto gpu = CudaMoeLayer::Upload(w, *opts);
    if (!gpu.ok()) return FailWith(gpu.status());
    const auto t0 = std::chrono::steady_clock::now();
    if (Status s = (*gpu)->Forward(x->data(), io->input.rows, out.data()); !s.ok()) {
      return FailWith(s);
    }
    const double ms = MsSince(t0);
    return Finish(f, *io, w, *x, out, "cuda " + (*gpu)->Describe(), ms);
  }
  MoeLayer layer(*weights, kernels, &pool);
  const auto t0 = std::chrono::steady_clock::now();
  if (Status s = layer.Forward(x->data(), io->input.rows, out.data()); !s.ok()) return FailWith(s);
  const double ms = MsSince(t0);
  return Finish(
      f, *io, w, *x, out,
      std::string("cpu ") + IsaName(isa) + " x" + std::to_string(pool.size()) + " threads", ms);
}

// Ranks: routers and expert ranks; rank 0 reads the input and writes the output.
int RunDistributed(const ForwardFlags& f, JobLaunch& job, Isa isa) {
  std::optional<ForwardIo> io;
  if (job.rank() == 0) {
    auto opened = OpenIo(f);
    if (!opened.ok()) {
      const int rc = FailWith(opened.status());
      if (job.multi_process()) job.Abort(rc);
      return rc;
    }
    io = std::move(opened).value();
  }
  JobOptions opts;
  job.Fill(&opts);
  opts.source.model = f.layer.model;
  opts.source.preset = f.layer.preset;
  opts.source.seed = f.layer.seed;
  opts.source.gate_skew = f.layer.gate_skew;
  opts.source.experts = f.layer.experts;
  opts.source.intermediate = f.layer.intermediate;
  opts.threads = f.layer.threads;
  opts.isa = isa;
  ExpertSetup expert_setup;
  if (f.dev.device == "cuda") {
    const int ranks = job.size();
    expert_setup = [&f, ranks](int rank, const LoadedLayers& l) -> Result<ExpertCompute> {
      if (l.empty()) return Status::InvalidArgument("--device cuda: the rank loaded no layer");
      // The job's placement, as RankJob made it (a GPU rank's experts never move).
      MOERUN_ASSIGN_OR_RETURN(
          const Placement placement,
          Placement::Make(f.launch.placement, l.begin()->second->spec.num_experts, ranks,
                          f.launch.routers));
      return CudaExpertCompute(f.dev, rank, l, placement);
    };
  }
  auto dtype = ParseWeightDType(f.layer.dtype);
  if (!dtype.ok()) return FailWith(dtype.status());
  opts.source.dtype = *dtype;
  auto spec = SpecOf(opts.source);
  if (!spec.ok()) return FailWith(spec.status());
  auto layer = ResolveMoeLayer(*spec, f.layer.layer);
  if (!layer.ok()) return FailWith(layer.status());
  opts.layers = {*layer};

  int rc = 0;
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    RouterLayer& ep = *router.layer(*layer);
    MOERUN_ASSIGN_OR_RETURN(std::vector<float> x, ReadMatrix(io->input, ep.weights().spec.hidden));
    std::vector<float> out(x.size());
    const auto t0 = std::chrono::steady_clock::now();
    if (Status fs = ep.Forward(x.data(), io->input.rows, out.data()); !fs.ok()) {
      // The job ends with this error whatever the others do: over mpirun, abort now rather than
      // first stopping the expert ranks one by one (they would enter MPI_Finalize, which waits
      // for a frozen rank, while this rank aborts: Open MPI 4.1's teardown has been seen to hang
      // on that race). In one process the caller's Abort ends every rank's thread the same way.
      if (job.multi_process()) job.Abort(FailWith(fs));
      return fs;
    }
    const double ms = MsSince(t0);
    const std::string how = fmt::format(
        "{} ranks ({} router, {} expert) over {} | placement {} | microbatch {} | cpu {}",
        job.size(), f.launch.routers, job.size() - f.launch.routers, job.transport(),
        f.launch.placement,
        f.launch.microbatch_tokens > 0 ? std::to_string(f.launch.microbatch_tokens) : "off",
        f.dev.device == "cuda" ? std::string("experts on cuda")
                               : std::string("cpu ") + IsaName(isa));
    rc = Finish(f, *io, ep.weights(), x, out, how, ms);
    return Status::Ok();
  };
  const Status s = job.Run(opts, work, expert_setup);
  if (!s.ok()) {
    const int code = FailWith(s);
    job.Abort(code);
  }
  return rc;
}

// forward --plan-memory: the device memory of every rank of the job the flags describe (one
// process: the whole layer; --ranks N / mpirun: CPU routers and expert ranks), from the shapes
// alone; prints to stdout and exits 0.
int PlanMemory(const ForwardFlags& f) {
  if (f.dev.device != "cuda") {
    return FailWith(Status::InvalidArgument(
        "--plan-memory plans the GPU memory of --device cuda: add --device cuda"));
  }
  WeightSource src;
  src.model = f.layer.model;
  src.preset = f.layer.preset;
  src.seed = f.layer.seed;
  src.experts = f.layer.experts;
  src.intermediate = f.layer.intermediate;
  auto dtype = ParseWeightDType(f.layer.dtype);
  if (!dtype.ok()) return FailWith(dtype.status());
  src.dtype = *dtype;
  if (src.model.empty() && src.preset.empty()) {
    return FailWith(Status::InvalidArgument("--plan-memory needs --model DIR or --preset NAME"));
  }
  auto spec = SpecOf(src);
  if (!spec.ok()) return FailWith(spec.status());
  auto layer = ResolveMoeLayer(*spec, f.layer.layer);
  if (!layer.ok()) return FailWith(layer.status());
  auto weights = SourceWeightType(src, *spec);
  if (!weights.ok()) return FailWith(weights.status());
  MemoryPlanJob job;
  job.model = src.model.empty() ? "preset " + src.preset : src.model;
  job.spec = *spec;
  job.layers = {*layer};
  job.dtype = *weights;
  job.ranks = PlanRanks(f.launch.ranks > 1 ? f.launch.ranks : 0, 1);
  job.routers = f.launch.routers;
  job.placement = f.launch.placement;
  auto text = FormatJobMemory(f.dev, job, f.json);
  if (!text.ok()) return FailWith(text.status());
  std::fputs(text->c_str(), stdout);
  std::fflush(stdout);
  return 0;
}

int RunForward(const ForwardFlags& f) {
  if (Status s = ValidateDeviceFlags(f.dev); !s.ok()) return FailWith(s);
  if (f.plan_memory) return PlanMemory(f);
  if (f.json) return FailWith(Status::InvalidArgument("--json goes with --plan-memory"));
  if (f.dev.device == "cuda") {  // before any work: no GPU is a clear error, exit 2
    if (auto probe = RequireCuda(); !probe.ok()) return FailWith(probe.status());
  }
  if (Status s = ValidateLayerFlags(f.layer); !s.ok()) return FailWith(s);
  auto isa = ChooseIsa(f.layer.isa);
  if (!isa.ok()) return FailWith(isa.status());
  auto job = JobLaunch::Create(f.launch);
  if (!job.ok()) return FailWith(job.status());
  if ((*job)->size() == 1) return RunLocal(f, *isa);
  return RunDistributed(f, **job, *isa);
}

}  // namespace

std::function<int()> AddForwardCommand(CLI::App& app) {
  auto flags = std::make_shared<ForwardFlags>();
  CLI::App* cmd = app.add_subcommand("forward", "Run one MoE layer over an input tensor");
  auto* model = cmd->add_option("--model", flags->layer.model,
                                "Hugging Face model folder (config.json + safetensors)");
  auto* preset = cmd->add_option("--preset", flags->layer.preset,
                                 "Real model shape with seeded random weights: mixtral-8x7b, "
                                 "qwen3-30b-a3b, deepseek-v3, gpt-oss-20b, step-3.5-flash");
  model->excludes(preset);
  cmd->add_option("--seed", flags->layer.seed, "Preset weight seed")->default_val(1);
  cmd->add_option("--gate-skew", flags->layer.gate_skew,
                  "Preset routing skew: Zipf exponent over experts (0: none)")
      ->default_val(0.0);
  cmd->add_option("--experts", flags->layer.experts,
                  "Preset expert count (default: as many as fit in 4 GB)");
  cmd->add_option("--intermediate", flags->layer.intermediate,
                  "Preset expert intermediate size, scaled down (a multiple of 32; default: the "
                  "model's)");
  cmd->add_option("--dtype", flags->layer.dtype,
                  "Preset weight type: f32, bf16, f16, fp8 (e4m3, 128x128 blocks), mxfp4")
      ->default_val("f32");
  auto* input =
      cmd->add_option("--input", flags->input, "safetensors file with tensor 'input' [T, H] (F32)");
  auto* output =
      cmd->add_option("--output", flags->output, "safetensors file to write 'output' [T, H] to");
  cmd->add_option("--layer", flags->layer.layer, "Decoder layer (default: the first MoE layer)");
  AddDeviceFlags(cmd, &flags->dev,
                 "cpu or cuda (the whole layer on one GPU; with several ranks, the expert "
                 "ranks' experts, each on its local GPU)",
                 "--device cuda: tokens per forward (one process) or per microbatch (expert "
                 "ranks) the GPU buffers hold");
  cmd->add_flag("--plan-memory", flags->plan_memory,
                "With --device cuda: print each rank's device memory by region (from the model's "
                "shapes; no GPU, weights, --input or --output needed) and exit");
  cmd->add_flag("--json", flags->json, "With --plan-memory: print the plan as JSON");
  cmd->add_option("--threads", flags->layer.threads, "Worker threads (default: all cores)");
  cmd->add_option("--isa", flags->layer.isa, "CPU kernels: scalar, avx2, avx512 (default: best)");
  cmd->add_option("--check", flags->check,
                  "safetensors file with the expected 'output': report the relative error "
                  "(exit 3 if above --tolerance)");
  cmd->add_option("--tolerance", flags->tolerance, "for --check")->default_val(1e-5);
  AddLaunchFlags(cmd, &flags->launch);
  // What the flags alone say is wrong ends as any bad command line (one line, exit 2).
  cmd->callback([flags, input, output] {
    // --input and --output are required, except to plan the memory.
    if (!flags->plan_memory) {
      if (input->count() == 0) throw CLI::RequiredError("--input");
      if (output->count() == 0) throw CLI::RequiredError("--output");
    }
    Status s = ValidateDeviceFlags(flags->dev);
    if (s.ok()) s = ValidateLayerFlags(flags->layer);
    if (s.ok()) s = ValidateLaunchFlags(flags->launch);
    if (s.ok()) s = ParseWeightDType(flags->layer.dtype).status();
    if (!s.ok()) throw CLI::ValidationError(s.message());
  });
  return [flags, cmd]() -> int {
    if (!cmd->parsed()) return -1;
    return RunForward(*flags);
  };
}

}  // namespace moerun
