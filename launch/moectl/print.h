// How moectl shows the router's answers: JSON (--json), or tables and lines on stdout.
#pragma once

#include <google/protobuf/message.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "moerun/v1/control.pb.h"
#include "router/placement.h"

namespace moerun::moectl {

// The message as indented JSON with proto field names, zeros and empty fields included.
std::string Json(const google::protobuf::Message& m);

// "12.3": bytes in MiB, one decimal; MibOf counts a negative byte count as 0.
std::string Mib(uint64_t bytes);
std::string MibOf(int64_t bytes);

// status: the job, its running or last migration, the load of each layer, and a table of ranks.
void PrintStatus(const v1::StatusResponse& s);

// stats: a table of assignments per (layer, expert).
void PrintStats(const v1::StatsResponse& s);

// placement plan: the predicted balancedness and the copies of each layer.
void PrintPlan(const v1::PlanResponse& p);

// placement import: what the file holds, once Placement::FromJson accepted it.
void PrintPlacementSummary(std::FILE* out, const std::string& path, const Placement& p,
                           const std::string& text);

// A migration, layer by layer, with its plan and a summary line.
void PrintMigration(const v1::MigrationStatus& m);

// --wait's line for a migration:
// "[  2.5 s] migration 3 running: 1/4 layers switched, 60.0 / 120.0 MiB loaded; layer 1 loading"
std::string MigrationProgressLine(const v1::MigrationStatus& m, double waited_s);

// expert ...: a table of the expert updates (or "no expert updates").
void PrintExperts(const v1::ExpertResponse& r);

}  // namespace moerun::moectl
