// The gate functions of router/gate.h for one token, computed by a warp: the GPU route kernel's
// code (router/cuda/gate_kernels.cu), written once for the device and for a host emulation of a
// warp, so that tests/unit/route_warp_test.cc runs this very source on the host and checks its
// experts and weight bits against the CPU gate (router/gate.cc's Route).
//
// Layout: expert e lives in lane e % 32, slot e / 32 (S slots a lane, S * 32 >= num_experts, at
// most 16); selection j (top_k <= 64) in lane j % 32, slot j / 32. Per-lane values are register
// arrays indexed only by compile-time slot numbers (fully unrolled loops; a runtime slot is
// picked by an unrolled select), so the device code keeps everything in registers: no local
// memory. Max and argmax are warp butterflies (order-free); every sum walks its values in index
// order, each broadcast from the lane that owns it, exactly as the CPU's loop adds them. Top-k is
// repeated selection of the largest key, ties to the lower index, NaN ranked lowest: the order of
// router/gate.cc's partial sort. Same ExpF and SigmoidF (base/fast_exp.h); CUDA code is built
// with --fmad=false, the host with -ffp-contract=off.
//
// How one source serves both: the algorithm is a template on a warp policy W.
//   W::V<T>          a per-lane value: T on the device (this thread's lane), std::array<T, 32> on
//                    the host (all lanes); written and read only as v[l] inside a lane loop
//                    `for (int l = W::Begin(); l < W::End(); ++l)` (the device runs its own lane
//                    once, the host runs lanes 0..31 in turn);
//   W::Bcast(v, src) lane src's value, to every lane (__shfl_sync);
//   W::Xor(v, m)     each lane gets lane (l ^ m)'s value (__shfl_xor_sync);
//   W::Uniform(v)    a value all lanes hold the same (the host checks that they do).
// Code outside lane loops sees only uniform scalars, so every shuffle is reached by the whole
// warp, and on the host the type system keeps per-lane values inside lane loops. Pure.
#pragma once

#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/fast_exp.h"
#include "base/host_device.h"
#include "router/gate.h"

#if defined(__CUDACC__)
#define MOERUN_ROUTE_INLINE __forceinline__
#else
#define MOERUN_ROUTE_INLINE inline
#endif
#if defined(__CUDA_ARCH__)
#define MOERUN_ROUTE_UNROLL _Pragma("unroll")
#else
#define MOERUN_ROUTE_UNROLL
#endif

namespace moerun::route_warp {

constexpr int kWarp = 32;
constexpr int kMaxExperts = 512;
constexpr int kMaxSlots = kMaxExperts / kWarp;
constexpr int kMaxGroups = 256;
constexpr int kMaxTopK = 64;  // ModelSpec::Validate refuses more
constexpr int kSelSlots = kMaxTopK / kWarp;

// Slots a lane holds for `num_experts` (1..512): the next power of two of ceil(n / 32), so that
// five kernel instantiations (1, 2, 4, 8, 16) cover every expert count.
constexpr int SlotsFor(int num_experts) {
  int s = 1;
  while (s * kWarp < num_experts) s *= 2;
  return s;
}

// The host's warp: 32 lanes run one after another, in lockstep between shuffles.
struct HostWarp {
  template <class T>
  using V = std::array<T, kWarp>;
  static int Begin() { return 0; }
  static int End() { return kWarp; }
  template <class T>
  static T Bcast(const V<T>& x, int src) {
    return x[static_cast<size_t>(src)];
  }
  template <class T>
  static V<T> Xor(const V<T>& x, int mask) {
    V<T> r;
    for (int l = 0; l < kWarp; ++l) r[static_cast<size_t>(l)] = x[static_cast<size_t>(l ^ mask)];
    return r;
  }
  // Counts calls whose lanes disagree (bitwise): on the device each lane would go its own way.
  static inline int non_uniform = 0;
  template <class T>
  static T Uniform(const V<T>& x) {
    for (const T& v : x) {
      if (std::memcmp(&v, &x[0], sizeof(T)) != 0) {
        ++non_uniform;
        break;
      }
    }
    return x[0];
  }
  static void AtomicMax(int32_t* p, int32_t v) { *p = v > *p ? v : *p; }
};

#if defined(__CUDACC__)
// The device's warp: each thread is one lane; V<T> is that lane's value.
template <class T>
struct DeviceLane {
  T v;
  __device__ T& operator[](int) { return v; }
  __device__ const T& operator[](int) const { return v; }
};
struct DeviceWarp {
  template <class T>
  using V = DeviceLane<T>;
  __device__ static int Begin() { return static_cast<int>(threadIdx.x) % kWarp; }
  __device__ static int End() { return Begin() + 1; }
  template <class T>
  __device__ static T Bcast(const V<T>& x, int src) {
    return __shfl_sync(0xffffffffu, x.v, src);
  }
  template <class T>
  __device__ static V<T> Xor(const V<T>& x, int mask) {
    return V<T>{__shfl_xor_sync(0xffffffffu, x.v, mask)};
  }
  template <class T>
  __device__ static T Uniform(const V<T>& x) {
    return x.v;
  }
  __device__ static void AtomicMax(int32_t* p, int32_t v) { atomicMax(p, v); }
};
#endif

MOERUN_HD MOERUN_ROUTE_INLINE float Key(float v) { return v != v ? -INFINITY : v; }

// Round to the nearest bfloat16, ties to even; NaN stays NaN (base/dtype.h's F32ToBf16).
MOERUN_HD MOERUN_ROUTE_INLINE float RoundBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BitsFloat(((u >> 16) | 0x40u) << 16);
  u += 0x7fffu + ((u >> 16) & 1u);
  return BitsFloat((u >> 16) << 16);
}

// a[s][l] for a runtime slot s, by an unrolled select (no dynamic index into registers).
template <class A, int S>
MOERUN_HD MOERUN_ROUTE_INLINE auto Pick(const A (&a)[S], int l, int s) {
  auto r = a[0][l];
  MOERUN_ROUTE_UNROLL
  for (int i = 1; i < S; ++i) r = i == s ? a[i][l] : r;
  return r;
}

// Every lane ends with the best (key, idx) of the warp: the larger key, on equal keys the lower
// idx. Keys are never NaN here.
template <class W>
MOERUN_HD MOERUN_ROUTE_INLINE void ArgMax(typename W::template V<float>& key,
                                          typename W::template V<int>& idx) {
  MOERUN_ROUTE_UNROLL
  for (int m = kWarp / 2; m >= 1; m /= 2) {
    const auto ok = W::Xor(key, m);
    const auto oi = W::Xor(idx, m);
    for (int l = W::Begin(); l < W::End(); ++l) {
      if (ok[l] > key[l] || (ok[l] == key[l] && oi[l] < idx[l])) {
        key[l] = ok[l];
        idx[l] = oi[l];
      }
    }
  }
}

// One step of top-k by repeated selection over v (expert e in lane e % 32, slot e / 32, e < n):
// the index of the largest Key() not yet taken, ties to the lower index; marks it taken
// (taken[l] bit s: lane l's slot s).
template <class W, int S>
MOERUN_HD MOERUN_ROUTE_INLINE int SelectNext(const typename W::template V<float> (&v)[S], int n,
                                             typename W::template V<uint32_t>& taken) {
  typename W::template V<float> key;
  typename W::template V<int> idx;
  for (int l = W::Begin(); l < W::End(); ++l) {
    key[l] = -INFINITY;
    idx[l] = INT_MAX;  // none: loses to every candidate, -inf ones included
    MOERUN_ROUTE_UNROLL
    for (int s = 0; s < S; ++s) {  // in index order, so a strict > keeps the lower index
      const int e = s * kWarp + l;
      if (e >= n || ((taken[l] >> s) & 1u)) continue;
      const float k = Key(v[s][l]);
      if (idx[l] == INT_MAX || k > key[l]) {
        key[l] = k;
        idx[l] = e;
      }
    }
  }
  ArgMax<W>(key, idx);
  const int win = W::Uniform(idx);
  for (int l = W::Begin(); l < W::End(); ++l) {
    if (l == win % kWarp) taken[l] |= 1u << (win / kWarp);
  }
  return win;
}

// sum = sum + v[i] for i = 0..count-1 in order (v[i] in lane i % 32, slot i / 32), from `sum`.
template <class W, int S>
MOERUN_HD MOERUN_ROUTE_INLINE float SumInOrder(const typename W::template V<float> (&v)[S],
                                               int count, float sum) {
  MOERUN_ROUTE_UNROLL
  for (int s = 0; s < S; ++s) {
    for (int src = 0; src < kWarp; ++src) {
      if (s * kWarp + src >= count) break;
      sum = sum + W::Bcast(v[s], src);
    }
  }
  return sum;
}

// Selections 0..k): their ids and weights, selection j in lane j % 32, slot j / 32.
template <class W>
struct Selected {
  typename W::template V<int32_t> id[kSelSlots];
  typename W::template V<float> w[kSelSlots];
};

// k selections of top-k over `choice`; each weight is `value` of the chosen expert.
template <class W, int S>
MOERUN_HD MOERUN_ROUTE_INLINE void TopK(const typename W::template V<float> (&choice)[S],
                                        const typename W::template V<float> (&value)[S], int n,
                                        int k, Selected<W>& out) {
  typename W::template V<uint32_t> taken;
  for (int l = W::Begin(); l < W::End(); ++l) {
    taken[l] = 0;
    MOERUN_ROUTE_UNROLL
    for (int js = 0; js < kSelSlots; ++js) {
      out.id[js][l] = 0;
      out.w[js][l] = 0.0f;
    }
  }
  for (int j = 0; j < k; ++j) {
    const int win = SelectNext<W, S>(choice, n, taken);
    typename W::template V<float> mine;
    for (int l = W::Begin(); l < W::End(); ++l) mine[l] = Pick(value, l, win / kWarp);
    const float wv = W::Bcast(mine, win % kWarp);
    for (int l = W::Begin(); l < W::End(); ++l) {
      MOERUN_ROUTE_UNROLL
      for (int js = 0; js < kSelSlots; ++js) {
        if (j == js * kWarp + l) {
          out.id[js][l] = win;
          out.w[js][l] = wv;
        }
      }
    }
  }
}

// w = w / (w[0] + ... + w[k-1] + eps), the sum in order; then w = w * scale.
template <class W>
MOERUN_HD MOERUN_ROUTE_INLINE void RenormalizeAndScale(const GateSpec& g, Selected<W>& sel) {
  if (g.renormalize) {
    const float sum = SumInOrder<W, kSelSlots>(sel.w, g.top_k, 0.0f) + g.renorm_eps;
    for (int l = W::Begin(); l < W::End(); ++l) {
      MOERUN_ROUTE_UNROLL
      for (int js = 0; js < kSelSlots; ++js) sel.w[js][l] = sel.w[js][l] / sum;
    }
  }
  for (int l = W::Begin(); l < W::End(); ++l) {
    MOERUN_ROUTE_UNROLL
    for (int js = 0; js < kSelSlots; ++js) sel.w[js][l] = sel.w[js][l] * g.scale;
  }
}

// Group-limited selection (kSigmoidTopK, n_group > 1): a group's score is the sum of its best two
// choice values (its best alone when a group has one expert); the topk_group best groups by the
// top-k rule stay and every other expert's choice becomes -inf. The CPU scans a group in order
// keeping (best, second) with strict >: a NaN never enters unless it is the group's first value,
// which makes the score NaN; otherwise best and second are the two largest other values (a
// repeated value counts twice). That is what the order-free merge below computes.
template <class W, int S>
MOERUN_HD MOERUN_ROUTE_INLINE void LimitGroups(const GateSpec& g,
                                               typename W::template V<float> (&choice)[S]) {
  constexpr int GS = S < kMaxGroups / kWarp ? S : kMaxGroups / kWarp;  // n_group <= n, <= 256
  const int n = g.num_experts, per = n / g.n_group;
  typename W::template V<float> score[GS];  // group q: lane q % 32, slot q / 32
  for (int l = W::Begin(); l < W::End(); ++l) {
    MOERUN_ROUTE_UNROLL
    for (int gs = 0; gs < GS; ++gs) score[gs][l] = 0.0f;
  }
  for (int q = 0; q < g.n_group; ++q) {
    const int lo = q * per, hi = lo + per;
    typename W::template V<float> b1, b2, first;
    for (int l = W::Begin(); l < W::End(); ++l) {
      b1[l] = -INFINITY;
      b2[l] = -INFINITY;
      MOERUN_ROUTE_UNROLL
      for (int s = 0; s < S; ++s) {
        const int e = s * kWarp + l;
        const float c = choice[s][l];
        if (e < lo || e >= hi || c != c) continue;
        if (c > b1[l]) {
          b2[l] = b1[l];
          b1[l] = c;
        } else if (c > b2[l]) {
          b2[l] = c;
        }
      }
      first[l] = Pick(choice, l, lo / kWarp);
    }
    MOERUN_ROUTE_UNROLL
    for (int m = kWarp / 2; m >= 1; m /= 2) {
      const auto o1 = W::Xor(b1, m);
      const auto o2 = W::Xor(b2, m);
      for (int l = W::Begin(); l < W::End(); ++l) {
        const float hi1 = o1[l] > b1[l] ? o1[l] : b1[l];
        const float lo1 = o1[l] > b1[l] ? b1[l] : o1[l];
        const float hi2 = o2[l] > b2[l] ? o2[l] : b2[l];
        b1[l] = hi1;
        b2[l] = hi2 > lo1 ? hi2 : lo1;
      }
    }
    const float c0 = W::Bcast(first, lo % kWarp);
    typename W::template V<float> sc;
    for (int l = W::Begin(); l < W::End(); ++l) {
      sc[l] = c0 != c0 ? c0 : (per >= 2 ? b1[l] + b2[l] : b1[l]);
    }
    // Lanes may differ in the sign of a zero score (not in its value): take lane 0's.
    const float group_score = W::Bcast(sc, 0);
    for (int l = W::Begin(); l < W::End(); ++l) {
      MOERUN_ROUTE_UNROLL
      for (int gs = 0; gs < GS; ++gs) {
        if (q == gs * kWarp + l) score[gs][l] = group_score;
      }
    }
  }
  typename W::template V<uint32_t> group_taken, keep;  // keep bit s: lane l's slot s stays
  for (int l = W::Begin(); l < W::End(); ++l) group_taken[l] = keep[l] = 0;
  for (int i = 0; i < g.topk_group; ++i) {
    const int q = SelectNext<W, GS>(score, g.n_group, group_taken);
    for (int l = W::Begin(); l < W::End(); ++l) {
      MOERUN_ROUTE_UNROLL
      for (int s = 0; s < S; ++s) {
        const int e = s * kWarp + l;
        if (e >= q * per && e < (q + 1) * per) keep[l] |= 1u << s;
      }
    }
  }
  for (int l = W::Begin(); l < W::End(); ++l) {
    MOERUN_ROUTE_UNROLL
    for (int s = 0; s < S; ++s) {
      if (!((keep[l] >> s) & 1u)) choice[s][l] = -INFINITY;
    }
  }
}

// One token's inputs and outputs.
struct TokenArgs {
  const float* row;             // the token's router logits: num_experts (+1 with shared_gated)
  const float* gate_bias;       // num_experts or null: added to the logits first
  const float* selection_bias;  // num_experts or null: kSigmoidTopK's choice only
  bool shared_gated;            // *shared_scale = SigmoidF(row[num_experts]), else 1
  const uint8_t* present;       // num_experts: 0 where the expert is not loaded
  int32_t* ids;                 // top_k expert ids, in selection order
  float* weights;               // top_k weights
  float* shared_scale;          // one value
  int32_t* error_flag;          // raised to id + 1 for a chosen id whose expert is not present
};

// The gate function of router/gate.h for one token (num_experts <= S * 32, top_k <= 64),
// computed by the whole warp; the same bits as Route() of router/gate.cc.
template <class W, int S>
MOERUN_HD MOERUN_ROUTE_INLINE void RouteToken(const GateSpec& g, const TokenArgs& a) {
  using F = typename W::template V<float>;
  const int n = g.num_experts, k = g.top_k;
  F logit[S];  // kSigmoidTopK: the choice values, once the sigmoid has read them
  F probs[S];
  for (int l = W::Begin(); l < W::End(); ++l) {
    MOERUN_ROUTE_UNROLL
    for (int s = 0; s < S; ++s) {
      const int e = s * kWarp + l;
      float x = 0.0f;
      if (e < n) {
        x = a.gate_bias != nullptr ? a.row[e] + a.gate_bias[e] : a.row[e];
        if (g.bf16_logits) x = RoundBf16(x);
      }
      logit[s][l] = x;
      probs[s][l] = 0.0f;
    }
  }
  Selected<W> sel;
  switch (g.kind) {
    case GateKind::kSoftmaxTopK: {
      // The CPU's mx = logit[i] > mx ? logit[i] : mx from logit[0]: NaN when logit[0] is NaN,
      // else the first largest of the other values (NaN never enters): an argmax, ties lower.
      const float first = W::Bcast(logit[0], 0);
      F key;
      typename W::template V<int> idx;
      for (int l = W::Begin(); l < W::End(); ++l) {
        key[l] = -INFINITY;
        idx[l] = INT_MAX;
        MOERUN_ROUTE_UNROLL
        for (int s = 0; s < S; ++s) {
          const int e = s * kWarp + l;
          const float x = logit[s][l];
          if (e >= n || x != x) continue;
          if (idx[l] == INT_MAX || x > key[l]) {
            key[l] = x;
            idx[l] = e;
          }
        }
      }
      ArgMax<W>(key, idx);
      const float mx = first != first ? first : W::Uniform(key);
      for (int l = W::Begin(); l < W::End(); ++l) {
        MOERUN_ROUTE_UNROLL
        for (int s = 0; s < S; ++s) {
          if (s * kWarp + l < n) probs[s][l] = ExpF(logit[s][l] - mx);
        }
      }
      const float sum = SumInOrder<W, S>(probs, n, 0.0f);
      for (int l = W::Begin(); l < W::End(); ++l) {
        MOERUN_ROUTE_UNROLL
        for (int s = 0; s < S; ++s) probs[s][l] = probs[s][l] / sum;
      }
      TopK<W, S>(probs, probs, n, k, sel);
      RenormalizeAndScale<W>(g, sel);
      break;
    }
    case GateKind::kSigmoidTopK: {
      F(&choice)[S] = logit;
      for (int l = W::Begin(); l < W::End(); ++l) {
        MOERUN_ROUTE_UNROLL
        for (int s = 0; s < S; ++s) {
          const int e = s * kWarp + l;
          if (e >= n) continue;
          probs[s][l] = SigmoidF(logit[s][l]);
          choice[s][l] =
              a.selection_bias != nullptr ? probs[s][l] + a.selection_bias[e] : probs[s][l];
        }
      }
      if (g.n_group > 1) LimitGroups<W, S>(g, choice);
      TopK<W, S>(choice, probs, n, k, sel);
      RenormalizeAndScale<W>(g, sel);
      break;
    }
    case GateKind::kTopKSoftmax: {
      TopK<W, S>(logit, logit, n, k, sel);
      const float mx = W::Bcast(sel.w[0], 0);
      for (int l = W::Begin(); l < W::End(); ++l) {
        MOERUN_ROUTE_UNROLL
        for (int js = 0; js < kSelSlots; ++js) {
          if (js * kWarp + l < k) sel.w[js][l] = ExpF(sel.w[js][l] - mx);
        }
      }
      const float sum = SumInOrder<W, kSelSlots>(sel.w, k, 0.0f);
      for (int l = W::Begin(); l < W::End(); ++l) {
        MOERUN_ROUTE_UNROLL
        for (int js = 0; js < kSelSlots; ++js) sel.w[js][l] = sel.w[js][l] / sum;
      }
      break;
    }
  }
  for (int l = W::Begin(); l < W::End(); ++l) {
    MOERUN_ROUTE_UNROLL
    for (int js = 0; js < kSelSlots; ++js) {
      const int j = js * kWarp + l;
      if (j >= k) continue;
      const int32_t id = sel.id[js][l];
      a.ids[j] = id;
      a.weights[j] = sel.w[js][l];
      if (!a.present[id]) W::AtomicMax(a.error_flag, id + 1);
    }
    if (l == 0) *a.shared_scale = a.shared_gated ? SigmoidF(a.row[n]) : 1.0f;
  }
}

}  // namespace moerun::route_warp
