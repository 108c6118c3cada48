// The transport registry (transport/registry.h): a backend is present exactly when this build
// has it, and one that is absent is named, with what was built and how to build it.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "moerun/build_info.h"
#include "transport/inproc.h"
#include "transport/registry.h"

namespace moerun {
namespace {

bool BackendBuilt(const char* name) {
  if (std::string(name) == "mpi") return MOERUN_HAVE_MPI;
  if (std::string(name) == "ucx") return MOERUN_HAVE_UCX;
  return MOERUN_HAVE_NCCL;
}

std::string UpperName(std::string s) {
  for (char& c : s) c = static_cast<char>(c - 'a' + 'A');
  return s;
}

TEST(TransportRegistryTest, HoldsExactlyTheBuiltBackends) {
  const std::vector<std::string> built = BuiltTransports();
  ASSERT_FALSE(built.empty());
  EXPECT_EQ(built.front(), "inproc");
  for (const char* name : {"mpi", "ucx", "nccl"}) {
    SCOPED_TRACE(name);
    const TransportBackend* b = FindTransport(name);
    EXPECT_EQ(b != nullptr, BackendBuilt(name));
    EXPECT_EQ(std::count(built.begin(), built.end(), name), BackendBuilt(name) ? 1 : 0);
    if (b == nullptr) continue;
    EXPECT_EQ(b->name, name);
    EXPECT_FALSE(b->offers.empty());
    EXPECT_TRUE(static_cast<bool>(b->create));
    EXPECT_EQ(static_cast<bool>(b->create_joiner), std::string(name) == "ucx");
    EXPECT_TRUE(RequireTransport(name).ok());
  }
}

TEST(TransportRegistryTest, AnAbsentBackendIsNamedWithWhatWasBuilt) {
  for (const char* name : {"mpi", "ucx", "nccl", "tcp"}) {
    if (FindTransport(name) != nullptr) continue;
    SCOPED_TRACE(name);
    const Result<const TransportBackend*> r = RequireTransport(name);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string m = r.status().message();
    EXPECT_NE(m.find("no '" + std::string(name) + "' transport"), std::string::npos) << m;
    EXPECT_NE(m.find("(built: inproc"), std::string::npos) << m;
    if (std::string(name) != "tcp") {  // a backend of ours: the flag that builds it
      const std::string flag = "MOERUN_WITH_" + UpperName(name) + "=ON";
      EXPECT_NE(m.find(flag), std::string::npos) << m;
    }
    // CreateTransport gives the same error, and never a transport.
    const auto t = CreateTransport(name);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().message(), m);
  }
}

TEST(TransportRegistryTest, LayeredBackendsNeedABootstrap) {
  for (const char* name : {"ucx", "nccl"}) {
    const TransportBackend* b = FindTransport(name);
    if (b == nullptr) continue;
    SCOPED_TRACE(name);
    EXPECT_TRUE(b->needs_bootstrap);
    const auto t = CreateTransport(name);  // no bootstrap: refused before the backend runs
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("bootstrap"), std::string::npos);
  }
}

TEST(TransportRegistryTest, NcclOverAnInprocBootstrapWithoutAGpuFailsCleanly) {
  const TransportBackend* b = FindTransport("nccl");
  if (b == nullptr) GTEST_SKIP() << RequireTransport("nccl").status().message();
  // A bad option is refused before any GPU is touched: the request reaches the backend intact.
  auto fabric = InprocFabric::Create(1);
  TransportRequest r;
  r.bootstrap = fabric->Endpoint(0);
  r.device = 0;
  r.bulk_tags = {kReservedTagBase};  // reserved: not allowed over NCCL
  const auto t = CreateTransport("nccl", std::move(r));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().ToString();
}

}  // namespace
}  // namespace moerun
