#include "router/local_search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

namespace moerun {
namespace {

// (max rank load, sum of squared rank loads), compared in that order, the sum of squares with a
// relative tolerance of 1e-12 (a move must beat the rounding to count). Candidates' rank loads
// and keys are computed with the arithmetic of a from-scratch evaluation (each rank summed over
// its slots in order, the squares summed rank after rank), so the search makes the moves the
// simple reference makes (tests/unit/planner_test.cc), bit for bit.
struct Key {
  double max = 0, sumsq = 0;
  bool operator<(const Key& o) const {
    return max < o.max || (max == o.max && sumsq < o.sumsq * (1 - 1e-12));
  }
};

enum class Kind { kNone, kSwap, kAssign };

// A move: kSwap exchanges the contents of slots i and j; kAssign makes slot j expert e.
struct Move {
  Kind kind = Kind::kNone;
  int i = -1, j = -1, e = -1;
};

class Search {
 public:
  // Experts from `pinned` on never move and never get a slot (the empty slots' voids); inv: each
  // rank's time factor (InverseSpeeds).
  Search(const std::vector<double>& load, const std::vector<int>& p2l, int num_ranks, int pinned,
         std::vector<double> inv)
      : pinned_(pinned),
        load_(load),
        num_log_(static_cast<int>(load.size())),
        slots_(static_cast<int>(p2l.size())),
        ranks_(num_ranks),
        per_rank_(slots_ / num_ranks),
        p2l_(p2l),
        cnt_(load.size(), 0),
        held_(static_cast<size_t>(num_ranks) * load.size(), 0),
        slots_of_(load.size()),
        rank_load_(static_cast<size_t>(num_ranks), 0.0),
        rows_(static_cast<size_t>(num_ranks), 0.0),
        w_(load.size()),
        w_less_(load.size()),
        w_more_(load.size()),
        w_min_(static_cast<size_t>(num_ranks)),
        w_max_(static_cast<size_t>(num_ranks)),
        new_load_(static_cast<size_t>(num_ranks), 0.0),
        mark_(static_cast<size_t>(num_ranks), 0),
        gain_(load.size()),
        inv_(std::move(inv)) {
    // A perfect split's time is the total load ÷ the total speed (in units of the fastest
    // rank's; the rank count itself when all are equal, as mean ÷ max computes it).
    speed_sum_ = 0;
    for (double f : inv_) speed_sum_ += 1 / f;
    for (int s = 0; s < slots_; ++s) {
      ++cnt_[Ex(p2l_[Sz(s)])];
      ++Held(s / per_rank_, p2l_[Sz(s)]);
    }
    start_ = held_;
    Refresh();
  }

  // Rounds of the best move (see local_search.h) until none helps or a limit is reached.
  void Balance(const SearchLimits& limits) {
    const int64_t rounds = limits.max_rounds > 0 ? limits.max_rounds : 50 * int64_t{slots_};
    const int64_t stall = limits.stall_rounds == 0 ? int64_t{slots_} : limits.stall_rounds;
    int64_t last_fall = -1;  // the last round that lowered the max
    for (int64_t round = 0; round < rounds; ++round) {
      if (limits.target_balance > 0 && Balancedness() >= limits.target_balance) break;
      if (stall > 0 && round - last_fall > stall) break;
      const Move m = BestMove(limits.max_copies);
      if (m.kind == Kind::kNone) break;
      const double max_before = now_.max;
      Apply(m);
      if (now_.max < max_before) last_fall = round;
    }
  }

  // Lifts replicas held twice on one rank (see local_search.h).
  void LiftTwice() {
    for (int round = 0; round < slots_; ++round) {
      int i = slots_;
      for (int s = 0; s < slots_ && i == slots_; ++s) {
        if (Held(s / per_rank_, p2l_[Sz(s)]) > 1) i = s;
      }
      if (i == slots_) break;
      const Move m = BestLift(i);
      if (m.kind == Kind::kNone) break;
      Apply(m);
    }
  }

  SearchResult Result() const {
    SearchResult r;
    r.maps = MapsFromSlots(p2l_, num_log_);
    r.moves = moves_;
    r.copies = copies_;
    return r;
  }

 private:
  static size_t Sz(int i) { return static_cast<size_t>(i); }
  static size_t Ex(int e) { return static_cast<size_t>(e); }
  int& Held(int r, int e) { return held_[Sz(r) * Ex(num_log_) + Ex(e)]; }
  int Held(int r, int e) const { return held_[Sz(r) * Ex(num_log_) + Ex(e)]; }
  bool InStart(int r, int e) const { return start_[Sz(r) * Ex(num_log_) + Ex(e)] > 0; }

  // Rank loads (summed as PredictedBalancedness sums them: each rank's slots in order), their
  // order, the key, each expert's slots and loads per replica: from the slots, at the start.
  void Refresh() {
    for (auto& v : slots_of_) v.clear();
    for (int s = 0; s < slots_; ++s) slots_of_[Ex(p2l_[Sz(s)])].push_back(s);
    for (int e = 0; e < num_log_; ++e) ExpertChanged(e);
    for (int r = 0; r < ranks_; ++r) RankChanged(r);
    order_.resize(Sz(ranks_));
    for (int r = 0; r < ranks_; ++r) order_[Sz(r)] = r;
    Reorder();
  }

  void ExpertChanged(int e) {
    const double l = load_[Ex(e)];
    const int c = cnt_[Ex(e)];
    w_[Ex(e)] = l / c;
    w_less_[Ex(e)] = c > 1 ? l / (c - 1) : 0;
    w_more_[Ex(e)] = l / (c + 1);
  }

  void RankChanged(int r) {
    double load = 0, lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (int s = r * per_rank_; s < (r + 1) * per_rank_; ++s) {
      const int e = p2l_[Sz(s)];
      const double w = load_[Ex(e)] / cnt_[Ex(e)];
      load += w;
      lo = std::min(lo, w);
      hi = std::max(hi, w);
    }
    rows_[Sz(r)] = load;
    rank_load_[Sz(r)] = load * inv_[Sz(r)];
    w_min_[Sz(r)] = lo;
    w_max_[Sz(r)] = hi;
  }

  // The key and the order of the ranks, after RankChanged (an insertion sort: few ranks move).
  void Reorder() {
    now_ = Key{};
    total_ = 0;
    for (double v : rank_load_) now_.max = std::max(now_.max, v), now_.sumsq += v * v;
    for (double v : rows_) total_ += v;
    auto before = [&](int x, int y) {
      const double lx = rank_load_[Sz(x)], ly = rank_load_[Sz(y)];
      return lx > ly || (lx == ly && x < y);
    };
    for (size_t k = 1; k < order_.size(); ++k) {
      const int r = order_[k];
      size_t m = k;
      for (; m > 0 && before(r, order_[m - 1]); --m) order_[m] = order_[m - 1];
      order_[m] = r;
    }
  }

  // After a move: the slot lists, loads per replica and rank loads it changed.
  void MoveSlot(int e, int from, int to) {
    std::vector<int>& v = slots_of_[Ex(e)];
    if (from >= 0) v.erase(std::find(v.begin(), v.end(), from));
    if (to >= 0) v.insert(std::lower_bound(v.begin(), v.end(), to), to);
  }

  double Balancedness() const { return now_.max <= 0 ? 1.0 : total_ / speed_sum_ / now_.max; }

  // The highest load among the ranks not marked with the current stamp (0 if all are).
  double MaxUnmarked() const {
    for (int r : order_) {
      if (mark_[Sz(r)] != stamp_) return rank_load_[Sz(r)];
    }
    return 0;
  }

  // Rank r's load after the candidate move is v.
  void Touch(int r, double v) {
    if (mark_[Sz(r)] != stamp_) {
      mark_[Sz(r)] = stamp_;
      touched_.push_back(r);
    }
    new_load_[Sz(r)] = v;
  }

  // The candidate's key from the touched ranks: the max exact, the sum of squares an estimate
  // (the kept sum plus the touched ranks' changes; ExactSumsq gives it as a reference would).
  Key KeyOfTouched() const {
    Key k{MaxUnmarked(), now_.sumsq};
    for (int r : touched_) {
      const double old = rank_load_[Sz(r)], v = new_load_[Sz(r)];
      k.max = std::max(k.max, v);
      k.sumsq += v * v - old * old;
    }
    return k;
  }

  double ExactSumsq() const {
    double sumsq = 0;
    for (int r = 0; r < ranks_; ++r) {
      const double v = mark_[Sz(r)] == stamp_ ? new_load_[Sz(r)] : rank_load_[Sz(r)];
      sumsq += v * v;
    }
    return sumsq;
  }

  // Whether the candidate just evaluated (key k, from KeyOfTouched) beats `best` (whose sum of
  // squares is exact); if so, k gets its exact sum of squares. The estimate decides where it is
  // far from the threshold (1e-13 relative: rounding is ~1e-16), ExactSumsq otherwise.
  bool Beats(Key* k, const Key& best) const {
    if (k->max > best.max) return false;
    const double threshold = best.sumsq * (1 - 1e-12), margin = 1e-13 * best.sumsq;
    if (k->max == best.max) {
      if (k->sumsq > threshold + margin) return false;
      if (k->sumsq >= threshold - margin && !(ExactSumsq() < threshold)) return false;
    }
    k->sumsq = ExactSumsq();
    return true;
  }

  void NewStamp() {
    ++stamp_;
    touched_.clear();
  }

  Key SwapKey(int i, int j) {
    NewStamp();
    const int a = i / per_rank_, b = j / per_rank_;
    const double wi = w_[Ex(p2l_[Sz(i)])], wj = w_[Ex(p2l_[Sz(j)])];
    Touch(a, rank_load_[Sz(a)] + (wj - wi) * inv_[Sz(a)]);
    Touch(b, rank_load_[Sz(b)] + (wi - wj) * inv_[Sz(b)]);
    return KeyOfTouched();
  }

  Key AssignKey(int j, int e) {
    NewStamp();
    const int f = p2l_[Sz(j)];
    const double wf2 = w_less_[Ex(f)], we2 = w_more_[Ex(e)];
    // Each rank of f, of e and j's rank, re-summed over its slots with the new counts.
    auto resum = [&](int r) {
      if (mark_[Sz(r)] == stamp_) return;
      double v = 0;
      for (int s = r * per_rank_; s < (r + 1) * per_rank_; ++s) {
        const int x = s == j ? e : p2l_[Sz(s)];
        v += x == f ? wf2 : x == e ? we2 : w_[Ex(x)];
      }
      Touch(r, v * inv_[Sz(r)]);
    };
    for (int s : slots_of_[Ex(f)]) resum(s / per_rank_);
    for (int s : slots_of_[Ex(e)]) resum(s / per_rank_);
    resum(j / per_rank_);
    return KeyOfTouched();
  }

  // (rank, expert) pairs the move adds that the start lacks, less those it removes.
  int64_t CopiesDelta(const Move& m) const {
    auto gain = [&](int r, int e) { return Held(r, e) == 0 && !InStart(r, e) ? 1 : 0; };
    auto loss = [&](int r, int e) { return Held(r, e) == 1 && !InStart(r, e) ? 1 : 0; };
    const int b = m.j / per_rank_, ej = p2l_[Sz(m.j)];
    if (m.kind == Kind::kAssign) return gain(b, m.e) - loss(b, ej);
    const int a = m.i / per_rank_, ei = p2l_[Sz(m.i)];
    return gain(a, ej) + gain(b, ei) - loss(a, ei) - loss(b, ej);
  }

  // Whether a candidate with key k beats *best within the copy budget; if so it becomes *best.
  bool Take(Key k, const Move& m, int64_t max_copies, Key* best, Move* best_move) const {
    if (!Beats(&k, *best)) return false;
    if (max_copies >= 0 && copies_ + CopiesDelta(m) > max_copies) return false;
    *best = k;
    *best_move = m;
    return true;
  }

  // The new max a candidate may have and still beat `best` (a little over best.max, against
  // rounding), for the pruning bounds.
  static double Bound(const Key& best) { return best.max * (1 + 1e-9); }

  Move BestMove(int64_t max_copies) {
    const int a = order_[0];
    Key best = now_;
    Move best_move;
    for (int i = a * per_rank_; i < (a + 1) * per_rank_; ++i) {
      const int ei = p2l_[Sz(i)];
      if (ei >= pinned_) continue;
      const double wi = w_[Ex(ei)];
      for (int b = 0; b < ranks_; ++b) {
        if (b == a || Held(b, ei) > 0) continue;
        // The lightest and heaviest slot of b bound every swap with it the same way.
        if (rank_load_[Sz(b)] - (w_max_[Sz(b)] - wi) * inv_[Sz(b)] > Bound(best) ||
            rank_load_[Sz(a)] + (w_min_[Sz(b)] - wi) * inv_[Sz(a)] > Bound(best)) {
          continue;
        }
        for (int j = b * per_rank_; j < (b + 1) * per_rank_; ++j) {
          const int ej = p2l_[Sz(j)];
          if (ej >= pinned_) continue;
          // The new loads of ranks a and b bound the new max from below.
          const double d = w_[Ex(ej)] - wi;
          if (rank_load_[Sz(b)] - d * inv_[Sz(b)] > Bound(best) ||
              rank_load_[Sz(a)] + d * inv_[Sz(a)] > Bound(best)) {
            continue;
          }
          if (Held(a, ej) > 0) continue;
          Take(SwapKey(i, j), Move{Kind::kSwap, i, j, -1}, max_copies, &best, &best_move);
        }
      }
    }
    // Re-assignments: a slot of rank a to any expert, any slot to an expert of rank a.
    std::vector<int>& on_a = scratch_;
    on_a.clear();
    for (int i = a * per_rank_; i < (a + 1) * per_rank_; ++i) on_a.push_back(p2l_[Sz(i)]);
    std::sort(on_a.begin(), on_a.end());
    on_a.erase(std::unique(on_a.begin(), on_a.end()), on_a.end());
    // A slot of another rank becoming e lowers rank a by what e's replica there loses, at most:
    // only the experts of a for which that can beat the best so far.
    std::vector<int>& relieve_a = scratch3_;
    relieve_a.clear();
    for (int e : on_a) {
      if (rank_load_[Sz(a)] + (w_more_[Ex(e)] - w_[Ex(e)]) * inv_[Sz(a)] <= Bound(best)) {
        relieve_a.push_back(e);
      }
    }
    // Per expert of several replicas: the first of its slots (in slot order) whose rank gains
    // most from one replica fewer, and the first such among the slots on other ranks than that
    // one's (where j lies on the first's rank). Rank loads do not change within a round, so this
    // is once per round, not once per slot j (the same r_f as a scan of f's slots would find).
    for (int f = 0; f < num_log_; ++f) {
      if (cnt_[Ex(f)] < 2) continue;
      int r1 = -1, r2 = -1;
      double v1 = 0, v2 = 0;
      for (int s : slots_of_[Ex(f)]) {
        const int r = s / per_rank_;
        const double v = rank_load_[Sz(r)] + (w_less_[Ex(f)] - w_[Ex(f)]) * inv_[Sz(r)];
        if (r1 < 0 || v > v1) r1 = r, v1 = v;
      }
      for (int s : slots_of_[Ex(f)]) {
        const int r = s / per_rank_;
        const double v = rank_load_[Sz(r)] + (w_less_[Ex(f)] - w_[Ex(f)]) * inv_[Sz(r)];
        if (r != r1 && (r2 < 0 || v > v2)) r2 = r, v2 = v;
      }
      gain_[Ex(f)] = Gain{r1, r2, v1, v2};
    }
    for (int j = 0; j < slots_; ++j) {
      const int f = p2l_[Sz(j)], b = j / per_rank_;
      if (cnt_[Ex(f)] < 2 || (b != a && relieve_a.empty())) continue;
      // Bounds on the new max whatever e is: rank b's new load (less what b's other replicas of
      // f gain), the new load of the rank r that gains most from f's lost replica (less what e's
      // replicas lose, where r holds e: then no bound).
      const double b_load = rank_load_[Sz(b)], inv_b = inv_[Sz(b)];
      const Gain& g = gain_[Ex(f)];
      const int r_f = g.r1 != b ? g.r1 : g.r2;
      const double r_f_load = g.r1 != b ? g.v1 : g.v2;
      auto consider = [&](int e) {
        if (e >= pinned_ || e == f || Held(b, e) > 0 ||
            b_load + (w_more_[Ex(e)] - w_[Ex(f)]) * inv_b > Bound(best)) {
          return;
        }
        if (r_f >= 0 && r_f_load > Bound(best) && Held(r_f, e) == 0) return;
        Take(AssignKey(j, e), Move{Kind::kAssign, -1, j, e}, max_copies, &best, &best_move);
      };
      if (b == a && r_f >= 0 && r_f_load > Bound(best)) {
        // Only an expert that r_f holds can relieve r_f: those, in expert order.
        std::vector<int>& on_r = scratch2_;
        on_r.clear();
        for (int s = r_f * per_rank_; s < (r_f + 1) * per_rank_; ++s) on_r.push_back(p2l_[Sz(s)]);
        std::sort(on_r.begin(), on_r.end());
        on_r.erase(std::unique(on_r.begin(), on_r.end()), on_r.end());
        for (int e : on_r) consider(e);
      } else if (b == a) {
        for (int e = 0; e < num_log_; ++e) consider(e);
      } else {
        for (int e : relieve_a) consider(e);
      }
    }
    return best_move;
  }

  // The move for slot i (its expert held twice on its rank) that keeps the max rank load lowest
  // without raising it: a swap with another rank's slot, or slot i re-assigned.
  Move BestLift(int i) {
    const int a = i / per_rank_, e = p2l_[Sz(i)];
    Key best{std::numeric_limits<double>::infinity(), 0};
    Move best_move;
    auto take = [&](Key k, const Move& m) {
      if (k.max <= now_.max && Beats(&k, best)) best = k, best_move = m;
    };
    // As in BestMove, ranks a's and b's new loads bound the new max from below.
    auto bound = [&] { return std::min(Bound(best), Bound(now_)); };
    const double wi = w_[Ex(e)];
    for (int j = 0; j < slots_; ++j) {
      const int b = j / per_rank_, ej = p2l_[Sz(j)];
      if (ej >= pinned_ || b == a || ej == e || Held(b, e) > 0 || Held(a, ej) > 0) continue;
      const double d = w_[Ex(ej)] - wi;
      if (rank_load_[Sz(b)] - d * inv_[Sz(b)] > bound() ||
          rank_load_[Sz(a)] + d * inv_[Sz(a)] > bound()) {
        continue;
      }
      take(SwapKey(i, j), Move{Kind::kSwap, i, j, -1});
    }
    for (int g = 0; g < pinned_; ++g) {
      if (Held(a, g) > 0 || rank_load_[Sz(a)] + (w_more_[Ex(g)] - wi) * inv_[Sz(a)] > bound()) {
        continue;
      }
      take(AssignKey(i, g), Move{Kind::kAssign, -1, i, g});
    }
    return best_move;
  }

  void Apply(const Move& m) {
    copies_ += CopiesDelta(m);
    ++moves_;
    const int b = m.j / per_rank_, ej = p2l_[Sz(m.j)];
    if (m.kind == Kind::kSwap) {
      const int a = m.i / per_rank_, ei = p2l_[Sz(m.i)];
      --Held(a, ei), ++Held(a, ej), --Held(b, ej), ++Held(b, ei);
      std::swap(p2l_[Sz(m.i)], p2l_[Sz(m.j)]);
      MoveSlot(ei, m.i, m.j);
      MoveSlot(ej, m.j, m.i);
      RankChanged(a);
      RankChanged(b);
    } else {
      --Held(b, ej), ++Held(b, m.e);
      --cnt_[Ex(ej)], ++cnt_[Ex(m.e)];
      p2l_[Sz(m.j)] = m.e;
      MoveSlot(ej, m.j, -1);
      MoveSlot(m.e, -1, m.j);
      ExpertChanged(ej);
      ExpertChanged(m.e);
      for (int e : {ej, m.e}) {
        for (int slot : slots_of_[Ex(e)]) RankChanged(slot / per_rank_);
      }
      RankChanged(b);
    }
    Reorder();
  }

  const int pinned_;
  const std::vector<double>& load_;
  const int num_log_, slots_, ranks_, per_rank_;
  std::vector<int> p2l_, cnt_;
  std::vector<int> held_, start_;  // [rank * experts + expert]: copies now, and at the start
  std::vector<std::vector<int>> slots_of_;
  std::vector<double> rank_load_;  // per rank: its time (its rows × inv_)
  std::vector<double> rows_;       // per rank: its rows
  // Per expert: its load per replica now, with one replica fewer (0 for a single one), one more.
  std::vector<double> w_, w_less_, w_more_;
  std::vector<double> w_min_, w_max_;  // per rank: its lightest and heaviest slot
  std::vector<int> order_;             // ranks by load, highest first (ties: the lower rank)
  Key now_;
  double total_ = 0;
  // Candidate evaluation: per rank, its load after the move (valid where mark_ == stamp_), the
  // ranks touched.
  std::vector<double> new_load_;
  std::vector<int> mark_;
  int stamp_ = 0;
  std::vector<int> touched_, scratch_, scratch2_, scratch3_;
  // Per expert, in BestMove's re-assignments: the rank of its slots that gains most from one
  // replica fewer (r1; its new load v1), and the one that does among the other ranks (r2, v2;
  // -1 if none).
  struct Gain {
    int r1 = -1, r2 = -1;
    double v1 = 0, v2 = 0;
  };
  std::vector<Gain> gain_;
  std::vector<double> inv_;  // per rank: its time factor (1 for every rank without speeds)
  double speed_sum_ = 0;     // the ranks' speeds ÷ the fastest's, summed
  int64_t moves_ = 0, copies_ = 0;
};

}  // namespace

LayerMaps MapsFromSlots(std::vector<int> phy2log, int num_log) {
  LayerMaps maps;
  maps.log2phy.resize(static_cast<size_t>(num_log));
  maps.logcnt.assign(static_cast<size_t>(num_log), 0);
  for (size_t s = 0; s < phy2log.size(); ++s) {
    if (phy2log[s] == kEmptySlot) continue;
    const size_t e = static_cast<size_t>(phy2log[s]);
    maps.log2phy[e].push_back(static_cast<int>(s));
    ++maps.logcnt[e];
  }
  maps.phy2log = std::move(phy2log);
  return maps;
}

bool HoldsTwice(const LayerMaps& maps, int num_ranks) {
  const size_t per_rank = maps.phy2log.size() / static_cast<size_t>(num_ranks);
  std::set<std::pair<size_t, int>> seen;
  for (size_t s = 0; s < maps.phy2log.size(); ++s) {
    if (maps.phy2log[s] == kEmptySlot) continue;
    if (!seen.insert({s / per_rank, maps.phy2log[s]}).second) return true;
  }
  return false;
}

std::vector<double> InverseSpeeds(const std::vector<double>& rank_speed, int num_ranks) {
  std::vector<double> inv(static_cast<size_t>(num_ranks), 1.0);
  if (rank_speed.size() != inv.size()) return inv;
  const double fastest = *std::max_element(rank_speed.begin(), rank_speed.end());
  for (size_t r = 0; r < inv.size(); ++r) inv[r] = fastest / rank_speed[r];
  return inv;
}

SearchResult LocalSearch(const std::vector<double>& load, const LayerMaps& start, int num_ranks,
                         const SearchLimits& limits, const std::vector<double>& rank_speed) {
  const int experts = static_cast<int>(load.size());
  std::vector<double> inv = InverseSpeeds(rank_speed, num_ranks);
  const auto empties = std::count(start.phy2log.begin(), start.phy2log.end(), kEmptySlot);
  if (empties == 0) {
    Search search(load, start.phy2log, num_ranks, experts, std::move(inv));
    search.Balance(limits);
    if (limits.lift_twice) search.LiftTwice();
    return search.Result();
  }
  // Empty slots (ranks of fewer slots) searched as pinned zero-load "void" experts, one each.
  std::vector<double> padded = load;
  padded.resize(load.size() + static_cast<size_t>(empties), 0.0);
  std::vector<int> p2l = start.phy2log;
  int next = experts;
  for (int& e : p2l) {
    if (e == kEmptySlot) e = next++;
  }
  Search search(padded, p2l, num_ranks, experts, std::move(inv));
  search.Balance(limits);
  if (limits.lift_twice) search.LiftTwice();
  SearchResult r = search.Result();
  for (int& e : r.maps.phy2log) {
    if (e >= experts) e = kEmptySlot;
  }
  r.maps = MapsFromSlots(std::move(r.maps.phy2log), experts);
  return r;
}

}  // namespace moerun
