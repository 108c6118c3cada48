// A process that joins a running job (moerun serve --join; ucx_transport.h): a ucx transport
// whose worker is open before the job's addresses are known.
#include <memory>
#include <utility>
#include <vector>

#include "transport/ucx/ucx_transport.h"
#include "transport/ucx/ucx_transport_impl.h"

namespace moerun {
namespace {

// A UcxTransport whose worker is open, waiting for the job's addresses.
class UcxJoinerImpl : public UcxJoiner {
 public:
  explicit UcxJoinerImpl(std::unique_ptr<ucx::UcxTransport> t)
      : t_(std::move(t)), address_(t_->own_address()) {}
  const std::vector<uint8_t>& address() const override { return address_; }
  Result<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::vector<uint8_t>>& addresses) override {
    if (t_ == nullptr) return Status::InvalidArgument("ucx: this joiner has connected already");
    std::unique_ptr<ucx::UcxTransport> t = std::move(t_);
    MOERUN_RETURN_IF_ERROR(t->Connect(rank, addresses));
    return std::unique_ptr<Transport>(std::move(t));
  }

 private:
  std::unique_ptr<ucx::UcxTransport> t_;
  std::vector<uint8_t> address_;
};

}  // namespace

Result<std::unique_ptr<UcxJoiner>> CreateUcxJoiner(UcxOptions options) {
  auto t = std::make_unique<ucx::UcxTransport>(nullptr, options);
  MOERUN_RETURN_IF_ERROR(t->OpenWorker());
  return std::unique_ptr<UcxJoiner>(std::make_unique<UcxJoinerImpl>(std::move(t)));
}

}  // namespace moerun
