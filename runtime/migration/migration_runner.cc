#include "runtime/migration/migration_runner.h"

#include <nlohmann/json.hpp>
#include <set>

#include "base/log.h"
#include "runtime/ep/protocol.h"
#include "runtime/migration/placement_diff.h"

namespace moerun {
namespace {

using nlohmann::json;

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

MigrationRunner::MigrationRunner(ControlLink* link, std::vector<int> served, size_t header_bytes)
    : link_(link), served_(std::move(served)), header_bytes_(header_bytes) {}

Status MigrationRunner::CheckIdle() const {
  if (running()) {
    return Status::Unavailable("migration " + std::to_string(migration_->view.id) +
                               " is still running (moectl placement progress)");
  }
  return Status::Ok();
}

Result<MigrationRunner::LayerStep> MigrationRunner::PlanLayer(
    int layer, const LayerPlacement* old, const LayerPlacement* nw,
    const MigrationOptions& options) const {
  const size_t capacity = (header_bytes_ - sizeof(EpHeaderFixed)) / sizeof(EpEntry);
  if (nw == nullptr) {
    return Status::InvalidArgument("the placement has no entry for layer " + std::to_string(layer) +
                                   " (nor a \"*\" entry)");
  }
  if (static_cast<size_t>(nw->MaxSlotsPerRank()) > capacity) {
    return Status::InvalidArgument("layer " + std::to_string(layer) + ": the placement puts " +
                                   std::to_string(nw->MaxSlotsPerRank()) +
                                   " slots on a rank; this job's headers hold " +
                                   std::to_string(capacity) + " (apply it with a restart)");
  }
  const Placement& cur = *link_->placement_in_use();
  LayerStep step;
  step.view.layer = layer;
  step.view.state = "pending";
  if (old != nullptr && Placement::SameSlots(*old, *nw)) {
    step.view.state = "unchanged";
    return step;
  }
  for (int d = cur.num_routers(); d < cur.num_ranks(); ++d) {
    const std::set<int> was = old ? ExpertsOn(*old, d) : std::set<int>();
    const std::set<int> will = ExpertsOn(*nw, d);
    step.add[d] = Minus(will, was);
    step.remove[d] = Minus(was, will);
    step.view.experts_to_load += static_cast<int>(step.add[d].size());
    step.view.experts_to_free += static_cast<int>(step.remove[d].size());
  }
  step.view.bytes_to_move = step.view.experts_to_load * options.expert_bytes;
  return step;
}

Result<MigrationView> MigrationRunner::Start(const Placement& target,
                                             const MigrationOptions& options) {
  const Placement& cur = *link_->placement_in_use();
  if (target.num_ranks() != cur.num_ranks() || target.num_routers() != cur.num_routers() ||
      target.num_experts() != cur.num_experts()) {
    return Status::InvalidArgument("the placement is for " + std::to_string(target.num_ranks()) +
                                   " ranks, " + std::to_string(target.num_routers()) +
                                   " router(s), " + std::to_string(target.num_experts()) +
                                   " experts; this job has " + std::to_string(cur.num_ranks()) +
                                   ", " + std::to_string(cur.num_routers()) + ", " +
                                   std::to_string(cur.num_experts()));
  }
  auto m = std::make_unique<Migration>();
  m->target = std::make_shared<const Placement>(target);
  m->started = std::chrono::steady_clock::now();
  m->view.id = ++migrations_;
  m->view.state = "running";
  m->view.trigger = options.trigger;
  m->view.note = options.note;
  m->view.throttle_bytes_s = options.throttle_bytes_s;
  m->view.from_version = cur.version();
  uint64_t changed = 0;
  for (int layer : served_) {
    MOERUN_ASSIGN_OR_RETURN(LayerStep step,
                            PlanLayer(layer, cur.Layer(layer), target.Layer(layer), options));
    if (step.view.state != "unchanged") {
      ++changed;
      m->view.bytes_to_move += step.view.bytes_to_move;
    }
    m->steps.push_back(std::move(step));
  }
  m->view.to_version = cur.version() + changed;
  if (changed == 0) {
    m->view.state = "done";
    m->view.note = "every layer already has this placement";
  } else {
    spdlog::info(
        "migration {} ({}): v{} -> v{}, {} layer(s), {} expert copies to load ({:.1f} MiB)",
        m->view.id, options.trigger, m->view.from_version, m->view.to_version, changed,
        [&] {
          int n = 0;
          for (const auto& s : m->steps) n += s.view.experts_to_load;
          return n;
        }(),
        static_cast<double>(m->view.bytes_to_move) / (1 << 20));
  }
  migration_ = std::move(m);
  MigrationView v = migration_->view;
  for (const auto& s : migration_->steps) v.layers.push_back(s.view);
  return v;
}

void MigrationRunner::Fail(const std::string& why) {
  migration_->view.state = "failed";
  migration_->view.error = why;
  migration_->view.elapsed_s = Since(migration_->started);
  spdlog::error("migration {} failed: {}", migration_->view.id, why);
}

Status MigrationRunner::StartLayer(LayerStep& step,
                                   const std::map<std::pair<int, int>, std::string>& promoted) {
  Migration* m = migration_.get();
  const int layer = step.view.layer;
  step.started = std::chrono::steady_clock::now();
  step.view.state = "loading";
  std::map<int, std::string> files;
  for (const auto& [key, file] : promoted) {
    if (key.first == layer) files[key.second] = file;
  }
  json jfiles = json::object();
  for (const auto& [e, f] : files) jfiles[std::to_string(e)] = f;
  for (const auto& [d, add] : step.add) {
    if (add.empty()) continue;
    ++step.awaiting;
    const size_t index = static_cast<size_t>(&step - m->steps.data());
    MOERUN_RETURN_IF_ERROR(link_->SendToExpert(d,
                                               json{{"op", "load"},
                                                    {"layer", layer},
                                                    {"experts", add},
                                                    {"files", jfiles},
                                                    {"throttle_bytes_s", m->view.throttle_bytes_s}}
                                                   .dump(),
                                               [this, m, index](int rank, const ControlReply& r) {
                                                 if (migration_.get() != m) return;
                                                 LayerStep& s = m->steps[index];
                                                 if (r.ok || !r.final) s.loaded[rank] = r.bytes;
                                                 if (!r.final) return;
                                                 if (!r.ok && s.error.empty())
                                                   s.error = "rank " + std::to_string(rank) + ": " +
                                                             r.error;
                                                 --s.awaiting;
                                               }));
  }
  spdlog::info("migration {}: layer {}: loading {} expert cop{} on {} rank(s)", m->view.id, layer,
               step.view.experts_to_load, step.view.experts_to_load == 1 ? "y" : "ies",
               step.awaiting);
  return Status::Ok();
}

Status MigrationRunner::Loaded(LayerStep& s, size_t index) {
  if (!s.error.empty()) {
    // Nobody sends rows to the copies this layer added: free them on every rank.
    for (const auto& [d, add] : s.add) {
      if (add.empty()) continue;
      MOERUN_RETURN_IF_ERROR(link_->SendToExpert(
          d,
          json{{"op", "release"}, {"layer", s.view.layer}, {"experts", add}, {"all_routers", true}}
              .dump(),
          nullptr));
    }
    s.view.state = "failed";
    s.view.seconds = Since(s.started);
    Fail("layer " + std::to_string(s.view.layer) + ": " + s.error);
    return Status::Ok();
  }
  Migration& m = *migration_;
  const Placement& cur = *link_->placement_in_use();
  MOERUN_ASSIGN_OR_RETURN(Placement next,
                          cur.WithLayer(s.view.layer, *m.target, cur.version() + 1));
  s.view.state = "switching";
  Migration* mp = &m;
  MOERUN_ASSIGN_OR_RETURN(
      s.awaiting, link_->Switch(s.view.layer, std::make_shared<const Placement>(std::move(next)),
                                true, [this, mp, index](int rank, const ControlReply& r) {
                                  if (migration_.get() != mp || !r.final) return;
                                  LayerStep& st = mp->steps[index];
                                  st.view.bytes_freed += r.freed;
                                  if (!r.ok && st.error.empty()) {
                                    st.error = "rank " + std::to_string(rank) + ": " + r.error;
                                  }
                                  --st.awaiting;
                                }));
  return Status::Ok();
}

Status MigrationRunner::Step(const std::map<std::pair<int, int>, std::string>& promoted) {
  if (!running()) return Status::Ok();
  Migration& m = *migration_;
  while (m.current < m.steps.size()) {
    LayerStep& s = m.steps[m.current];
    const size_t index = m.current;
    if (s.view.state == "unchanged") {
      ++m.current;
      continue;
    }
    if (s.view.state == "pending") MOERUN_RETURN_IF_ERROR(StartLayer(s, promoted));
    if (s.view.state == "loading") {
      if (s.awaiting > 0) return Status::Ok();
      MOERUN_RETURN_IF_ERROR(Loaded(s, index));
      if (s.view.state == "failed") return Status::Ok();
    }
    if (s.view.state == "switching") {
      if (s.awaiting > 0) return Status::Ok();
      s.view.seconds = Since(s.started);
      if (!s.error.empty()) {
        s.view.state = "failed";
        Fail("layer " + std::to_string(s.view.layer) + " (switched): " + s.error);
        return Status::Ok();
      }
      s.view.state = "done";
      spdlog::info("migration {}: layer {} done in {:.2f} s ({:.1f} MiB loaded)", m.view.id,
                   s.view.layer, s.view.seconds, [&] {
                     int64_t b = 0;
                     for (const auto& [d, n] : s.loaded) b += n;
                     return static_cast<double>(b) / (1 << 20);
                   }());
      ++m.current;
    }
  }
  m.view.state = "done";
  m.view.elapsed_s = Since(m.started);
  spdlog::info("migration {} done: placement v{} in {:.2f} s", m.view.id,
               link_->placement_in_use()->version(), m.view.elapsed_s);
  return Status::Ok();
}

MigrationView MigrationRunner::Progress() const {
  if (!migration_) return MigrationView{};
  MigrationView v = migration_->view;
  v.bytes_loaded = 0;
  for (const auto& s : migration_->steps) {
    MigrationLayerView lv = s.view;
    for (const auto& [d, n] : s.loaded) lv.bytes_loaded += n;
    if (s.view.state == "loading" || s.view.state == "switching") lv.seconds = Since(s.started);
    v.bytes_loaded += lv.bytes_loaded;
    v.bytes_freed += lv.bytes_freed;
    v.layers.push_back(lv);
  }
  if (v.state == "running") v.elapsed_s = Since(migration_->started);
  return v;
}

}  // namespace moerun
