#include "launch/rank_services.h"

#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>

#include "base/host_name.h"
#include "base/log.h"
#include "base/peer_log.h"
#include "experts/cpu/packed_matrix.h"
#include "router/placement_plan.h"
#include "runtime/cache/expert_cache.h"
#include "runtime/ep/router_layer.h"
#include "runtime/ranks/expert_rank.h"
#include "runtime/ranks/router_rank.h"

namespace moerun {

namespace {
// Per expert rank (rank - routers): whether `peers` says it is dead. No allocation once *skip
// has reached its size.
void DeadExpertRanks(const std::vector<PeerView>& peers, int routers, std::vector<bool>* skip) {
  skip->assign(skip->size(), false);
  for (const PeerView& p : peers) {
    if (p.rank < routers) continue;
    const size_t i = static_cast<size_t>(p.rank - routers);
    if (skip->size() <= i) skip->resize(i + 1, false);
    (*skip)[i] = p.dead;
  }
}

// The most slots per layer an expert rank's memory holds (0: no limit): its budget ÷ one expert's
// bytes ÷ the layers served.
int CapacitySlots(const PeerView& p, int64_t expert_bytes, size_t layers) {
  if (p.memory_budget_bytes == 0 || expert_bytes <= 0) return 0;
  return static_cast<int>(
      std::min<uint64_t>(ExpertsPerLayer(p.memory_budget_bytes, expert_bytes, layers), INT32_MAX));
}

// An expert rank's own speed: rows computed per second computing (0 before any).
double MeasuredSpeed(const PeerView& p) {
  return p.busy_us == 0 ? 0.0 : static_cast<double>(p.rows) * 1e6 / static_cast<double>(p.busy_us);
}
}  // namespace

Result<std::unique_ptr<RankServices>> RankServices::Start(
    int rank, const Placement& placement, const ModelSpec& spec, const std::vector<int>& layers,
    const Transport* transport, const HostPort& metrics_listen,
    std::chrono::milliseconds load_window, HttpServerOptions http) {
  std::unique_ptr<RankServices> rs(new RankServices());
  rs->rank_ = rank;
  rs->router_ = rank < placement.num_routers();
  rs->model_ = FamilyName(spec.family);
  rs->placement_ = std::make_shared<const Placement>(placement);
  rs->layers_ = layers;
  rs->gate_groups_ = spec.gate.n_group;
  rs->transport_ = transport;
  MetricsRegistry& m = rs->metrics_;
  const std::string role = rs->router_ ? "router" : "expert";
  m.AddGauge("moerun_rank_info", "This rank: its number and role (value 1)",
             {{"rank", std::to_string(rank)}, {"role", role}})
      ->Set(1);
  RankServices* raw = rs.get();
  m.AddCallbackGauge("moerun_weights_loaded", "1 once every rank has loaded its weights",
                     [raw] { return raw->loaded_.load() ? 1.0 : 0.0; });
  m.AddCallbackGauge("moerun_process_resident_memory_bytes", "Resident memory of this process",
                     [] { return ProcessResidentBytes(); });
  for (int k = 0; k < static_cast<int>(PeerEvent::kCount); ++k) {
    const auto kind = static_cast<PeerEvent>(k);
    m.AddCallbackCounter(
        "moerun_peer_events_total",
        "Events a remote peer caused (bad frames, slow frames or readers, failed TLS handshakes, "
        "refused HTTP or control requests, ...), by kind; their log lines are written at most "
        "once per 10 s a kind",
        [kind] { return static_cast<double>(PeerEventCount(kind)); },
        {{"kind", PeerEventName(kind)}});
  }
  for (int peer = 0; peer < placement.num_ranks(); ++peer) {
    if (peer == rank) continue;
    m.AddCallbackCounter(
        "moerun_sent_bytes_total", "Bytes this rank sent to each peer rank",
        [transport, peer] { return static_cast<double>(transport->sent_bytes(peer)); },
        {{"peer", std::to_string(peer)}});
  }
  for (int layer : layers) {
    auto& ex = rs->by_expert_[layer];
    for (int e = 0; e < spec.num_experts; ++e) {
      const Labels l = {{"layer", std::to_string(layer)}, {"expert", std::to_string(e)}};
      ex.push_back(rs->router_ ? m.AddCounter("moerun_assignments_total",
                                              "(token, expert) assignments the gate chose, per "
                                              "layer and logical expert",
                                              l)
                               : m.AddCounter("moerun_expert_rows_total",
                                              "Rows this expert rank computed, per layer and "
                                              "logical expert",
                                              l));
    }
    if (!rs->router_) continue;
    auto& br = rs->by_rank_[layer];
    for (int r = 0; r < placement.num_ranks(); ++r) {
      br.push_back(
          r < placement.num_routers()
              ? nullptr
              : m.AddCounter("moerun_rank_assignments_total",
                             "(token, expert) assignments sent to each expert rank",
                             {{"layer", std::to_string(layer)}, {"rank", std::to_string(r)}}));
    }
    rs->rank_seen_[layer].assign(static_cast<size_t>(placement.num_ranks()), 0);
    rs->balancedness_[layer] = m.AddGauge(
        "moerun_balancedness", "Mean / max assignments per expert rank since the start (1 = even)",
        {{"layer", std::to_string(layer)}});
    rs->windows_.emplace(
        layer,
        LoadWindow(spec.num_experts, placement.num_ranks() - placement.num_routers(), load_window));
    rs->expert_seen_[layer].assign(static_cast<size_t>(spec.num_experts), 0);
    const double window_s = static_cast<double>(load_window.count()) / 1e3;
    rs->window_balancedness_[layer] = m.AddGauge(
        "moerun_window_balancedness",
        fmt::format("Mean / max assignments per expert rank over the last {:g} s (1 = even)",
                    window_s),
        {{"layer", std::to_string(layer)}});
    rs->window_balancedness_[layer]->Set(1);
    rs->window_assignments_[layer] =
        m.AddGauge("moerun_window_assignments",
                   fmt::format("(token, expert) assignments over the last {:g} s", window_s),
                   {{"layer", std::to_string(layer)}});
  }
  if (rs->router_) {
    rs->dispatch_ = m.AddHistogram("moerun_dispatch_duration_seconds",
                                   "Per microbatch: gate, plan, gather and send", LatencyBuckets());
    rs->combine_ =
        m.AddHistogram("moerun_combine_duration_seconds",
                       "Per microbatch: wait for the expert ranks and combine", LatencyBuckets());
    rs->queue_requests_ =
        m.AddGauge("moerun_queue_depth_requests", "Requests waiting in the router's batcher");
    rs->queue_tokens_ =
        m.AddGauge("moerun_queue_depth_tokens", "Tokens waiting in the router's batcher");
    rs->ranks_dead_ = m.AddGauge("moerun_ranks_dead",
                                 "Expert ranks given up on (dead, or frozen past the deadline)");
    rs->ranks_retired_ = m.AddGauge("moerun_ranks_retired",
                                    "Expert ranks taken out of the job on purpose (moectl retire)");
    rs->ranks_spare_ =
        m.AddGauge("moerun_ranks_spare", "Spare expert rank slots no process has joined yet");
    rs->retried_counter_ =
        m.AddCounter("moerun_microbatches_retried_total",
                     "Microbatches abandoned in flight to a dead rank and dispatched again");
    rs->replaced_counter_ = m.AddCounter("moerun_experts_replaced_total",
                                         "Expert copies re-placed on survivors after a death");
    {
      const std::shared_ptr<DispatchBytes> b = rs->dispatch_bytes_;
      const char* help =
          "Bytes of token rows this router dispatched to expert ranks: all of them, those to ranks "
          "on another node (per row, as sent), and per (token, other node) (what a transport that "
          "sends a token once per node would send)";
      m.AddCallbackCounter("moerun_dispatch_bytes_total", help,
                           [b] { return static_cast<double>(b->rows.load()); },
                           {{"to", "all"}, {"per", "row"}});
      m.AddCallbackCounter("moerun_dispatch_bytes_total", help,
                           [b] { return static_cast<double>(b->off_node_rows.load()); },
                           {{"to", "other_node"}, {"per", "row"}});
      m.AddCallbackCounter("moerun_dispatch_bytes_total", help,
                           [b] { return static_cast<double>(b->off_node_token_nodes.load()); },
                           {{"to", "other_node"}, {"per", "token_node"}});
    }
    for (int r = 0; r < placement.num_ranks(); ++r) {
      rs->answering_by_rank_.push_back(
          r < placement.num_routers()
              ? nullptr
              : m.AddGauge("moerun_rank_answering",
                           "1 while an expert rank answers probes and has no late transfers",
                           {{"rank", std::to_string(r)}}));
      if (r >= placement.num_routers()) rs->answering_by_rank_.back()->Set(1);
    }
  }

  std::map<std::string, HttpHandler> routes;
  routes["/metrics"] = [raw] {
    HttpReply r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = raw->metrics_.Render();
    return r;
  };
  routes["/health/live"] = [] { return HttpReply{200, "text/plain; charset=utf-8", "live\n"}; };
  routes["/health/ready"] = [raw] {
    std::string why;
    if (raw->Ready(&why)) return HttpReply{200, "text/plain; charset=utf-8", "ready\n"};
    return HttpReply{503, "text/plain; charset=utf-8", "not ready: " + why + "\n"};
  };
  const HostPort where = WithPortOffset(metrics_listen, rank);
  MOERUN_ASSIGN_OR_RETURN(
      rs->http_, HttpServer::Start(where, std::move(routes),
                                   role + " rank " + std::to_string(rank) + " http", http));
  return rs;
}

RankServices::~RankServices() {
  if (http_) http_->Stop();
}

uint16_t RankServices::http_port() const { return http_ ? http_->port() : 0; }

bool RankServices::Ready(std::string* why) const {
  if (!loaded_.load()) {
    *why = "weights are loading";
    return false;
  }
  if (draining_.load()) {
    *why = "draining";
    return false;
  }
  if (router_ && !answering_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    std::string list;
    for (const PeerView& p : peers_) {
      if (!p.answering && !p.dead) list += (list.empty() ? "" : ", ") + std::to_string(p.rank);
    }
    *why = "expert rank(s) " + list + " not answering";
    return false;
  }
  return true;
}

void RankServices::Attach(RouterLayer* layer) {
  ep_layers_.push_back(layer);
  layer->set_timing(dispatch_, combine_);
  const MoeLayerWeights& w = layer->weights();
  expert_bytes_ = static_cast<int64_t>(
      static_cast<double>(3 * w.spec.hidden * w.spec.expert_inter) * HeldBytesPerWeight(w.dtype));
  auto it = by_expert_.find(layer->weights().layer);
  if (it == by_expert_.end()) return;
  std::vector<Counter*>* counters = &it->second;
  layer->set_routing_observer([counters](const int32_t* ids, int64_t tokens, int k) {
    for (int64_t i = 0; i < tokens * k; ++i) {
      const int32_t e = ids[i];
      if (e >= 0 && static_cast<size_t>(e) < counters->size()) (*counters)[e]->Inc();
    }
  });
}

void RankServices::Attach(RouterRank& router) {
  for (const auto& [number, layer] : router.layers()) Attach(layer);
}

void RankServices::Attach(ExpertRank* host) {
  if (const ExpertCache* cache = host->cache()) {
    MetricsRegistry& m = metrics_;
    const std::shared_ptr<const ExpertCacheStats> st = cache->shared_stats();
    m.AddCallbackCounter("moerun_expert_cache_hits_total",
                         "Experts a microbatch needed that were resident when its header arrived",
                         [st] { return static_cast<double>(st->hits.load()); });
    m.AddCallbackCounter(
        "moerun_expert_cache_misses_total",
        "Experts a microbatch needed that were not resident when its header arrived (loaded)",
        [st] { return static_cast<double>(st->misses.load()); });
    m.AddCallbackCounter("moerun_expert_cache_evictions_total",
                         "Experts evicted from the expert cache",
                         [st] { return static_cast<double>(st->evictions.load()); });
    m.AddCallbackCounter("moerun_expert_cache_spill_reads_total",
                         "Expert loads the expert cache served from its spill file",
                         [st] { return static_cast<double>(st->spill_reads.load()); });
    m.AddCallbackCounter("moerun_expert_cache_loaded_bytes_total",
                         "Bytes of expert weights the expert cache loaded",
                         [st] { return static_cast<double>(st->loaded_bytes.load()); });
    m.AddCallbackGauge("moerun_expert_cache_resident_bytes",
                       "Bytes of expert weights resident in the expert cache",
                       [st] { return static_cast<double>(st->resident_bytes.load()); });
    m.AddCallbackGauge("moerun_expert_cache_resident_experts", "Experts resident in the cache",
                       [st] { return static_cast<double>(st->resident_experts.load()); });
    m.AddCallbackGauge("moerun_expert_cache_hosted_experts",
                       "Experts this rank hosts (resident or not)",
                       [st] { return static_cast<double>(st->hosted_experts.load()); });
    for (EvictionPolicy p : {EvictionPolicy::kCycle, EvictionPolicy::kLru, EvictionPolicy::kLfu}) {
      if (cache->options().policy != EvictionPolicy::kAdaptive && cache->options().policy != p) {
        continue;
      }
      m.AddCallbackGauge(
          "moerun_expert_cache_following",
          "1 for the eviction policy the expert cache follows now (adaptive: the shadow cache "
          "that hit most lately), 0 for the others",
          [st, p] { return st->following.load() == static_cast<int>(p) ? 1.0 : 0.0; },
          {{"policy", EvictionPolicyName(p)}});
    }
    m.AddGauge("moerun_expert_cache_budget_bytes", "The expert cache's budget")
        ->Set(static_cast<double>(cache->options().budget_bytes));
    Histogram* wait = m.AddHistogram(
        "moerun_expert_cache_wait_seconds",
        "Per microbatch that missed the cache: time it waited for its experts' loads",
        LatencyBuckets());
    host->set_cache_wait_observer([wait](double s) { wait->Observe(s); });
  }
  auto* by_expert = &by_expert_;
  host->set_rows_observer([by_expert](int layer, int expert, int64_t rows) {
    auto it = by_expert->find(layer);
    if (it != by_expert->end() && expert >= 0 && static_cast<size_t>(expert) < it->second.size()) {
      it->second[static_cast<size_t>(expert)]->Inc(static_cast<uint64_t>(rows));
    }
  });
}

void RankServices::Refresh(const PeerHealth* health, int64_t queued_requests,
                           int64_t queued_tokens) {
  if (!router_) return;
  queue_requests_->Set(static_cast<double>(queued_requests));
  queue_tokens_->Set(static_cast<double>(queued_tokens));
  // The window's balancedness is over the expert ranks that are alive (a dead one has no load).
  if (health != nullptr) health->CopyView(&peers_scratch_);
  DeadExpertRanks(peers_scratch_, Current()->num_routers(), &skip_scratch_);
  {
    uint64_t rows = 0, off_rows = 0, off_token_nodes = 0;
    for (RouterLayer* l : ep_layers_) {
      const EpStats& st = l->stats();
      const uint64_t row_bytes = static_cast<uint64_t>(l->weights().spec.hidden) * sizeof(float);
      rows += st.rows_sent * row_bytes;
      off_rows += st.off_node_rows * row_bytes;
      off_token_nodes += st.off_node_token_nodes * row_bytes;
    }
    dispatch_bytes_->rows.store(rows);
    dispatch_bytes_->off_node_rows.store(off_rows);
    dispatch_bytes_->off_node_token_nodes.store(off_token_nodes);
  }
  for (RouterLayer* l : ep_layers_) {
    const int layer = l->weights().layer;
    auto& seen = rank_seen_[layer];
    auto& counters = by_rank_[layer];
    const auto& now = l->stats().rows_per_rank;
    uint64_t most = 0, total = 0;
    int n = 0;
    // What arrived since the last refresh goes into the sliding window too.
    const size_t routers = static_cast<size_t>(Current()->num_routers());
    std::vector<uint64_t>& rank_delta = rank_delta_;
    rank_delta.assign(now.size() > routers ? now.size() - routers : 0, 0);
    for (size_t r = 0; r < now.size() && r < seen.size(); ++r) {
      if (counters[r] == nullptr) continue;
      if (now[r] > seen[r]) {
        counters[r]->Inc(now[r] - seen[r]);
        if (r >= routers) rank_delta[r - routers] = now[r] - seen[r];
      }
      seen[r] = now[r];
      most = std::max(most, counters[r]->value());
      total += counters[r]->value();
      ++n;
    }
    balancedness_[layer]->Set(
        most == 0 ? 1.0 : static_cast<double>(total) / n / static_cast<double>(most));
    auto& expert_seen = expert_seen_[layer];
    const auto& experts = by_expert_[layer];
    std::vector<uint64_t>& expert_delta = expert_delta_;
    expert_delta.assign(experts.size(), 0);
    for (size_t e = 0; e < experts.size() && e < expert_seen.size(); ++e) {
      const uint64_t v = experts[e]->value();
      expert_delta[e] = v - expert_seen[e];
      expert_seen[e] = v;
    }
    const auto t = LoadWindow::Clock::now();
    double window_b = 1.0;
    uint64_t window_total = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      LoadWindow& w = windows_.at(layer);
      w.Add(expert_delta, rank_delta, t);
      window_b = w.Balancedness(t, skip_scratch_);
      window_total = w.Total(t);
    }
    window_balancedness_[layer]->Set(window_b);
    window_assignments_[layer]->Set(static_cast<double>(window_total));
  }
  if (health != nullptr) {
    for (const PeerView& p : peers_scratch_) {
      if (Gauge* g = answering_by_rank_[static_cast<size_t>(p.rank)]) g->Set(p.answering ? 1 : 0);
    }
    answering_ = health->all_answering();
    ranks_dead_->Set(static_cast<double>(health->dead_count()));
    ranks_retired_->Set(static_cast<double>(health->retired_count()));
    ranks_spare_->Set(static_cast<double>(health->spare_count()));
    std::lock_guard<std::mutex> lock(mu_);
    peers_ = peers_scratch_;  // element-wise: no allocation once the sizes are reached
  }
}

void RankServices::CountRecovery(uint64_t retried_total, uint64_t replaced_total) {
  if (!router_) return;
  const uint64_t r = retried_.exchange(retried_total);
  if (retried_total > r) retried_counter_->Inc(retried_total - r);
  const uint64_t p = replaced_.exchange(replaced_total);
  if (replaced_total > p) replaced_counter_->Inc(replaced_total - p);
}

moerun::v1::StatusResponse RankServices::Status() const {
  moerun::v1::StatusResponse s;
  const std::shared_ptr<const Placement> placement = Current();
  s.set_model(model_);
  s.set_num_ranks(placement->num_ranks());
  s.set_num_routers(placement->num_routers());
  s.set_placement_version(placement->version());
  std::string why;
  s.set_ready(Ready(&why));
  s.set_uptime_s(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  s.set_batches(requests_.load());
  std::vector<PeerView> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers = peers_;
  }
  std::vector<std::string> nodes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    nodes = node_names_;
  }
  int dead = 0;
  for (const PeerView& p : peers) dead += p.dead && !p.retired ? 1 : 0;  // retired: no failure
  s.set_ranks_dead(dead);
  s.set_health(dead > 0 ? "degraded" : "ok");
  s.set_microbatches_retried(retried_.load());
  s.set_experts_replaced(replaced_.load());
  for (int r = 0; r < placement->num_ranks(); ++r) {
    moerun::v1::RankStatus* rs = s.add_ranks();
    rs->set_rank(r);
    const bool is_router = r < placement->num_routers();
    rs->set_role(is_router ? "router" : "expert");
    if (static_cast<size_t>(r) < nodes.size()) rs->set_node(nodes[static_cast<size_t>(r)]);
    if (!is_router) {  // its capacity in use: the most slots any layer gives it
      size_t most = 0;
      for (int layer : layers_) {
        const LayerPlacement* lp = placement->Layer(layer);
        if (lp != nullptr && static_cast<size_t>(r) < lp->rank_slots.size()) {
          most = std::max(most, lp->rank_slots[static_cast<size_t>(r)].size());
        }
      }
      rs->set_slots(static_cast<int32_t>(most));
    }
    if (r == rank_) {
      rs->set_host(HostName());
      rs->set_pid(::getpid());
      rs->set_resident_bytes(static_cast<uint64_t>(ProcessResidentBytes()));
      rs->set_state(loaded_.load() ? "ready" : "loading");
    } else if (is_router) {
      rs->set_state("unknown (another router)");
    } else {
      rs->set_state(loaded_.load() ? "ready" : "loading");
    }
    for (const PeerView& p : peers) {
      if (p.rank != r) continue;
      rs->set_host(p.host);
      rs->set_pid(static_cast<int64_t>(p.pid));
      rs->set_rows_served(p.rows);
      rs->set_busy_s(static_cast<double>(p.busy_us) / 1e6);
      rs->set_speed(MeasuredSpeed(p));
      if (p.memory_budget_bytes > 0) {  // (-1: under one expert: no slot fits)
        const int cap = CapacitySlots(p, expert_bytes_.load(), layers_.size());
        rs->set_capacity_slots(cap > 0 ? cap : -1);
      }
      rs->set_resident_bytes(p.resident_bytes);
      rs->set_last_seen_s(p.last_seen_s);
      if (p.cache_budget_bytes > 0) {
        moerun::v1::ExpertCacheStatus* c = rs->mutable_cache();
        c->set_budget_bytes(p.cache_budget_bytes);
        c->set_resident_bytes(p.cache_resident_bytes);
        c->set_hosted_experts(p.cache_hosted);
        c->set_resident_experts(p.cache_resident);
        c->set_hits(p.cache_hits);
        c->set_misses(p.cache_misses);
        const uint64_t asked = p.cache_hits + p.cache_misses;
        c->set_hit_rate(
            asked == 0 ? 1.0 : static_cast<double>(p.cache_hits) / static_cast<double>(asked));
      }
      if (p.spare) {
        rs->set_state("spare");
      } else if (p.retired) {
        rs->set_state("retired");
      } else if (p.dead) {
        rs->set_state("dead");
      } else if (!p.answering) {
        rs->set_state(p.stranded ? "late (catching up)" : "not answering");
      }
    }
    uint64_t assigned = 0;
    for (int layer : layers_) {
      moerun::v1::LayerExperts* le = rs->add_layers();
      le->set_layer(layer);
      if (const LayerPlacement* lp = placement->Layer(layer)) {
        for (int slot : lp->rank_slots[static_cast<size_t>(r)]) {
          le->add_experts(lp->slots[static_cast<size_t>(slot)].expert);
        }
      }
      auto it = by_rank_.find(layer);
      if (it != by_rank_.end() && it->second[static_cast<size_t>(r)] != nullptr) {
        assigned += it->second[static_cast<size_t>(r)]->value();
      }
    }
    rs->set_assignments(assigned);
  }
  for (int layer : layers_) {
    moerun::v1::LayerLoad* ll = s.add_layers();
    ll->set_layer(layer);
    uint64_t total = 0;
    auto it = by_expert_.find(layer);
    if (it != by_expert_.end()) {
      for (const Counter* c : it->second) total += c->value();
    }
    ll->set_assignments(total);
    auto b = balancedness_.find(layer);
    ll->set_balancedness(b != balancedness_.end() ? b->second->value() : 1.0);
    std::lock_guard<std::mutex> lock(mu_);
    auto w = windows_.find(layer);
    if (w != windows_.end()) {
      const auto t = LoadWindow::Clock::now();
      ll->set_window_assignments(w->second.Total(t));
      std::vector<bool> skip;
      DeadExpertRanks(peers_, placement_ != nullptr ? placement_->num_routers() : 0, &skip);
      ll->set_window_balancedness(w->second.Balancedness(t, skip));
      ll->set_window_s(static_cast<double>(w->second.window().count()) / 1e3);
    }
  }
  return s;
}

std::shared_ptr<const Placement> RankServices::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return placement_;
}

void RankServices::SetPlacement(std::shared_ptr<const Placement> placement) {
  std::lock_guard<std::mutex> lock(mu_);
  placement_ = std::move(placement);
}

moerun::v1::PlacementResponse RankServices::PlacementInfo() const {
  moerun::v1::PlacementResponse p;
  const std::shared_ptr<const Placement> placement = Current();
  p.set_version(placement->version());
  p.set_json(placement->ToJson());
  return p;
}

moerun::v1::PlanResponse PlanToProto(const PlanReport& rep) {
  moerun::v1::PlanResponse r;
  r.set_policy(rep.policy);
  r.set_slots_per_rank(rep.slots_per_rank);
  r.set_min_slots_per_rank(rep.min_slots_per_rank);
  r.set_plan_ms_per_layer(rep.plan_ms_per_layer);
  for (const auto& [rank, speed] : rep.rank_speed) (*r.mutable_rank_speed())[rank] = speed;
  for (const LayerPlanReport& l : rep.layers) {
    moerun::v1::LayerPlan* lp = r.add_layers();
    lp->set_layer(l.layer);
    lp->set_load(l.load);
    lp->set_balancedness_before(l.balancedness_before);
    lp->set_balancedness_after(l.balancedness_after);
    lp->set_experts_to_load(l.experts_to_load);
    lp->set_bytes_to_move(l.bytes_to_move);
    lp->set_hit_rate_before(l.hit_rate_before);
    lp->set_hit_rate_after(l.hit_rate_after);
    for (int rank : l.ranks) lp->add_ranks(rank);
    for (double v : l.rank_load_before) lp->add_rank_load_before(v);
    for (double v : l.rank_load_after) lp->add_rank_load_after(v);
    lp->set_experts_to_release(l.experts_to_release);
    lp->set_max_rank_bytes(l.max_rank_bytes);
    lp->set_kept(l.kept);
  }
  r.set_placement_json(rep.placement_json);
  r.set_note(rep.note);
  moerun::v1::RebalanceCost* c = r.mutable_cost();
  c->set_steps(static_cast<int32_t>(rep.cost.steps.size()));
  c->set_copies_loaded(rep.cost.copies_loaded);
  c->set_copies_released(rep.cost.copies_released);
  c->set_load_bytes(rep.cost.load_bytes);
  c->set_critical_bytes(rep.cost.critical_bytes);
  c->set_max_rank_bytes(rep.cost.max_rank_bytes);
  c->set_messages(rep.cost.messages);
  c->set_switch_bytes(rep.cost.switch_bytes);
  c->set_max_bytes(rep.max_bytes);
  return r;
}

uint64_t RankServices::WindowAssignments() const {
  const auto t = LoadWindow::Clock::now();
  uint64_t n = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [layer, w] : windows_) n += w.Total(t);
  return n;
}

Result<moerun::v1::PlanResponse> RankServices::Plan(const moerun::v1::PlanRequest& request) const {
  if (!router_) return Status::InvalidArgument("plan: only routers measure load");
  PlanOptions o;
  o.redundant = request.redundant();
  if (!request.policy().empty()) {
    MOERUN_ASSIGN_OR_RETURN(o.policy, ParsePlannerPolicy(request.policy()));
  }
  o.groups = request.groups() > 0 ? request.groups() : gate_groups_;
  o.nodes = request.nodes() > 0 ? request.nodes() : 0;  // 0: the job's nodes
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::map<std::string, int> ids;
    for (const std::string& name : node_names_) {
      const auto [it, fresh] = ids.emplace(name, static_cast<int>(ids.size()));
      o.rank_node.push_back(name.empty() ? -1 : it->second);
    }
  }
  o.incremental = request.incremental();
  o.max_moves = request.max_moves();
  o.target_balance = request.target_balance();
  o.max_bytes = request.max_bytes();
  if (request.has_local_share()) o.local_share = request.local_share();
  if (request.has_copy_prior()) o.copy_prior = request.copy_prior();
  for (const auto& [rank, n] : request.rank_slots()) o.rank_slots[rank] = n;
  for (const auto& [rank, v] : request.rank_speed()) o.rank_speed[rank] = v;
  const int routers = Current()->num_routers();  // (takes mu_)
  if (request.speed_measured()) {
    if (!o.rank_speed.empty()) {
      return Status::InvalidArgument("plan: give speeds or measure them, not both");
    }
    // Each live expert rank's own speed; one that computed nothing yet (a joiner before its
    // first experts) plans at the mean of the others'.
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int> unmeasured;
    double sum = 0;
    for (const PeerView& p : peers_) {
      if (p.rank < routers || p.dead) continue;
      if (p.busy_us == 0 || p.rows == 0) {
        unmeasured.push_back(p.rank);
        continue;
      }
      o.rank_speed[p.rank] = MeasuredSpeed(p);
      sum += o.rank_speed[p.rank];
    }
    if (o.rank_speed.empty()) {
      return Status::Unavailable(
          "plan: no expert rank has computed anything yet: no measured speed (send traffic "
          "first, or give --rank-speed)");
    }
    for (int rank : unmeasured) o.rank_speed[rank] = sum / static_cast<double>(o.rank_speed.size());
  }
  const int64_t one = expert_bytes_.load();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const PeerView& p : peers_) {
      if (p.dead) o.exclude.push_back(p.rank);  // the plan puts nothing on a dead rank
    }
    // Each expert rank's cache, in experts per layer (its budget over every layer it serves).
    for (const PeerView& p : peers_) {
      if (p.rank < routers || p.cache_budget_bytes == 0 || one <= 0) continue;
      const size_t i = static_cast<size_t>(p.rank - routers);
      if (o.cache_experts.size() <= i) o.cache_experts.resize(i + 1, 0);
      o.cache_experts[i] = static_cast<int>(
          std::max<uint64_t>(1, ExpertsPerLayer(p.cache_budget_bytes, one, layers_.size())));
    }
    // Each expert rank's memory: the most slots it may get.
    for (const PeerView& p : peers_) {
      if (p.rank < routers || p.dead || p.memory_budget_bytes == 0 || one <= 0) continue;
      o.rank_capacity[p.rank] = CapacitySlots(p, one, layers_.size());
    }
  }
  std::map<int, std::vector<double>> loads;
  const auto t = LoadWindow::Clock::now();
  double window_s = 0;
  for (int layer : layers_) {
    std::vector<uint64_t> w;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = windows_.find(layer);
      if (it != windows_.end()) {
        w = it->second.ExpertLoad(t);
        window_s = static_cast<double>(it->second.window().count()) / 1e3;
      }
    }
    uint64_t sum = 0;
    for (uint64_t v : w) sum += v;
    auto& l = loads[layer];
    if (sum > 0) {
      for (uint64_t v : w) l.push_back(static_cast<double>(v));
    } else {  // nothing in the window: everything since the start
      window_s = 0;
      for (const Counter* c : by_expert_.at(layer)) l.push_back(c->value());
    }
  }
  MOERUN_ASSIGN_OR_RETURN(PlanReport rep, MakePlan(loads, *Current(), expert_bytes_.load(), o));
  moerun::v1::PlanResponse r = PlanToProto(rep);
  r.set_window_s(window_s);
  return r;
}

moerun::v1::StatsResponse RankServices::Stats() const {
  moerun::v1::StatsResponse s;
  const auto t = LoadWindow::Clock::now();
  for (const auto& [layer, counters] : by_expert_) {
    std::vector<uint64_t> window;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto w = windows_.find(layer);
      if (w != windows_.end()) window = w->second.ExpertLoad(t);
    }
    for (size_t e = 0; e < counters.size(); ++e) {
      moerun::v1::ExpertLoad* el = s.add_experts();
      el->set_layer(layer);
      el->set_expert(static_cast<int>(e));
      el->set_assignments(counters[e]->value());
      if (e < window.size()) el->set_window_assignments(window[e]);
    }
  }
  return s;
}

}  // namespace moerun
