// The safetensors format: parsing and validating its header, and reading tensors through mmap.
//
// A file is: 8 bytes little-endian header length N, N bytes of JSON, then the data buffer.
// ParseSafetensorsHeader validates everything before any tensor is read:
//   - N is at most kMaxSafetensorsHeaderBytes and 8 + N fits in the file;
//   - the JSON is an object (nesting at most 3 deep) of tensor entries
//     {"dtype": NAME, "shape": [d0, ...], "data_offsets": [begin, end]} and an optional
//     "__metadata__" object of strings; nothing else;
//   - every dtype name is a safetensors dtype; numel(shape) * dtype size == end - begin;
//   - the spans, sorted, tile the data buffer exactly: no overlap, no hole, nothing past its end
//     (the rule of the reference implementation, which also rules out polyglot files).
// It is a pure function of its input (the fuzz target calls it on arbitrary bytes).
// SafetensorsFile is immutable after Open and safe to share between threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/dtype.h"
#include "base/mapped_file.h"
#include "base/status.h"

namespace moerun {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;  // as the reference library

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0;  // byte offsets inside the data buffer
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_offset = 0;         // 8 + N: where the data buffer starts in the file
  std::vector<TensorInfo> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
};

// `bytes` holds the file's first min(file_size, 8 + N) bytes at least (the whole file is fine).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> bytes,
                                                 uint64_t file_size);

// A view of one tensor's bytes inside a mapped file.
struct TensorRef {
  const TensorInfo* info = nullptr;
  const uint8_t* data = nullptr;  // not necessarily aligned
  const MappedFile* file = nullptr;
};

class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  const std::string& path() const { return file_->path(); }
  const SafetensorsHeader& header() const { return header_; }
  bool Has(const std::string& name) const { return index_.count(name) != 0; }
  // NotFound naming the tensor and the file if absent.
  Result<TensorRef> Get(const std::string& name) const;

 private:
  SafetensorsFile(std::unique_ptr<MappedFile> file, SafetensorsHeader header);
  std::unique_ptr<MappedFile> file_;
  SafetensorsHeader header_;
  std::unordered_map<std::string, size_t> index_;
};

// Writes F32 tensors (name -> shape, data) as a safetensors file, header padded to 8 bytes.
struct F32Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};
Status WriteSafetensorsF32(const std::string& path, const std::map<std::string, F32Tensor>& tensors,
                           const std::map<std::string, std::string>& metadata = {});

}  // namespace moerun
