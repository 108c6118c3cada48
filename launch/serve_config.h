// The YAML config of `moerun serve`, read strictly: unknown keys, wrong types and out-of-range
// values are errors that name the key. Relative paths (model, placement) are relative to the
// config file's folder. The README documents every key.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/migration/placement_control.h"
#include "runtime/serving/batcher.h"
#include "runtime/serving/tls_context.h"

namespace moerun {

// The network side (routers listen on port + router rank; every rank's HTTP on metrics port +
// rank). Every endpoint listens on loopback unless the config or a flag names an address: a job
// reached from other hosts (clients, probes, Prometheus) names its own or 0.0.0.0.
struct ServingConfig {
  std::string listen = "127.0.0.1:5700";          // serving endpoint of router 0
  std::string control_listen = "127.0.0.1:5800";  // moectl endpoint (router 0; needs token_file)
  std::string metrics_listen = "127.0.0.1:9700";  // HTTP /metrics and /health of rank 0
  std::string token_file;                         // control token (empty: no control endpoint)
  std::string key_file;  // serving key every InferRequest must carry (empty: none; chmod 600)
  int64_t max_frame_bytes = 64 << 20;
  int max_connections = 4096;
  int max_inflight_per_connection = 64;
  int64_t max_buffered_bytes = int64_t{1} << 30;
  int64_t max_request_tokens = 65536;
  int64_t default_deadline_ms = 30000;
  int64_t frame_timeout_ms = 10000;
  int64_t first_frame_timeout_ms = 10000;  // a new connection's first frame must start by then
  int64_t idle_timeout_ms = 60000;         // between frames, with no answer owed
  // The HTTP endpoint (/metrics, /health): a connection waiting for a request's first byte this
  // long is closed; at most this many connections (runtime/serving/http_server.h).
  int64_t http_idle_timeout_ms = 10000;
  int http_max_connections = 512;
  // Connections of the serving endpoint from one peer address (0: no cap of its own; a full
  // endpoint makes room at the busiest address first either way).
  int max_connections_per_address = 0;
  // TLS on the serving and control endpoints (runtime/serving/tls_context.h); none without
  // cert_file.
  TlsServerFiles tls;
  // The CA that the job's own clients (a joining rank to router 0's control endpoint) check the
  // router's certificate with; empty: the system's store.
  std::string tls_ca_file;
  int64_t probe_interval_ms = 1000;
  int64_t probe_deadline_ms = 2000;
  int64_t drain_timeout_s = 30;
  int64_t load_window_s = 60;  // sliding window of the load statistics (moectl status, planner)
};

// OpenTelemetry traces of the requests (runtime/serving/trace_exporter.h): each router exports
// its requests' spans, the expert ranks' parts included, to an OTLP/HTTP collector.
struct TracingConfig {
  std::string endpoint;         // http://HOST:PORT[/PATH] (PATH: /v1/traces); empty: tracing off
  double sample = 0.01;         // share of requests traced (besides sampled traceparents)
  int64_t slow_ms = 0;          // > 0: also every request slower than this
  int64_t queue_spans = 16384;  // spans waiting for the exporter at most (more are dropped)
};

// Which copy of an expert a router sends a token to (router/dispatch_plan.h, DispatchLocality).
struct DispatchConfig {
  bool prefer_node = false;  // a copy on the router's own node first (else the least loaded)
  double spill = 1.0;        // ... while its rank's load is within the least loaded copy's load
                             // + spill × the mean rows a rank gets in the microbatch
};

struct ServeConfig {
  // Weights: a checkpoint folder, or a preset.
  std::string model;
  std::string preset;
  uint64_t seed = 1;
  int experts = 0;
  int64_t intermediate = 0;  // preset.intermediate: a scaled expert intermediate size (0: real)
  double gate_skew = 0.0;    // preset.gate_skew: Zipf exponent of the routing
  std::string dtype = "f32";
  // Layers to serve: empty = the model's first MoE layer; {-1} = every MoE layer.
  std::vector<int> layers;
  // The job.
  std::string transport;  // mpi | ucx | nccl | inproc | "" (ucx under an MPI launcher where the
                          // build has UCX, else mpi; inproc without a launcher); nccl:
                          // launch/job_launch.h
  int ranks = 1;          // inproc only
  int routers = 1;
  // Expert rank slots beyond the launched ranks, with no process at start (ucx only): a process
  // started later joins into one (moerun serve --join) and a migration gives it experts. The
  // initial placement is made over the launched ranks.
  int spare_expert_ranks = 0;
  std::string placement = "linear";
  int64_t microbatch_tokens = 0;
  int64_t deadline_ms = 30000;
  int64_t startup_timeout_s = 600;
  int threads = 0;
  // rank_threads: {RANK: N}: ranks with a thread count of their own (over `threads`).
  std::map<int, int> rank_threads;
  std::string isa;
  // rank_isa: {RANK: scalar|avx2|avx512}: ranks with kernels of their own (over `isa`).
  std::map<int, std::string> rank_isa;
  // expert_memory_mib: the most expert weights an expert rank may hold (0: no limit), and
  // rank_expert_memory_mib: {RANK: MiB} for ranks with a budget of their own.
  int64_t expert_memory_mib = 0;
  std::map<int, int64_t> rank_expert_memory_mib;
  BatcherOptions batching;
  ServingConfig serving;
  RebalanceConfig rebalance;
  TracingConfig tracing;
  DispatchConfig dispatch;
  // nodes: {NAME: [rank, ...], ...}: which ranks share a node (rank -> node name); empty: each
  // rank's host name, gathered at start (runtime/ranks/rank_job.h).
  std::map<int, std::string> nodes;
  std::string log_level = "info";
  // files.allow: the only directories `moectl expert update --from FILE` may name (absolute,
  // lexically normal; runtime/migration/file_allow.h). Without the key: the model's folder, or none
  // (updates refused) for a preset.
  std::vector<std::string> files_allow;
  // Expert ranks: an expert cache of this many MiB each (0: every hosted expert resident), its
  // eviction policy (lfu | lru | cycle), parallel loads, and experts (of every layer) that never
  // leave.
  int64_t expert_cache_mib = 0;
  std::string expert_cache_policy = "adaptive";
  int expert_cache_loaders = 2;
  std::vector<int> expert_cache_pinned;
  std::string expert_cache_spill_dir;  // spill file folder ("": misses load from the source)
  double expert_cache_load_mib_s = 0;  // bandwidth of the cache's loads per rank (0: unlimited)
};

Result<ServeConfig> ParseServeConfig(const std::string& yaml_text, const std::string& source,
                                     const std::string& base_dir);
Result<ServeConfig> LoadServeConfig(const std::string& path);

// The warning for an endpoint given `listen` (HOST:PORT as written) when it listens on every
// interface (host 0.0.0.0, ::, or none as in ":PORT"): names the endpoint, the address, and the
// config key and flag that restrict it. Empty when the address is one interface's.
std::string AllInterfacesWarning(const std::string& endpoint, const std::string& listen,
                                 const std::string& key, const std::string& flag);

}  // namespace moerun
