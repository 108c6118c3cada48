#include "launch/moectl/print.h"

#include <fmt/format.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <map>
#include <nlohmann/json.hpp>

namespace moerun::moectl {

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;  // layer 0, 0 copies: printed, not left out
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::string Mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

void PrintStatus(const v1::StatusResponse& s) {
  std::printf("model %s: %d ranks (%d router%s), placement v%llu, %s, up %.0f s, %llu batches\n",
              s.model().c_str(), s.num_ranks(), s.num_routers(), s.num_routers() == 1 ? "" : "s",
              static_cast<unsigned long long>(s.placement_version()),
              s.ready() ? "ready" : "NOT READY", s.uptime_s(),
              static_cast<unsigned long long>(s.batches()));
  if (s.health() == "degraded") {
    std::printf(
        "health: degraded: %d expert rank%s dead (serving without them), %llu "
        "microbatch%s re-dispatched, %llu expert cop%s re-placed\n",
        s.ranks_dead(), s.ranks_dead() == 1 ? "" : "s",
        static_cast<unsigned long long>(s.microbatches_retried()),
        s.microbatches_retried() == 1 ? "" : "es",
        static_cast<unsigned long long>(s.experts_replaced()),
        s.experts_replaced() == 1 ? "y" : "ies");
  }
  if (s.has_migration() && s.migration().id() != 0) {
    const auto& m = s.migration();
    std::printf("migration %llu (%s): %s, v%llu -> v%llu, %s of %s MiB loaded, %.1f s%s%s\n",
                static_cast<unsigned long long>(m.id()), m.trigger().c_str(), m.state().c_str(),
                static_cast<unsigned long long>(m.from_version()),
                static_cast<unsigned long long>(m.to_version()),
                Mib(static_cast<uint64_t>(m.bytes_loaded())).c_str(),
                Mib(static_cast<uint64_t>(m.bytes_to_move())).c_str(), m.elapsed_s(),
                m.error().empty() ? "" : ": ", m.error().c_str());
  }
  for (const auto& l : s.layers()) {
    std::printf(
        "layer %d: %llu assignments, balancedness %.3f; last %.0f s: %llu assignments, "
        "balancedness %.3f\n",
        l.layer(), static_cast<unsigned long long>(l.assignments()), l.balancedness(), l.window_s(),
        static_cast<unsigned long long>(l.window_assignments()), l.window_balancedness());
  }
  std::printf("%-5s %-7s %-20s %-12s %-8s %-22s %12s %12s %10s %6s %9s %s\n", "rank", "role",
              "host", "node", "pid", "state", "assignments", "rows_served", "speed", "slots",
              "rss_mib", "experts");
  for (const auto& r : s.ranks()) {
    std::string experts;
    for (const auto& le : r.layers()) {
      if (s.layers_size() > 1) experts += fmt::format("L{}:", le.layer());
      std::string list;
      for (int e : le.experts()) list += fmt::format("{}{}", list.empty() ? "" : ",", e);
      experts += fmt::format("{} ", list.empty() ? "-" : list);
    }
    // Speed: rows computed per second computing (expert ranks, once they computed any).
    const std::string speed = r.speed() > 0 ? fmt::format("{:.0f}", r.speed()) : "-";
    // Slots: those in use, / what its memory holds where it has a budget (expert_memory_mib).
    const std::string slots = r.role() != "expert" ? std::string("-")
                              : r.capacity_slots() != 0
                                  ? fmt::format("{}/{}", r.slots(), std::max(r.capacity_slots(), 0))
                                  : fmt::format("{}", r.slots());
    std::printf("%-5d %-7s %-20s %-12s %-8lld %-22s %12llu %12llu %10s %6s %9s %s\n", r.rank(),
                r.role().c_str(), r.host().empty() ? "?" : r.host().c_str(),
                r.node().empty() ? "?" : r.node().c_str(), static_cast<long long>(r.pid()),
                r.state().c_str(), static_cast<unsigned long long>(r.assignments()),
                static_cast<unsigned long long>(r.rows_served()), speed.c_str(), slots.c_str(),
                Mib(r.resident_bytes()).c_str(), experts.c_str());
  }
  bool any_cache = false;
  for (const auto& r : s.ranks()) any_cache = any_cache || r.has_cache();
  if (!any_cache) return;
  std::printf("\nexpert cache:\n%-5s %12s %14s %10s %10s %12s %12s %9s\n", "rank", "budget_mib",
              "resident_mib", "resident", "hosted", "hits", "misses", "hit_rate");
  for (const auto& r : s.ranks()) {
    if (!r.has_cache()) continue;
    const auto& c = r.cache();
    std::printf("%-5d %12s %14s %10u %10u %12llu %12llu %9.3f\n", r.rank(),
                Mib(c.budget_bytes()).c_str(), Mib(c.resident_bytes()).c_str(),
                c.resident_experts(), c.hosted_experts(), static_cast<unsigned long long>(c.hits()),
                static_cast<unsigned long long>(c.misses()), c.hit_rate());
  }
}

void PrintStats(const v1::StatsResponse& s) {
  std::printf("%-6s %-7s %s\n", "layer", "expert", "assignments");
  for (const auto& e : s.experts()) {
    std::printf("%-6d %-7d %llu\n", e.layer(), e.expert(),
                static_cast<unsigned long long>(e.assignments()));
  }
}

void PrintPlan(const v1::PlanResponse& p) {
  const std::string slots =
      p.min_slots_per_rank() > 0 && p.min_slots_per_rank() < p.slots_per_rank()
          ? fmt::format("{} to {}", p.min_slots_per_rank(), p.slots_per_rank())
          : std::to_string(p.slots_per_rank());
  std::printf(
      "plan (%s policy, %s slots per expert rank%s, planned in %.3f ms per layer): a dry run, "
      "nothing changed\n",
      p.policy().c_str(), slots.c_str(),
      p.window_s() > 0 ? fmt::format(", loads of the last {:.0f} s", p.window_s()).c_str() : "",
      p.plan_ms_per_layer());
  if (!p.rank_speed().empty()) {
    std::map<int, double> speeds(p.rank_speed().begin(), p.rank_speed().end());
    std::string list;
    for (const auto& [rank, v] : speeds) {
      list += fmt::format("{}{}: {:.4g}", list.empty() ? "" : ", ", rank, v);
    }
    std::printf("balanced by time (load / speed), expert ranks' speeds %s\n", list.c_str());
  }
  // The predicted expert-cache hit rates, where any expert rank has a cache.
  bool cache = false;
  for (const auto& l : p.layers()) {
    cache = cache || l.hit_rate_before() != 1.0 || l.hit_rate_after() != 1.0;
  }
  std::printf("%-6s %12s %10s %10s %8s %9s %12s %14s%s\n", "layer", "assignments", "balanced",
              "planned", "copies", "released", "bytes", "slowest_rank",
              cache ? fmt::format(" {:>9} {:>11}", "hit_rate", "planned_hit").c_str() : "");
  const auto mib = [](int64_t b) {
    return fmt::format("{:.1f} MiB", static_cast<double>(b) / (1 << 20));
  };
  for (const auto& l : p.layers()) {
    std::printf(
        "%-6d %12llu %10.3f %10.3f %8d %9d %12s %14s%s%s\n", l.layer(),
        static_cast<unsigned long long>(l.load()), l.balancedness_before(), l.balancedness_after(),
        l.experts_to_load(), l.experts_to_release(), mib(l.bytes_to_move()).c_str(),
        mib(l.max_rank_bytes()).c_str(),
        cache ? fmt::format(" {:9.3f} {:11.3f}", l.hit_rate_before(), l.hit_rate_after()).c_str()
              : "",
        l.kept() ? "  (kept: over the byte budget)" : "");
  }
  if (p.has_cost() && p.placement_json().size() > 0) {
    const auto& c = p.cost();
    std::printf(
        "cost: %d step(s) (one per layer that changes), %d copies loaded (%s), %d released; "
        "each step's slowest rank loads %s in all (at rebalance.throttle_mib_s T the migration "
        "takes at least that / T), at most %s on one rank; %d control messages (%s of "
        "placements)%s\n",
        c.steps(), c.copies_loaded(), mib(c.load_bytes()).c_str(), c.copies_released(),
        mib(c.critical_bytes()).c_str(), mib(c.max_rank_bytes()).c_str(), c.messages(),
        mib(c.switch_bytes()).c_str(),
        c.max_bytes() > 0 ? fmt::format("; budget {}", mib(c.max_bytes())).c_str() : "");
  }
  if (!p.note().empty()) std::printf("note: %s\n", p.note().c_str());
}

void PrintPlacementSummary(std::FILE* out, const std::string& path, const Placement& p,
                           const std::string& text) {
  std::string layers;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.contains("layers") && j["layers"].is_object()) {
      for (const auto& [key, slots] : j["layers"].items()) {
        const int layer = key == "*" ? Placement::kAnyLayer : std::atoi(key.c_str());
        const LayerPlacement* lp = p.Layer(layer);
        layers += fmt::format("{}{} ({} slots, at most {} per rank)", layers.empty() ? "" : ", ",
                              key, slots.size(), lp ? lp->MaxSlotsPerRank() : 0);
      }
    }
  } catch (const std::exception&) {  // FromJson read it: a second parse does not fail
  }
  std::fprintf(out, "placement %s: v%llu, %d experts, %d ranks (%d router%s); layers %s\n",
               path.c_str(), static_cast<unsigned long long>(p.version()), p.num_experts(),
               p.num_ranks(), p.num_routers(), p.num_routers() == 1 ? "" : "s",
               layers.empty() ? "-" : layers.c_str());
}

std::string MibOf(int64_t bytes) { return Mib(static_cast<uint64_t>(std::max<int64_t>(bytes, 0))); }

void PrintMigration(const v1::MigrationStatus& m) {
  if (m.id() == 0) {
    std::printf("no migration has run%s%s\n", m.note().empty() ? "" : ": ", m.note().c_str());
    return;
  }
  if (m.layers_size() > 0) {
    std::printf("%-6s %-10s %6s %6s %12s %12s %8s\n", "layer", "state", "load", "free",
                "to_move_mib", "loaded_mib", "seconds");
  }
  for (const auto& l : m.layers()) {
    std::printf("%-6d %-10s %6d %6d %12s %12s %8.1f\n", l.layer(), l.state().c_str(),
                l.experts_to_load(), l.experts_to_free(), MibOf(l.bytes_to_move()).c_str(),
                MibOf(l.bytes_loaded()).c_str(), l.seconds());
  }
  if (m.has_plan()) {
    const auto& p = m.plan();
    for (const auto& l : p.layers()) {
      std::printf("plan (%s policy): layer %d balancedness %.3f -> %.3f predicted\n",
                  p.policy().c_str(), l.layer(), l.balancedness_before(), l.balancedness_after());
    }
    if (!p.note().empty()) std::printf("plan note: %s\n", p.note().c_str());
  }
  std::string line =
      fmt::format("migration {}{}: {}, v{} -> v{}, {} / {} MiB loaded, {:.1f} s, {}", m.id(),
                  m.trigger().empty() ? "" : " (" + m.trigger() + ")", m.state(), m.from_version(),
                  m.to_version(), MibOf(m.bytes_loaded()), MibOf(m.bytes_to_move()), m.elapsed_s(),
                  m.throttle_mib_s() > 0 ? fmt::format("throttle {:.1f} MiB/s", m.throttle_mib_s())
                                         : std::string("unthrottled"));
  if (!m.error().empty()) line += "; error: " + m.error();
  if (!m.note().empty()) line += "; note: " + m.note();
  std::printf("%s\n", line.c_str());
}

std::string MigrationProgressLine(const v1::MigrationStatus& m, double waited_s) {
  int switched = 0;
  std::string current;
  for (const auto& l : m.layers()) {
    if (l.state() == "done" || l.state() == "unchanged") ++switched;
    if (current.empty() && (l.state() == "loading" || l.state() == "switching")) {
      current = fmt::format("; layer {} {}", l.layer(), l.state());
    }
  }
  return fmt::format("[{:6.1f} s] migration {} {}: {}/{} layers switched, {} / {} MiB loaded{}{}",
                     waited_s, m.id(), m.state(), switched, m.layers_size(),
                     MibOf(m.bytes_loaded()), MibOf(m.bytes_to_move()), current,
                     m.error().empty() ? "" : "; error: " + m.error());
}

void PrintExperts(const v1::ExpertResponse& r) {
  if (r.variants_size() == 0) {
    std::printf("no expert updates\n");
    return;
  }
  std::printf("%-6s %-7s %-12s %8s %10s %12s %9s %-10s %s\n", "layer", "expert", "state", "canary%",
              "rows", "canary_rows", "measured%", "ranks", "file");
  for (const auto& v : r.variants()) {
    std::string ranks;
    for (int rank : v.ranks()) ranks += fmt::format("{}{}", ranks.empty() ? "" : ",", rank);
    const std::string measured =
        v.rows() > 0 ? fmt::format("{:.1f}", 100.0 * static_cast<double>(v.canary_rows()) /
                                                 static_cast<double>(v.rows()))
                     : std::string("-");
    std::printf("%-6d %-7d %-12s %8.1f %10llu %12llu %9s %-10s %s%s%s\n", v.layer(), v.expert(),
                v.state().c_str(), v.canary_percent(), static_cast<unsigned long long>(v.rows()),
                static_cast<unsigned long long>(v.canary_rows()), measured.c_str(),
                ranks.empty() ? "-" : ranks.c_str(), v.file().c_str(),
                v.error().empty() ? "" : "  error: ", v.error().c_str());
  }
}

}  // namespace moerun::moectl
