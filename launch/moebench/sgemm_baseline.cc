#include "launch/moebench/sgemm_baseline.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <sstream>

#include "experts/cpu/isa.h"
#include "launch/moebench/timing.h"
#include "moerun/build_info.h"

#if MOERUN_HAVE_OPENBLAS
#include <cblas.h>
#endif

extern char** environ;

namespace moerun::bench {

std::string ShapesToArg(const std::vector<GemmShape>& shapes) {
  std::string s;
  for (const auto& g : shapes) {
    if (!s.empty()) s += ";";
    s += std::to_string(g.m) + "x" + std::to_string(g.n) + "x" + std::to_string(g.k);
  }
  return s;
}

Result<std::vector<GemmShape>> ShapesFromArg(const std::string& arg) {
  std::vector<GemmShape> out;
  std::stringstream ss(arg);
  std::string item;
  while (std::getline(ss, item, ';')) {
    GemmShape g{};
    char x1 = 0, x2 = 0;
    std::stringstream is(item);
    if (!(is >> g.m >> x1 >> g.n >> x2 >> g.k) || x1 != 'x' || x2 != 'x' || g.m <= 0 || g.n <= 0 ||
        g.k <= 0 || g.m > (1 << 24) || g.n > (1 << 24) || g.k > (1 << 24)) {
      return Status::InvalidArgument("bad shape '" + item + "' (want MxNxK)");
    }
    out.push_back(g);
  }
  if (out.empty()) return Status::InvalidArgument("no shapes");
  return out;
}

std::vector<std::string> CandidateCoreTypes() {
  std::vector<std::string> out{""};
  const auto& cpu = DetectCpu();
  if (cpu.avx512) {
    out.push_back("SkylakeX");
  } else if (cpu.avx2_fma) {
    out.push_back(cpu.brand.find("AMD") != std::string::npos ? "Zen" : "Haswell");
  }
  return out;
}

int RunSgemmChild(const std::vector<GemmShape>& shapes, int threads, double min_seconds) {
#if MOERUN_HAVE_OPENBLAS
  if (threads > 0) openblas_set_num_threads(threads);
  std::vector<std::vector<float>> a, b, c;
  double flops = 0;
  for (const auto& g : shapes) {
    a.emplace_back(static_cast<size_t>(g.m * g.k));
    b.emplace_back(static_cast<size_t>(g.n * g.k));
    c.emplace_back(static_cast<size_t>(g.m * g.n));
    for (size_t i = 0; i < a.back().size(); ++i) a.back()[i] = static_cast<float>(i % 13) * 0.01f;
    for (size_t i = 0; i < b.back().size(); ++i) b.back()[i] = static_cast<float>(i % 7) * 0.01f;
    flops += 2.0 * static_cast<double>(g.m) * static_cast<double>(g.n) * static_cast<double>(g.k);
  }
  auto run = [&] {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto& g = shapes[i];
      // Row-major C[m][n] = A[m][k] * W[n][k]^T, as the layer computes x W^T.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(g.m),
                  static_cast<int>(g.n), static_cast<int>(g.k), 1.0f, a[i].data(),
                  static_cast<int>(g.k), b[i].data(), static_cast<int>(g.k), 0.0f, c[i].data(),
                  static_cast<int>(g.n));
    }
  };
  run();
  const Timing t = TimeIt(run, 3, min_seconds);
  std::printf(
      "{\"corename\": \"%s\", \"threads\": %d, \"ms\": %.6f, \"gflops\": %.3f, \"reps\": %d}\n",
      openblas_get_corename(), openblas_get_num_threads(), t.median_ms, flops / (t.median_ms * 1e6),
      t.reps);
  return 0;
#else
  (void)shapes, (void)threads, (void)min_seconds;
  std::fprintf(stderr, "moebench was built without OpenBLAS\n");
  return 1;
#endif
}

Result<nlohmann::json> RunSgemmBaseline(const std::vector<GemmShape>& shapes, int threads,
                                        double min_seconds, const std::string& coretype) {
  int pipefd[2];
  if (pipe(pipefd) != 0) return Status::IoError("pipe failed");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&fa, pipefd[0]);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "OPENBLAS_CORETYPE=", 18) == 0) continue;
    if (std::strncmp(*e, "OPENBLAS_NUM_THREADS=", 21) == 0) continue;
    env.emplace_back(*e);
  }
  if (!coretype.empty()) env.push_back("OPENBLAS_CORETYPE=" + coretype);
  env.push_back("OPENBLAS_NUM_THREADS=" + std::to_string(threads));
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", sub = "sgemm", shapes_flag = "--shapes",
              shapes_arg = ShapesToArg(shapes), threads_flag = "--threads",
              threads_arg = std::to_string(threads), time_flag = "--min-time",
              time_arg = std::to_string(min_seconds);
  char* argv[] = {exe.data(),        sub.data(),          shapes_flag.data(),
                  shapes_arg.data(), threads_flag.data(), threads_arg.data(),
                  time_flag.data(),  time_arg.data(),     nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(pipefd[1]);
  if (rc != 0) {
    close(pipefd[0]);
    return Status::IoError(std::string("cannot start the sgemm child: ") + std::strerror(rc));
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(pipefd[0], buf, sizeof buf)) > 0;)
    out.append(buf, static_cast<size_t>(n));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Status::Internal("the sgemm child failed (OPENBLAS_CORETYPE=" + coretype + ")");
  }
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::Internal("sgemm child printed: " + out);
  j["coretype"] = coretype.empty() ? "as installed" : coretype;
  return j;
}

}  // namespace moerun::bench
