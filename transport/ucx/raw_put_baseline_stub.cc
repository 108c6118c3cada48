// RawPutBaseline for builds without UCX.
#include "transport/ucx/raw_put_baseline.h"

namespace moerun {

struct RawPutBaseline::Impl {};

RawPutBaseline::RawPutBaseline(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RawPutBaseline::~RawPutBaseline() = default;

Result<std::unique_ptr<RawPutBaseline>> RawPutBaseline::Create(Transport*,
                                                               const std::vector<int64_t>&,
                                                               const std::vector<int64_t>&) {
  return Status::Unsupported("this build has no UCX: no raw ucp_put_nbx baseline");
}

Result<double> RawPutBaseline::RoundTripMs() {
  return Status::Unsupported("this build has no UCX: no raw ucp_put_nbx baseline");
}

}  // namespace moerun
