#include "runtime/model/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

namespace moerun {
namespace {

using json = nlohmann::json;

constexpr int kMaxJsonDepth = 3;  // header object -> tensor object -> shape array

// Rejects nesting deeper than kMaxJsonDepth before the JSON parser sees the text, so hostile
// input ("[[[[...") cannot cost more than a linear scan.
bool DepthWithin(std::span<const uint8_t> text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (uint8_t c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

bool AsU64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    const int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = static_cast<uint64_t>(s);
    return true;
  }
  return false;
}

Status ParseTensorEntry(const std::string& name, const json& v, TensorInfo* t) {
  auto bad = [&](const std::string& why) {
    return Status::Corrupt("tensor '" + name + "': " + why);
  };
  if (!v.is_object()) return bad("entry is not an object");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return bad("unexpected key '" + it.key() + "'");
    }
  }
  const auto d = v.find("dtype");
  const auto s = v.find("shape");
  const auto o = v.find("data_offsets");
  if (d == v.end() || s == v.end() || o == v.end()) {
    return bad("needs the keys dtype, shape and data_offsets");
  }
  if (!d->is_string()) return bad("dtype is not a string");
  const auto dtype = ParseDType(d->get_ref<const std::string&>());
  if (!dtype) return bad("unknown dtype '" + d->get<std::string>() + "'");
  t->name = name;
  t->dtype = *dtype;

  if (!s->is_array()) return bad("shape is not an array");
  uint64_t numel = 1;
  for (const auto& dim : *s) {
    uint64_t n = 0;
    if (!AsU64(dim, &n)) return bad("shape holds something other than a non-negative integer");
    if (n > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, n, &numel) ||
        numel > static_cast<uint64_t>(INT64_MAX)) {
      return bad("shape overflows");
    }
    t->shape.push_back(static_cast<int64_t>(n));
  }
  t->numel = static_cast<int64_t>(numel);

  if (!o->is_array() || o->size() != 2) return bad("data_offsets is not [begin, end]");
  if (!AsU64((*o)[0], &t->begin) || !AsU64((*o)[1], &t->end)) {
    return bad("data_offsets holds something other than non-negative integers");
  }
  if (t->end < t->begin) return bad("data_offsets end is before begin");

  uint64_t bits = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeBits(*dtype)), &bits)) {
    return bad("byte size overflows");
  }
  if (bits % 8 != 0) return bad("shape is not a whole number of bytes of " + d->get<std::string>());
  if (bits / 8 != t->end - t->begin) {
    return bad("shape " + s->dump() + " of " + d->get<std::string>() + " needs " +
               std::to_string(bits / 8) + " bytes but data_offsets span " +
               std::to_string(t->end - t->begin));
  }
  return Status::Ok();
}

}  // namespace

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> bytes,
                                                 uint64_t file_size) {
  if (file_size < 8 || bytes.size() < 8) {
    return Status::Corrupt("file of " + std::to_string(file_size) +
                           " bytes is too short for a safetensors header");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  // The length's value is never printed: those 8 bytes may be the start of any file (a path
  // named by a control request), and an error must not echo a file's content.
  if (n > kMaxSafetensorsHeaderBytes) {
    return Status::Corrupt(
        "not a safetensors file: invalid header length (it exceeds the limit of " +
        std::to_string(kMaxSafetensorsHeaderBytes) + " bytes)");
  }
  if (n + 8 > file_size) {
    return Status::Corrupt("not a safetensors file: invalid header length (past the end of the " +
                           std::to_string(file_size) + "-byte file; truncated?)");
  }
  if (bytes.size() < n + 8) return Status::Internal("header bytes not supplied");
  const auto text = bytes.subspan(8, n);
  if (n == 0 || text[0] != '{') return Status::Corrupt("header does not start with '{'");
  // The JSON parser would stop at a NUL and ignore what follows; the format allows only JSON
  // padded with spaces, so bytes hidden behind a NUL are an error.
  if (const void* nul = std::memchr(text.data(), 0, text.size()); nul != nullptr) {
    return Status::Corrupt("header holds a NUL byte at offset " +
                           std::to_string(static_cast<const uint8_t*>(nul) - text.data()));
  }
  if (!DepthWithin(text, kMaxJsonDepth)) return Status::Corrupt("header JSON is nested too deep");

  const json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::Corrupt("header is not valid JSON");
  if (!doc.is_object()) return Status::Corrupt("header JSON is not an object");

  SafetensorsHeader h;
  h.data_offset = 8 + n;
  const uint64_t data_len = file_size - h.data_offset;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Status::Corrupt("__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return Status::Corrupt("__metadata__ value of '" + m.key() + "' is not a string");
        }
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    TensorInfo t;
    MOERUN_RETURN_IF_ERROR(ParseTensorEntry(it.key(), it.value(), &t));
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const TensorInfo& t = h.tensors[i];
    if (t.begin < expect) {
      return Status::Corrupt("tensor '" + t.name + "' [" + std::to_string(t.begin) + ", " +
                             std::to_string(t.end) + ") overlaps tensor '" + h.tensors[i - 1].name +
                             "'");
    }
    if (t.begin > expect) {
      return Status::Corrupt("data bytes [" + std::to_string(expect) + ", " +
                             std::to_string(t.begin) + ") before tensor '" + t.name +
                             "' belong to no tensor");
    }
    if (t.end > data_len) {
      return Status::Corrupt("tensor '" + t.name + "' ends at data byte " + std::to_string(t.end) +
                             " but the data buffer holds " + std::to_string(data_len) +
                             " bytes (truncated?)");
    }
    expect = t.end;
  }
  if (expect != data_len) {
    return Status::Corrupt("data buffer holds " + std::to_string(data_len) +
                           " bytes but the tensors cover " + std::to_string(expect));
  }
  return h;
}

SafetensorsFile::SafetensorsFile(std::unique_ptr<MappedFile> file, SafetensorsHeader header)
    : file_(std::move(file)), header_(std::move(header)) {
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  MOERUN_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  auto header =
      ParseSafetensorsHeader(std::span<const uint8_t>(file->data(), file->size()), file->size());
  if (!header.ok()) return header.status().WithContext(path);
  return std::unique_ptr<SafetensorsFile>(
      new SafetensorsFile(std::move(file), std::move(header).value()));
}

Result<TensorRef> SafetensorsFile::Get(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) return Status::NotFound("tensor '" + name + "' not in " + path());
  const TensorInfo& t = header_.tensors[it->second];
  return TensorRef{&t, file_->data() + header_.data_offset + t.begin, file_.get()};
}

Status WriteSafetensorsF32(const std::string& path, const std::map<std::string, F32Tensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (numel != static_cast<int64_t>(t.data.size())) {
      return Status::Internal("tensor '" + name + "' shape does not match its data");
    }
    const uint64_t bytes = t.data.size() * sizeof(float);
    header[name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return Status::IoError(path + ": " + std::strerror(errno));
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  bool ok = std::fwrite(len, 1, 8, f) == 8 && std::fwrite(text.data(), 1, n, f) == n;
  for (const auto& [name, t] : tensors) {
    if (!ok) break;
    if (t.data.empty()) continue;
    ok = std::fwrite(t.data.data(), sizeof(float), t.data.size(), f) == t.data.size();
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return Status::IoError(path + ": write failed");
  return Status::Ok();
}

}  // namespace moerun
