#include "tests/unit/test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace moerun::testing {

namespace fs = std::filesystem;

std::string DataDir() { return MOERUN_TEST_DATA; }
std::string FixtureDir(const std::string& name) { return DataDir() + "/hf-moe/" + name; }

std::vector<std::string> FixtureNames() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(DataDir() + "/hf-moe")) {
    if (e.is_directory()) out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TempDir::TempDir() {
  std::string tmpl = (fs::temp_directory_path() / "moerun-test-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string MakeSafetensors(const std::string& header_json, const std::string& data,
                            int64_t header_len_override) {
  const uint64_t n =
      header_len_override >= 0 ? static_cast<uint64_t>(header_len_override) : header_json.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header_json + data;
}

std::vector<float> ReadF32(const std::string& path, const std::string& name, int64_t* rows,
                           int64_t* cols) {
  auto f = SafetensorsFile::Open(path);
  if (!f.ok()) throw std::runtime_error(f.status().ToString());
  auto t = (*f)->Get(name);
  if (!t.ok()) throw std::runtime_error(t.status().ToString());
  if (t->info->dtype != DType::kF32) throw std::runtime_error(name + " is not F32");
  if (rows) *rows = t->info->shape.size() > 0 ? t->info->shape[0] : 1;
  if (cols) *cols = t->info->shape.size() > 1 ? t->info->shape[1] : 1;
  std::vector<float> v(static_cast<size_t>(t->info->numel));
  std::memcpy(v.data(), t->data, v.size() * 4);
  return v;
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

ProcessResult RunProcess(const std::vector<std::string>& argv, int timeout_s) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe");
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  ProcessResult r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  char buf[4096];
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now())
                                          .count());
    if (left <= 0) {
      kill(pid, SIGKILL);
      r.output += "\n[test harness: killed after timeout]";
      break;
    }
    if (poll(&p, 1, left) <= 0) continue;
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    r.output.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  return r;
}

}  // namespace moerun::testing
