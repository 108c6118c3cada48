#include "router/replay/routing_trace.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unordered_map>

namespace moerun {
namespace {

using json = nlohmann::json;

Status Bad(const std::string& path, const std::string& what) {
  return Status::InvalidArgument(path + ": " + what);
}

Result<std::string> ReadAll(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path + ": no such file");
  if (std::filesystem::is_directory(path, ec)) return Bad(path, "is a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::IoError(path + ": read failed");
  return ss.str();
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A count: a finite number >= 0.
Result<double> CountOf(const json& v, const std::string& path, const std::string& where) {
  if (!v.is_number()) return Bad(path, where + " is not a number");
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < 0) return Bad(path, where + " is negative or not finite");
  return d;
}

// A JSON array of L arrays of E counts (E the same in every row, > 0).
Result<std::vector<std::vector<double>>> CountRows(const json& rows, const std::string& path,
                                                   const std::string& key) {
  if (!rows.is_array() || rows.empty())
    return Bad(path, "\"" + key + "\" is not a non-empty array");
  std::vector<std::vector<double>> out;
  for (size_t l = 0; l < rows.size(); ++l) {
    const json& row = rows[l];
    const std::string where = "\"" + key + "\" row " + std::to_string(l);
    if (!row.is_array() || row.empty()) return Bad(path, where + " is not a non-empty array");
    if (!out.empty() && row.size() != out[0].size()) {
      return Bad(path, where + " has " + std::to_string(row.size()) + " entries, row 0 has " +
                           std::to_string(out[0].size()) + " (ragged rows)");
    }
    std::vector<double> r(row.size());
    for (size_t e = 0; e < row.size(); ++e) {
      MOERUN_ASSIGN_OR_RETURN(r[e], CountOf(row[e], path, where + " entry " + std::to_string(e)));
    }
    out.push_back(std::move(r));
  }
  return out;
}

Status CheckExperts(RoutingTrace& t, const RoutingTraceOptions& o) {
  if (o.num_experts > 0 && o.num_experts != t.num_experts) {
    return Bad(t.source, "holds " + std::to_string(t.num_experts) + " experts per layer, not the " +
                             std::to_string(o.num_experts) + " asked for");
  }
  return Status::Ok();
}

Result<RoutingTrace> ReadSglang(const json& doc, const std::string& path,
                                const RoutingTraceOptions& o) {
  MOERUN_ASSIGN_OR_RETURN(auto rows, CountRows(doc["logical_count"], path, "logical_count"));
  RoutingTrace t;
  t.source = path;
  t.num_experts = static_cast<int>(rows[0].size());
  for (size_t l = 0; l < rows.size(); ++l) {
    if (std::all_of(rows[l].begin(), rows[l].end(), [](double c) { return c == 0; })) continue;
    t.layers.push_back(static_cast<int>(l));
    t.counts.push_back(std::move(rows[l]));
  }
  if (t.counts.empty()) return Bad(path, "every layer of \"logical_count\" is all zero");
  MOERUN_RETURN_IF_ERROR(CheckExperts(t, o));
  return t;
}

Result<RoutingTrace> ReadOlmoe(const json& doc, const std::string& path,
                               const RoutingTraceOptions& o) {
  MOERUN_ASSIGN_OR_RETURN(auto rows, CountRows(doc["counts"], path, "counts"));
  const json& layers = doc["layers"];
  if (!layers.is_array() || layers.size() != rows.size()) {
    return Bad(path, "\"layers\" is not an array of " + std::to_string(rows.size()) +
                         " layer numbers (one per \"counts\" row)");
  }
  RoutingTrace t;
  t.source = path;
  t.num_experts = static_cast<int>(rows[0].size());
  std::set<int> seen;
  for (const json& l : layers) {
    if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() > 1000000) {
      return Bad(path, "\"layers\" holds " + l.dump() + ", not a layer number");
    }
    if (!seen.insert(l.get<int>()).second) return Bad(path, "\"layers\" names a layer twice");
    t.layers.push_back(l.get<int>());
  }
  if (doc.contains("num_experts")) {
    const json& n = doc["num_experts"];
    if (!n.is_number_integer() || n.get<int64_t>() != t.num_experts) {
      return Bad(path, "\"num_experts\" is " + n.dump() + " but the rows hold " +
                           std::to_string(t.num_experts) + " counts");
    }
  }
  const std::string kind = doc.value("kind", std::string());
  t.top_k = EndsWith(kind, "_top1") ? 1 : 0;
  t.counts = std::move(rows);
  MOERUN_RETURN_IF_ERROR(CheckExperts(t, o));
  return t;
}

Result<RoutingTrace> ReadJson(const std::string& text, const std::string& path,
                              const RoutingTraceOptions& o) {
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Bad(path, "is not valid JSON");
  if (!doc.is_object()) return Bad(path, "is not a JSON object");
  if (doc.contains("logical_count")) return ReadSglang(doc, path, o);
  const std::string kind =
      doc.contains("kind") && doc["kind"].is_string() ? doc["kind"].get<std::string>() : "";
  if (kind.find("crosslayer") != std::string::npos || doc.contains("matrices")) {
    return Bad(path, "holds cross-layer expert pair counts (\"" + kind +
                         "\": (expert at layer i, expert at layer j) pairs), not per-expert "
                         "counts; use the expert_counts file of the same domain");
  }
  if (doc.contains("counts") && doc.contains("layers")) return ReadOlmoe(doc, path, o);
  return Bad(path,
             "is neither SGLang's expert distribution ({\"logical_count\": ...}) nor per-domain "
             "expert counts ({\"counts\": ..., \"layers\": ...})");
}

Result<RoutingTrace> ReadCsv(const std::string& text, const std::string& path,
                             const RoutingTraceOptions& o) {
  RoutingTrace t;
  t.source = path;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    std::vector<double> row;
    std::stringstream cells(line);
    std::string cell;
    while (std::getline(cells, cell, ',')) {
      const size_t b = cell.find_first_not_of(" \t");
      const size_t e = cell.find_last_not_of(" \t");
      const std::string c = b == std::string::npos ? "" : cell.substr(b, e - b + 1);
      char* end = nullptr;
      errno = 0;
      const double v = c.empty() ? 0 : std::strtod(c.c_str(), &end);
      if (c.empty() || end != c.c_str() + c.size() || errno != 0 || !std::isfinite(v) || v < 0) {
        return Bad(path, "line " + std::to_string(line_no) + ": '" + c +
                             "' is not a count (a number >= 0)");
      }
      row.push_back(v);
    }
    if (!line.empty() && line.back() == ',') {
      return Bad(path, "line " + std::to_string(line_no) + " ends with an empty cell");
    }
    if (!t.counts.empty() && row.size() != t.counts[0].size()) {
      return Bad(path, "line " + std::to_string(line_no) + " has " + std::to_string(row.size()) +
                           " counts, the first line " + std::to_string(t.counts[0].size()) +
                           " (ragged rows)");
    }
    t.layers.push_back(static_cast<int>(t.counts.size()));
    t.counts.push_back(std::move(row));
  }
  if (t.counts.empty()) return Bad(path, "holds no counts");
  t.num_experts = static_cast<int>(t.counts[0].size());
  MOERUN_RETURN_IF_ERROR(CheckExperts(t, o));
  return t;
}

// The number of experts of a token-level trace, and the ids checked against it.
Status SetExperts(RoutingTrace& t, int max_id, const RoutingTraceOptions& o) {
  if (max_id < 0) return Bad(t.source, "names no expert at all");
  if (o.num_experts > 0) {
    if (max_id >= o.num_experts) {
      return Bad(t.source, "names expert " + std::to_string(max_id) + ", but the model has " +
                               std::to_string(o.num_experts) + " experts");
    }
    t.num_experts = o.num_experts;
  } else {
    t.num_experts = max_id + 1;
  }
  CountFromStreams(&t);
  return Status::Ok();
}

// --- .npy ---

// The header's Python dict literal: {'descr': '<i2', 'fortran_order': False, 'shape': (..), }.
struct NpyHeader {
  std::string descr;
  bool fortran_order = true;
  bool has_fortran = false;
  std::vector<int64_t> shape;
  bool has_shape = false;
};

Result<NpyHeader> ParseNpyDict(const std::string& h, const std::string& path) {
  size_t i = 0;
  auto skip = [&] {
    while (i < h.size() && std::isspace(static_cast<unsigned char>(h[i]))) ++i;
  };
  auto bad = [&](const std::string& what) {
    return Bad(path, "the .npy header " + what + " (header: " + h.substr(0, 120) + ")");
  };
  auto quoted = [&](std::string* out) -> bool {
    skip();
    if (i >= h.size() || (h[i] != '\'' && h[i] != '"')) return false;
    const char q = h[i++];
    const size_t end = h.find(q, i);
    if (end == std::string::npos) return false;
    *out = h.substr(i, end - i);
    i = end + 1;
    return true;
  };
  NpyHeader r;
  skip();
  if (i >= h.size() || h[i] != '{') return bad("is not a Python dict");
  ++i;
  for (;;) {
    skip();
    if (i < h.size() && h[i] == '}') break;
    std::string key;
    if (!quoted(&key)) return bad("has a key that is not a quoted string");
    skip();
    if (i >= h.size() || h[i] != ':') return bad("lacks a ':' after '" + key + "'");
    ++i;
    skip();
    if (key == "descr") {
      if (!quoted(&r.descr)) return bad("'descr' is not a quoted string");
    } else if (key == "fortran_order") {
      if (h.compare(i, 4, "True") == 0) {
        r.fortran_order = true, i += 4;
      } else if (h.compare(i, 5, "False") == 0) {
        r.fortran_order = false, i += 5;
      } else {
        return bad("'fortran_order' is neither True nor False");
      }
      r.has_fortran = true;
    } else if (key == "shape") {
      if (i >= h.size() || h[i] != '(') return bad("'shape' is not a tuple");
      ++i;
      for (;;) {
        skip();
        if (i < h.size() && h[i] == ')') break;
        size_t j = i;
        while (j < h.size() && std::isdigit(static_cast<unsigned char>(h[j]))) ++j;
        if (j == i || j - i > 15) return bad("'shape' holds something other than sizes");
        r.shape.push_back(std::stoll(h.substr(i, j - i)));
        i = j;
        skip();
        if (i < h.size() && h[i] == ',') ++i;
      }
      ++i;
      r.has_shape = true;
    } else {
      return bad("has an unknown key '" + key + "'");
    }
    skip();
    if (i < h.size() && h[i] == ',') ++i;
    if (i >= h.size()) return bad("is not a closed dict");
  }
  if (r.descr.empty() || !r.has_fortran || !r.has_shape) {
    return bad("lacks 'descr', 'fortran_order' or 'shape'");
  }
  return r;
}

uint32_t LittleEndian(const std::string& s, size_t at, int bytes) {
  uint32_t v = 0;
  for (int b = bytes - 1; b >= 0; --b) v = (v << 8) | static_cast<unsigned char>(s[at + b]);
  return v;
}

Result<RoutingTrace> ReadNpy(const std::string& data, const std::string& path,
                             const RoutingTraceOptions& o) {
  static const char kMagic[] = "\x93NUMPY";
  if (data.size() < 10 || data.compare(0, 6, kMagic, 6) != 0) {
    return Bad(path, "is not a .npy file (no \\x93NUMPY magic)");
  }
  const int major = static_cast<unsigned char>(data[6]);
  if (major < 1 || major > 3) {
    return Bad(path, "is .npy format " + std::to_string(major) + ".x; only 1.0, 2.0, 3.0 are read");
  }
  const int len_bytes = major == 1 ? 2 : 4;
  if (data.size() < static_cast<size_t>(8 + len_bytes)) return Bad(path, "is truncated (header)");
  const size_t header_len = LittleEndian(data, 8, len_bytes);
  const size_t data_at = 8 + static_cast<size_t>(len_bytes) + header_len;
  if (data.size() < data_at) return Bad(path, "is truncated (the header runs past the file's end)");
  MOERUN_ASSIGN_OR_RETURN(
      NpyHeader h, ParseNpyDict(data.substr(8 + static_cast<size_t>(len_bytes), header_len), path));
  int item = 0;
  if (h.descr == "<i2") {
    item = 2;
  } else if (h.descr == "<i4") {
    item = 4;
  } else if (h.descr == "<i8") {
    item = 8;
  } else {
    return Bad(path, "has dtype '" + h.descr + "'; expert ids are read as '<i2', '<i4' or '<i8'");
  }
  if (h.fortran_order) return Bad(path, "is in Fortran order; only C order is read");
  if (h.shape.size() != 3) {
    return Bad(path, "has a " + std::to_string(h.shape.size()) +
                         "-D shape; expected (layers, tokens, top_k)");
  }
  const int64_t L = h.shape[0], T = h.shape[1], K = h.shape[2];
  if (L < 1 || T < 1 || K < 1) return Bad(path, "has an empty shape");
  if (L > 100000 || K > 4096 || T > (int64_t{1} << 40) / (L * K)) {
    return Bad(path, "has an implausible shape (layers, tokens, top_k)");
  }
  const int64_t n = L * T * K;
  const size_t want = static_cast<size_t>(n) * static_cast<size_t>(item);
  if (data.size() - data_at != want) {
    return Bad(path, "holds " + std::to_string(data.size() - data_at) + " bytes of data; shape (" +
                         std::to_string(L) + ", " + std::to_string(T) + ", " + std::to_string(K) +
                         ") of '" + h.descr + "' needs " + std::to_string(want) +
                         (data.size() - data_at < want ? " (truncated)" : ""));
  }
  RoutingTrace t;
  t.source = path;
  t.top_k = static_cast<int>(K);
  RoutingTrace::Stream s;
  s.name = std::filesystem::path(path).filename().string();
  s.tokens = T;
  s.ids.assign(static_cast<size_t>(L), std::vector<int32_t>(static_cast<size_t>(T * K)));
  int max_id = -1;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(data.data() + data_at);
  for (int64_t l = 0; l < L; ++l) {
    t.layers.push_back(static_cast<int>(l));
    for (int64_t i = 0; i < T * K; ++i) {
      uint64_t u = 0;
      for (int b = item - 1; b >= 0; --b) u = (u << 8) | p[b];
      p += item;
      const int shift = 64 - 8 * item;  // sign-extend
      const int64_t v = static_cast<int64_t>(u << shift) >> shift;
      if (v < -1 || v > 1000000) {
        return Bad(path, "layer " + std::to_string(l) + " token " + std::to_string(i / K) +
                             " names expert " + std::to_string(v) +
                             " (ids are in [0, 1000000], or -1 for none)");
      }
      s.ids[static_cast<size_t>(l)][static_cast<size_t>(i)] = static_cast<int32_t>(v);
      max_id = std::max(max_id, static_cast<int>(v));
    }
  }
  t.streams.push_back(std::move(s));
  MOERUN_RETURN_IF_ERROR(SetExperts(t, max_id, o));
  return t;
}

// --- .jsonl ---

Result<int64_t> IntField(const json& rec, const char* key, const std::string& path, int line_no,
                         int64_t max) {
  const auto it = rec.find(key);
  if (it == rec.end()) {
    return Bad(path, "line " + std::to_string(line_no) + " has no \"" + key + "\"");
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > max) {
    return Bad(path, "line " + std::to_string(line_no) + ": \"" + key + "\" is " + it->dump() +
                         ", not an integer in [0, " + std::to_string(max) + "]");
  }
  return it->get<int64_t>();
}

Result<RoutingTrace> ReadJsonl(const std::string& text, const std::string& path,
                               const RoutingTraceOptions& o) {
  struct Record {
    int stream;
    int64_t token;
    int layer;
    size_t at;  // into `experts`
  };
  std::vector<Record> records;
  std::vector<int32_t> experts;
  std::vector<std::string> stream_names;
  std::unordered_map<std::string, int> stream_of;
  std::map<std::pair<int, int64_t>, int64_t> next_token;  // (stream, layer) -> records so far
  int top_k = 0;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json rec = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (rec.is_discarded() || !rec.is_object()) {
      return Bad(path, "line " + std::to_string(line_no) + " is not a JSON object");
    }
    MOERUN_ASSIGN_OR_RETURN(const int64_t layer, IntField(rec, "layer", path, line_no, 100000));
    std::string name = "all";
    if (const auto pid = rec.find("problem_id"); pid != rec.end()) {
      name = "problem_id " + (pid->is_string() ? pid->get<std::string>() : pid->dump());
    }
    auto [it, added] = stream_of.emplace(name, static_cast<int>(stream_names.size()));
    if (added) stream_names.push_back(name);
    // Without "token_idx" (a raw hook's output: prefill rows, then one row per decode step, in
    // time order), the n-th record of a layer in the stream is its token n.
    int64_t token = next_token[{it->second, layer}]++;
    if (rec.contains("token_idx")) {
      MOERUN_ASSIGN_OR_RETURN(token, IntField(rec, "token_idx", path, line_no, int64_t{1} << 32));
    }
    const auto ex = rec.find("experts");
    if (ex == rec.end() || !ex->is_array() || ex->empty()) {
      return Bad(path, "line " + std::to_string(line_no) + ": \"experts\" is missing or empty");
    }
    if (top_k == 0) top_k = static_cast<int>(ex->size());
    if (static_cast<int>(ex->size()) != top_k) {
      return Bad(path, "line " + std::to_string(line_no) + " names " + std::to_string(ex->size()) +
                           " experts, the first line " + std::to_string(top_k) +
                           " (top_k differs)");
    }
    const size_t at = experts.size();
    for (const json& e : *ex) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > 1000000) {
        return Bad(path, "line " + std::to_string(line_no) + ": expert id " + e.dump() +
                             " is not an integer >= 0");
      }
      experts.push_back(e.get<int32_t>());
    }
    records.push_back({it->second, token, static_cast<int>(layer), at});
  }
  if (records.empty()) return Bad(path, "holds no records");
  RoutingTrace t;
  t.source = path;
  t.top_k = top_k;
  std::set<int> layer_set;
  for (const Record& r : records) layer_set.insert(r.layer);
  t.layers.assign(layer_set.begin(), layer_set.end());
  std::map<int, size_t> layer_index;
  for (size_t i = 0; i < t.layers.size(); ++i) layer_index[t.layers[i]] = i;
  t.streams.resize(stream_names.size());
  for (size_t s = 0; s < stream_names.size(); ++s) t.streams[s].name = stream_names[s];
  for (const Record& r : records) {
    auto& s = t.streams[static_cast<size_t>(r.stream)];
    s.tokens = std::max(s.tokens, r.token + 1);
  }
  const size_t L = t.layers.size();
  const size_t K = static_cast<size_t>(top_k);
  for (auto& s : t.streams) {
    if (static_cast<double>(s.tokens) * static_cast<double>(L * K) > 1e9) {
      return Bad(path, "stream " + s.name + " has an implausible token_idx (" +
                           std::to_string(s.tokens - 1) + ")");
    }
    s.ids.assign(L, std::vector<int32_t>(static_cast<size_t>(s.tokens) * K, -1));
  }
  int max_id = -1;
  for (const Record& r : records) {
    auto& row = t.streams[static_cast<size_t>(r.stream)].ids[layer_index[r.layer]];
    int32_t* dst = row.data() + static_cast<size_t>(r.token) * K;
    if (dst[0] != -1) {
      return Bad(path, "two records for token " + std::to_string(r.token) + " of layer " +
                           std::to_string(r.layer) + " in stream " +
                           t.streams[static_cast<size_t>(r.stream)].name);
    }
    for (size_t k = 0; k < K; ++k) {
      dst[k] = experts[r.at + k];
      max_id = std::max(max_id, static_cast<int>(dst[k]));
    }
  }
  MOERUN_RETURN_IF_ERROR(SetExperts(t, max_id, o));
  return t;
}

}  // namespace

void CountFromStreams(RoutingTrace* trace) {
  const size_t L = trace->layers.size();
  trace->counts.assign(L, std::vector<double>(static_cast<size_t>(trace->num_experts), 0.0));
  for (const auto& s : trace->streams) {
    for (size_t l = 0; l < L && l < s.ids.size(); ++l) {
      for (int32_t e : s.ids[l]) {
        if (e >= 0 && e < trace->num_experts) trace->counts[l][static_cast<size_t>(e)] += 1;
      }
    }
  }
}

Result<RoutingTrace> ReadRoutingTrace(const std::string& path) {
  return ReadRoutingTrace(path, RoutingTraceOptions{});
}

Result<RoutingTrace> ReadRoutingTrace(const std::string& path, const RoutingTraceOptions& options) {
  if (options.num_experts < 0) return Bad(path, "num_experts must be >= 0");
  const bool jsonl = EndsWith(path, ".jsonl");
  const bool json = !jsonl && EndsWith(path, ".json");
  const bool csv = EndsWith(path, ".csv");
  const bool npy = EndsWith(path, ".npy");
  if (!jsonl && !json && !csv && !npy) {
    return Bad(path, "unknown routing format (expected .json, .jsonl, .csv or .npy)");
  }
  MOERUN_ASSIGN_OR_RETURN(const std::string text, ReadAll(path));
  if (text.empty()) return Bad(path, "is empty");
  if (npy) return ReadNpy(text, path, options);
  if (csv) return ReadCsv(text, path, options);
  if (jsonl) return ReadJsonl(text, path, options);
  return ReadJson(text, path, options);
}

}  // namespace moerun
