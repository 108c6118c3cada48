// Runs the fuzz target over every file of a corpus folder, so that each build replays the seeds
// (and any crashers added to the corpus) without libFuzzer. Usage: moerun_fuzz_replay DIR...
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR...\n", argv[0]);
    return 2;
  }
  size_t count = 0;
  for (int a = 1; a < argc; ++a) {
    std::error_code ec;
    if (!fs::is_directory(argv[a], ec)) {
      std::fprintf(stderr, "%s: not a folder\n", argv[a]);
      return 2;
    }
    std::vector<fs::path> files;
    for (const auto& e : fs::recursive_directory_iterator(argv[a], ec)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    if (ec) {
      std::fprintf(stderr, "%s: %s\n", argv[a], ec.message().c_str());
      return 2;
    }
    std::sort(files.begin(), files.end());
    for (const auto& path : files) {
      std::ifstream in(path, std::ios::binary);
      const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                    std::istreambuf_iterator<char>());
      if (!in.good() && !in.eof()) {
        std::fprintf(stderr, "%s: cannot read\n", path.c_str());
        return 2;
      }
      // A copy of exactly `size` bytes, so that reading past the end is visible to sanitizers.
      std::vector<uint8_t> copy(bytes.begin(), bytes.end());
      static const uint8_t kEmpty = 0;
      LLVMFuzzerTestOneInput(copy.empty() ? &kEmpty : copy.data(), copy.size());
      ++count;
    }
  }
  std::printf("replayed %zu inputs\n", count);
  return 0;
}
