// libFuzzer target for ParseSafetensorsHeader: arbitrary bytes must never crash the parser, and
// whatever it accepts must satisfy the invariants the rest of moerun relies on:
//   - the data buffer starts at 8 + N, inside the input;
//   - every tensor has numel == product(shape) and (numel x dtype bits) / 8 == end - begin;
//   - the tensors are sorted by offset and tile [0, data length) exactly, so every span lies
//     inside the input.
// A violation traps (__builtin_trap) so that the fuzzer reports it with the input that broke it.
#include <cstddef>
#include <cstdint>
#include <span>

#include "base/dtype.h"
#include "runtime/model/safetensors.h"

namespace {

void Check(bool invariant) {
  if (!invariant) __builtin_trap();
}

void CheckTensor(const moerun::TensorInfo& t) {
  Check(t.name != "__metadata__");
  Check(t.begin <= t.end);
  Check(t.numel >= 0);
  // The product of the dims, saturated just above INT64_MAX (128 bits cannot overflow then).
  constexpr unsigned __int128 kTooBig = static_cast<unsigned __int128>(INT64_MAX) + 1;
  unsigned __int128 numel = 1;
  for (int64_t d : t.shape) {
    Check(d >= 0);
    numel *= static_cast<uint64_t>(d);
    if (numel > kTooBig) numel = kTooBig;
  }
  Check(numel == static_cast<unsigned __int128>(t.numel));
  const int bits = moerun::DTypeBits(t.dtype);
  Check(bits > 0);
  const unsigned __int128 total_bits = numel * static_cast<unsigned>(bits);
  Check(total_bits % 8 == 0);
  Check(total_bits / 8 == t.end - t.begin);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto header = moerun::ParseSafetensorsHeader(std::span<const uint8_t>(data, size), size);
  if (!header.ok()) {
    Check(!header.status().message().empty());
    return 0;
  }
  const moerun::SafetensorsHeader& h = header.value();
  Check(h.data_offset >= 8 + 2);  // at least "{}"
  Check(h.data_offset <= size);
  const uint64_t data_len = size - h.data_offset;
  uint64_t expect = 0;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const moerun::TensorInfo& t = h.tensors[i];
    CheckTensor(t);
    if (i > 0) Check(h.tensors[i - 1].begin <= t.begin);
    Check(t.begin == expect);  // no hole, no overlap
    Check(t.end <= data_len);
    expect = t.end;
  }
  Check(expect == data_len);
  return 0;
}
