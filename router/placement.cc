#include "router/placement.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace moerun {
namespace {

using json = nlohmann::json;

Status CheckJob(int num_experts, int ranks, int routers) {
  if (num_experts <= 0) return Status::InvalidArgument("placement: no experts");
  if (routers < 1) return Status::InvalidArgument("placement: at least one router rank is needed");
  if (ranks <= routers) {
    return Status::InvalidArgument("placement: " + std::to_string(ranks) + " ranks with " +
                                   std::to_string(routers) +
                                   " routers leave no rank to host experts");
  }
  return Status::Ok();
}

// Whether a slot of lp is on a rank `dead` marks.
bool SlotOnAny(const LayerPlacement& lp, const std::vector<bool>& dead) {
  for (const Slot& s : lp.slots) {
    if (static_cast<size_t>(s.rank) < dead.size() && dead[static_cast<size_t>(s.rank)]) {
      return true;
    }
  }
  return false;
}

}  // namespace

int LayerPlacement::MaxSlotsPerRank() const {
  size_t m = 0;
  for (const auto& s : rank_slots) m = std::max(m, s.size());
  return static_cast<int>(m);
}

Status Placement::AddLayer(int layer, std::vector<Slot> slots, const std::string& source) {
  LayerPlacement lp;
  lp.replicas.resize(static_cast<size_t>(num_experts_));
  lp.rank_slots.resize(static_cast<size_t>(num_ranks_));
  std::set<std::pair<int, int>> seen;
  const std::string where =
      source + ": layer " + (layer == kAnyLayer ? "*" : std::to_string(layer));
  for (size_t i = 0; i < slots.size(); ++i) {
    const Slot& s = slots[i];
    if (s.rank < num_routers_ || s.rank >= num_ranks_) {
      return Status::InvalidArgument(where + ": slot " + std::to_string(i) + " is on rank " +
                                     std::to_string(s.rank) + ", not an expert rank (" +
                                     std::to_string(num_routers_) + ".." +
                                     std::to_string(num_ranks_ - 1) + ")");
    }
    if (s.expert < 0 || s.expert >= num_experts_) {
      return Status::InvalidArgument(where + ": slot " + std::to_string(i) + " names expert " +
                                     std::to_string(s.expert) + " of " +
                                     std::to_string(num_experts_));
    }
    if (!seen.insert({s.rank, s.expert}).second) {
      return Status::InvalidArgument(where + ": expert " + std::to_string(s.expert) +
                                     " appears twice on rank " + std::to_string(s.rank));
    }
    lp.replicas[static_cast<size_t>(s.expert)].push_back(static_cast<int>(i));
    lp.rank_slots[static_cast<size_t>(s.rank)].push_back(static_cast<int>(i));
  }
  for (int e = 0; e < num_experts_; ++e) {
    if (lp.replicas[static_cast<size_t>(e)].empty()) {
      return Status::InvalidArgument(where + ": expert " + std::to_string(e) + " has no slot");
    }
  }
  lp.slots = std::move(slots);
  if (lp.MaxSlotsPerRank() > kMaxSlotsPerRank) {
    return Status::InvalidArgument(where + ": more than " + std::to_string(kMaxSlotsPerRank) +
                                   " slots on one rank");
  }
  layers_[layer] = std::move(lp);
  return Status::Ok();
}

Result<Placement> Placement::WithLayer(int layer, const Placement& from, uint64_t version) const {
  const LayerPlacement* lp = from.Layer(layer);
  if (lp == nullptr) {
    return Status::InvalidArgument("the new placement has no entry for layer " +
                                   std::to_string(layer));
  }
  if (from.num_experts_ != num_experts_ || from.num_ranks_ != num_ranks_ ||
      from.num_routers_ != num_routers_) {
    return Status::InvalidArgument("the new placement is for another job");
  }
  Placement p = *this;
  p.version_ = version;
  MOERUN_RETURN_IF_ERROR(p.AddLayer(layer, lp->slots, "placement"));
  return p;
}

LayerPlacement LiveLayer(const LayerPlacement& lp, const std::vector<bool>& dead, int* orphans) {
  auto is_dead = [&](int rank) {
    return rank >= 0 && static_cast<size_t>(rank) < dead.size() && dead[static_cast<size_t>(rank)];
  };
  LayerPlacement live = lp;
  int lost = 0;
  for (auto& reps : live.replicas) {
    const bool had = !reps.empty();
    std::erase_if(reps, [&](int s) { return is_dead(lp.slots[static_cast<size_t>(s)].rank); });
    if (had && reps.empty()) ++lost;
  }
  for (size_t r = 0; r < live.rank_slots.size(); ++r) {
    if (is_dead(static_cast<int>(r))) live.rank_slots[r].clear();
  }
  if (orphans != nullptr) *orphans = lost;
  return live;
}

bool Placement::UsesAny(const std::vector<bool>& dead) const {
  for (const auto& [layer, lp] : layers_) {
    if (SlotOnAny(lp, dead)) return true;
  }
  return false;
}

bool Placement::UsesAny(const std::vector<bool>& dead, const std::vector<int>& layers) const {
  for (int l : layers) {
    const LayerPlacement* lp = Layer(l);
    if (lp != nullptr && SlotOnAny(*lp, dead)) return true;
  }
  return false;
}

Result<Placement> Placement::WithoutRanks(const std::vector<bool>& dead, uint64_t version,
                                          int* replaced, const std::vector<int>& capacity) const {
  auto has_room = [&](int rank, int count) {
    return static_cast<size_t>(rank) >= capacity.size() ||
           capacity[static_cast<size_t>(rank)] < 0 || count < capacity[static_cast<size_t>(rank)];
  };
  auto is_dead = [&](int rank) {
    return static_cast<size_t>(rank) < dead.size() && dead[static_cast<size_t>(rank)];
  };
  int survivors = 0;
  for (int r = num_routers_; r < num_ranks_; ++r) survivors += is_dead(r) ? 0 : 1;
  if (survivors == 0) {
    return Status::Unavailable("no expert rank survives: the experts cannot be re-placed");
  }
  Placement p = *this;
  p.version_ = version;
  int added = 0;
  for (const auto& [layer, lp] : layers_) {
    std::vector<Slot> slots;
    std::vector<int> count(static_cast<size_t>(num_ranks_), 0);
    std::vector<bool> held(static_cast<size_t>(num_experts_), false);
    for (const Slot& s : lp.slots) {
      if (is_dead(s.rank)) continue;
      slots.push_back(s);
      ++count[static_cast<size_t>(s.rank)];
      held[static_cast<size_t>(s.expert)] = true;
    }
    for (int e = 0; e < num_experts_; ++e) {
      if (held[static_cast<size_t>(e)]) continue;
      int best = -1;
      for (bool any_room : {false, true}) {  // the survivors with room first, else any
        for (int r = num_routers_; r < num_ranks_; ++r) {
          if (is_dead(r) || (!any_room && !has_room(r, count[static_cast<size_t>(r)]))) continue;
          if (best < 0 || count[static_cast<size_t>(r)] < count[static_cast<size_t>(best)])
            best = r;
        }
        if (best >= 0) break;
      }
      slots.push_back(Slot{best, e});
      ++count[static_cast<size_t>(best)];
      ++added;
    }
    MOERUN_RETURN_IF_ERROR(p.AddLayer(layer, std::move(slots), "placement without dead ranks"));
  }
  if (replaced != nullptr) *replaced = added;
  return p;
}

bool Placement::SameSlots(const LayerPlacement& a, const LayerPlacement& b) {
  if (a.slots.size() != b.slots.size()) return false;
  for (size_t i = 0; i < a.slots.size(); ++i) {
    if (a.slots[i].rank != b.slots[i].rank || a.slots[i].expert != b.slots[i].expert) return false;
  }
  return true;
}

Result<Placement> Placement::Linear(int num_experts, int ranks, int routers) {
  MOERUN_RETURN_IF_ERROR(CheckJob(num_experts, ranks, routers));
  Placement p;
  p.num_experts_ = num_experts, p.num_ranks_ = ranks, p.num_routers_ = routers;
  const int hosts = ranks - routers;
  std::vector<Slot> slots;
  for (int e = 0; e < num_experts; ++e) {
    slots.push_back(
        Slot{routers + static_cast<int>(static_cast<int64_t>(e) * hosts / num_experts), e});
  }
  MOERUN_RETURN_IF_ERROR(p.AddLayer(kAnyLayer, std::move(slots), "linear"));
  return p;
}

Result<Placement> Placement::RoundRobin(int num_experts, int ranks, int routers) {
  MOERUN_RETURN_IF_ERROR(CheckJob(num_experts, ranks, routers));
  Placement p;
  p.num_experts_ = num_experts, p.num_ranks_ = ranks, p.num_routers_ = routers;
  const int hosts = ranks - routers;
  std::vector<Slot> slots;
  for (int e = 0; e < num_experts; ++e) slots.push_back(Slot{routers + e % hosts, e});
  MOERUN_RETURN_IF_ERROR(p.AddLayer(kAnyLayer, std::move(slots), "round_robin"));
  return p;
}

Result<Placement> Placement::FromJson(const std::string& text, const std::string& source) {
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object())
    return Status::Corrupt(source + ": not a JSON object");
  auto get_int = [&](const char* key, int64_t lo, int64_t hi, int64_t* out) -> Status {
    const auto it = doc.find(key);
    if (it == doc.end() || !it->is_number_integer()) {
      return Status::InvalidArgument(source + ": \"" + key + "\" must be an integer");
    }
    *out = it->get<int64_t>();
    if (*out < lo || *out > hi) {
      return Status::InvalidArgument(source + ": \"" + key + "\" is out of range");
    }
    return Status::Ok();
  };
  const auto format = doc.find("format");
  if (format == doc.end() || !format->is_string() ||
      format->get<std::string>() != "moerun-placement-v1") {
    return Status::InvalidArgument(source + ": \"format\" must be \"moerun-placement-v1\"");
  }
  int64_t version = 0, experts = 0, ranks = 0, routers = 0;
  MOERUN_RETURN_IF_ERROR(get_int("version", 0, INT64_MAX, &version));
  MOERUN_RETURN_IF_ERROR(get_int("num_experts", 1, 1 << 20, &experts));
  MOERUN_RETURN_IF_ERROR(get_int("num_ranks", 2, 1 << 20, &ranks));
  MOERUN_RETURN_IF_ERROR(get_int("num_routers", 1, ranks - 1, &routers));
  Placement p;
  p.version_ = static_cast<uint64_t>(version);
  p.num_experts_ = static_cast<int>(experts);
  p.num_ranks_ = static_cast<int>(ranks);
  p.num_routers_ = static_cast<int>(routers);
  const auto layers = doc.find("layers");
  if (layers == doc.end() || !layers->is_object() || layers->empty()) {
    return Status::InvalidArgument(source + ": \"layers\" must be a non-empty object");
  }
  for (auto it = layers->begin(); it != layers->end(); ++it) {
    int layer = kAnyLayer;
    if (it.key() != "*") {
      const std::string& k = it.key();
      if (k.empty() || k.size() > 6 || k.find_first_not_of("0123456789") != std::string::npos) {
        return Status::InvalidArgument(source + ": layer key \"" + k + "\" is not a layer number");
      }
      layer = std::stoi(k);
    }
    if (!it->is_array()) {
      return Status::InvalidArgument(source + ": layer " + it.key() + " must be a list of slots");
    }
    std::vector<Slot> slots;
    for (const json& s : *it) {
      if (!s.is_array() || s.size() != 2 || !s[0].is_number_integer() ||
          !s[1].is_number_integer()) {
        return Status::InvalidArgument(source + ": layer " + it.key() +
                                       ": every slot must be [rank, expert]");
      }
      const int64_t r = s[0].get<int64_t>(), e = s[1].get<int64_t>();
      if (r < 0 || r > (1 << 20) || e < 0 || e > (1 << 20)) {
        return Status::InvalidArgument(source + ": layer " + it.key() + ": slot out of range");
      }
      slots.push_back(Slot{static_cast<int>(r), static_cast<int>(e)});
    }
    MOERUN_RETURN_IF_ERROR(p.AddLayer(layer, std::move(slots), source));
  }
  return p;
}

Result<Placement> Placement::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open the placement file");
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().size() > (64u << 20)) return Status::InvalidArgument(path + ": too large");
  return FromJson(ss.str(), path);
}

Result<Placement> Placement::Make(const std::string& spec, int num_experts, int ranks,
                                  int routers) {
  if (spec == "linear" || spec.empty()) return Linear(num_experts, ranks, routers);
  if (spec == "round_robin") return RoundRobin(num_experts, ranks, routers);
  MOERUN_ASSIGN_OR_RETURN(Placement p, FromFile(spec));
  MOERUN_RETURN_IF_ERROR(p.CheckFits(ranks, routers, num_experts));
  return p;
}

Status Placement::CheckFits(int ranks, int routers, int num_experts) const {
  if (num_ranks_ != ranks || num_routers_ != routers) {
    return Status::InvalidArgument("the placement is for " + std::to_string(num_ranks_) +
                                   " ranks with " + std::to_string(num_routers_) +
                                   " router(s), but this job has " + std::to_string(ranks) +
                                   " ranks with " + std::to_string(routers) + " router(s)");
  }
  if (num_experts_ != num_experts) {
    return Status::InvalidArgument("the placement is for " + std::to_string(num_experts_) +
                                   " experts, but the model has " + std::to_string(num_experts));
  }
  return Status::Ok();
}

const LayerPlacement* Placement::Layer(int layer) const {
  auto it = layers_.find(layer);
  if (it == layers_.end()) it = layers_.find(kAnyLayer);
  return it == layers_.end() ? nullptr : &it->second;
}

std::vector<bool> Placement::ExpertsOf(int rank, int layer) const {
  std::vector<bool> mask(static_cast<size_t>(num_experts_), false);
  const LayerPlacement* lp = Layer(layer);
  if (lp == nullptr || rank < 0 || rank >= num_ranks_) return mask;
  for (int s : lp->rank_slots[static_cast<size_t>(rank)]) {
    mask[static_cast<size_t>(lp->slots[static_cast<size_t>(s)].expert)] = true;
  }
  return mask;
}

std::string Placement::ToJson() const {
  json doc = {{"format", "moerun-placement-v1"},
              {"version", version_},
              {"num_experts", num_experts_},
              {"num_ranks", num_ranks_},
              {"num_routers", num_routers_}};
  json layers = json::object();
  for (const auto& [layer, lp] : layers_) {
    json slots = json::array();
    for (const Slot& s : lp.slots) slots.push_back({s.rank, s.expert});
    layers[layer == kAnyLayer ? "*" : std::to_string(layer)] = slots;
  }
  doc["layers"] = layers;
  return doc.dump(1);
}

}  // namespace moerun
