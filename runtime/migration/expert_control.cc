#include "runtime/migration/expert_control.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "base/log.h"

namespace moerun {
namespace {

using nlohmann::json;

std::string ErrorReply(uint64_t id, const std::string& why) {
  return json{{"id", id}, {"final", true}, {"ok", false}, {"error", why}}.dump();
}

std::vector<int> IntList(const json& j, const char* key) {
  std::vector<int> out;
  if (!j.contains(key) || !j[key].is_array()) return out;
  for (const auto& v : j[key]) {
    if (v.is_number_integer()) out.push_back(v.get<int>());
  }
  return out;
}

}  // namespace

ExpertControl::ExpertControl(Transport* transport, int routers,
                             std::map<int, std::shared_ptr<MoeLayerWeights>> layers,
                             std::chrono::milliseconds deadline)
    : t_(transport), deadline_(deadline), layers_(std::move(layers)) {
  const size_t n = static_cast<size_t>(routers);
  for (const auto& [layer, w] : layers_) {
    auto& users = users_[layer];
    users.assign(w->experts.size(), std::vector<bool>(n, false));
    for (size_t e = 0; e < w->experts.size(); ++e) {
      if (!w->experts[e].w13.empty()) users[e].assign(n, true);
    }
  }
  Publish();
}

ExpertControl::~ExpertControl() {
  cancel_.store(true);
  if (result_.valid()) result_.wait();
  outgoing_.Drain(t_, SteadyClock::now());
}

void ExpertControl::EnableCache(ExpertCacheOptions options, ExpertFetch fetch,
                                const std::map<int, std::vector<bool>>& hosted,
                                const std::map<int, std::vector<bool>>& pinned,
                                std::unique_ptr<SpillFile> spill) {
  std::map<int, std::vector<ExpertWeights>*> vectors;
  for (auto& [layer, w] : layers_) vectors[layer] = &w->experts;
  cache_ = std::make_unique<ExpertCache>(options, std::move(fetch), std::move(vectors),
                                         std::move(spill));
  for (const auto& [layer, mask] : hosted) {
    auto u = users_.find(layer);
    if (u == users_.end()) continue;
    for (size_t e = 0; e < mask.size() && e < u->second.size(); ++e) {
      if (!mask[e]) continue;
      u->second[e].assign(u->second[e].size(), true);
      cache_->Host(layer, static_cast<int>(e), true);
    }
  }
  for (const auto& [layer, mask] : pinned) {
    for (size_t e = 0; e < mask.size(); ++e) {
      if (mask[e]) cache_->Pin(layer, static_cast<int>(e));
    }
  }
  Publish();
}

bool ExpertControl::hosts(int layer, int expert) const {
  const auto u = users_.find(layer);
  if (u == users_.end() || expert < 0 || static_cast<size_t>(expert) >= u->second.size()) {
    return false;
  }
  const auto& users = u->second[static_cast<size_t>(expert)];
  return std::any_of(users.begin(), users.end(), [](bool b) { return b; });
}

void ExpertControl::set_on_change(std::function<void(const ServedWeights&)> f) {
  on_change_ = std::move(f);
  if (on_change_) on_change_(served_);
}

void ExpertControl::Publish() {
  const int top = layers_.empty() ? -1 : layers_.rbegin()->first;
  served_.layers.assign(static_cast<size_t>(std::max(top, -1) + 1), ServedLayer{});
  for (const auto& [layer, w] : layers_) {
    if (layer < 0) continue;  // no header names it
    ServedLayer& s = served_.layers[static_cast<size_t>(layer)];
    s.weights = w.get();
    s.hosted.resize(w->experts.size());
    for (size_t e = 0; e < w->experts.size(); ++e) {
      // With a cache an expert loads when a microbatch needs it; without, only what is held.
      s.hosted[e] = cache_ ? hosts(layer, static_cast<int>(e)) : !w->experts[e].w13.empty();
    }
  }
  served_.cache = cache_.get();
  served_.has_updates = !variants_.empty();
  if (on_change_) on_change_(served_);
}

void ExpertControl::set_loaders(ExpertLoader load, ExpertFileLoader load_file) {
  loader_ = std::move(load);
  file_loader_ = std::move(load_file);
}

const MoeLayerWeights* ExpertControl::layer(int layer) const {
  const auto it = layers_.find(layer);
  return it == layers_.end() ? nullptr : it->second.get();
}

std::vector<int> ExpertControl::layer_ids() const {
  std::vector<int> ids;
  for (const auto& [layer, w] : layers_) ids.push_back(layer);
  return ids;
}

void ExpertControl::Drain(Deadline deadline) { outgoing_.Drain(t_, deadline); }

size_t ExpertControl::held_bytes() const {
  size_t n = 0;
  for (const auto& [l, w] : layers_) n += w->ExpertBytes();
  for (const auto& [k, v] : variants_) n += v.weights.bytes();
  return n;
}

const ExpertWeights* ExpertControl::CanaryRows(int layer, int expert, int64_t first, int64_t n,
                                               std::vector<int32_t>* rows) {
  const auto v = variants_.find({layer, expert});
  if (v == variants_.end()) return nullptr;
  // Row j of the expert's stream goes to the new weights when floor((j + 1) * share) passes
  // floor(j * share): after any number of rows the canary count is the share, rounded down.
  Variant& var = v->second;
  const size_t before_rows = rows->size();
  for (int64_t r = 0; r < n; ++r) {
    const uint64_t j = var.rows++;
    const auto before = static_cast<uint64_t>(static_cast<double>(j) * var.share);
    const auto after = static_cast<uint64_t>(static_cast<double>(j + 1) * var.share);
    if (after > before) rows->push_back(static_cast<int32_t>(first + r));
  }
  var.canary_rows += rows->size() - before_rows;
  return &var.weights;
}

Status ExpertControl::Reply(int router, const std::string& body) {
  if (t_->peer_failed(router)) return Status::Ok();  // it died: nobody reads the reply
  return outgoing_.Send(t_, router, kTagControl, kTagControlBody, ControlHeaderFor(body), body);
}

Status ExpertControl::OnMessage(int router, const EpHeaderFixed& h) {
  const int me = t_->rank();
  if (h.rows <= 0 || static_cast<uint64_t>(h.rows) > kMaxControlBytes) {
    return Status::Corrupt("rank " + std::to_string(me) + ": control message of " +
                           std::to_string(h.rows) + " bytes from router " + std::to_string(router));
  }
  body_.resize(static_cast<size_t>(h.rows));
  MOERUN_RETURN_IF_ERROR(
      t_->Recv(router, kTagRows, body_.data(), body_.size(), DeadlineIn(deadline_)));
  Status s;
  try {
    s = Handle(router, h.seq);
  } catch (const nlohmann::json::exception& e) {  // a field of the wrong type
    s = Reply(router, ErrorReply(h.seq, std::string("malformed control message: ") + e.what()));
  }
  Publish();  // a release, promote, rollback or a load that needed nothing may have changed it
  return s;
}

Status ExpertControl::Handle(int router, uint64_t id) {
  const int me = t_->rank();
  const json j = json::parse(body_.begin(), body_.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("op") || !j["op"].is_string() ||
      !j.contains("layer") || !j["layer"].is_number_integer()) {
    return Reply(router, ErrorReply(id, "malformed control message"));
  }
  const std::string op = j["op"].get<std::string>();
  const int layer = j["layer"].get<int>();
  const auto lw = layers_.find(layer);
  if (lw == layers_.end()) {
    return Reply(router, ErrorReply(id, "rank " + std::to_string(me) + " does not serve layer " +
                                            std::to_string(layer)));
  }
  const int experts = static_cast<int>(lw->second->experts.size());
  auto bad_expert = [&](int e) { return e < 0 || e >= experts; };

  if (op == "release") {
    std::vector<int> list = IntList(j, "experts");
    for (int e : list) {
      if (bad_expert(e)) return Reply(router, ErrorReply(id, "no expert " + std::to_string(e)));
    }
    const bool all = j.value("all_routers", false);
    return Reply(router, Release(id, router, layer, list, all));
  }
  if (op == "query" || op == "promote" || op == "rollback") {
    const int e = j.value("expert", -1);
    const auto v = variants_.find({layer, e});
    if (v == variants_.end()) {
      return Reply(router,
                   ErrorReply(id, "rank " + std::to_string(me) + " has no update of " + "layer " +
                                      std::to_string(layer) + " expert " + std::to_string(e)));
    }
    json r{{"id", id},
           {"final", true},
           {"ok", true},
           {"rows", v->second.rows},
           {"canary_rows", v->second.canary_rows}};
    if (op == "promote") {
      lw->second->experts[static_cast<size_t>(e)] = std::move(v->second.weights);
      if (cache_) {  // resident now; a later load reads the update's file
        cache_->Resized(layer, e);
        cache_->SetFile(layer, e, v->second.file);
      }
      variants_.erase(v);
      spdlog::info("rank {}: layer {} expert {}: the new weights are promoted", me, layer, e);
    } else if (op == "rollback") {
      variants_.erase(v);
      spdlog::info("rank {}: layer {} expert {}: the update is rolled back", me, layer, e);
    }
    return Reply(router, r.dump());
  }
  if (op != "load" && op != "update") {
    return Reply(router, ErrorReply(id, "unknown control operation '" + op + "'"));
  }
  if (device_copy_) {
    return Reply(router, ErrorReply(id, "rank " + std::to_string(me) +
                                            " computes on a device whose copy of the experts is "
                                            "made at start: loading experts while serving needs "
                                            "--device cpu"));
  }
  Job job;
  job.router = router;
  job.id = id;
  job.layer = layer;
  if (op == "load") {
    if (!loader_) return Reply(router, ErrorReply(id, "this rank cannot load experts"));
    for (int e : IntList(j, "experts")) {
      if (bad_expert(e)) return Reply(router, ErrorReply(id, "no expert " + std::to_string(e)));
      job.experts.push_back(e);
    }
    if (j.contains("files") && j["files"].is_object()) {
      for (const auto& [k, v] : j["files"].items()) {
        if (v.is_string()) job.files[std::atoi(k.c_str())] = v.get<std::string>();
      }
    }
    job.throttle = j.value("throttle_bytes_s", 0.0);
  } else {
    if (!file_loader_) return Reply(router, ErrorReply(id, "this rank cannot load expert files"));
    job.update = true;
    job.expert = j.value("expert", -1);
    job.file = j.value("file", std::string());
    job.canary = j.value("canary", 0.0);
    if (bad_expert(job.expert)) {
      return Reply(router, ErrorReply(id, "no expert " + std::to_string(job.expert)));
    }
    if (!(job.canary >= 0.0 && job.canary <= 1.0)) {
      return Reply(router, ErrorReply(id, "the canary share must be within 0..1"));
    }
    if (!hosts(layer, job.expert)) {
      return Reply(router, ErrorReply(id, "rank " + std::to_string(me) + " does not hold layer " +
                                              std::to_string(layer) + " expert " +
                                              std::to_string(job.expert)));
    }
    if (variants_.count({layer, job.expert}) != 0) {
      return Reply(router, ErrorReply(id, "layer " + std::to_string(layer) + " expert " +
                                              std::to_string(job.expert) +
                                              " already has an update: promote or roll it back"));
    }
  }
  queued_.push_back(std::move(job));
  if (!running_) return StartNextJob();
  return Status::Ok();
}

std::string ExpertControl::Release(uint64_t id, int router, int layer,
                                   const std::vector<int>& experts, bool all_routers) {
  MoeLayerWeights& w = *layers_.at(layer);
  auto& users = users_.at(layer);
  json freed = json::array();
  uint64_t freed_bytes = 0;
  for (int e : experts) {
    auto& u = users[static_cast<size_t>(e)];
    if (all_routers) {
      u.assign(u.size(), false);
    } else {
      u[static_cast<size_t>(router)] = false;
    }
    ExpertWeights& ew = w.experts[static_cast<size_t>(e)];
    if (std::any_of(u.begin(), u.end(), [](bool b) { return b; })) continue;
    if (cache_ && cache_->hosted(layer, e)) {  // hosted, resident or not: no longer
      freed_bytes += ew.w13.empty() ? 0 : ew.bytes();
      cache_->Host(layer, e, false);
      freed.push_back(e);
    } else if (!ew.w13.empty()) {
      freed_bytes += ew.bytes();
      ew = ExpertWeights{};
      freed.push_back(e);
    }
  }
  if (!freed.empty()) {
    spdlog::info("rank {}: layer {}: freed {} expert(s) ({:.1f} MiB)", t_->rank(), layer,
                 freed.size(), static_cast<double>(freed_bytes) / (1 << 20));
  }
  return json{
      {"id", id}, {"final", true}, {"ok", true}, {"freed", freed}, {"freed_bytes", freed_bytes}}
      .dump();
}

Status ExpertControl::StartNextJob() {
  // Experts this rank already holds need no load: they are only marked used again.
  while (!queued_.empty()) {
    Job job = std::move(queued_.front());
    queued_.pop_front();
    if (!job.update) {
      MoeLayerWeights& w = *layers_.at(job.layer);
      std::vector<int> missing;
      for (int e : job.experts) {
        const bool have =
            cache_ ? hosts(job.layer, e) : !w.experts[static_cast<size_t>(e)].w13.empty();
        if (!have) missing.push_back(e);
        auto& u = users_.at(job.layer)[static_cast<size_t>(e)];
        u.assign(u.size(), true);
      }
      job.experts = missing;
      if (cache_ && !missing.empty()) {
        // Hosted from now on; warmed as far as the budget allows, answered once those loads
        // are done (the others load when a microbatch needs them).
        for (int e : missing) {
          cache_->Host(job.layer, e, true);
          const auto f = job.files.find(e);
          if (f != job.files.end()) cache_->SetFile(job.layer, e, f->second);
        }
        cache_->Warm(job.layer, missing);
        job.warming = true;
        running_ = std::make_unique<Job>(std::move(job));
        running_->started = std::chrono::steady_clock::now();
        last_progress_ = running_->started;
        spdlog::info("rank {}: layer {}: {} expert(s) hosted; warming the expert cache", t_->rank(),
                     running_->layer, running_->experts.size());
        return Status::Ok();
      }
      if (missing.empty()) {
        MOERUN_RETURN_IF_ERROR(Reply(
            job.router,
            json{{"id", job.id}, {"final", true}, {"ok", true}, {"bytes", 0}, {"seconds", 0.0}}
                .dump()));
        continue;
      }
    }
    running_ = std::make_unique<Job>(std::move(job));
    running_->started = std::chrono::steady_clock::now();
    last_progress_ = running_->started;
    job_bytes_.store(0);
    const Job& r = *running_;
    if (r.update) {
      spdlog::info("rank {}: layer {} expert {}: loading new weights from {}", t_->rank(), r.layer,
                   r.expert, r.file);
      result_ = std::async(std::launch::async,
                           [this, layer = r.layer, expert = r.expert, file = r.file]() {
                             Loaded out;
                             Result<ExpertWeights> w = file_loader_(layer, expert, file);
                             if (w.ok()) {
                               out.expert = std::move(*w);
                             } else {
                               out.status = w.status();
                             }
                             return out;
                           });
    } else {
      const size_t n = layers_.at(r.layer)->experts.size();
      std::vector<bool> mask(n, false);
      for (int e : r.experts) mask[static_cast<size_t>(e)] = true;
      spdlog::info("rank {}: layer {}: loading {} expert(s) in the background{}", t_->rank(),
                   r.layer, r.experts.size(),
                   r.throttle > 0 ? fmt::format(" at most {:.1f} MiB/s", r.throttle / (1 << 20))
                                  : std::string());
      LoadThrottle th;
      th.bytes_per_s = r.throttle;
      th.bytes_done = &job_bytes_;
      th.cancel = &cancel_;
      result_ =
          std::async(std::launch::async, [this, layer = r.layer, mask, files = r.files, th]() {
            Loaded out;
            auto w = loader_(layer, mask, files, th);
            if (w.ok()) {
              out.layer = std::move(*w);
            } else {
              out.status = w.status();
            }
            return out;
          });
    }
    return Status::Ok();
  }
  return Status::Ok();
}

Status ExpertControl::Poll() {
  // A reply to a router that died is dropped: nobody reads it.
  MOERUN_RETURN_IF_ERROR(outgoing_.Poll(t_, [this](int peer) { return t_->peer_failed(peer); }));
  if (cache_) MOERUN_RETURN_IF_ERROR(cache_->Poll());
  if (!running_) return Status::Ok();
  const auto now = std::chrono::steady_clock::now();
  if (running_->warming) {
    if (cache_->Loading(running_->layer, running_->experts)) return Status::Ok();
    std::unique_ptr<Job> job = std::move(running_);
    uint64_t bytes = 0;
    int resident = 0;
    for (int e : job->experts) {
      if (!cache_->resident(job->layer, e)) continue;
      ++resident;
      bytes += layers_.at(job->layer)->experts[static_cast<size_t>(e)].bytes();
    }
    const double secs = std::chrono::duration<double>(now - job->started).count();
    spdlog::info(
        "rank {}: layer {}: {} of {} new expert(s) resident in the cache ({:.1f} MiB, {:.2f} s)",
        t_->rank(), job->layer, resident, job->experts.size(),
        static_cast<double>(bytes) / (1 << 20), secs);
    Status s = Reply(job->router, json{{"id", job->id},
                                       {"final", true},
                                       {"ok", true},
                                       {"bytes", bytes},
                                       {"seconds", secs},
                                       {"resident", resident}}
                                      .dump());
    if (s.ok()) s = StartNextJob();
    Publish();
    return s;
  }
  if (result_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (now - last_progress_ >= std::chrono::seconds(1)) {
      last_progress_ = now;
      MOERUN_RETURN_IF_ERROR(Reply(
          running_->router,
          json{{"id", running_->id}, {"final", false}, {"ok", true}, {"bytes", job_bytes_.load()}}
              .dump()));
    }
    return Status::Ok();
  }
  std::unique_ptr<Job> job = std::move(running_);
  Status s = Finish(*job, result_.get());
  if (s.ok()) s = StartNextJob();
  Publish();  // what loaded is in (or, failed, nobody uses it)
  return s;
}

Status ExpertControl::Finish(Job& job, Loaded loaded) {
  const int me = t_->rank();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - job.started).count();
  if (!loaded.status.ok()) {
    spdlog::error("rank {}: layer {}: {} failed: {}", me, job.layer, job.update ? "update" : "load",
                  loaded.status.ToString());
    if (!job.update) {  // nobody uses what could not be loaded
      for (int e : job.experts) {
        if (layers_.at(job.layer)->experts[static_cast<size_t>(e)].w13.empty()) {
          auto& u = users_.at(job.layer)[static_cast<size_t>(e)];
          u.assign(u.size(), false);
        }
      }
    }
    return Reply(job.router, ErrorReply(job.id, loaded.status.ToString()));
  }
  uint64_t bytes = 0;
  if (job.update) {
    if (!hosts(job.layer, job.expert)) {
      return Reply(job.router, ErrorReply(job.id, "the expert was freed while its update loaded"));
    }
    bytes = loaded.expert.bytes();
    Variant& v = variants_[{job.layer, job.expert}];
    v.weights = std::move(loaded.expert);
    v.share = job.canary;
    v.file = job.file;
    spdlog::info(
        "rank {}: layer {} expert {}: new weights in ({:.1f} MiB, {:.2f} s), canary {:.2f}%", me,
        job.layer, job.expert, static_cast<double>(bytes) / (1 << 20), secs, job.canary * 100);
  } else {
    MoeLayerWeights& w = *layers_.at(job.layer);
    for (int e : job.experts) {
      ExpertWeights& src = loaded.layer->experts[static_cast<size_t>(e)];
      if (src.w13.empty()) {
        return Reply(job.router,
                     ErrorReply(job.id, "the loader did not load expert " + std::to_string(e)));
      }
      bytes += src.bytes();
      w.experts[static_cast<size_t>(e)] = std::move(src);
    }
    spdlog::info("rank {}: layer {}: {} expert(s) loaded in the background ({:.1f} MiB, {:.2f} s)",
                 me, job.layer, job.experts.size(), static_cast<double>(bytes) / (1 << 20), secs);
  }
  return Reply(
      job.router,
      json{{"id", job.id}, {"final", true}, {"ok", true}, {"bytes", bytes}, {"seconds", secs}}
          .dump());
}

}  // namespace moerun
