// Registers the ucx transport (registry.h); compiled only in builds with UCX. Its options come
// from the environment (MOERUN_UCX_PUT_MIN, MOERUN_UCX_PROTOCOL: ucx_transport.h).
#include <utility>

#include "transport/registry.h"
#include "transport/ucx/ucx_transport.h"

namespace moerun {
namespace {

// A UcxJoiner seen as the registry's TransportJoiner.
class UcxJoinerAdapter final : public TransportJoiner {
 public:
  explicit UcxJoinerAdapter(std::unique_ptr<UcxJoiner> joiner) : joiner_(std::move(joiner)) {}
  const std::vector<uint8_t>& address() const override { return joiner_->address(); }
  Result<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::vector<uint8_t>>& addresses) override {
    return joiner_->Connect(rank, addresses);
  }

 private:
  std::unique_ptr<UcxJoiner> joiner_;
};

}  // namespace

void RegisterUcxTransport(TransportRegistry& registry) {
  auto create = [](TransportRequest r) -> Result<std::unique_ptr<Transport>> {
    MOERUN_ASSIGN_OR_RETURN(const UcxOptions opts, UcxOptionsFromEnvironment());
    return CreateUcxTransport(std::move(r.bootstrap), opts);
  };
  auto create_joiner = []() -> Result<std::unique_ptr<TransportJoiner>> {
    MOERUN_ASSIGN_OR_RETURN(const UcxOptions opts, UcxOptionsFromEnvironment());
    MOERUN_ASSIGN_OR_RETURN(std::unique_ptr<UcxJoiner> joiner, CreateUcxJoiner(opts));
    return std::unique_ptr<TransportJoiner>(new UcxJoinerAdapter(std::move(joiner)));
  };
  registry.Add({.name = "ucx",
                .offers = "host memory over UCX (verbs, shared memory, TCP), large messages by "
                          "zero-copy put",
                .needs_bootstrap = true,
                .needs_mpi_launcher = true,
                .create = std::move(create),
                .create_joiner = std::move(create_joiner)});
}

}  // namespace moerun
