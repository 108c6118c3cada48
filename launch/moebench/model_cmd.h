// `moebench model`: the performance model's prediction (perf_model.h) for a model, a deployment
// and a machine, as JSON on stdout and one readable line on stderr. The machine is either a
// profile `moebench calibrate` measured (--profile FILE: CPU ranks sharing this machine's cores;
// the transport entry for --transport at the nearest calibrated rank count) or figures a user
// gives (--device-gbps/--device-tflops per device, --link-gbps/--link-us within a node,
// --net-gbps/--net-us across nodes, --nodes x --ranks-per-node; every device both routes its
// share of the tokens and hosts experts). Routing shares come from the preset's own gate sampled
// on random inputs (--gate-skew as the preset applies it), from --loads FILE (one load per
// expert), or are uniform.
#pragma once

#include <cstdint>
#include <string>

namespace moerun::bench {

struct ModelFlags {
  std::string profile;
  // Figures instead of a profile (all > 0 to be used).
  double device_gbps = 0, device_tflops = 0, link_gbps = 0, link_us = 0;
  double net_gbps = 0, net_us = 0;  // across nodes (default: the link's)
  double kernel_us = 10;            // per kernel pass on a device
  int nodes = 1, ranks_per_node = 0;
  // The model.
  std::string model, preset;
  int experts = 0;
  std::string dtype = "f32";
  int64_t hidden = 0, inter = 0, shared_inter = -1;  // shape overrides (-1: the model's)
  int top_k = 0, moe_layers = 0;
  double activation_bytes = 4;  // per value of the rows sent (moerun sends F32)
  // The deployment.
  int64_t tokens = 256, microbatch_tokens = 0;
  int routers = 1, ranks = 0;  // profile: total ranks (routers included)
  std::string transport = "mpi";
  std::string placement = "linear";
  std::string loads;
  double gate_skew = 0;
  int threads = 0;  // profile: kernel threads per rank (0: the profile's)
  // Serving.
  double rate = 0;  // requests/s (0: no serving prediction)
  int64_t tokens_per_request = 1, max_batch_tokens = 1024;
  double max_wait_us = 2000, request_overhead_us = 0;
};

int RunModel(const ModelFlags& f);

}  // namespace moerun::bench
