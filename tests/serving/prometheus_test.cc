// A real Prometheus (Debian's `prometheus`) scrapes a running `moerun serve`: after a known
// sequence of requests, a query of the per-expert assignment counter returns exactly what the
// gate chose for those inputs (computed here with the same gate), tokens x k in total.
// Skipped when the prometheus binary is missing (scripts/install-deps.sh --test installs it).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "router/gating.h"
#include "runtime/serving/serve_client.h"
#include "tests/unit/layer_fixtures.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// A child process with its output in a file; killed (TERM, then KILL) when destroyed.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::string& log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      std::_Exit(127);
    }
  }
  ~Child() { Stop(); }
  bool alive() const { return pid_ > 0 && ::waitpid(pid_, nullptr, WNOHANG) == 0; }
  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 100 && ::waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

bool PortFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// The first of `n` consecutive free ports.
int FreePorts(int n) {
  static int calls = 0;
  ++calls;
  for (int tries = 0; tries < 200; ++tries) {
    // Below Linux's ephemeral range (32768..60999), where the kernel picks client ports.
    const int base =
        20000 + static_cast<int>((::getpid() * 7919 + (calls * 211 + tries) * 104729) % 12000);
    bool ok = true;
    for (int i = 0; i < n && ok; ++i) ok = PortFree(base + i);
    if (ok) return base;
  }
  return 0;
}

std::string Which(const std::string& name) {
  for (const char* dir : {"/usr/bin", "/usr/local/bin", "/bin"}) {
    const std::string p = std::string(dir) + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

TEST(PrometheusTest, PerExpertAssignmentsAreExactlyWhatTheGateChose) {
  const std::string prometheus = Which("prometheus");
  if (prometheus.empty()) GTEST_SKIP() << "prometheus is not installed";
  ASSERT_FALSE(Which("curl").empty()) << "curl is needed to query Prometheus";
  TempDir tmp;
  const int base = FreePorts(6);  // serving, prometheus, 4 metrics ports
  ASSERT_NE(base, 0);
  const int serve_port = base, prom_port = base + 1, metrics_port = base + 2;
  const std::string configs = DataDir() + "/../../configs";
  Child serve({MOERUN_BIN, "serve", "--config", configs + "/tiny.yaml", "--listen",
               "127.0.0.1:" + std::to_string(serve_port), "--metrics-listen",
               "127.0.0.1:" + std::to_string(metrics_port), "--ready-file", tmp.File("ready")},
              tmp.File("serve.log"));
  WriteFile(tmp.File("prom.yml"),
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
            "  - job_name: moerun\n    static_configs:\n      - targets: ['127.0.0.1:" +
                std::to_string(metrics_port) + "']\n");
  Child prom({prometheus, "--config.file=" + tmp.File("prom.yml"),
              "--storage.tsdb.path=" + tmp.File("tsdb"),
              "--web.listen-address=127.0.0.1:" + std::to_string(prom_port)},
             tmp.File("prom.log"));
  for (int i = 0; i < 600 && !std::filesystem::exists(tmp.File("ready")); ++i) {
    ASSERT_TRUE(serve.alive()) << ReadFile(tmp.File("serve.log"));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(std::filesystem::exists(tmp.File("ready"))) << ReadFile(tmp.File("serve.log"));

  // The known sequence: 12 requests of 1..12 tokens.
  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(1);
  auto w = LoadFixture("deepseek_v3", k);
  Gating gate(w->Gate(), k, &pool);
  const int64_t hidden = w->spec.hidden;
  const int topk = w->spec.top_k;
  std::map<int, uint64_t> want;
  uint64_t total = 0;
  auto conn = ServeConnection::Connect("127.0.0.1:" + std::to_string(serve_port));
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  for (int r = 1; r <= 12; ++r) {
    const auto x = RandomRows(r, hidden, static_cast<uint32_t>(100 + r));
    v1::InferRequest req;
    req.set_id(static_cast<uint64_t>(r));
    SetRequestData(&req, x.data(), r, hidden, v1::F32);
    v1::InferResponse resp;
    ASSERT_TRUE((*conn)->Call(req, &resp, DeadlineIn(std::chrono::seconds(20))).ok());
    ASSERT_EQ(resp.code(), v1::OK) << resp.message();
    gate.Run(x.data(), r);
    for (int i = 0; i < r * topk; ++i) ++want[gate.ids()[static_cast<size_t>(i)]];
    total += static_cast<uint64_t>(r * topk);
  }
  EXPECT_EQ(total, 78u * static_cast<uint64_t>(topk));

  // Ask Prometheus until its latest scrape has everything.
  const std::string url = "http://127.0.0.1:" + std::to_string(prom_port) +
                          "/api/v1/query?query=moerun_assignments_total";
  std::map<int, uint64_t> got;
  uint64_t got_total = 0;
  for (int i = 0; i < 120 && got_total != total; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const ProcessResult r = RunProcess({Which("curl"), "-s", "--max-time", "5", url}, 10);
    if (r.exit_code != 0) continue;
    const auto j = nlohmann::json::parse(r.output, nullptr, false);
    if (j.is_discarded() || j.value("status", "") != "success") continue;
    got.clear();
    got_total = 0;
    for (const auto& s : j["data"]["result"]) {
      const int e = std::stoi(s["metric"]["expert"].get<std::string>());
      const uint64_t v = std::stoull(s["value"][1].get<std::string>());
      EXPECT_EQ(s["metric"]["layer"], "0");
      if (v > 0) got[e] = v;
      got_total += v;
    }
  }
  EXPECT_EQ(got_total, total) << ReadFile(tmp.File("prom.log"));
  EXPECT_EQ(got, want);
  serve.Stop();
  prom.Stop();
}

}  // namespace
}  // namespace moerun
