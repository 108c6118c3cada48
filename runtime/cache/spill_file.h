// The expert cache's spill file: every expert loaded from its source once is also written here
// in packed form, so that a later miss is one read of its bytes (from the page cache, or the
// disk) instead of a new load and pack from the checkpoint or preset. The file is unlinked as
// soon as it is made: nothing is left behind, whatever ends the process.
// Thread-safe (the cache's loader threads share it).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "base/status.h"
#include "experts/cpu/expert_weights.h"

namespace moerun {

class SpillFile {
 public:
  // A new, already unlinked file in `dir`.
  static Result<std::unique_ptr<SpillFile>> Create(const std::string& dir);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  // The generation of an expert's entry: taken before a load from the source, so that a Put
  // after a Forget (new weights) does not store the old ones.
  uint64_t Generation(int layer, int expert) const;
  // Stores the expert's packed weights (once per generation); an error if the write fails.
  Status Put(int layer, int expert, uint64_t generation, const ExpertWeights& w);
  // The stored weights, or NotFound. `reuse` (may be empty): weights whose matrices are read
  // into where they have the same type and shape (no new allocation, no page faults).
  Result<ExpertWeights> Get(int layer, int expert, ExpertWeights reuse = {}) const;
  // The expert's weights changed (a promoted update): its copy is no longer used.
  void Forget(int layer, int expert);
  uint64_t bytes() const;

 private:
  struct Matrix {
    DType dtype = DType::kF32;
    int64_t n = 0, k = 0;
    int nr = 16;
    uint64_t offset = 0, bytes = 0;
  };
  struct Entry {
    uint64_t generation = 0;
    bool stored = false;
    int64_t hidden = 0, inter = 0, pairs = 0;
    Matrix w13, w2;
    uint64_t bias_offset = 0;
    uint64_t bias_gate = 0, bias_up = 0, bias_down = 0;  // float counts
  };
  SpillFile() = default;
  Status WriteAt(const void* p, uint64_t n, uint64_t offset) const;
  Status ReadAt(void* p, uint64_t n, uint64_t offset) const;

  int fd_ = -1;
  std::string dir_;
  mutable std::mutex mu_;
  std::map<std::pair<int, int>, Entry> entries_;
  uint64_t end_ = 0;
};

}  // namespace moerun
