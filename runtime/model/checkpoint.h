// A model checkpoint: one safetensors file, or shards named by model.safetensors.index.json.
//
// Opening reads config-free metadata only: the index (if any) and, lazily, the header of a shard
// when one of its tensors is first asked for. Tensor bytes stay on disk until the caller touches
// them (mmap), so a rank that needs three experts reads three experts. Thread-safe.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/model/safetensors.h"

namespace moerun {

class Checkpoint {
 public:
  // `path` is a folder (with model.safetensors.index.json or model.safetensors, or exactly one
  // *.safetensors file) or a .safetensors file.
  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& path);

  bool Has(const std::string& name) const;
  // The tensor's bytes and info; NotFound names the tensor. Opens its shard on first use.
  Result<TensorRef> Get(const std::string& name) const;
  // All tensor names (from the index, or the single file's header), sorted.
  std::vector<std::string> Names() const;
  const std::string& path() const { return path_; }
  // Opens every shard now (mapped for the checkpoint's life: later reads do not need the files
  // to exist under their names).
  Status OpenAllShards() const;
  // Number of shard files opened so far (to check that only needed shards are touched).
  size_t OpenedShards() const;

 private:
  Checkpoint() = default;
  Result<const SafetensorsFile*> Shard(const std::string& file) const;

  std::string path_;
  std::string dir_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name
  mutable std::mutex mu_;
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> shards_;
};

}  // namespace moerun
