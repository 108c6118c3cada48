#include "runtime/serving/buffer_pool.h"

#include <algorithm>
#include <utility>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace moerun {

PooledBuffer::PooledBuffer(BufferPool* pool, std::unique_ptr<Block> block, size_t size)
    : pool_(pool), block_(std::move(block)), bytes_(block_->bytes.get()), size_(size) {}

PooledBuffer::PooledBuffer(PooledBuffer&& o) noexcept
    : pool_(o.pool_), block_(std::move(o.block_)), bytes_(o.bytes_), size_(o.size_) {
  o.pool_ = nullptr;
  o.bytes_ = nullptr;
  o.size_ = 0;
}

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& o) noexcept {
  if (this != &o) {
    Release();
    pool_ = o.pool_;
    block_ = std::move(o.block_);
    bytes_ = o.bytes_;
    size_ = o.size_;
    o.pool_ = nullptr;
    o.bytes_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void PooledBuffer::Release() {
  if (block_ && pool_ != nullptr) pool_->Give(std::move(block_));
  block_.reset();
  pool_ = nullptr;
  bytes_ = nullptr;
  size_ = 0;
}

void TrimFreeMemory() {
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
}

BufferPool::BufferPool(size_t max_pooled_bytes, size_t trim_after_bytes)
    : max_pooled_bytes_(max_pooled_bytes), trim_after_bytes_(trim_after_bytes) {
  idle_.reserve(256);
}

BufferPool::~BufferPool() = default;

PooledBuffer BufferPool::Take(size_t size) {
  std::unique_ptr<PooledBuffer::Block> block;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The most recently returned buffer that is large enough (warm in the cache); else the
    // largest, which grows.
    for (size_t i = idle_.size(); i-- > 0;) {
      if (idle_[i]->capacity >= size) {
        block = std::move(idle_[i]);
        idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    if (!block && !idle_.empty()) {
      auto largest = std::max_element(idle_.begin(), idle_.end(), [](const auto& a, const auto& b) {
        return a->capacity < b->capacity;
      });
      block = std::move(*largest);
      idle_.erase(largest);
    }
    if (block) idle_bytes_ -= block->capacity;
    if (!block || block->capacity < size) ++allocations_;
  }
  if (!block) block = std::make_unique<PooledBuffer::Block>();
  if (block->capacity < size) {
    // Grow with some room, so that slowly growing sizes do not reallocate every time.
    const size_t capacity = std::max(size, block->capacity + block->capacity / 2);
    block->bytes.reset(new char[capacity]);
    block->capacity = capacity;
  }
  return PooledBuffer(this, std::move(block), size);
}

void BufferPool::Give(std::unique_ptr<PooledBuffer::Block> block) {
  bool trim = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_bytes_ + block->capacity <= max_pooled_bytes_) {
      idle_bytes_ += block->capacity;
      idle_.push_back(std::move(block));
      return;
    }
    // Beyond the pool: freed (below, outside the lock); a burst of them is given back.
    freed_since_trim_ += block->capacity;
    if (freed_since_trim_ >= trim_after_bytes_) {
      freed_since_trim_ = 0;
      ++trims_;
      trim = true;
    }
  }
  block.reset();
  if (trim) TrimFreeMemory();
}

size_t BufferPool::allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_;
}

size_t BufferPool::trims() const {
  std::lock_guard<std::mutex> lock(mu_);
  return trims_;
}

size_t BufferPool::idle_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_bytes_;
}

}  // namespace moerun
