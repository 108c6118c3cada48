#include "base/aligned_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace moerun {

namespace {
constexpr size_t kHugePage = 2u << 20;
}

AlignedBuffer::AlignedBuffer(size_t bytes) {
  if (bytes == 0) return;
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = nullptr;
  if (posix_memalign(&p, align, rounded) != 0) throw std::bad_alloc();
  if (align == kHugePage) ::madvise(p, rounded, MADV_HUGEPAGE);
  std::memset(p, 0, rounded);
  p_ = p;
  n_ = bytes;
}

AlignedBuffer::~AlignedBuffer() { std::free(p_); }

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(p_);
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
  }
  return *this;
}

void AlignedBuffer::Reserve(size_t bytes) {
  if (bytes <= n_) return;
  *this = AlignedBuffer(bytes);
}

}  // namespace moerun
