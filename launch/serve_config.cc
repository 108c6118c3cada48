#include "launch/serve_config.h"

#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <vector>

#include "base/log.h"
#include "experts/cpu/isa.h"
#include "runtime/cache/expert_cache.h"
#include "runtime/model/preset.h"
#include "runtime/serving/tracing_options.h"

namespace moerun {
namespace {

namespace fs = std::filesystem;

class Reader {
 public:
  Reader(const YAML::Node& node, std::string where) : node_(node), where_(std::move(where)) {}

  Status CheckKeys(const std::set<std::string>& allowed) const {
    if (!node_.IsMap()) return Status::InvalidArgument(where_ + " must be a mapping");
    for (const auto& kv : node_) {
      const std::string key = kv.first.as<std::string>();
      if (!allowed.count(key)) {
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        return Status::InvalidArgument(where_ + ": unknown key \"" + key + "\" (known: " + list +
                                       ")");
      }
    }
    return Status::Ok();
  }

  template <typename T>
  Status Get(const char* key, T* out, T lo, T hi) const {
    const YAML::Node v = node_[key];
    if (!v) return Status::Ok();
    try {
      const T x = v.as<T>();
      if (x < lo || x > hi) {
        return Status::InvalidArgument(Where(key) + " must be in " + std::to_string(lo) + ".." +
                                       std::to_string(hi));
      }
      *out = x;
      return Status::Ok();
    } catch (const YAML::Exception&) {
      return Status::InvalidArgument(Where(key) + " must be a number");
    }
  }

  Status GetString(const char* key, std::string* out) const {
    const YAML::Node v = node_[key];
    if (!v) return Status::Ok();
    if (!v.IsScalar()) return Status::InvalidArgument(Where(key) + " must be a string");
    *out = v.as<std::string>();
    return Status::Ok();
  }

  const YAML::Node& node() const { return node_; }
  std::string Where(const char* key) const { return where_ + ": \"" + key + "\""; }

 private:
  YAML::Node node_;
  std::string where_;
};

std::string Resolve(const std::string& path, const std::string& base) {
  if (path.empty() || fs::path(path).is_absolute() || base.empty()) return path;
  return (fs::path(base) / path).lexically_normal().string();
}

std::string AbsoluteDir(const std::string& path, const std::string& base) {
  std::error_code ec;
  fs::path p = fs::absolute(Resolve(path, base), ec);
  if (ec) p = Resolve(path, base);
  p = p.lexically_normal();
  std::string s = p.string();
  if (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

// files: {allow: [dir, ...]}; by default the model's folder (a preset has none).
Status ParseFiles(const YAML::Node& root, const std::string& source, const std::string& base_dir,
                  ServeConfig* c) {
  const YAML::Node n = root["files"];
  if (!n) {
    if (!c->model.empty()) c->files_allow = {AbsoluteDir(c->model, base_dir)};
    return Status::Ok();
  }
  Reader fr(n, source + ": \"files\"");
  MOERUN_RETURN_IF_ERROR(fr.CheckKeys({"allow"}));
  const YAML::Node a = n["allow"];
  if (!a) return Status::Ok();  // files: {} allows none
  if (!a.IsSequence()) {
    return Status::InvalidArgument(fr.Where("allow") + " must be a list of directories");
  }
  for (const auto& e : a) {
    if (!e.IsScalar() || e.as<std::string>().empty()) {
      return Status::InvalidArgument(fr.Where("allow") + " must be a list of directories");
    }
    c->files_allow.push_back(AbsoluteDir(e.as<std::string>(), base_dir));
  }
  return Status::Ok();
}

// --- the config's keys, by table: one entry per key says how it is read; a section's known keys
// are its table's names, so the list in an "unknown key" error is always the table's.

template <typename S>
struct Key {
  const char* name;
  std::function<Status(const Reader& r, S* s)> read;
};

template <typename S, typename T>
Key<S> Number(const char* name, T S::*member, T lo, T hi) {
  return {name, [=](const Reader& r, S* s) { return r.Get<T>(name, &(s->*member), lo, hi); }};
}

template <typename S>
Key<S> Text(const char* name, std::string S::*member) {
  return {name, [=](const Reader& r, S* s) { return r.GetString(name, &(s->*member)); }};
}

// A path, relative to the config file's folder unless absolute.
template <typename S>
Key<S> Path(const char* name, std::string S::*member, const std::string& base) {
  return {name, [=](const Reader& r, S* s) {
            MOERUN_RETURN_IF_ERROR(r.GetString(name, &(s->*member)));
            s->*member = Resolve(s->*member, base);
            return Status::Ok();
          }};
}

// A nested mapping read by its own table.
template <typename S, typename N>
Key<S> Section(const char* name, const std::string& source,
               std::function<std::vector<Key<N>>()> table, N* (*field)(S*)) {
  return {name, [=](const Reader& r, S* s) -> Status {
            const YAML::Node n = r.node()[name];
            if (!n) return Status::Ok();
            return ReadTable(Reader(n, source + ": \"" + name + "\""), table(), field(s));
          }};
}

template <typename S>
Status ReadTable(const Reader& r, const std::vector<Key<S>>& keys, S* s) {
  std::set<std::string> names;
  for (const Key<S>& k : keys) names.insert(k.name);
  MOERUN_RETURN_IF_ERROR(r.CheckKeys(names));
  for (const Key<S>& k : keys) MOERUN_RETURN_IF_ERROR(k.read(r, s));
  return Status::Ok();
}

Status OneOf(const Reader& r, const char* key, const std::string& v,
             std::initializer_list<const char*> allowed, const std::string& what) {
  for (const char* a : allowed) {
    if (v == a) return Status::Ok();
  }
  return Status::InvalidArgument(r.Where(key) + " must be " + what);
}

// expert_cache_pinned: a list of expert numbers.
Status ReadPinned(const Reader& r, ServeConfig* c) {
  const YAML::Node pin = r.node()["expert_cache_pinned"];
  if (!pin) return Status::Ok();
  bool ok = pin.IsSequence();
  for (size_t i = 0; ok && i < pin.size(); ++i) {
    try {
      const int v = pin[i].as<int>();
      ok = v >= 0;
      c->expert_cache_pinned.push_back(v);
    } catch (const YAML::Exception&) {
      ok = false;
    }
  }
  if (ok) return Status::Ok();
  return Status::InvalidArgument(r.Where("expert_cache_pinned") +
                                 " must be a list of expert numbers");
}

// preset: NAME, or {name, seed, experts, intermediate, dtype, gate_skew}.
Status ReadPreset(const Reader& r, const std::string& source, ServeConfig* c) {
  const YAML::Node p = r.node()["preset"];
  if (!p) return Status::Ok();
  if (p.IsScalar()) {
    c->preset = p.as<std::string>();
    return Status::Ok();
  }
  return ReadTable(
      Reader(p, source + ": \"preset\""),
      std::vector<Key<ServeConfig>>{
          Text("name", &ServeConfig::preset),
          Number("seed", &ServeConfig::seed, uint64_t{0}, UINT64_MAX),
          Number("experts", &ServeConfig::experts, 0, 65536),
          Number("intermediate", &ServeConfig::intermediate, int64_t{0}, int64_t{1} << 22),
          Text("dtype", &ServeConfig::dtype),
          Number("gate_skew", &ServeConfig::gate_skew, 0.0, 8.0),
      },
      c);
}

// layers: [n, ...] or "all".
Status ReadLayers(const Reader& r, ServeConfig* c) {
  const YAML::Node l = r.node()["layers"];
  if (!l) return Status::Ok();
  if (l.IsScalar() && l.as<std::string>() == "all") {
    c->layers = {-1};
    return Status::Ok();
  }
  if (!l.IsSequence()) {
    return Status::InvalidArgument(r.Where("layers") + " must be a list of layers or \"all\"");
  }
  for (const auto& e : l) {
    try {
      const int v = e.as<int>();
      if (v < 0) return Status::InvalidArgument(r.Where("layers") + " must not be negative");
      c->layers.push_back(v);
    } catch (const YAML::Exception&) {
      return Status::InvalidArgument(r.Where("layers") + " must be a list of layer numbers");
    }
  }
  return Status::Ok();
}

std::vector<Key<BatcherOptions>> BatchingKeys() {
  using B = BatcherOptions;
  return {
      Number("max_batch_tokens", &B::max_batch_tokens, int64_t{1}, int64_t{1} << 24),
      Number("max_wait_us", &B::max_wait_us, int64_t{0}, int64_t{60000000}),
      Number("max_queue_tokens", &B::max_queue_tokens, int64_t{1}, int64_t{1} << 30),
      Number("max_queue_requests", &B::max_queue_requests, 1, 1 << 20),
      Number("spin_us", &B::spin_us, int64_t{0}, int64_t{1000000}),
  };
}

// serving.tls: {cert_file, key_file, client_ca_file, ca_file}.
Key<ServingConfig> TlsKey(const std::string& source, const std::string& base) {
  return {"tls", [=](const Reader& r, ServingConfig* v) -> Status {
            const YAML::Node t = r.node()["tls"];
            if (!t) return Status::Ok();
            MOERUN_RETURN_IF_ERROR(
                ReadTable(Reader(t, source + ": \"serving.tls\""),
                          std::vector<Key<ServingConfig>>{
                              {"cert_file",
                               [&](const Reader& tr, ServingConfig* s) {
                                 return tr.GetString("cert_file", &s->tls.cert_file);
                               }},
                              {"key_file",
                               [&](const Reader& tr, ServingConfig* s) {
                                 return tr.GetString("key_file", &s->tls.key_file);
                               }},
                              {"client_ca_file",
                               [&](const Reader& tr, ServingConfig* s) {
                                 return tr.GetString("client_ca_file", &s->tls.client_ca_file);
                               }},
                              Text("ca_file", &ServingConfig::tls_ca_file),
                          },
                          v));
            for (std::string* f :
                 {&v->tls.cert_file, &v->tls.key_file, &v->tls.client_ca_file, &v->tls_ca_file}) {
              *f = Resolve(*f, base);
            }
            if (v->tls.cert_file.empty() != v->tls.key_file.empty()) {
              return Status::InvalidArgument(source +
                                             ": \"serving.tls\" needs both cert_file and key_file");
            }
            return Status::Ok();
          }};
}

std::vector<Key<ServingConfig>> ServingKeys(const std::string& source, const std::string& base) {
  using V = ServingConfig;
  const int64_t hour_ms = 3600000, day_ms = 86400000, day_s = 86400;
  return {
      Text("listen", &V::listen),
      Text("control_listen", &V::control_listen),
      Text("metrics_listen", &V::metrics_listen),
      Path("token_file", &V::token_file, base),
      Path("key_file", &V::key_file, base),
      Number("max_connections_per_address", &V::max_connections_per_address, 0, 1 << 20),
      TlsKey(source, base),
      Number("max_frame_bytes", &V::max_frame_bytes, int64_t{64}, int64_t{1} << 31),
      Number("max_connections", &V::max_connections, 1, 1 << 20),
      Number("max_inflight_per_connection", &V::max_inflight_per_connection, 1, 1 << 16),
      Number("max_buffered_bytes", &V::max_buffered_bytes, int64_t{1} << 20, int64_t{1} << 40),
      Number("max_request_tokens", &V::max_request_tokens, int64_t{1}, int64_t{1} << 24),
      Number("default_deadline_ms", &V::default_deadline_ms, int64_t{1}, day_ms),
      Number("frame_timeout_ms", &V::frame_timeout_ms, int64_t{1}, hour_ms),
      Number("first_frame_timeout_ms", &V::first_frame_timeout_ms, int64_t{1}, hour_ms),
      Number("idle_timeout_ms", &V::idle_timeout_ms, int64_t{1}, day_ms),
      Number("http_idle_timeout_ms", &V::http_idle_timeout_ms, int64_t{1}, day_ms),
      Number("http_max_connections", &V::http_max_connections, 1, 1 << 16),
      Number("probe_interval_ms", &V::probe_interval_ms, int64_t{1}, hour_ms),
      Number("probe_deadline_ms", &V::probe_deadline_ms, int64_t{1}, hour_ms),
      Number("drain_timeout_s", &V::drain_timeout_s, int64_t{0}, day_s),
      Number("load_window_s", &V::load_window_s, int64_t{1}, day_s),
  };
}

std::vector<Key<RebalanceConfig>> RebalanceKeys() {
  using V = RebalanceConfig;
  return {
      Number("throttle_mib_s", &V::throttle_mib_s, 0.0, 1e9),
      Number("auto", &V::automatic, false, true),
      Number("interval_s", &V::interval_s, int64_t{1}, int64_t{86400} * 30),
      Number("min_gain", &V::min_gain, 0.0, 1.0),
      Number("redundant", &V::redundant, 0, 65536),
      {"policy",
       [](const Reader& r, V* v) {
         MOERUN_RETURN_IF_ERROR(r.GetString("policy", &v->policy));
         return OneOf(r, "policy", v->policy, {"default", "eplb-hierarchical", "eplb-global"},
                      "default, eplb-hierarchical or eplb-global");
       }},
      Number("min_assignments", &V::min_assignments, int64_t{0}, int64_t{1} << 40),
  };
}

std::vector<Key<TracingConfig>> TracingKeys() {
  using V = TracingConfig;
  return {
      {"endpoint",
       [](const Reader& r, V* v) {
         MOERUN_RETURN_IF_ERROR(r.GetString("endpoint", &v->endpoint));
         if (v->endpoint.empty()) return Status::Ok();
         return ParseOtlpEndpoint(v->endpoint).status().WithContext(r.Where("endpoint"));
       }},
      Number("sample", &V::sample, 0.0, 1.0),
      Number("slow_ms", &V::slow_ms, int64_t{0}, int64_t{86400000}),
      Number("queue_spans", &V::queue_spans, int64_t{64}, int64_t{1} << 24),
  };
}

std::vector<Key<DispatchConfig>> DispatchKeys() {
  using V = DispatchConfig;
  return {
      {"prefer_node",
       [](const Reader& r, V* v) {
         const YAML::Node n = r.node()["prefer_node"];
         if (!n) return Status::Ok();
         try {
           v->prefer_node = n.as<bool>();
           return Status::Ok();
         } catch (const YAML::Exception&) {
           return Status::InvalidArgument(r.Where("prefer_node") + " must be true or false");
         }
       }},
      Number("spill", &V::spill, 0.0, 1000.0),
  };
}

// nodes: {NAME: [rank, ...]}: every rank in at most one node.
Status ReadNodes(const Reader& r, ServeConfig* c) {
  const YAML::Node n = r.node()["nodes"];
  if (!n) return Status::Ok();
  if (!n.IsMap() || n.size() == 0) {
    return Status::InvalidArgument(r.Where("nodes") +
                                   " must be a mapping of node names to lists of ranks");
  }
  for (const auto& kv : n) {
    const std::string name = kv.first.as<std::string>();
    const std::string where = r.Where("nodes") + "." + name;
    if (name.empty()) return Status::InvalidArgument(r.Where("nodes") + ": a node name is empty");
    if (!kv.second.IsSequence() || kv.second.size() == 0) {
      return Status::InvalidArgument(where + " must be a non-empty list of ranks");
    }
    for (const auto& v : kv.second) {
      int rank = -1;
      try {
        rank = v.as<int>();
      } catch (const YAML::Exception&) {
      }
      if (rank < 0 || rank > 65535) {
        return Status::InvalidArgument(where + " must list rank numbers (0..65535)");
      }
      const auto [it, fresh] = c->nodes.emplace(rank, name);
      if (!fresh) {
        return Status::InvalidArgument(where + ": rank " + std::to_string(rank) +
                                       " is already on node " + it->second);
      }
    }
  }
  return Status::Ok();
}

// KEY: {RANK: V, ...} into *out: rank numbers 0..65535, each value one `valid` accepts (`values`
// names them in the error).
template <typename V, typename Valid>
Status ReadRankMap(const Reader& r, const char* key, const char* values, Valid valid,
                   std::map<int, V>* out) {
  const YAML::Node n = r.node()[key];
  if (!n) return Status::Ok();
  const auto bad = [&] {
    return Status::InvalidArgument(r.Where(key) + " must map rank numbers (0..65535) to " + values);
  };
  if (!n.IsMap()) return bad();
  for (const auto& kv : n) {
    int rank = -1;
    V v{};
    try {
      rank = kv.first.as<int>();
      v = kv.second.as<V>();
    } catch (const YAML::Exception&) {
      return bad();
    }
    if (rank < 0 || rank > 65535 || !valid(v)) return bad();
    (*out)[rank] = v;
  }
  return Status::Ok();
}

// The top level. "model" is resolved and "files" read once both model and preset are known.
std::vector<Key<ServeConfig>> TopKeys(const std::string& source, const std::string& base) {
  using C = ServeConfig;
  return {
      Text("model", &C::model),
      {"preset", [=](const Reader& r, C* c) { return ReadPreset(r, source, c); }},
      {"layers", ReadLayers},
      {"transport",
       [](const Reader& r, C* c) {
         MOERUN_RETURN_IF_ERROR(r.GetString("transport", &c->transport));
         if (c->transport.empty()) return Status::Ok();
         return OneOf(r, "transport", c->transport, {"mpi", "ucx", "nccl", "inproc"},
                      "mpi, ucx, nccl or inproc");
       }},
      Number("ranks", &C::ranks, 1, 256),
      Number("routers", &C::routers, 1, 256),
      Number("spare_expert_ranks", &C::spare_expert_ranks, 0, 256),
      {"placement",
       [=](const Reader& r, C* c) {
         MOERUN_RETURN_IF_ERROR(r.GetString("placement", &c->placement));
         if (c->placement != "linear" && c->placement != "round_robin") {
           c->placement = Resolve(c->placement, base);
         }
         return Status::Ok();
       }},
      Number("microbatch_tokens", &C::microbatch_tokens, int64_t{0}, int64_t{1} << 24),
      Number("deadline_ms", &C::deadline_ms, int64_t{1}, int64_t{86400000}),
      Number("startup_timeout_s", &C::startup_timeout_s, int64_t{1}, int64_t{86400}),
      Number("threads", &C::threads, 0, 1024),
      Text("isa", &C::isa),
      {"log_level",
       [](const Reader& r, C* c) {
         MOERUN_RETURN_IF_ERROR(r.GetString("log_level", &c->log_level));
         return CheckLogLevel(c->log_level, "log_level");
       }},
      Section<C, BatcherOptions>("batching", source, BatchingKeys,
                                 [](C* c) { return &c->batching; }),
      Section<C, ServingConfig>(
          "serving", source, [=] { return ServingKeys(source, base); },
          [](C* c) { return &c->serving; }),
      Section<C, RebalanceConfig>("rebalance", source, RebalanceKeys,
                                  [](C* c) { return &c->rebalance; }),
      Section<C, TracingConfig>("tracing", source, TracingKeys, [](C* c) { return &c->tracing; }),
      Section<C, DispatchConfig>("dispatch", source, DispatchKeys,
                                 [](C* c) { return &c->dispatch; }),
      {"nodes", ReadNodes},
      // Ranks with threads, kernels or a memory budget of their own.
      {"rank_threads",
       [](const Reader& r, C* c) {
         return ReadRankMap<int>(
             r, "rank_threads", "thread counts (1..1024)",
             [](int n) { return n >= 1 && n <= 1024; }, &c->rank_threads);
       }},
      {"rank_isa",
       [](const Reader& r, C* c) {
         return ReadRankMap<std::string>(
             r, "rank_isa", "scalar, avx2 or avx512",
             [](const std::string& isa) { return ParseIsa(isa).has_value(); }, &c->rank_isa);
       }},
      Number("expert_memory_mib", &C::expert_memory_mib, int64_t{0}, int64_t{1} << 30),
      {"rank_expert_memory_mib",
       [](const Reader& r, C* c) {
         return ReadRankMap<int64_t>(
             r, "rank_expert_memory_mib", "MiB (1..1073741824)",
             [](int64_t mib) { return mib >= 1 && mib <= (int64_t{1} << 30); },
             &c->rank_expert_memory_mib);
       }},
      Number("expert_cache_mib", &C::expert_cache_mib, int64_t{0}, int64_t{1} << 30),
      {"expert_cache_policy",
       [](const Reader& r, C* c) {
         MOERUN_RETURN_IF_ERROR(r.GetString("expert_cache_policy", &c->expert_cache_policy));
         const std::string& p = c->expert_cache_policy;
         if (ParseEvictionPolicy(p).ok()) return Status::Ok();
         return Status::InvalidArgument(r.Where("expert_cache_policy") +
                                        " must be adaptive, cycle, lfu or lru, not '" + p + "'");
       }},
      Number("expert_cache_loaders", &C::expert_cache_loaders, 1, 64),
      {"expert_cache_pinned", ReadPinned},
      Path("expert_cache_spill_dir", &C::expert_cache_spill_dir, base),
      Number("expert_cache_load_mib_s", &C::expert_cache_load_mib_s, 0.0, 1e9),
      {"files", [](const Reader&, C*) { return Status::Ok(); }},  // after model: below
  };
}

}  // namespace

Result<ServeConfig> ParseServeConfig(const std::string& text, const std::string& source,
                                     const std::string& base_dir) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source + ": not valid YAML: " + e.msg + " (line " +
                                   std::to_string(e.mark.line + 1) + ")");
  }
  ServeConfig c;
  MOERUN_RETURN_IF_ERROR(ReadTable(Reader(root, source), TopKeys(source, base_dir), &c));
  if (c.model.empty() == c.preset.empty()) {
    return Status::InvalidArgument(source + ": give exactly one of \"model\" and \"preset\"");
  }
  c.model = Resolve(c.model, base_dir);
  MOERUN_RETURN_IF_ERROR(ParseFiles(root, source, base_dir, &c));
  if (c.intermediate > 0) {  // the preset's own size bounds it: checked here, naming the key
    ModelSpec spec;
    if (Result<ModelSpec> full = PresetFullSpec(c.preset); full.ok()) spec = *full;
    if (spec.expert_inter > 0) {
      MOERUN_RETURN_IF_ERROR(
          ScaleIntermediate(c.preset, c.intermediate, &spec).WithContext(source + ": \"preset\""));
    }
  }
  return c;
}

Result<ServeConfig> LoadServeConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open the config file");
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().size() > (1u << 20)) return Status::InvalidArgument(path + ": too large");
  MOERUN_ASSIGN_OR_RETURN(ServeConfig c,
                          ParseServeConfig(ss.str(), path, fs::path(path).parent_path().string()));
  std::error_code ec;
  if (c.placement != "linear" && c.placement != "round_robin" &&
      !fs::is_regular_file(c.placement, ec)) {
    return Status::InvalidArgument(path + ": placement must be linear, round_robin or a " +
                                   "placement JSON file; '" + c.placement + "' is not a file");
  }
  return c;
}

std::string AllInterfacesWarning(const std::string& endpoint, const std::string& listen,
                                 const std::string& key, const std::string& flag) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return "";
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (!host.empty() && host != "0.0.0.0" && host != "::" && host != "::0" &&
      host != "0:0:0:0:0:0:0:0") {
    return "";
  }
  return endpoint + " listens on every network interface (" + listen +
         "): every host that can reach this one can connect to it; to restrict it, set " + key +
         " (or " + flag + ") to the address of one interface (127.0.0.1 for this host only)";
}

}  // namespace moerun
