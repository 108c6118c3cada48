#include "launch/moebench/decode_run.h"

#include <algorithm>
#include <cstring>
#include <string_view>
#include <thread>

#include "base/clock.h"
#include "base/log.h"
#include "launch/moebench/client_common.h"
#include "runtime/serving/serve_client.h"

namespace moerun::bench {
namespace {

using Clock = SteadyClock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

template <typename K>
void Append(std::map<K, std::vector<double>>* to, const std::map<K, std::vector<double>>& from) {
  for (const auto& [k, v] : from) (*to)[k].insert((*to)[k].end(), v.begin(), v.end());
}

// The request of `tokens` rows of x for `layer`, the id, deadline and timing flag set.
void FillRequest(const DecodeWorkload& w, const DecodeRunOptions& o, uint64_t id, int layer,
                 const float* x, int64_t tokens, v1::InferRequest* r) {
  r->set_id(id);
  r->set_layer(layer);
  r->set_deadline_ms(o.deadline_ms);
  r->set_timing(o.parts);
  SetRequestData(r, x, tokens, w.hidden, w.bf16 ? v1::BF16 : v1::F32);
}

// "" when the answer has the request's shape and type; else why not.
std::string ShapeError(const DecodeWorkload& w, const v1::InferResponse& r, int64_t tokens) {
  const size_t bytes = static_cast<size_t>(tokens * w.hidden) * w.elem_bytes();
  const v1::DType dtype = w.bf16 ? v1::BF16 : v1::F32;
  if (r.dtype() == dtype && r.shape_size() == 2 && r.shape(0) == tokens && r.shape(1) == w.hidden &&
      r.data().size() == bytes) {
    return "";
  }
  return "answer " + std::to_string(r.id()) + " has dtype " + std::to_string(r.dtype()) + ", " +
         std::to_string(r.shape_size()) + " dims and " + std::to_string(r.data().size()) +
         " bytes; expected [" + std::to_string(tokens) + ", " + std::to_string(w.hidden) + "] of " +
         (w.bf16 ? "BF16" : "F32");
}

}  // namespace

void DecodeStats::Merge(const DecodeStats& o) {
  counts.Merge(o.counts);
  round_trip_ms.insert(round_trip_ms.end(), o.round_trip_ms.begin(), o.round_trip_ms.end());
  attention_ms.insert(attention_ms.end(), o.attention_ms.begin(), o.attention_ms.end());
  with_timing += o.with_timing;
  Append(&parts_us, o.parts_us);
  batch_tokens.insert(batch_tokens.end(), o.batch_tokens.begin(), o.batch_tokens.end());
  Append(&rank_round_trip_us, o.rank_round_trip_us);
  Append(&rank_compute_us, o.rank_compute_us);
}

MicroBatchRunner::MicroBatchRunner(const DecodeWorkload& w, const DecodeRunOptions& o, int index,
                                   MicroBatch mb, std::unique_ptr<FailoverClient> client)
    : w_(w),
      o_(o),
      index_(index),
      mb_(mb),
      client_(std::move(client)),
      x_(static_cast<size_t>(mb.count * w.hidden)),
      y_(static_cast<size_t>(mb.count * w.hidden)) {}

void MicroBatchRunner::RecordParts(const v1::InferResponse& r, double round_trip_ms) {
  if (!r.has_timing()) return;
  const v1::Timing& t = r.timing();
  ++stats_.with_timing;
  const std::pair<const char*, uint64_t> parts[] = {
      {"queue", t.queue_us()}, {"gate", t.gate_us()},       {"dispatch", t.dispatch_us()},
      {"wait", t.wait_us()},   {"combine", t.combine_us()}, {"shared", t.shared_us()},
      {"reply", t.reply_us()}, {"server", t.server_us()},
  };
  for (const auto& [name, us] : parts) {
    if (us > 0) stats_.parts_us[name].push_back(static_cast<double>(us));
  }
  if (t.server_us() > 0) {  // the rest of the round trip: the network and the client
    const double client_us = round_trip_ms * 1000.0 - static_cast<double>(t.server_us());
    stats_.parts_us["network_and_client"].push_back(std::max(0.0, client_us));
  }
  if (t.batch_tokens() > 0) stats_.batch_tokens.push_back(static_cast<double>(t.batch_tokens()));
  for (const v1::RankTiming& rt : t.ranks()) {
    if (rt.round_trip_us() > 0) {
      stats_.rank_round_trip_us[rt.rank()].push_back(static_cast<double>(rt.round_trip_us()));
    }
    if (rt.compute_us() > 0) {
      stats_.rank_compute_us[rt.rank()].push_back(static_cast<double>(rt.compute_us()));
    }
  }
}

bool MicroBatchRunner::RunStep(int64_t step, int p, bool measured) {
  const int64_t tokens = mb_.count;
  const int64_t n = tokens * w_.hidden;
  const size_t offset = static_cast<size_t>(mb_.first * w_.hidden);
  std::memcpy(x_.data(), w_.starts[static_cast<size_t>(p)].data() + offset,
              static_cast<size_t>(n) * sizeof(float));
  const auto attention = AttentionTime(o_.attention_us, tokens, w_.sequences);
  for (size_t i = 0; i < w_.layers.size(); ++i) {
    const int layer = w_.layers[i];
    const auto where = [&] {
      return fmt::format("step {}, layer {}, micro-batch {} (sequences {}..{})", step, layer,
                         index_, mb_.first, mb_.first + tokens - 1);
    };
    if (attention.count() > 0) {  // asleep: the job keeps the cores
      const auto a0 = Clock::now();
      std::this_thread::sleep_for(attention);
      if (measured) stats_.attention_ms.push_back(Ms(Clock::now() - a0));
    }
    const uint64_t id = (static_cast<uint64_t>(index_ + 1) << 40) | seq_++;
    FillRequest(w_, o_, id, layer, x_.data(), tokens, &request_);
    const auto t0 = Clock::now();
    const Status s = client_->Call(request_, &response_, t0 + o_.wait);
    const double round_trip_ms = Ms(Clock::now() - t0);
    if (!s.ok()) {
      // The connection is gone (and no other router took over) or no answer came in time: the
      // run stops rather than wait on a job that is not there.
      const std::string kind = s.code() == StatusCode::kDeadlineExceeded ? "client_timeout" : "io";
      fatal_ = where() + ": " + s.ToString();
      stats_.counts.Failed(measured, kind, fatal_);
      client_->Drop();  // a late answer must not be taken for the next request's
      return false;
    }
    if (response_.code() != v1::OK) {
      stats_.counts.Failed(measured, ErrorCodeKind(response_.code()),
                           where() + ": " + response_.message());
      return false;
    }
    if (std::string why = ShapeError(w_, response_, tokens); !why.empty()) {
      stats_.counts.Failed(measured, "mismatch", where() + ": " + why);
      return false;
    }
    bool verified = false;
    if (o_.verify) {
      const std::string& all = w_.expected[static_cast<size_t>(p)][i];
      const std::string_view want(all.data() + offset * w_.elem_bytes(),
                                  static_cast<size_t>(n) * w_.elem_bytes());
      if (response_.data() != want) {
        stats_.counts.Failed(
            measured, "mismatch",
            where() + ": the answer differs from the local layer at " +
                FirstDifference(response_.data(), std::string(want), w_.elem_bytes(), w_.hidden));
        DecodeWire(std::string(want), w_.bf16, y_.data());  // the chain goes on as expected
      } else {
        verified = true;
      }
    }
    if (!o_.verify || verified) {
      DecodeWire(response_.data(), w_.bf16, y_.data());
      stats_.counts.Answered(measured, verified);
      if (measured) {
        stats_.round_trip_ms.push_back(round_trip_ms);
        RecordParts(response_, round_trip_ms);
      }
    }
    NextHidden(x_.data(), y_.data(), tokens, w_.hidden, x_.data());
    RoundToWire(x_.data(), n, w_.bf16);
  }
  return true;
}

Result<std::vector<double>> LoneRoundTrips(const DecodeWorkload& w, const DecodeRunOptions& o,
                                           FailoverClient* client, int passes) {
  std::vector<double> ms;
  v1::InferRequest request;
  v1::InferResponse response;
  DecodeRunOptions lone = o;
  lone.parts = false;
  uint64_t id = uint64_t{0xffff} << 40;
  for (int pass = 0; pass < passes; ++pass) {
    for (int layer : w.layers) {
      FillRequest(w, lone, ++id, layer, w.starts[0].data(), 1, &request);
      const auto t0 = Clock::now();
      Status s = client->Call(request, &response, t0 + o.wait);
      const double elapsed = Ms(Clock::now() - t0);
      if (s.ok()) s = StatusFromResponse(response.code(), response.message());
      if (!s.ok()) return s.WithContext("a lone request to layer " + std::to_string(layer));
      ms.push_back(elapsed);
    }
  }
  return ms;
}

}  // namespace moerun::bench
