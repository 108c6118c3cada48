// A read-only memory map of a whole file. Pages are read from disk only when first touched, so a
// rank that needs a few tensors of a 100 GB checkpoint reads only those. Movable, not copyable;
// safe to read from many threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"

namespace moerun {

class MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Hints the kernel to read [offset, offset+len) ahead of use.
  void WillNeed(uint64_t offset, uint64_t len) const;

 private:
  MappedFile(std::string path, const uint8_t* data, uint64_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_;
  uint64_t size_;
};

}  // namespace moerun
