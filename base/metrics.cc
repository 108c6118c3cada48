#include "base/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <system_error>

#include "base/resident_memory.h"

namespace moerun {

static_assert(std::atomic<uint64_t>::is_always_lock_free, "counters must be lock-free");
static_assert(std::atomic<double>::is_always_lock_free, "gauges must be lock-free");

namespace {

enum Type { kCounter = 0, kGauge = 1, kHistogram = 2 };
const char* TypeName(int type) {
  switch (type) {
    case kCounter:
      return "counter";
    case kGauge:
      return "gauge";
    default:
      return "histogram";
  }
}

void AtomicAdd(std::atomic<double>& a, double d) {
  double old = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(old, old + d, std::memory_order_relaxed)) {
  }
}

bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

void CheckMetricName(const std::string& name, int type) {
  bool ok = !name.empty() && (IsNameStart(name[0]) || name[0] == ':');
  for (char c : name) ok = ok && (IsNameStart(c) || IsDigit(c) || c == ':');
  if (!ok)
    throw std::invalid_argument("metric name \"" + name + "\" is not [a-zA-Z_:][a-zA-Z0-9_:]*");
  if (name.rfind("moerun_", 0) != 0) {
    throw std::invalid_argument("metric name \"" + name + "\" does not start with \"moerun_\"");
  }
  const std::string total = "_total";
  bool ends_total = name.size() > total.size() &&
                    name.compare(name.size() - total.size(), total.size(), total) == 0;
  if (type == kCounter && !ends_total) {
    throw std::invalid_argument("counter name \"" + name + "\" does not end in \"_total\"");
  }
}

void CheckLabels(const std::string& name, const Labels& labels, int type) {
  for (size_t i = 0; i < labels.size(); ++i) {
    const std::string& l = labels[i].first;
    bool ok = !l.empty() && IsNameStart(l[0]);
    for (char c : l) ok = ok && (IsNameStart(c) || IsDigit(c));
    if (!ok || l.rfind("__", 0) == 0) {
      throw std::invalid_argument("metric " + name + ": label name \"" + l +
                                  "\" is not [a-zA-Z_][a-zA-Z0-9_]* or starts with \"__\"");
    }
    if (type == kHistogram && l == "le") {
      throw std::invalid_argument("histogram " + name + ": label name \"le\" is reserved");
    }
    for (size_t j = 0; j < i; ++j) {
      if (labels[j].first == l) {
        throw std::invalid_argument("metric " + name + ": label \"" + l + "\" given twice");
      }
    }
  }
}

void CheckBounds(const std::string& name, const std::vector<double>& bounds) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i - 1] < bounds[i]))) {
      throw std::invalid_argument("histogram " + name +
                                  ": bucket bounds must be finite and strictly increasing");
    }
  }
}

void AppendEscaped(std::string& out, const std::string& s, bool quote) {
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

// {a="x",b="y"} plus an optional le="..." last; nothing when there are no labels at all.
void AppendLabels(std::string& out, const Labels& labels, const std::string* le) {
  if (labels.empty() && le == nullptr) return;
  out += '{';
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ',';
    first = false;
    out += k;
    out += "=\"";
    AppendEscaped(out, v, true);
    out += '"';
  }
  if (le != nullptr) {
    if (!first) out += ',';
    out += "le=\"";
    out += *le;
    out += '"';
  }
  out += '}';
}

}  // namespace

struct MetricsRegistry::Family {
  struct Series {
    Labels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
    std::function<double()> read;  // callback gauge
  };
  std::string name;
  std::string help;
  int type = kCounter;
  std::vector<double> bounds;  // histograms
  std::vector<Series> series;

  Series* Find(const Labels& labels) {
    for (Series& s : series) {
      if (s.labels == labels) return &s;
    }
    return nullptr;
  }
};

void Gauge::Add(double d) { AtomicAdd(value_, d); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  // First bound >= v; NaN compares false with everything, so it goes to +Inf explicitly.
  size_t i = std::isnan(v)
                 ? bounds_.size()
                 : static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) -
                                       bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
}

uint64_t Histogram::count() const {
  uint64_t n = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) n += buckets_[i].load(std::memory_order_relaxed);
  return n;
}

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

MetricsRegistry::Family& MetricsRegistry::FamilyFor(const std::string& name,
                                                    const std::string& help, int type,
                                                    const Labels& labels) {
  CheckMetricName(name, type);
  CheckLabels(name, labels, type);
  for (auto& f : families_) {
    if (f->name != name) continue;
    if (f->type != type) {
      throw std::invalid_argument("metric " + name + " is a " + TypeName(f->type) +
                                  ", registered again as a " + TypeName(type));
    }
    if (f->help != help) {
      throw std::invalid_argument("metric " + name + " registered with two help texts");
    }
    return *f;
  }
  auto f = std::make_unique<Family>();
  f->name = name;
  f->help = help;
  f->type = type;
  families_.push_back(std::move(f));
  return *families_.back();
}

Counter* MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                     const Labels& labels) {
  std::lock_guard lock(mu_);
  Family& f = FamilyFor(name, help, kCounter, labels);
  if (Family::Series* s = f.Find(labels)) return s->counter.get();
  f.series.push_back({labels, std::make_unique<Counter>(), nullptr, nullptr, nullptr});
  return f.series.back().counter.get();
}

Gauge* MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                 const Labels& labels) {
  std::lock_guard lock(mu_);
  Family& f = FamilyFor(name, help, kGauge, labels);
  if (Family::Series* s = f.Find(labels)) {
    if (!s->gauge) {
      throw std::invalid_argument("gauge " + name + ": these labels are a callback gauge");
    }
    return s->gauge.get();
  }
  f.series.push_back({labels, nullptr, std::make_unique<Gauge>(), nullptr, nullptr});
  return f.series.back().gauge.get();
}

Histogram* MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                         std::vector<double> bounds, const Labels& labels) {
  CheckBounds(name, bounds);
  std::lock_guard lock(mu_);
  bool is_new = true;
  for (const auto& fam : families_) is_new = is_new && fam->name != name;
  Family& f = FamilyFor(name, help, kHistogram, labels);
  if (is_new) {
    f.bounds = bounds;
  } else if (f.bounds != bounds) {
    throw std::invalid_argument("histogram " + name + " registered with two sets of bounds");
  }
  if (Family::Series* s = f.Find(labels)) return s->histogram.get();
  f.series.push_back(
      {labels, nullptr, nullptr, std::make_unique<Histogram>(std::move(bounds)), nullptr});
  return f.series.back().histogram.get();
}

void MetricsRegistry::AddCallbackGauge(const std::string& name, const std::string& help,
                                       std::function<double()> read, const Labels& labels) {
  AddCallback(name, help, kGauge, std::move(read), labels);
}

void MetricsRegistry::AddCallbackCounter(const std::string& name, const std::string& help,
                                         std::function<double()> read, const Labels& labels) {
  AddCallback(name, help, kCounter, std::move(read), labels);
}

void MetricsRegistry::AddCallback(const std::string& name, const std::string& help, int type,
                                  std::function<double()> read, const Labels& labels) {
  if (!read) throw std::invalid_argument("callback metric " + name + ": empty function");
  std::lock_guard lock(mu_);
  Family& f = FamilyFor(name, help, type, labels);
  if (f.Find(labels) != nullptr) {
    throw std::invalid_argument("metric " + name + ": these labels are already registered");
  }
  f.series.push_back({labels, nullptr, nullptr, nullptr, std::move(read)});
}

std::string FormatMetricValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  constexpr double kTwo53 = 9007199254740992.0;
  if (std::fabs(v) < kTwo53 && v == std::trunc(v)) {
    return std::to_string(static_cast<int64_t>(v));
  }
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  if (ec != std::errc()) {
    std::snprintf(buf, sizeof(buf), "%.17g", v);
    return buf;
  }
  return std::string(buf, end);
}

std::string MetricsRegistry::Render() const {
  std::lock_guard lock(mu_);
  std::string out;
  for (const auto& f : families_) {
    out += "# HELP ";
    out += f->name;
    out += ' ';
    AppendEscaped(out, f->help, false);
    out += "\n# TYPE ";
    out += f->name;
    out += ' ';
    out += TypeName(f->type);
    out += '\n';
    for (const Family::Series& s : f->series) {
      if (f->type != kHistogram) {
        double v = 0;
        if (s.counter) {
          out += f->name;
          AppendLabels(out, s.labels, nullptr);
          out += ' ';
          out += std::to_string(s.counter->value());
          out += '\n';
          continue;
        }
        if (s.gauge) {
          v = s.gauge->value();
        } else {
          try {
            v = s.read();
          } catch (...) {
            v = std::nan("");
          }
        }
        out += f->name;
        AppendLabels(out, s.labels, nullptr);
        out += ' ';
        out += FormatMetricValue(v);
        out += '\n';
        continue;
      }
      const Histogram& h = *s.histogram;
      uint64_t cumulative = 0;
      for (size_t i = 0; i <= h.bounds().size(); ++i) {
        cumulative += h.bucket_count(i);
        std::string le = i < h.bounds().size() ? FormatMetricValue(h.bounds()[i]) : "+Inf";
        out += f->name;
        out += "_bucket";
        AppendLabels(out, s.labels, &le);
        out += ' ';
        out += std::to_string(cumulative);
        out += '\n';
      }
      out += f->name;
      out += "_sum";
      AppendLabels(out, s.labels, nullptr);
      out += ' ';
      out += FormatMetricValue(h.sum());
      out += '\n';
      out += f->name;
      out += "_count";
      AppendLabels(out, s.labels, nullptr);
      out += ' ';
      out += std::to_string(cumulative);  // equals the +Inf bucket even during updates
      out += '\n';
    }
  }
  return out;
}

std::vector<double> LatencyBuckets() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,     0.25,   0.5,     1,      2.5,   5,      10,    30,   60};
}

double ProcessResidentBytes() {
  const Result<size_t> r = ResidentBytes();
  return r.ok() ? static_cast<double>(*r) : 0;  // a gauge has no error: 0 (see metrics.h)
}

}  // namespace moerun
