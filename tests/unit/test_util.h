// Helpers shared by the tests: test data paths, temporary folders, small safetensors writers,
// comparing tensors, and running a binary to capture its output and exit code.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/model/safetensors.h"

namespace moerun::testing {

std::string DataDir();                            // tests/data
std::string FixtureDir(const std::string& name);  // tests/data/hf-moe/<name>
std::vector<std::string> FixtureNames();          // all folders of tests/data/hf-moe

// A fresh empty folder under $TMPDIR, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Writes `bytes` to `path`.
void WriteFile(const std::string& path, const std::string& bytes);
std::string ReadFile(const std::string& path);

// A safetensors file from a raw JSON header and data buffer (no validation: for bad files too).
std::string MakeSafetensors(const std::string& header_json, const std::string& data,
                            int64_t header_len_override = -1);

// Reads an F32 tensor [rows, cols] (asserting its type).
std::vector<float> ReadF32(const std::string& path, const std::string& name,
                           int64_t* rows = nullptr, int64_t* cols = nullptr);

double RelativeError(const std::vector<float>& got, const std::vector<float>& want);

struct ProcessResult {
  int exit_code = -1;  // -signal if killed by a signal
  std::string output;  // stdout and stderr together
};
ProcessResult RunProcess(const std::vector<std::string>& argv, int timeout_s = 120);

}  // namespace moerun::testing
