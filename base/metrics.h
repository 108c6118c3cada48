// Metrics: counters, gauges and histograms, rendered in the Prometheus text exposition format
// (version 0.0.4) for a /metrics endpoint.
//
// Thread-safety: updating a metric (Counter::Inc, Gauge::Set/Add, Histogram::Observe) is lock-free,
// allocates nothing and may be done from any thread. Registration and Render take the registry's
// mutex. Pointers returned by registration stay valid for the registry's lifetime. Registration
// errors (a bad name, a type clash) are programming errors and throw std::invalid_argument.
//
// A callback gauge's function is called by Render under the registry's mutex: it must be cheap,
// thread-safe, and must not call into the registry.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace moerun {

using Labels = std::vector<std::pair<std::string, std::string>>;

// A monotonically increasing count.
class Counter {
 public:
  void Inc(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double d);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into buckets fixed at creation (upper bounds, inclusive: v <= bound), plus
// their count and sum. NaN observations land in the +Inf bucket only.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  uint64_t count() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  const std::vector<double>& bounds() const { return bounds_; }
  // Non-cumulative count of bucket i (0..bounds().size(); the last one is +Inf).
  uint64_t bucket_count(size_t i) const { return buckets_[i].load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1
  std::atomic<double> sum_{0.0};
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registering the same name and labels (same order) twice returns the same object. A name
  // matches [a-zA-Z_:][a-zA-Z0-9_:]* and starts with "moerun_"; a counter's ends in "_total";
  // label names match [a-zA-Z_][a-zA-Z0-9_]*, don't start with "__" and are unique in a series
  // ("le" is reserved for histograms); one name has one type and one help text; a histogram's
  // bounds are finite, strictly increasing, and the same for every series of the name.
  Counter* AddCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge* AddGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram* AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds, const Labels& labels = {});
  // A gauge whose value is read at render time (resident memory, queue depth). A name and labels
  // may be registered as a callback gauge only once.
  void AddCallbackGauge(const std::string& name, const std::string& help,
                        std::function<double()> read, const Labels& labels = {});
  // A counter read at render time from a monotonic source (e.g. a transport's byte count).
  void AddCallbackCounter(const std::string& name, const std::string& help,
                          std::function<double()> read, const Labels& labels = {});

  // The text format 0.0.4: families in registration order, each with "# HELP" and "# TYPE" once,
  // then its series in registration order.
  std::string Render() const;

  struct Family;  // implementation detail (metrics.cc)

 private:
  void AddCallback(const std::string& name, const std::string& help, int type,
                   std::function<double()> read, const Labels& labels);
  Family& FamilyFor(const std::string& name, const std::string& help, int type,
                    const Labels& labels);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Family>> families_;
};

// Default latency buckets in seconds: 50 us .. 60 s, roughly x2 apart.
std::vector<double> LatencyBuckets();

// This process's resident set size in bytes (from /proc/self/statm), 0 if unreadable: for the
// resident-memory gauge and the probes' pong only, which have no way to report an error. Whatever
// checks memory (a load's log line, a test) uses ResidentBytes() (base/resident_memory.h), whose
// failure is an error.
double ProcessResidentBytes();

// A number as the text format writes it: integral values with |v| < 2^53 as plain integers,
// others with the fewest digits that round-trip, NaN, +Inf, -Inf.
std::string FormatMetricValue(double v);

}  // namespace moerun
