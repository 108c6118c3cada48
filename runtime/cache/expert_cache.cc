#include "runtime/cache/expert_cache.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/log.h"

namespace moerun {

const char* EvictionPolicyName(EvictionPolicy p) {
  switch (p) {
    case EvictionPolicy::kLru:
      return "lru";
    case EvictionPolicy::kCycle:
      return "cycle";
    case EvictionPolicy::kAdaptive:
      return "adaptive";
    case EvictionPolicy::kLfu:
      break;
  }
  return "lfu";
}

Result<EvictionPolicy> ParseEvictionPolicy(const std::string& name) {
  if (name == "lfu") return EvictionPolicy::kLfu;
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "cycle") return EvictionPolicy::kCycle;
  if (name == "adaptive") return EvictionPolicy::kAdaptive;
  return Status::InvalidArgument("unknown expert cache policy '" + name +
                                 "' (adaptive, cycle, lfu or lru)");
}

ExpertCache::ExpertCache(ExpertCacheOptions options, ExpertFetch fetch,
                         std::map<int, std::vector<ExpertWeights>*> layers,
                         std::unique_ptr<SpillFile> spill)
    : opts_(options),
      fetch_(std::move(fetch)),
      spill_(std::move(spill)),
      layers_(std::move(layers)) {
  opts_.loaders = std::max(1, opts_.loaders);
  if (!(opts_.half_life > 0)) opts_.half_life = 256;
  for (const auto& [layer, experts] : layers_) {
    auto& ents = entries_[layer];
    ents.resize(experts->size());
    for (size_t e = 0; e < experts->size(); ++e) {
      const ExpertWeights& w = (*experts)[e];
      if (w.w13.empty()) continue;
      ents[e].hosted = true;
      ents[e].state = State::kResident;
      ents[e].bytes = w.bytes();
      expert_bytes_[layer] = w.bytes();
      resident_bytes_ += w.bytes();
    }
  }
  Publish();
  for (int i = 0; i < opts_.loaders; ++i) threads_.emplace_back([this] { LoaderMain(); });
}

ExpertCache::~ExpertCache() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    work_.clear();
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

ExpertCache::Entry* ExpertCache::Find(int layer, int expert) {
  const auto it = entries_.find(layer);
  if (it == entries_.end() || expert < 0 || static_cast<size_t>(expert) >= it->second.size()) {
    return nullptr;
  }
  return &it->second[static_cast<size_t>(expert)];
}

const ExpertCache::Entry* ExpertCache::Find(int layer, int expert) const {
  return const_cast<ExpertCache*>(this)->Find(layer, expert);
}

bool ExpertCache::hosted(int layer, int expert) const {
  const Entry* e = Find(layer, expert);
  return e != nullptr && e->hosted;
}

bool ExpertCache::resident(int layer, int expert) const {
  const Entry* e = Find(layer, expert);
  return e != nullptr && e->state == State::kResident;
}

size_t ExpertCache::expert_bytes(int layer) const {
  const auto it = expert_bytes_.find(layer);
  return it == expert_bytes_.end() ? 0 : it->second;
}

size_t ExpertCache::Bytes(int layer) const {
  const size_t b = expert_bytes(layer);
  if (b > 0 || expert_bytes_.empty()) return b;
  return expert_bytes_.begin()->second;  // layers share the shape
}

void ExpertCache::Publish() {
  if (!dirty_) return;  // (Poll runs in the rank's idle loop: no scan unless something changed)
  dirty_ = false;
  uint64_t resident = 0, hosted = 0;
  for (const auto& [layer, ents] : entries_) {
    for (const Entry& e : ents) {
      resident += e.state == State::kResident;
      hosted += e.hosted;
    }
  }
  stats_->resident_bytes.store(resident_bytes_);
  stats_->resident_experts.store(resident);
  stats_->hosted_experts.store(hosted);
  stats_->following.store(static_cast<int>(following()));
}

void ExpertCache::Host(int layer, int expert, bool on) {
  Entry* e = Find(layer, expert);
  if (e == nullptr) return;
  dirty_ = true;
  e->hosted = on;
  if (!on) {
    e->pinned = false;
    e->held = 0;
    e->uses = 0;
    for (size_t s = 0; s < e->shadow.size(); ++s) {
      if (e->shadow[s]) shadows_[s].bytes -= std::min(shadows_[s].bytes, Bytes(layer));
      e->shadow[s] = false;
    }
    e->file.clear();
    if (e->state == State::kResident) Evict(layer, expert, *e);
    if (e->state == State::kFailed) e->state = State::kCold;
    // A queued load is dropped when it starts; one in flight when it finishes.
  }
  Publish();
}

void ExpertCache::Pin(int layer, int expert) {
  if (Entry* e = Find(layer, expert)) e->pinned = true;
}

void ExpertCache::SetFile(int layer, int expert, const std::string& file) {
  if (Entry* e = Find(layer, expert)) e->file = file;
  if (spill_) spill_->Forget(layer, expert);  // its spilled copy holds the old weights
}

void ExpertCache::Resized(int layer, int expert) {
  Entry* e = Find(layer, expert);
  if (e == nullptr) return;
  const ExpertWeights& w = (*layers_.at(layer))[static_cast<size_t>(expert)];
  dirty_ = true;
  resident_bytes_ -= e->bytes;
  e->bytes = w.w13.empty() ? 0 : w.bytes();
  resident_bytes_ += e->bytes;
  if (e->bytes > 0) {
    e->state = State::kResident;
    e->hosted = true;
    expert_bytes_[layer] = e->bytes;
  }
  order_valid_ = false;
  Publish();
}

void ExpertCache::Touch(Entry& e) {
  // Decayed count: halves every half_life ticks, +1 for this use.
  const double age = static_cast<double>(tick_ - std::min(tick_, e.last));
  e.uses = e.uses * std::exp2(-age / opts_.half_life) + 1.0;
  e.last = tick_;
}

EvictionPolicy ExpertCache::following() const {
  return opts_.policy == EvictionPolicy::kAdaptive ? leader_ : opts_.policy;
}

namespace {

// The shadows' order in Entry::shadow and shadows_.
constexpr std::array<EvictionPolicy, 3> kShadowed = {EvictionPolicy::kLfu, EvictionPolicy::kLru,
                                                     EvictionPolicy::kCycle};
// Eviction order as a max-heap: its top goes first (the lowest score; ties: the higher layer and
// expert).
bool GoesLater(const ExpertCache::Victim& a, const ExpertCache::Victim& b) {
  if (a.score != b.score) return a.score > b.score;
  return std::make_pair(a.layer, a.expert) < std::make_pair(b.layer, b.expert);
}

// A shadow's hits are counted over about this many needs.
constexpr double kShadowWindow = 1024;
// The leader changes only to a shadow with this many more hits (relative): no flapping.
constexpr double kShadowMargin = 0.01;

}  // namespace

void ExpertCache::ShadowStep() {
  const std::vector<Key>& pending = shadow_pending_;  // cleared at the end (its room kept)
  for (size_t s = 0; s < kShadowed.size(); ++s) {
    Shadow& sh = shadows_[s];
    for (const auto& [layer, expert] : pending) {
      sh.hits *= 1.0 - 1.0 / kShadowWindow;
      sh.hits += entries_.at(layer)[static_cast<size_t>(expert)].shadow[s] ? 1 : 0;
    }
    for (const auto& [layer, expert] : pending) {
      Entry& e = entries_.at(layer)[static_cast<size_t>(expert)];
      const size_t one = Bytes(layer);
      if (e.shadow[s] || !e.hosted || one == 0) continue;
      e.shadow[s] = true;
      sh.bytes += one;
    }
    if (sh.bytes <= opts_.budget_bytes) continue;
    // Evicts the lowest scores under this shadow's policy among its experts no microbatch holds
    // (ties: the higher layer and expert first, as MakeRoom): one pass over the entries a step,
    // the same choice as one eviction at a time (no score changes within a step).
    victims_.clear();
    for (const auto& [l, ents] : entries_) {
      for (size_t x = 0; x < ents.size(); ++x) {
        const Entry& c = ents[x];
        if (c.shadow[s] && c.held == 0) {
          victims_.push_back({ScoreAs(kShadowed[s], l, c), l, static_cast<int>(x)});
        }
      }
    }
    std::make_heap(victims_.begin(), victims_.end(), GoesLater);
    while (sh.bytes > opts_.budget_bytes && !victims_.empty()) {
      std::pop_heap(victims_.begin(), victims_.end(), GoesLater);
      const Victim v = victims_.back();
      victims_.pop_back();
      entries_.at(v.layer)[static_cast<size_t>(v.expert)].shadow[s] = false;
      sh.bytes -= std::min(sh.bytes, Bytes(v.layer));
    }
    // Still over: every expert it holds is held (over, as the cache goes).
  }
  shadow_pending_.clear();
  size_t lead = 0;
  for (size_t s = 0; s < kShadowed.size(); ++s) {
    if (kShadowed[s] == leader_) lead = s;
  }
  for (size_t s = 0; s < kShadowed.size(); ++s) {
    if (shadows_[s].hits > shadows_[lead].hits * (1 + kShadowMargin) + 1) lead = s;
  }
  if (leader_ != kShadowed[lead]) {
    leader_ = kShadowed[lead];
    order_valid_ = false;  // MakeRoom's order is by the leader's scores
    stats_->following.store(static_cast<int>(leader_));
  }
}

double ExpertCache::ScoreAs(EvictionPolicy policy, int layer, const Entry& e) const {
  if (policy == EvictionPolicy::kLru) return static_cast<double>(e.last);
  if (policy == EvictionPolicy::kLfu) {
    const double age = static_cast<double>(tick_ - std::min(tick_, e.last));
    return e.uses * std::exp2(-age / opts_.half_life);
  }
  // cycle: minus the expected ticks until the next use.
  const auto it = turns_.find(layer);
  const LayerTurn t = it == turns_.end() ? LayerTurn{} : it->second;
  // A layer not seen twice yet: the others' mean period, or before any, the layers seen so far.
  const double period =
      t.period > 0 ? static_cast<double>(t.period)
                   : (mean_period_ > 0 ? mean_period_
                                       : std::max<double>(1.0, static_cast<double>(turns_.size())));
  const double since = t.seen ? static_cast<double>(tick_ - std::min(tick_, t.last)) : 0.0;
  const double wait = std::max(0.0, period - since);
  // The decayed count as of the layer's last turn; in steady state a use probability p per turn
  // gives p / (1 - 2^(-period / half_life)).
  const double age = t.seen ? static_cast<double>(t.last - std::min(t.last, e.last)) : 0.0;
  const double f = e.uses * std::exp2(-age / opts_.half_life);
  const double p = std::min(1.0, f * (1.0 - std::exp2(-period / opts_.half_life)));
  if (!(p > 0)) return -std::numeric_limits<double>::max();
  return -(wait + period * (1.0 / p - 1.0));
}

void ExpertCache::Need(int layer, int expert) {
  Entry* e = Find(layer, expert);
  if (e == nullptr || !e->hosted) return;  // the caller reports experts it does not host
  if (opts_.policy == EvictionPolicy::kCycle || opts_.policy == EvictionPolicy::kAdaptive) {
    LayerTurn& t = turns_[layer];
    if (!t.seen || t.last != tick_) {  // the layer's first Need of this microbatch
      order_valid_ = false;            // the layer's scores move with its turn
      if (t.seen && tick_ > t.last) {
        t.period = tick_ - t.last;
        double sum = 0;
        int n = 0;
        for (const auto& [l, u] : turns_) {
          if (u.period > 0) {
            sum += static_cast<double>(u.period);
            ++n;
          }
        }
        mean_period_ = n > 0 ? sum / n : 0;
      }
      t.last = tick_;
      t.seen = true;
    }
  }
  ++e->held;
  Touch(*e);
  if (opts_.policy == EvictionPolicy::kAdaptive) shadow_pending_.push_back({layer, expert});
  if (e->state == State::kResident) {
    stats_->hits.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  stats_->misses.fetch_add(1, std::memory_order_relaxed);
  if (e->state == State::kCold || e->state == State::kFailed) {
    e->state = State::kCold;
    Queue(layer, expert, false);
  } else if (e->state == State::kQueued && e->warm) {
    // A warm load waiting behind others becomes a demand load.
    e->warm = false;
    warm_.erase(std::remove(warm_.begin(), warm_.end(), Key{layer, expert}), warm_.end());
    demand_.push_back({layer, expert});
  }
}

void ExpertCache::Done(int layer, int expert) {
  Entry* e = Find(layer, expert);
  if (e != nullptr && e->held > 0 && --e->held == 0) order_valid_ = false;
}

Status ExpertCache::Failed(int layer, int expert) const {
  const Entry* e = Find(layer, expert);
  if (e == nullptr || e->state != State::kFailed) return Status::Ok();
  return e->error;
}

void ExpertCache::Queue(int layer, int expert, bool warm) {
  Entry* e = Find(layer, expert);
  e->state = State::kQueued;
  e->warm = warm;
  (warm ? warm_ : demand_).push_back({layer, expert});
}

void ExpertCache::Warm(int layer, const std::vector<int>& experts) {
  for (int x : experts) {
    Entry* e = Find(layer, x);
    if (e == nullptr || !e->hosted || e->state != State::kCold) continue;
    Queue(layer, x, true);
  }
}

bool ExpertCache::Loading(int layer, const std::vector<int>& experts) const {
  for (int x : experts) {
    const Entry* e = Find(layer, x);
    if (e != nullptr && (e->state == State::kQueued || e->state == State::kLoading)) return true;
  }
  return false;
}

void ExpertCache::Evict(int layer, int expert, Entry& e) {
  ExpertWeights& w = (*layers_.at(layer))[static_cast<size_t>(expert)];
  if (spill_) {
    std::lock_guard<std::mutex> lock(mu_);
    if (spare_.size() < static_cast<size_t>(opts_.loaders)) spare_.push_back(std::move(w));
  }
  w = ExpertWeights{};
  dirty_ = true;
  resident_bytes_ -= e.bytes;
  e.bytes = 0;
  e.state = State::kCold;
  stats_->evictions.fetch_add(1, std::memory_order_relaxed);
}

bool ExpertCache::MakeRoom(size_t need, bool strict) {
  bool rebuilt = false;
  while (resident_bytes_ + inflight_bytes_ + need > opts_.budget_bytes) {
    if (strict) return false;  // a warm load takes free room only
    // The eviction order: the experts that may go, by score, built once a tick (scores change
    // only with the tick, or for an expert while a microbatch holds it) and again when an expert
    // may have become free to go (Done, an install, a resize), so that it gives the same choice
    // as a scan of every entry per eviction.
    if (!order_valid_ || order_tick_ != tick_) {
      order_.clear();
      for (const auto& [layer, ents] : entries_) {
        for (size_t x = 0; x < ents.size(); ++x) {
          const Entry& e = ents[x];
          if (e.state == State::kResident && !e.pinned && e.held == 0) {
            order_.push_back({Score(layer, e), layer, static_cast<int>(x)});
          }
        }
      }
      std::make_heap(order_.begin(), order_.end(), GoesLater);
      order_valid_ = true;
      order_tick_ = tick_;
      rebuilt = true;
    }
    if (order_.empty()) {
      if (rebuilt) return false;  // nothing may go
      order_valid_ = false;
      continue;
    }
    std::pop_heap(order_.begin(), order_.end(), GoesLater);
    const Victim v = order_.back();
    order_.pop_back();
    Entry& e = entries_.at(v.layer)[static_cast<size_t>(v.expert)];
    // Skips what left the order's set since it was built (a microbatch holds it, pinned, gone).
    if (e.state != State::kResident || e.pinned || e.held > 0) continue;
    Evict(v.layer, v.expert, e);
  }
  return true;
}

void ExpertCache::Install(Finished& d) {
  Entry* e = Find(d.layer, d.expert);
  --inflight_;
  inflight_bytes_ -= std::min(inflight_bytes_, e->loading_bytes);
  e->loading_bytes = 0;
  if (e->state != State::kLoading) return;
  if (!e->hosted) {  // released while it loaded
    e->state = State::kCold;
    return;
  }
  if (!d.weights.ok()) {
    e->state = State::kFailed;
    e->error = d.weights.status().WithContext("loading layer " + std::to_string(d.layer) +
                                              " expert " + std::to_string(d.expert));
    spdlog::error("expert cache: {}", e->error.ToString());
    return;
  }
  ExpertWeights& slot = (*layers_.at(d.layer))[static_cast<size_t>(d.expert)];
  slot = std::move(*d.weights);
  dirty_ = true;
  e->bytes = slot.bytes();
  e->state = State::kResident;
  if (e->held == 0) order_valid_ = false;  // a warm load: free to go (held ones: at their Done)
  expert_bytes_[d.layer] = e->bytes;
  resident_bytes_ += e->bytes;
  stats_->loaded_bytes.fetch_add(e->bytes, std::memory_order_relaxed);
  stats_->loads.fetch_add(1, std::memory_order_relaxed);
}

Status ExpertCache::Poll() {
  if (!shadow_pending_.empty()) ShadowStep();  // before this step's evictions
  std::deque<Finished> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished.swap(done_);
  }
  for (Finished& d : finished) Install(d);
  // Back within the budget once microbatches have let go of what they held.
  MakeRoom(0, false);
  if (resident_bytes_ > opts_.budget_bytes && !warned_over_) {
    warned_over_ = true;
    spdlog::warn(
        "expert cache: the experts held by the microbatches in flight need {:.1f} MiB, more than "
        "the budget of {:.1f} MiB; they stay resident until done",
        static_cast<double>(resident_bytes_) / (1 << 20),
        static_cast<double>(opts_.budget_bytes) / (1 << 20));
  }
  // Start loads: demand first, then warm ones, within the parallel and byte bounds.
  std::vector<std::pair<Key, std::string>> start;
  for (std::deque<Key>* q : {&demand_, &warm_}) {
    const bool warm = q == &warm_;
    while (!q->empty()) {
      const Key k = q->front();
      Entry* e = Find(k.first, k.second);
      // Entries that left this queue (a warm load made a demand one, a load of an expert no
      // longer hosted) are skipped.
      if (e == nullptr || e->state != State::kQueued || e->warm != warm) {
        q->pop_front();
        continue;
      }
      if (!e->hosted) {
        e->state = State::kCold;
        q->pop_front();
        continue;
      }
      const size_t bytes = Bytes(k.first);
      const size_t max_inflight =
          opts_.max_inflight_bytes > 0 ? opts_.max_inflight_bytes : 2 * std::max<size_t>(bytes, 1);
      if (inflight_ >= opts_.loaders || (inflight_ > 0 && inflight_bytes_ + bytes > max_inflight)) {
        break;
      }
      if (!MakeRoom(bytes, warm)) {
        if (warm) {  // no room without pushing out a used expert: it stays cold
          e->state = State::kCold;
          q->pop_front();
          continue;
        }
        // A demand load goes ahead over the budget (Poll evicts once microbatches let go).
      }
      q->pop_front();
      e->state = State::kLoading;
      ++inflight_;
      e->loading_bytes = bytes;
      inflight_bytes_ += bytes;
      start.push_back({k, e->file});
    }
  }
  if (!start.empty()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& s : start) work_.push_back(std::move(s));
    }
    work_cv_.notify_all();
  }
  Publish();
  return Status::Ok();
}

bool ExpertCache::WaitForLoad(Deadline until) {
  std::unique_lock<std::mutex> lock(mu_);
  return done_cv_.wait_until(lock, until, [this] { return !done_.empty(); });
}

void ExpertCache::LoaderMain() {
  for (;;) {
    std::pair<Key, std::string> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stop_ || !work_.empty(); });
      if (stop_) return;
      job = std::move(work_.front());
      work_.pop_front();
    }
    const int layer = job.first.first, expert = job.first.second;
    const auto started = SteadyClock::now();
    Result<ExpertWeights> w = Status::NotFound("not spilled");
    if (spill_) {
      ExpertWeights reuse;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!spare_.empty()) {
          reuse = std::move(spare_.back());
          spare_.pop_back();
        }
      }
      w = spill_->Get(layer, expert, std::move(reuse));
      if (w.ok()) stats_->spill_reads.fetch_add(1, std::memory_order_relaxed);
    }
    if (!w.ok()) {
      const uint64_t generation = spill_ ? spill_->Generation(layer, expert) : 0;
      w = fetch_(layer, expert, job.second);
      if (w.ok() && spill_) {
        const Status s = spill_->Put(layer, expert, generation, *w);
        std::lock_guard<std::mutex> lock(mu_);
        if (!s.ok() && !warned_spill_) {
          warned_spill_ = true;
          spdlog::warn("{} (misses load from the source)", s.ToString());
        }
      }
    }
    if (w.ok() && opts_.load_bytes_per_s > 0) {
      // Paced: this load is due its bytes' worth of time after the one before it was.
      std::unique_lock<std::mutex> lock(mu_);
      const auto now = SteadyClock::now();
      paced_until_ =
          std::max(paced_until_, started) +
          std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(
              static_cast<double>(w->bytes()) / opts_.load_bytes_per_s));
      const auto due = paced_until_;
      if (due > now) work_cv_.wait_until(lock, due, [this] { return stop_; });
      if (stop_) return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_.push_back(Finished{job.first.first, job.first.second, std::move(w)});
    }
    done_cv_.notify_all();
  }
}

}  // namespace moerun
