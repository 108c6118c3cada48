// Memory for Asio's asynchronous operations without a heap allocation per operation (the pattern
// of Asio's "allocation" example): each kind of operation of a connection (its reads, its writes,
// a timer) gets a HandlerMemory of a few small blocks, and its handlers are wrapped with
// WithMemory so that Asio allocates their operation state there. A block is free again before the
// handler runs, so a chain of operations reuses it; an operation that finds every block taken (or
// is too large) falls back to the heap.
//
// Thread-safety: blocks are claimed and freed with atomics, so the operation may be started on
// one thread and completed on another (a post from the router thread to the I/O thread).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <new>
#include <utility>

namespace moerun {

class HandlerMemory {
 public:
  static constexpr size_t kBlockBytes = 512;
  static constexpr size_t kBlocks = 2;

  HandlerMemory() = default;
  HandlerMemory(const HandlerMemory&) = delete;
  HandlerMemory& operator=(const HandlerMemory&) = delete;

  void* Allocate(size_t n) {
    if (n <= kBlockBytes) {
      for (size_t i = 0; i < kBlocks; ++i) {
        bool expected = false;
        if (used_[i].compare_exchange_strong(expected, true, std::memory_order_acquire)) {
          return blocks_[i].bytes;
        }
      }
    }
    return ::operator new(n);
  }

  void Deallocate(void* p) {
    for (size_t i = 0; i < kBlocks; ++i) {
      if (p == blocks_[i].bytes) {
        used_[i].store(false, std::memory_order_release);
        return;
      }
    }
    ::operator delete(p);
  }

 private:
  struct alignas(std::max_align_t) Block {
    unsigned char bytes[kBlockBytes];
  };
  std::array<Block, kBlocks> blocks_{};
  std::array<std::atomic<bool>, kBlocks> used_{};
};

// The allocator Asio finds through a handler's allocator_type / get_allocator().
template <typename T>
class HandlerAllocator {
 public:
  using value_type = T;
  explicit HandlerAllocator(HandlerMemory* m) : memory_(m) {}
  template <typename U>
  HandlerAllocator(const HandlerAllocator<U>& o) noexcept : memory_(o.memory_) {}
  T* allocate(size_t n) { return static_cast<T*>(memory_->Allocate(sizeof(T) * n)); }
  void deallocate(T* p, size_t) { memory_->Deallocate(p); }
  template <typename U>
  bool operator==(const HandlerAllocator<U>& o) const noexcept {
    return memory_ == o.memory_;
  }
  template <typename U>
  bool operator!=(const HandlerAllocator<U>& o) const noexcept {
    return memory_ != o.memory_;
  }

 private:
  template <typename>
  friend class HandlerAllocator;
  HandlerMemory* memory_;
};

template <typename Handler>
class MemoryHandler {
 public:
  using allocator_type = HandlerAllocator<Handler>;
  MemoryHandler(HandlerMemory* m, Handler h) : memory_(m), handler_(std::move(h)) {}
  allocator_type get_allocator() const noexcept { return allocator_type(memory_); }
  template <typename... Args>
  void operator()(Args&&... args) {
    handler_(std::forward<Args>(args)...);
  }

 private:
  HandlerMemory* memory_;
  Handler handler_;
};

// `h`, with its operation's state in `m` (which must outlive the operation).
template <typename Handler>
MemoryHandler<std::decay_t<Handler>> WithMemory(HandlerMemory* m, Handler&& h) {
  return MemoryHandler<std::decay_t<Handler>>(m, std::forward<Handler>(h));
}

}  // namespace moerun
