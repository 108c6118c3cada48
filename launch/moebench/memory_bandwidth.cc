#include "launch/moebench/memory_bandwidth.h"

#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "base/aligned_buffer.h"

namespace moerun::bench {
namespace {

// The read kernels walk kReadStreams parts of their range at once, one cache line of each per
// step, each part into its own accumulators: more misses in flight per core than one stream (and
// its hardware prefetcher) keeps, which is what bounds a core's share of the bandwidth.
constexpr int kReadStreams = 4;
constexpr size_t kLineWords = 64 / sizeof(uint64_t);
// Software prefetch distance per stream, in words (2 KiB ahead: far enough to cover the memory
// latency at a stream's rate, near enough to stay in L1/L2 until read).
constexpr size_t kPrefetchWords = 2048 / sizeof(uint64_t);
// Words per ParallelFor task: 2 MiB, so a 512 MiB pass has 256 tasks to balance the threads.
constexpr size_t kTaskWords = (size_t{2} << 20) / sizeof(uint64_t);

// Words in each of the kReadStreams parts of an n-word range: whole lines; the kernels read the
// rest (under kReadStreams lines) with TailSum.
size_t StreamWords(size_t n) { return n / (kReadStreams * kLineWords) * kLineWords; }

// Prefetches words[at] for reading, clamped into [0, n) so the address stays in the buffer.
inline void PrefetchWord(const uint64_t* words, size_t n, size_t at) {
  __builtin_prefetch(words + std::min(at, n - 1), 0, 3);
}

// The plain sum of words[from, n): the kernels' tail, and the scalar reference.
inline uint64_t TailSum(const uint64_t* words, size_t from, size_t n) {
  uint64_t s = 0;
  for (size_t i = from; i < n; ++i) s += words[i];
  return s;
}

// Portable kernel (the compiler may vectorise it with the baseline ISA): one accumulator per
// stream.
uint64_t ReadSumScalar(const uint64_t* words, size_t n) {
  const size_t part = StreamWords(n);
  uint64_t acc[kReadStreams] = {};
  for (size_t i = 0; i < part; i += kLineWords) {
    for (int s = 0; s < kReadStreams; ++s) {
      const size_t at = static_cast<size_t>(s) * part + i;
      PrefetchWord(words, n, at + kPrefetchWords);
      for (size_t w = 0; w < kLineWords; ++w) acc[s] += words[at + w];
    }
  }
  return acc[0] + acc[1] + acc[2] + acc[3] + TailSum(words, kReadStreams * part, n);
}

// AVX2 kernel: a line is two 32-byte loads, each into its own accumulator (8 in all).
__attribute__((target("avx2"))) uint64_t ReadSumAvx2(const uint64_t* words, size_t n) {
  const size_t part = StreamWords(n);
  __m256i acc[2 * kReadStreams];
  for (__m256i& a : acc) a = _mm256_setzero_si256();
  for (size_t i = 0; i < part; i += kLineWords) {
    for (int s = 0; s < kReadStreams; ++s) {
      const size_t at = static_cast<size_t>(s) * part + i;
      PrefetchWord(words, n, at + kPrefetchWords);
      const auto* line = reinterpret_cast<const __m256i*>(words + at);
      acc[2 * s] = _mm256_add_epi64(acc[2 * s], _mm256_loadu_si256(line));
      acc[2 * s + 1] = _mm256_add_epi64(acc[2 * s + 1], _mm256_loadu_si256(line + 1));
    }
  }
  __m256i t = _mm256_setzero_si256();
  for (const __m256i& a : acc) t = _mm256_add_epi64(t, a);
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), t);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + TailSum(words, kReadStreams * part, n);
}

// AVX-512 kernel: a line is one 64-byte load into the stream's accumulator.
__attribute__((target("avx512f"))) uint64_t ReadSumAvx512(const uint64_t* words, size_t n) {
  const size_t part = StreamWords(n);
  __m512i acc[kReadStreams];
  for (__m512i& a : acc) a = _mm512_setzero_si512();
  for (size_t i = 0; i < part; i += kLineWords) {
    for (int s = 0; s < kReadStreams; ++s) {
      const size_t at = static_cast<size_t>(s) * part + i;
      PrefetchWord(words, n, at + kPrefetchWords);
      acc[s] = _mm512_add_epi64(acc[s], _mm512_loadu_si512(words + at));
    }
  }
  const __m512i t =
      _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
  // Lanes through memory: GCC 12's _mm512_reduce_add_epi64 trips -Werror=uninitialized.
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, t);
  return TailSum(lanes, 0, 8) + TailSum(words, kReadStreams * part, n);
}

// Fills the buffer on every thread (each page is touched, so no pass pays its first-touch
// faults) with distinct words, so a kernel that skips or repeats one changes the sum.
void FillWords(ThreadPool* pool, uint64_t* words, size_t n) {
  const int64_t tasks = static_cast<int64_t>((n + kTaskWords - 1) / kTaskWords);
  pool->ParallelFor(tasks, [&](int64_t t, int) {
    const size_t from = static_cast<size_t>(t) * kTaskWords;
    const size_t to = std::min(n, from + kTaskWords);
    for (size_t i = from; i < to; ++i) words[i] = i * 0x9e3779b97f4a7c15ull + 1;
  });
}

// Bytes per second of one ReadAll pass; its sum goes to *sum (to compare passes and keep the
// reads alive).
double TimePass(ThreadPool* pool, Isa isa, const uint64_t* words, size_t n, uint64_t* sum) {
  const auto t0 = std::chrono::steady_clock::now();
  const ReadPass pass = ReadAll(pool, isa, words, n);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  *sum = pass.sum;
  return static_cast<double>(pass.bytes) / sec;
}

}  // namespace

uint64_t ReadSum(Isa isa, const uint64_t* words, size_t n) {
  switch (isa) {
    case Isa::kAvx512:
      return ReadSumAvx512(words, n);
    case Isa::kAvx2:
      return ReadSumAvx2(words, n);
    case Isa::kScalar:
      break;
  }
  return ReadSumScalar(words, n);
}

ReadPass ReadAll(ThreadPool* pool, Isa isa, const uint64_t* words, size_t n) {
  const int64_t tasks = static_cast<int64_t>((n + kTaskWords - 1) / kTaskWords);
  std::atomic<uint64_t> sum{0};
  std::atomic<size_t> bytes{0};
  pool->ParallelFor(tasks, [&](int64_t t, int) {
    const size_t from = static_cast<size_t>(t) * kTaskWords;
    const size_t count = std::min(kTaskWords, n - from);
    sum.fetch_add(ReadSum(isa, words + from, count), std::memory_order_relaxed);
    bytes.fetch_add(count * sizeof(uint64_t), std::memory_order_relaxed);
  });
  return {sum.load(), bytes.load()};
}

size_t DefaultReadBufferBytes() {
  long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc <= 0) llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return std::max(size_t{512} << 20, 8 * static_cast<size_t>(std::max(llc, 0L)));
}

ReadBandwidth MeasureReadBandwidth(ThreadPool* pool, size_t bytes, int reps) {
  ReadBandwidth out;
  out.threads = pool->size();
  out.reps = std::max(reps, 1);
  const size_t n = bytes / sizeof(uint64_t);
  out.buffer_bytes = n * sizeof(uint64_t);
  AlignedBuffer buf(out.buffer_bytes);
  uint64_t* words = buf.as<uint64_t>();
  FillWords(pool, words, n);
  for (Isa isa : SupportedIsas()) out.variants.push_back({isa, 0});
  uint64_t first_sum = 0;
  for (int r = 0; r < out.reps; ++r) {
    for (ReadVariantRate& v : out.variants) {
      uint64_t sum = 0;
      v.bytes_per_s = std::max(v.bytes_per_s, TimePass(pool, v.isa, words, n, &sum));
      if (r == 0 && v.isa == Isa::kScalar) first_sum = sum;
      out.sums_agree = out.sums_agree && sum == first_sum;
    }
  }
  for (const ReadVariantRate& v : out.variants) {
    if (v.bytes_per_s > out.bytes_per_s) {
      out.bytes_per_s = v.bytes_per_s;
      out.best = v.isa;
    }
  }
  return out;
}

}  // namespace moerun::bench
