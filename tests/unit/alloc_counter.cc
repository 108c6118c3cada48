// The replacements below pair malloc/aligned_alloc with free on purpose.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include "tests/unit/alloc_counter.h"

#include <execinfo.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

namespace {
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_allocations{0};
thread_local bool t_not_counted = false;  // a test's client threads
// MOERUN_ALLOC_TRACE=N prints the call stacks of the first N counted allocations (to find them).
const int g_trace =
    std::getenv("MOERUN_ALLOC_TRACE") ? std::atoi(std::getenv("MOERUN_ALLOC_TRACE")) : 0;
std::atomic<int> g_traced{0};
void Trace() {
  static thread_local bool in_trace = false;
  if (in_trace || g_traced.fetch_add(1) >= g_trace) return;
  in_trace = true;
  void* frames[24];
  const int n = backtrace(frames, 24);
  std::fprintf(stderr, "--- counted allocation %d\n", g_traced.load());
  backtrace_symbols_fd(frames, n, 2);
  in_trace = false;
}
bool Counted() { return g_counting.load(std::memory_order_relaxed) && !t_not_counted; }
void Count() {
  g_allocations.fetch_add(1);
  if (g_trace > 0) Trace();
}
}  // namespace

namespace moerun::testing {

void StartCountingAllocations() {
  g_allocations = 0;
  g_counting = true;
}

uint64_t StopCountingAllocations() {
  g_counting = false;
  return g_allocations.load();
}

void SetThreadNotCounted(bool not_counted) { t_not_counted = not_counted; }

}  // namespace moerun::testing

void* operator new(std::size_t n) {
  if (Counted()) Count();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (Counted()) Count();
  const size_t align = static_cast<size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
