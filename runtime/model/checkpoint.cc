#include "runtime/model/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace moerun {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint64_t kMaxIndexBytes = 64ull << 20;

bool SafeShardName(const std::string& name) {
  if (name.empty() || name.size() > 255) return false;
  if (name.find('/') != std::string::npos || name.find('\\') != std::string::npos) return false;
  if (name == "." || name == "..") return false;
  return name.find('\0') == std::string::npos;
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t limit) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) return Status::IoError(path + ": " + ec.message());
  if (size > limit) {
    return Status::Corrupt(path + ": " + std::to_string(size) + " bytes is over the limit of " +
                           std::to_string(limit));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Result<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& path) {
  std::unique_ptr<Checkpoint> ck(new Checkpoint());
  ck->path_ = path;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    const fs::path p(path);
    ck->dir_ = p.parent_path().string();
    const std::string file = p.filename().string();
    MOERUN_ASSIGN_OR_RETURN(const SafetensorsFile* f, ck->Shard(file));
    for (const auto& t : f->header().tensors) ck->weight_map_[t.name] = file;
    return ck;
  }
  if (!fs::is_directory(path, ec)) return Status::NotFound(path + ": no such file or folder");
  ck->dir_ = path;
  const std::string index = (fs::path(path) / "model.safetensors.index.json").string();
  if (fs::exists(index, ec)) {
    MOERUN_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index, kMaxIndexBytes));
    const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded() || !doc.is_object()) {
      return Status::Corrupt(index + ": not a JSON object");
    }
    const auto wm = doc.find("weight_map");
    if (wm == doc.end() || !wm->is_object()) {
      return Status::Corrupt(index + ": no \"weight_map\" object");
    }
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string() || !SafeShardName(it->get<std::string>())) {
        return Status::Corrupt(index + ": tensor '" + it.key() +
                               "' maps to something other than a file name in this folder");
      }
      ck->weight_map_[it.key()] = it->get<std::string>();
    }
    return ck;
  }
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    if (e.is_regular_file() && e.path().extension() == ".safetensors") {
      files.push_back(e.path().filename().string());
    }
  }
  std::string file;
  if (fs::exists(fs::path(path) / "model.safetensors", ec)) {
    file = "model.safetensors";
  } else if (files.size() == 1) {
    file = files[0];
  } else {
    return Status::NotFound(path + ": no model.safetensors.index.json or model.safetensors" +
                            (files.empty() ? std::string()
                                           : " (and " + std::to_string(files.size()) +
                                                 " other .safetensors files: which one?)"));
  }
  MOERUN_ASSIGN_OR_RETURN(const SafetensorsFile* f, ck->Shard(file));
  for (const auto& t : f->header().tensors) ck->weight_map_[t.name] = file;
  return ck;
}

Result<const SafetensorsFile*> Checkpoint::Shard(const std::string& file) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = shards_.find(file);
  if (it != shards_.end()) return static_cast<const SafetensorsFile*>(it->second.get());
  const std::string full = dir_.empty() ? file : (fs::path(dir_) / file).string();
  MOERUN_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(full));
  const SafetensorsFile* raw = f.get();
  shards_[file] = std::move(f);
  return raw;
}

bool Checkpoint::Has(const std::string& name) const { return weight_map_.count(name) != 0; }

Result<TensorRef> Checkpoint::Get(const std::string& name) const {
  const auto it = weight_map_.find(name);
  if (it == weight_map_.end()) {
    return Status::NotFound("tensor '" + name + "' is not in the checkpoint " + path_);
  }
  auto shard = Shard(it->second);
  if (!shard.ok()) {
    return shard.status().WithContext("tensor '" + name + "' is in shard " + it->second);
  }
  const SafetensorsFile* f = *shard;
  auto t = f->Get(name);
  if (!t.ok()) {
    return Status::Corrupt("the index of " + path_ + " places tensor '" + name + "' in " +
                           it->second + ", which does not hold it");
  }
  return t;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(weight_map_.size());
  for (const auto& [name, file] : weight_map_) names.push_back(name);
  return names;
}

Status Checkpoint::OpenAllShards() const {
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map_) files.insert(file);
  for (const std::string& f : files) MOERUN_RETURN_IF_ERROR(Shard(f).status());
  return Status::Ok();
}

size_t Checkpoint::OpenedShards() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shards_.size();
}

}  // namespace moerun
