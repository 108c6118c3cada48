// Test helper: counts heap allocations (every operator new, and every malloc, calloc, realloc,
// aligned_alloc, memalign and posix_memalign, on every thread and from every library) while
// counting is on. A binary that links alloc_counter.cc has operator new replaced and the C
// allocator interposed (glibc: they forward to __libc_malloc and its kin); threads that drive a
// test (its clients) mark themselves NotCounted. MOERUN_ALLOC_TRACE=N prints the call stacks of the
// first N counted allocations, to find them (symbolize with addr2line).
#pragma once

#include <cstdint>

// Under a sanitizer the C allocator belongs to the sanitizer's runtime (it intercepts malloc,
// strdup and their kin with an allocator of its own, which a free of ours must not meet): there
// only operator new is counted, through malloc, and the C allocator is left alone.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MOERUN_ALLOC_COUNTS_MALLOC 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define MOERUN_ALLOC_COUNTS_MALLOC 0
#endif
#endif
#ifndef MOERUN_ALLOC_COUNTS_MALLOC
#define MOERUN_ALLOC_COUNTS_MALLOC 1
#endif

namespace moerun::testing {

void StartCountingAllocations();     // resets the count
uint64_t StopCountingAllocations();  // the count since the start
// This thread's allocations are not counted (from now on, until it ends or says otherwise).
void SetThreadNotCounted(bool not_counted);

}  // namespace moerun::testing
