// Byte buffers for frames, reused instead of allocated per request: a frame's body is read into
// one, and an answer is written into one after its frame header. A buffer keeps its capacity when
// it goes back to its pool, so at steady state (frames no larger than before) no buffer is
// allocated. The pool keeps at most `max_pooled_bytes` of idle buffers; a buffer returned beyond
// that is freed.
//
// Thread-safety: a BufferPool may be used from any thread (one mutex, held for a push or a pop);
// a PooledBuffer belongs to one thread at a time and goes back to its pool when destroyed. The
// pool must outlive its buffers.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace moerun {

class BufferPool;

class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(PooledBuffer&& o) noexcept;
  PooledBuffer& operator=(PooledBuffer&& o) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer() { Release(); }

  char* data() { return bytes_; }
  const char* data() const { return bytes_; }
  size_t size() const { return size_; }
  bool empty() const { return bytes_ == nullptr; }
  // Gives the buffer back to its pool (idempotent).
  void Release();

 private:
  friend class BufferPool;
  struct Block {
    std::unique_ptr<char[]> bytes;
    size_t capacity = 0;
  };
  PooledBuffer(BufferPool* pool, std::unique_ptr<Block> block, size_t size);

  BufferPool* pool_ = nullptr;
  std::unique_ptr<Block> block_;
  char* bytes_ = nullptr;
  size_t size_ = 0;
};

class BufferPool {
 public:
  explicit BufferPool(size_t max_pooled_bytes = size_t{256} << 20);
  ~BufferPool();

  // A buffer of `size` bytes (contents undefined); allocates only when no idle buffer is large
  // enough.
  PooledBuffer Take(size_t size);
  // Buffers allocated so far (idle and in use), for tests.
  size_t allocations() const;

 private:
  friend class PooledBuffer;
  void Give(std::unique_ptr<PooledBuffer::Block> block);

  const size_t max_pooled_bytes_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<PooledBuffer::Block>> idle_;  // under mu_
  size_t idle_bytes_ = 0;                                   // under mu_
  size_t allocations_ = 0;                                  // under mu_
};

}  // namespace moerun
