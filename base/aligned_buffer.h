// A zero-initialised, 64-byte aligned heap buffer. Large buffers ask for transparent huge pages,
// which matters when gigabytes of expert weights are streamed per batch. Movable, not copyable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

namespace moerun {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  void* data() { return p_; }
  const void* data() const { return p_; }
  template <typename T>
  T* as() {
    return static_cast<T*>(p_);
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(p_);
  }
  size_t size() const { return n_; }
  // Grows (never shrinks) to at least `bytes`; contents are not preserved.
  void Reserve(size_t bytes);

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace moerun
