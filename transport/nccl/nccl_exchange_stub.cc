// NcclExchange for builds without NCCL: Create says so; nothing else can be reached.
#include "transport/nccl/nccl_exchange.h"

#include <utility>

namespace moerun {

struct NcclExchange::Impl {};

NcclExchange::NcclExchange(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclExchange::~NcclExchange() = default;

Result<std::unique_ptr<NcclExchange>> NcclExchange::Create(Transport& /*bootstrap*/, int /*device*/,
                                                           Deadline /*deadline*/) {
  return Status::Unsupported(
      "this build of moerun has no NCCL support (configure with the CUDA toolkit and NCCL, "
      "MOERUN_WITH_CUDA=ON and MOERUN_WITH_NCCL=ON)");
}

bool NcclExchange::built() { return false; }
std::string NcclExchange::LibraryVersion() { return ""; }

int NcclExchange::rank() const { return 0; }
int NcclExchange::size() const { return 0; }
int NcclExchange::device() const { return -1; }
bool NcclExchange::usable() const { return false; }

Status NcclExchange::Exchange(const void* /*send_dev*/, std::span<const int64_t> /*send*/,
                              void* /*recv_dev*/, std::span<const int64_t> /*recv*/,
                              Deadline /*deadline*/) {
  return Status::Unsupported("this build of moerun has no NCCL support");
}

}  // namespace moerun
