#include "launch/moebench/decode_workload.h"

#include <chrono>
#include <memory>

#include "base/log.h"
#include "base/thread_pool.h"
#include "launch/moebench/client_common.h"
#include "launch/moebench/decode_chain.h"
#include "runtime/layer/moe_layer.h"

namespace moerun::bench {

void MakeStarts(int inputs, uint64_t seed, DecodeWorkload* w) {
  const int64_t n = w->sequences * w->hidden;
  w->starts.clear();
  for (int p = 0; p < inputs; ++p) {
    std::vector<float> x = MakeInput(seed, p, n);
    RoundToWire(x.data(), n, w->bf16);
    w->starts.push_back(std::move(x));
  }
}

Status ComputeExpected(const LayerFlags& lf, size_t max_bytes, DecodeWorkload* w) {
  const int64_t n = w->sequences * w->hidden;
  const double bytes = static_cast<double>(n) * static_cast<double>(w->elem_bytes()) *
                       static_cast<double>(w->starts.size() * w->layers.size());
  if (bytes > static_cast<double>(max_bytes)) {
    return Status::InvalidArgument(fmt::format(
        "--verify: the expected answers of {} layers x {} inputs x {} sequences x {} values "
        "need {:.1f} GiB (at most {:.1f}): use fewer --inputs or --sequences",
        w->layers.size(), w->starts.size(), w->sequences, w->hidden, bytes / (1 << 30),
        static_cast<double>(max_bytes) / (1 << 30)));
  }
  MOERUN_ASSIGN_OR_RETURN(const Isa isa, ChooseIsa(lf.isa));
  const CpuKernels& kernels = KernelsFor(isa);
  ThreadPool pool(lf.threads);
  std::vector<std::vector<float>> x = w->starts;  // each chain's current input
  std::vector<float> y(static_cast<size_t>(n));
  w->expected.assign(w->starts.size(), std::vector<std::string>(w->layers.size()));
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < w->layers.size(); ++i) {
    LayerFlags one = lf;
    one.layer = w->layers[i];
    MOERUN_ASSIGN_OR_RETURN(auto weights, LoadLayerFromFlags(one, kernels, pool.size()));
    if (weights->spec.hidden != w->hidden) {
      return Status::InvalidArgument("layer " + std::to_string(w->layers[i]) + " has hidden " +
                                     std::to_string(weights->spec.hidden) + ", not " +
                                     std::to_string(w->hidden));
    }
    if (i == 0)
      spdlog::info("verifying against {} and the layers after it", DescribeLayer(*weights));
    MoeLayer layer(weights, kernels, &pool);
    for (size_t p = 0; p < x.size(); ++p) {
      MOERUN_RETURN_IF_ERROR(layer.Forward(x[p].data(), w->sequences, y.data()));
      std::string& answer = w->expected[p][i];
      answer = EncodeWire(y.data(), n, w->bf16);  // as the server sends it
      DecodeWire(answer, w->bf16, y.data());      // as the client reads it
      NextHidden(x[p].data(), y.data(), w->sequences, w->hidden, x[p].data());
      RoundToWire(x[p].data(), n, w->bf16);
    }
    spdlog::debug("expected chain: layer {} ({}/{})", w->layers[i], i + 1, w->layers.size());
  }
  spdlog::info("expected answers of {} layers x {} inputs computed in {:.1f} s", w->layers.size(),
               x.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return Status::Ok();
}

}  // namespace moerun::bench
