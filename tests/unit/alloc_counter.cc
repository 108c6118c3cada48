// The replacements below pair glibc's malloc/memalign with free on purpose.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include "tests/unit/alloc_counter.h"

#include <execinfo.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
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
thread_local bool t_in_trace = false;  // backtrace's own first allocations are not counted
void Trace() {
  if (g_traced.fetch_add(1) >= g_trace) return;
  t_in_trace = true;
  void* frames[24];
  const int n = backtrace(frames, 24);
  std::fprintf(stderr, "--- counted allocation %d\n", g_traced.load());
  backtrace_symbols_fd(frames, n, 2);
  t_in_trace = false;
}
bool Counted() {
  return g_counting.load(std::memory_order_relaxed) && !t_not_counted && !t_in_trace;
}
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

#if MOERUN_ALLOC_COUNTS_MALLOC
// The C allocator, interposed: a definition here (in the executable) takes the place of libc's for
// every library the binary loads, libc's own callers included (strdup, fopen, ...). Each counts
// and forwards to glibc's allocator under its internal names, which glibc exports for exactly
// this (no dlsym: dlsym itself allocates). Memory from any of them may be freed by any free.
extern "C" {
void* __libc_malloc(size_t n);  // NOLINT: glibc's names
void* __libc_calloc(size_t n, size_t m);
void* __libc_realloc(void* p, size_t n);
void* __libc_memalign(size_t align, size_t n);
void __libc_free(void* p);

void* malloc(size_t n) noexcept {
  if (Counted()) Count();
  return __libc_malloc(n);
}
void* calloc(size_t n, size_t m) noexcept {
  if (Counted()) Count();
  return __libc_calloc(n, m);
}
void* realloc(void* p, size_t n) noexcept {
  if (Counted()) Count();
  return __libc_realloc(p, n);
}
void free(void* p) noexcept { __libc_free(p); }
void* aligned_alloc(size_t align, size_t n) noexcept {
  if (Counted()) Count();
  return __libc_memalign(align, n);
}
void* memalign(size_t align, size_t n) noexcept {
  if (Counted()) Count();
  return __libc_memalign(align, n);
}
int posix_memalign(void** out, size_t align, size_t n) noexcept {
  if (align < sizeof(void*) || (align & (align - 1)) != 0) return EINVAL;
  if (Counted()) Count();
  void* p = __libc_memalign(align, n);
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
}  // extern "C"
#endif  // MOERUN_ALLOC_COUNTS_MALLOC

// Where operator new takes its memory: glibc's allocator directly when the C allocator is
// interposed above (not through that malloc, which would count it twice), the sanitizer's
// malloc otherwise.
namespace {
#if MOERUN_ALLOC_COUNTS_MALLOC
void* RawAlloc(std::size_t n) { return __libc_malloc(n); }
void* RawAlignedAlloc(std::size_t align, std::size_t n) { return __libc_memalign(align, n); }
void RawFree(void* p) { __libc_free(p); }
#else
void* RawAlloc(std::size_t n) { return std::malloc(n); }
void* RawAlignedAlloc(std::size_t align, std::size_t n) {
  void* p = nullptr;
  return posix_memalign(&p, align < sizeof(void*) ? sizeof(void*) : align, n) == 0 ? p : nullptr;
}
void RawFree(void* p) { std::free(p); }
#endif
}  // namespace

// operator new counts once and takes its memory from RawAlloc (above).
void* operator new(std::size_t n) {
  if (Counted()) Count();
  if (void* p = RawAlloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (Counted()) Count();
  const size_t align = static_cast<size_t>(a);
  if (void* p = RawAlignedAlloc(align, n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { RawFree(p); }
void operator delete[](void* p) noexcept { RawFree(p); }
void operator delete(void* p, std::size_t) noexcept { RawFree(p); }
void operator delete[](void* p, std::size_t) noexcept { RawFree(p); }
void operator delete(void* p, std::align_val_t) noexcept { RawFree(p); }
void operator delete[](void* p, std::align_val_t) noexcept { RawFree(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { RawFree(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { RawFree(p); }
