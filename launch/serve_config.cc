#include "launch/serve_config.h"

#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "base/log.h"

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
  Reader r(root, source);
  MOERUN_RETURN_IF_ERROR(r.CheckKeys({"model",
                                      "preset",
                                      "layers",
                                      "transport",
                                      "ranks",
                                      "routers",
                                      "placement",
                                      "microbatch_tokens",
                                      "deadline_ms",
                                      "startup_timeout_s",
                                      "threads",
                                      "isa",
                                      "batching",
                                      "serving",
                                      "rebalance",
                                      "log_level",
                                      "expert_cache_mib",
                                      "expert_cache_policy",
                                      "expert_cache_loaders",
                                      "expert_cache_pinned",
                                      "expert_cache_spill_dir",
                                      "expert_cache_load_mib_s",
                                      "files"}));
  MOERUN_RETURN_IF_ERROR(r.GetString("expert_cache_spill_dir", &c.expert_cache_spill_dir));
  c.expert_cache_spill_dir = Resolve(c.expert_cache_spill_dir, base_dir);
  MOERUN_RETURN_IF_ERROR(
      r.Get<int64_t>("expert_cache_mib", &c.expert_cache_mib, 0, int64_t{1} << 30));
  MOERUN_RETURN_IF_ERROR(r.GetString("expert_cache_policy", &c.expert_cache_policy));
  if (c.expert_cache_policy != "lfu" && c.expert_cache_policy != "lru") {
    return Status::InvalidArgument(r.Where("expert_cache_policy") + " must be lfu or lru, not '" +
                                   c.expert_cache_policy + "'");
  }
  MOERUN_RETURN_IF_ERROR(r.Get<int>("expert_cache_loaders", &c.expert_cache_loaders, 1, 64));
  MOERUN_RETURN_IF_ERROR(
      r.Get<double>("expert_cache_load_mib_s", &c.expert_cache_load_mib_s, 0.0, 1e9));
  if (const YAML::Node pin = root["expert_cache_pinned"]) {
    bool ok = pin.IsSequence();
    for (size_t i = 0; ok && i < pin.size(); ++i) {
      try {
        const int v = pin[i].as<int>();
        ok = v >= 0;
        c.expert_cache_pinned.push_back(v);
      } catch (const YAML::Exception&) {
        ok = false;
      }
    }
    if (!ok) {
      return Status::InvalidArgument(r.Where("expert_cache_pinned") +
                                     " must be a list of expert numbers");
    }
  }
  MOERUN_RETURN_IF_ERROR(r.GetString("model", &c.model));
  if (const YAML::Node p = root["preset"]) {
    Reader pr(p, source + ": \"preset\"");
    if (p.IsScalar()) {
      c.preset = p.as<std::string>();
    } else {
      MOERUN_RETURN_IF_ERROR(pr.CheckKeys({"name", "seed", "experts", "dtype", "gate_skew"}));
      MOERUN_RETURN_IF_ERROR(pr.GetString("name", &c.preset));
      MOERUN_RETURN_IF_ERROR(pr.Get<uint64_t>("seed", &c.seed, 0, UINT64_MAX));
      MOERUN_RETURN_IF_ERROR(pr.Get<int>("experts", &c.experts, 0, 65536));
      MOERUN_RETURN_IF_ERROR(pr.GetString("dtype", &c.dtype));
      MOERUN_RETURN_IF_ERROR(pr.Get<double>("gate_skew", &c.gate_skew, 0.0, 8.0));
    }
  }
  if (c.model.empty() == c.preset.empty()) {
    return Status::InvalidArgument(source + ": give exactly one of \"model\" and \"preset\"");
  }
  c.model = Resolve(c.model, base_dir);
  MOERUN_RETURN_IF_ERROR(ParseFiles(root, source, base_dir, &c));
  if (const YAML::Node l = root["layers"]) {
    if (l.IsScalar() && l.as<std::string>() == "all") {
      c.layers = {-1};
    } else if (l.IsSequence()) {
      for (const auto& e : l) {
        try {
          const int v = e.as<int>();
          if (v < 0) return Status::InvalidArgument(r.Where("layers") + " must not be negative");
          c.layers.push_back(v);
        } catch (const YAML::Exception&) {
          return Status::InvalidArgument(r.Where("layers") + " must be a list of layer numbers");
        }
      }
    } else {
      return Status::InvalidArgument(r.Where("layers") + " must be a list of layers or \"all\"");
    }
  }
  MOERUN_RETURN_IF_ERROR(r.GetString("transport", &c.transport));
  if (!c.transport.empty() && c.transport != "mpi" && c.transport != "ucx" &&
      c.transport != "nccl" && c.transport != "inproc") {
    return Status::InvalidArgument(r.Where("transport") + " must be mpi, ucx, nccl or inproc");
  }
  MOERUN_RETURN_IF_ERROR(r.Get<int>("ranks", &c.ranks, 1, 256));
  MOERUN_RETURN_IF_ERROR(r.Get<int>("routers", &c.routers, 1, 256));
  MOERUN_RETURN_IF_ERROR(r.GetString("placement", &c.placement));
  if (c.placement != "linear" && c.placement != "round_robin") {
    c.placement = Resolve(c.placement, base_dir);
  }
  MOERUN_RETURN_IF_ERROR(r.Get<int64_t>("microbatch_tokens", &c.microbatch_tokens, 0, 1 << 24));
  MOERUN_RETURN_IF_ERROR(r.Get<int64_t>("deadline_ms", &c.deadline_ms, 1, 86400000));
  MOERUN_RETURN_IF_ERROR(r.Get<int64_t>("startup_timeout_s", &c.startup_timeout_s, 1, 86400));
  MOERUN_RETURN_IF_ERROR(r.Get<int>("threads", &c.threads, 0, 1024));
  MOERUN_RETURN_IF_ERROR(r.GetString("isa", &c.isa));
  MOERUN_RETURN_IF_ERROR(r.GetString("log_level", &c.log_level));
  MOERUN_RETURN_IF_ERROR(CheckLogLevel(c.log_level, "log_level"));
  if (const YAML::Node b = root["batching"]) {
    Reader br(b, source + ": \"batching\"");
    MOERUN_RETURN_IF_ERROR(br.CheckKeys(
        {"max_batch_tokens", "max_wait_us", "max_queue_tokens", "max_queue_requests"}));
    MOERUN_RETURN_IF_ERROR(
        br.Get<int64_t>("max_batch_tokens", &c.batching.max_batch_tokens, 1, 1 << 24));
    MOERUN_RETURN_IF_ERROR(br.Get<int64_t>("max_wait_us", &c.batching.max_wait_us, 0, 60000000));
    MOERUN_RETURN_IF_ERROR(
        br.Get<int64_t>("max_queue_tokens", &c.batching.max_queue_tokens, 1, int64_t{1} << 30));
    MOERUN_RETURN_IF_ERROR(
        br.Get<int>("max_queue_requests", &c.batching.max_queue_requests, 1, 1 << 20));
  }
  if (const YAML::Node n = root["serving"]) {
    Reader sr(n, source + ": \"serving\"");
    ServingConfig& v = c.serving;
    MOERUN_RETURN_IF_ERROR(sr.CheckKeys({"listen",
                                         "control_listen",
                                         "metrics_listen",
                                         "token_file",
                                         "key_file",
                                         "max_frame_bytes",
                                         "max_connections",
                                         "max_inflight_per_connection",
                                         "max_buffered_bytes",
                                         "max_request_tokens",
                                         "default_deadline_ms",
                                         "frame_timeout_ms",
                                         "probe_interval_ms",
                                         "probe_deadline_ms",
                                         "drain_timeout_s",
                                         "load_window_s",
                                         "first_frame_timeout_ms",
                                         "idle_timeout_ms",
                                         "http_idle_timeout_ms",
                                         "http_max_connections",
                                         "max_connections_per_address",
                                         "tls"}));
    MOERUN_RETURN_IF_ERROR(sr.GetString("listen", &v.listen));
    MOERUN_RETURN_IF_ERROR(sr.GetString("control_listen", &v.control_listen));
    MOERUN_RETURN_IF_ERROR(sr.GetString("metrics_listen", &v.metrics_listen));
    MOERUN_RETURN_IF_ERROR(sr.GetString("token_file", &v.token_file));
    v.token_file = Resolve(v.token_file, base_dir);
    MOERUN_RETURN_IF_ERROR(sr.GetString("key_file", &v.key_file));
    v.key_file = Resolve(v.key_file, base_dir);
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int>("max_connections_per_address", &v.max_connections_per_address, 0, 1 << 20));
    if (const YAML::Node t = n["tls"]) {
      Reader tr(t, source + ": \"serving.tls\"");
      MOERUN_RETURN_IF_ERROR(tr.CheckKeys({"cert_file", "key_file", "client_ca_file", "ca_file"}));
      MOERUN_RETURN_IF_ERROR(tr.GetString("cert_file", &v.tls.cert_file));
      MOERUN_RETURN_IF_ERROR(tr.GetString("key_file", &v.tls.key_file));
      MOERUN_RETURN_IF_ERROR(tr.GetString("client_ca_file", &v.tls.client_ca_file));
      MOERUN_RETURN_IF_ERROR(tr.GetString("ca_file", &v.tls_ca_file));
      v.tls.cert_file = Resolve(v.tls.cert_file, base_dir);
      v.tls.key_file = Resolve(v.tls.key_file, base_dir);
      v.tls.client_ca_file = Resolve(v.tls.client_ca_file, base_dir);
      v.tls_ca_file = Resolve(v.tls_ca_file, base_dir);
      if (v.tls.cert_file.empty() != v.tls.key_file.empty()) {
        return Status::InvalidArgument(source +
                                       ": \"serving.tls\" needs both cert_file and key_file");
      }
    }
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int64_t>("max_frame_bytes", &v.max_frame_bytes, 64, int64_t{1} << 31));
    MOERUN_RETURN_IF_ERROR(sr.Get<int>("max_connections", &v.max_connections, 1, 1 << 20));
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int>("max_inflight_per_connection", &v.max_inflight_per_connection, 1, 1 << 16));
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int64_t>("max_buffered_bytes", &v.max_buffered_bytes, 1 << 20, int64_t{1} << 40));
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int64_t>("max_request_tokens", &v.max_request_tokens, 1, int64_t{1} << 24));
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int64_t>("default_deadline_ms", &v.default_deadline_ms, 1, 86400000));
    MOERUN_RETURN_IF_ERROR(sr.Get<int64_t>("frame_timeout_ms", &v.frame_timeout_ms, 1, 3600000));
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int64_t>("first_frame_timeout_ms", &v.first_frame_timeout_ms, 1, 3600000));
    MOERUN_RETURN_IF_ERROR(sr.Get<int64_t>("idle_timeout_ms", &v.idle_timeout_ms, 1, 86400000));
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int64_t>("http_idle_timeout_ms", &v.http_idle_timeout_ms, 1, 86400000));
    MOERUN_RETURN_IF_ERROR(
        sr.Get<int>("http_max_connections", &v.http_max_connections, 1, 1 << 16));
    MOERUN_RETURN_IF_ERROR(sr.Get<int64_t>("probe_interval_ms", &v.probe_interval_ms, 1, 3600000));
    MOERUN_RETURN_IF_ERROR(sr.Get<int64_t>("probe_deadline_ms", &v.probe_deadline_ms, 1, 3600000));
    MOERUN_RETURN_IF_ERROR(sr.Get<int64_t>("drain_timeout_s", &v.drain_timeout_s, 0, 86400));
    MOERUN_RETURN_IF_ERROR(sr.Get<int64_t>("load_window_s", &v.load_window_s, 1, 86400));
  }
  if (const YAML::Node n = root["rebalance"]) {
    Reader rr(n, source + ": \"rebalance\"");
    RebalanceConfig& v = c.rebalance;
    MOERUN_RETURN_IF_ERROR(rr.CheckKeys({"throttle_mib_s", "auto", "interval_s", "min_gain",
                                         "redundant", "policy", "min_assignments"}));
    MOERUN_RETURN_IF_ERROR(rr.Get<double>("throttle_mib_s", &v.throttle_mib_s, 0.0, 1e9));
    MOERUN_RETURN_IF_ERROR(rr.Get<bool>("auto", &v.automatic, false, true));
    MOERUN_RETURN_IF_ERROR(rr.Get<int64_t>("interval_s", &v.interval_s, 1, 86400 * 30));
    MOERUN_RETURN_IF_ERROR(rr.Get<double>("min_gain", &v.min_gain, 0.0, 1.0));
    MOERUN_RETURN_IF_ERROR(rr.Get<int>("redundant", &v.redundant, 0, 65536));
    MOERUN_RETURN_IF_ERROR(rr.GetString("policy", &v.policy));
    if (v.policy != "default" && v.policy != "eplb-hierarchical" && v.policy != "eplb-global") {
      return Status::InvalidArgument(rr.Where("policy") +
                                     " must be default, eplb-hierarchical or eplb-global");
    }
    MOERUN_RETURN_IF_ERROR(
        rr.Get<int64_t>("min_assignments", &v.min_assignments, 0, int64_t{1} << 40));
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
