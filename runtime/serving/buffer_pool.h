// Byte buffers for frames, reused instead of allocated per request: a frame's body is read into
// one, and an answer is written into one after its frame header. A buffer keeps its capacity when
// it goes back to its pool, so at steady state (frames no larger than before) no buffer is
// allocated. The pool keeps at most `max_pooled_bytes` of idle buffers (8 MiB by default); a
// buffer returned beyond that is freed, and once such frees add up to `trim_after_bytes` the
// allocator is asked to give its free memory back to the system (TrimFreeMemory), so that a burst
// (a client pipelining 64 MiB of answers it never reads, thousands of connections at once) does
// not leave the process that much larger once it is over. A 256 MiB pool kept ~80 MiB resident
// after such a burst (tests/serving/endpoint_floods.sh measures it).
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

// Returns the allocator's free memory to the system (glibc: malloc_trim(0), which also releases
// free pages inside the heap, not only at its top); a no-op elsewhere. Costs a walk of the free
// lists: call it after a burst of frees, not per request. Thread-safe.
void TrimFreeMemory();

class BufferPool {
 public:
  explicit BufferPool(size_t max_pooled_bytes = size_t{8} << 20,
                      size_t trim_after_bytes = size_t{4} << 20);
  ~BufferPool();

  // A buffer of `size` bytes (contents undefined); allocates only when no idle buffer is large
  // enough.
  PooledBuffer Take(size_t size);
  // Buffers allocated so far (idle and in use), and TrimFreeMemory calls, for tests.
  size_t allocations() const;
  size_t trims() const;
  // Bytes of the idle buffers kept.
  size_t idle_bytes() const;

 private:
  friend class PooledBuffer;
  void Give(std::unique_ptr<PooledBuffer::Block> block);

  const size_t max_pooled_bytes_;
  const size_t trim_after_bytes_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<PooledBuffer::Block>> idle_;  // under mu_
  size_t idle_bytes_ = 0;                                   // under mu_
  size_t allocations_ = 0;                                  // under mu_
  size_t freed_since_trim_ = 0;                             // under mu_
  size_t trims_ = 0;                                        // under mu_
};

}  // namespace moerun
