#include "launch/moebench/serve_floor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "base/clock.h"
#include "launch/moebench/client_common.h"

namespace moerun::bench {
namespace {

using json = nlohmann::json;
using Clock = SteadyClock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// One request: the frame header, its id, the body and `extra` fields, in one gather write; then
// its answer, which must carry the id.
Status Call(ServeConnection* c, uint64_t id, const std::string& body, const std::string& extra,
            v1::InferResponse* resp, Deadline deadline) {
  MOERUN_RETURN_IF_ERROR(SendRequestFrame(c, id, body, extra, deadline));
  MOERUN_RETURN_IF_ERROR(c->Receive(resp, deadline));
  if (resp->id() != id) {
    return Status::Corrupt("answer for id " + std::to_string(resp->id()) + ", expected " +
                           std::to_string(id));
  }
  return StatusFromResponse(resp->code(), resp->message());
}

double P50(std::vector<double> v) { return Percentile((std::sort(v.begin(), v.end()), v), 0.5); }

}  // namespace

std::string ProbeFields(int probe, bool timing) {
  std::string s;
  if (timing) s += std::string("\x40\x01", 2);  // field 8 (timing), varint 1
  if (probe != 0) {
    s += '\x48';  // field 9 (probe), varint
    s += static_cast<char>(probe);
  }
  return s;
}

Result<json> MeasureFloor(const FloorInputs& in) {
  if (in.connection == nullptr || in.layer == nullptr || in.bodies.empty() ||
      in.inputs.size() != in.bodies.size()) {
    return Status::InvalidArgument("floor: a connection, the layer and the inputs are needed");
  }
  const std::string real = ProbeFields(v1::PROBE_NONE, true);
  const std::string client = ProbeFields(v1::PROBE_CLIENT, false);
  const std::string transport = ProbeFields(v1::PROBE_TRANSPORT, true);
  const int64_t hidden = in.layer->weights().spec.hidden;
  std::vector<float> out(static_cast<size_t>(in.tokens * hidden));
  std::vector<double> round_trip, client_ms, transport_ms, layer_ms, single_ms;
  std::map<int, std::vector<double>> by_rank;
  std::map<std::string, std::vector<double>> parts;
  v1::InferResponse resp;
  uint64_t id = uint64_t{1} << 50;
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(in.duration_s));
  for (size_t round = 0; round < 20 || Clock::now() < until; ++round) {
    const size_t p = round % in.bodies.size();
    const std::string& body = in.bodies[p];
    // 1. The request.
    auto t0 = Clock::now();
    MOERUN_RETURN_IF_ERROR(
        Call(in.connection, ++id, body, real, &resp, DeadlineIn(in.wait)).WithContext("floor"));
    round_trip.push_back(MsSince(t0));
    if (!in.expected.empty() && resp.data() != in.expected[p]) {
      return Status::Corrupt("floor: an answer differs from the local layer");
    }
    const v1::Timing& t = resp.timing();
    const std::pair<const char*, uint64_t> part_us[] = {
        {"queue", t.queue_us()}, {"gate", t.gate_us()},       {"dispatch", t.dispatch_us()},
        {"wait", t.wait_us()},   {"combine", t.combine_us()}, {"shared", t.shared_us()},
        {"reply", t.reply_us()}, {"server", t.server_us()}};
    for (const auto& [name, us] : part_us) parts[name].push_back(static_cast<double>(us) * 1e-3);
    for (const v1::RankTiming& r : t.ranks()) {
      parts["rank" + std::to_string(r.rank()) + "_round_trip"].push_back(
          static_cast<double>(r.round_trip_us()) * 1e-3);
      parts["rank" + std::to_string(r.rank()) + "_compute"].push_back(
          static_cast<double>(r.compute_us()) * 1e-3);
    }
    // 2. The client connection's own round trip: the same bytes both ways.
    t0 = Clock::now();
    MOERUN_RETURN_IF_ERROR(Call(in.connection, ++id, body, client, &resp, DeadlineIn(in.wait))
                               .WithContext("floor: client probe"));
    client_ms.push_back(MsSince(t0));
    // 3. The transport's: the router's round trip with each expert rank.
    const v1::InferResponse echo_of = resp;
    MOERUN_RETURN_IF_ERROR(Call(in.connection, ++id, body, transport, &resp, DeadlineIn(in.wait))
                               .WithContext("floor: transport probe"));
    if (resp.data() != echo_of.data() || resp.timing().ranks_size() == 0) {
      return Status::Corrupt(
          "floor: a probe's answer is not its request's data, or names no expert rank");
    }
    for (const v1::RankTiming& r : resp.timing().ranks()) {
      const double ms = static_cast<double>(r.round_trip_us()) * 1e-3;
      transport_ms.push_back(ms);
      by_rank[r.rank()].push_back(ms);
    }
    // 4. The layer in process, for the same tokens.
    t0 = Clock::now();
    MOERUN_RETURN_IF_ERROR(in.layer->Forward(in.inputs[p].data(), in.tokens, out.data()));
    layer_ms.push_back(MsSince(t0));
    if (in.layer_single != nullptr) {
      t0 = Clock::now();
      MOERUN_RETURN_IF_ERROR(in.layer_single->Forward(in.inputs[p].data(), in.tokens, out.data()));
      single_ms.push_back(MsSince(t0));
    }
  }
  json r;
  r["rounds"] = round_trip.size();
  const double rt50 = P50(round_trip);
  const double layer50 =
      single_ms.empty() ? P50(layer_ms) : std::min(P50(layer_ms), P50(single_ms));
  const double floor = P50(client_ms) + P50(transport_ms) + layer50;
  json by = json::object();
  for (auto& [rank, v] : by_rank) by[std::to_string(rank)] = P50(v);
  json part50 = json::object();
  for (auto& [name, v] : parts) part50[name] = P50(v);
  r["transport_by_rank_p50_ms"] = by;
  r["parts_p50_ms"] = part50;
  r["round_trip_ms"] = LatencyJson(&round_trip);
  r["client_pingpong_ms"] = LatencyJson(&client_ms);
  r["transport_pingpong_ms"] = LatencyJson(&transport_ms);
  r["layer_ms"] = LatencyJson(&layer_ms);
  r["layer_threads"] = in.layer_threads;
  if (!single_ms.empty()) r["layer_single_thread_ms"] = LatencyJson(&single_ms);
  r["layer_p50_used_ms"] = layer50;
  r["floor_ms"] = floor;
  r["x_floor"] = floor > 0 ? rt50 / floor : 0.0;
  r["p99_over_p50"] = rt50 > 0 ? r["round_trip_ms"]["p99"].get<double>() / rt50 : 0.0;
  return r;
}

}  // namespace moerun::bench
