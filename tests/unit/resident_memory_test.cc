// ResidentBytes reads the truth from /proc and fails loudly: tests/mpi/fp8_memory.sh checks what
// a load costs with it, and a read that returned 0 would pass every "grew by at most" check.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/resident_memory.h"

namespace moerun {
namespace {

namespace fs = std::filesystem;

// VmRSS from /proc/self/status (another file the kernel writes from the same counters), bytes.
size_t VmRss() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // "N kB"
  }
  return 0;
}

TEST(ResidentMemoryTest, MatchesVmRssAndGrowsWithTouchedMemory) {
  const Result<size_t> before = ResidentBytes();
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  const size_t rss = VmRss();
  ASSERT_GT(rss, 0u) << "no VmRSS in /proc/self/status";
  EXPECT_GT(*before, size_t{1} << 20);  // a running test binary holds more than 1 MiB
  // Read a moment apart: within 4 MiB of each other.
  EXPECT_LT(*before > rss ? *before - rss : rss - *before, size_t{4} << 20)
      << *before << " vs VmRSS " << rss;
  // 64 MiB written page by page are resident: the count grows by at least 60 MiB.
  std::vector<char> touched(size_t{64} << 20);
  const long page = sysconf(_SC_PAGESIZE);  // NOLINT(runtime/int)
  for (size_t i = 0; i < touched.size(); i += static_cast<size_t>(page)) touched[i] = 1;
  const Result<size_t> after = ResidentBytes();
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_GE(*after, *before + (size_t{60} << 20)) << *before << " -> " << *after;
  EXPECT_EQ(touched[touched.size() - 1] + touched[0], 1);  // (the writes are used)
}

TEST(ResidentMemoryTest, AFailedReadIsAnErrorNotZero) {
  const Result<size_t> missing = ResidentBytesFrom("/nonexistent/moerun/statm");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIoError);
  EXPECT_NE(missing.status().ToString().find("/nonexistent/moerun/statm"), std::string::npos);
  const fs::path dir = fs::temp_directory_path() / ("moerun-statm-" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::vector<std::string> bad = {"", "garbage\n", "12345\n", "12345 0 7 1 0 9 0\n"};
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string path = (dir / ("statm" + std::to_string(i))).string();
    std::ofstream(path) << bad[i];
    const Result<size_t> r = ResidentBytesFrom(path.c_str());
    EXPECT_FALSE(r.ok()) << "'" << bad[i] << "' read as " << (r.ok() ? *r : 0);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().ToString();
    }
  }
  const std::string good = (dir / "statm_good").string();
  std::ofstream(good) << "12345 678 90 1 0 200 0\n";
  const Result<size_t> r = ResidentBytesFrom(good.c_str());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, size_t{678} * static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moerun
