#include "launch/moebench/decode_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

#include "base/log.h"
#include "launch/moebench/client_common.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;

// The p50 of each part the answers carried (µs); null when none carried a Timing.
json PartsJson(DecodeStats* s) {
  if (s->with_timing == 0) return nullptr;
  json p50 = json::object();
  for (auto& [name, v] : s->parts_us) {
    std::sort(v.begin(), v.end());
    p50[name] = Percentile(v, 0.5);
  }
  json ranks = json::object();
  const std::pair<const char*, std::map<int, std::vector<double>>*> by[] = {
      {"round_trip", &s->rank_round_trip_us}, {"compute", &s->rank_compute_us}};
  for (const auto& [what, by_rank] : by) {
    for (auto& [rank, v] : *by_rank) {
      std::sort(v.begin(), v.end());
      ranks[std::to_string(rank)][what] = Percentile(v, 0.5);
    }
  }
  std::sort(s->batch_tokens.begin(), s->batch_tokens.end());
  return {{"answers", s->with_timing},
          {"p50_us", p50},
          {"ranks_p50_us", ranks},
          {"batch_tokens_p50",
           s->batch_tokens.empty() ? json(nullptr) : json(Percentile(s->batch_tokens, 0.5))}};
}

}  // namespace

json DecodeReport(const DecodeBenchFlags& f, const DecodeWorkload& w,
                  const std::vector<MicroBatch>& microbatches, DecodeResult* r) {
  DecodeStats& s = r->stats;
  json sizes = json::array();
  for (const MicroBatch& m : microbatches) sizes.push_back(m.count);
  const json lone = LatencyJson(&r->lone_ms);
  // A lone sequence's step with no attention: every layer's lone round trip, one after another.
  const double lone_step_ms = lone["p50"].get<double>() * static_cast<double>(w.layers.size());
  const auto per_s = [&](int64_t n) {
    return r->wall_s > 0 ? static_cast<double>(n) / r->wall_s : 0.0;
  };
  // The run as asked for.
  json report = {
      {"bench", "decode"},
      {"target", f.client.target},
      {"model", !f.layer.model.empty()    ? json(f.layer.model)
                : !f.layer.preset.empty() ? json("preset " + f.layer.preset)
                                          : json(nullptr)},
      {"sequences", w.sequences},
      {"pingpong", f.pingpong},
      {"microbatches", sizes},
      {"layers", w.layers},
      {"layer_count", w.layers.size()},
      {"hidden", w.hidden},
      {"dtype", f.dtype},
      {"attention_us", f.attention_us},
      {"deadline_ms", f.deadline_ms},
      {"inputs", f.inputs},
      {"seed_inputs", f.seed_inputs},
      {"steps_requested", f.steps > 0 ? json(f.steps) : json(nullptr)},
      {"duration_s", f.steps > 0 ? json(nullptr) : json(f.duration_s > 0 ? f.duration_s : 10)},
      {"warmup_steps", f.warmup_steps},
      {"verify", f.verify},
      {"parts_requested", f.parts},
  };
  // What it measured: throughput beside the latency one lone request sees.
  report.update({
      {"steps", r->steps},
      {"failed_steps", r->failed_steps},
      {"wall_s", r->wall_s},
      {"tokens", r->tokens},
      {"tokens_per_s", per_s(r->tokens)},
      {"steps_per_s", per_s(r->steps)},
      {"tpot_ms", LatencyJson(&r->step_ms)},  // time per output token: one step
      {"layer_round_trip_ms", LatencyJson(&s.round_trip_ms)},
      {"attention_sleep_ms", LatencyJson(&s.attention_ms)},
      {"lone",
       {{"round_trip_ms", lone},
        {"step_ms", lone_step_ms},
        {"tokens_per_s", lone_step_ms > 0 ? 1000.0 / lone_step_ms : 0.0}}},
      {"parts", PartsJson(&s)},
      {"failovers", r->failovers},
      {"retried", r->retried},
      {"stopped", r->stopped.empty() ? json(nullptr) : json(r->stopped)},
      {"measure_start_unix_s", r->measure_start_unix_s},
  });
  report.update(AnswerCountsJson(s.counts));
  report["warmup"]["steps"] = r->warmup_steps;
  return report;
}

void PrintDecodeSummary(const DecodeBenchFlags& f, const json& report, const DecodeResult& r) {
  std::string sizes;
  for (const json& c : report["microbatches"]) {
    sizes += fmt::format("{}{}", sizes.empty() ? "" : "+", c.get<int64_t>());
  }
  const json& tpot = report["tpot_ms"];
  const json& rt = report["layer_round_trip_ms"];
  const json& lone = report["lone"];
  std::fprintf(
      stderr,
      "decode %s: S=%lld in %d micro-batch%s (%s), %zu layers, hidden %lld, %s, attention %.0f "
      "us/layer: %lld steps, %lld tokens | %.1f tokens/s, time per token p50 %.3f ms p99 %.3f "
      "ms | layer round trip p50 %.3f ms p99 %.3f ms | a lone request p50 %.3f ms (a lone "
      "sequence's step %.3f ms, %.1f tokens/s)%s\n",
      f.client.target.c_str(), static_cast<long long>(report["sequences"].get<int64_t>()),
      f.pingpong, f.pingpong == 1 ? "" : "es", sizes.c_str(), report["layers"].size(),
      static_cast<long long>(report["hidden"].get<int64_t>()), f.dtype.c_str(), f.attention_us,
      static_cast<long long>(r.steps), static_cast<long long>(r.tokens),
      report["tokens_per_s"].get<double>(), tpot["p50"].get<double>(), tpot["p99"].get<double>(),
      rt["p50"].get<double>(), rt["p99"].get<double>(), lone["round_trip_ms"]["p50"].get<double>(),
      lone["step_ms"].get<double>(), lone["tokens_per_s"].get<double>(),
      f.verify
          ? fmt::format(" | verified {}/{} bitwise", r.stats.counts.verified, r.stats.counts.ok)
                .c_str()
          : "");
  if (f.attention_us > 0) {
    const json& a = report["attention_sleep_ms"];
    std::fprintf(stderr, "decode: attention by sleeping, as slept: p50 %.3f ms, max %.3f ms\n",
                 a["p50"].get<double>(), a["max"].get<double>());
  }
  const json& parts = report["parts"];
  if (f.parts && parts.is_null()) {
    std::fprintf(stderr, "decode: --parts: no answer carried the server's timing\n");
  } else if (!parts.is_null()) {
    std::string line;
    for (const auto& [name, v] : parts["p50_us"].items()) {
      line += fmt::format("{}{} {:.0f}", line.empty() ? "" : ", ", name, v.get<double>());
    }
    for (const auto& [rank, v] : parts["ranks_p50_us"].items()) {
      line += fmt::format("; rank {}:", rank);
      for (const auto& [what, us] : v.items())
        line += fmt::format(" {} {:.0f}", what, us.get<double>());
    }
    if (parts["batch_tokens_p50"].is_number()) {
      line += fmt::format("; the batch that computed it: {:.0f} tokens",
                          parts["batch_tokens_p50"].get<double>());
    }
    std::fprintf(stderr, "decode: parts, p50 us per layer round trip (%lld answers): %s\n",
                 static_cast<long long>(parts["answers"].get<int64_t>()), line.c_str());
  }
}

int DecodeExitCode(const DecodeBenchFlags& f, const DecodeResult& r) {
  bool failed = !r.stopped.empty();
  if (failed) std::fprintf(stderr, "decode: stopped: %s\n", r.stopped.c_str());
  if (r.steps + r.failed_steps == 0 && !failed) {
    std::fprintf(stderr, "decode: no step was measured\n");
    failed = true;
  }
  return ExitCodeOfAnswers("decode", r.stats.counts, f.verify, failed);
}

}  // namespace moerun::bench
