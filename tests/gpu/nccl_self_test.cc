// The NCCL exchange on one GPU: a communicator of one rank (bootstrapped over an inproc transport
// of one rank) exchanging with itself. Two ranks cannot share one process's GPU (NCCL refuses
// "Duplicate GPU detected"), and the GPU machine has one GPU: multi-rank NCCL needs a machine
// with two GPUs and mpirun. With no GPU every test that needs one skips, saying why (the CUDA
// probe's error); the rest check that the exchange fails cleanly without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "runtime/layer/cuda/cuda_device.h"
#include "transport/inproc.h"
#include "transport/nccl/nccl_exchange.h"

namespace moerun {
namespace {

constexpr auto kDeadline = std::chrono::seconds(120);

// A device buffer freed at scope end.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
  }
  ~DeviceBuffer() {
    if (p != nullptr) (void)cudaFree(p);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

class NcclSelfTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const CudaProbe probe = ProbeCuda();
    if (probe.devices.empty()) {
      GTEST_SKIP() << "no GPU here (" << probe.error << "): the NCCL exchange needs one";
    }
    fabric_ = InprocFabric::Create(1);
    boot_ = fabric_->Endpoint(0);
    auto x = NcclExchange::Create(*boot_, 0, DeadlineIn(kDeadline));
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    nccl_ = std::move(x).value();
  }

  std::shared_ptr<InprocFabric> fabric_;
  std::unique_ptr<Transport> boot_;
  std::unique_ptr<NcclExchange> nccl_;
};

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  uint32_t x = seed;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

TEST_F(NcclSelfTest, OneMiBToSelfIsExact) {
  constexpr size_t kBytes = size_t{1} << 20;
  DeviceBuffer send(kBytes), recv(kBytes);
  ASSERT_NE(send.p, nullptr);
  ASSERT_NE(recv.p, nullptr);
  const std::vector<uint8_t> in = Pattern(kBytes, 7);
  ASSERT_EQ(cudaMemcpy(send.p, in.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(recv.p, 0, kBytes), cudaSuccess);
  const std::vector<int64_t> off = {0, static_cast<int64_t>(kBytes)};
  const Status s = nccl_->Exchange(send.p, off, recv.p, off, DeadlineIn(kDeadline));
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<uint8_t> out(kBytes);
  ASSERT_EQ(cudaMemcpy(out.data(), recv.p, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(out.data(), in.data(), kBytes), 0);
}

TEST_F(NcclSelfTest, OffsetsInsideTheBuffersAreHonoured) {
  constexpr size_t kBytes = 3 * 4096 + 17;
  DeviceBuffer send(4 * 4096), recv(4 * 4096);
  const std::vector<uint8_t> in = Pattern(4 * 4096, 11);
  ASSERT_EQ(cudaMemcpy(send.p, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(recv.p, 0xab, 4 * 4096), cudaSuccess);
  const std::vector<int64_t> send_off = {100, 100 + static_cast<int64_t>(kBytes)};
  const std::vector<int64_t> recv_off = {900, 900 + static_cast<int64_t>(kBytes)};
  const Status s = nccl_->Exchange(send.p, send_off, recv.p, recv_off, DeadlineIn(kDeadline));
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<uint8_t> out(4 * 4096);
  ASSERT_EQ(cudaMemcpy(out.data(), recv.p, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(out.data() + 900, in.data() + 100, kBytes), 0);
  for (size_t i = 0; i < 900; ++i) ASSERT_EQ(out[i], 0xab) << "byte " << i << " was written";
  for (size_t i = 900 + kBytes; i < out.size(); ++i) ASSERT_EQ(out[i], 0xab) << "byte " << i;
}

TEST_F(NcclSelfTest, ZeroSizeExchangeMovesNothing) {
  const std::vector<int64_t> off = {0, 0};
  const Status s = nccl_->Exchange(nullptr, off, nullptr, off, DeadlineIn(kDeadline));
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(nccl_->usable());
}

TEST_F(NcclSelfTest, InvalidOffsetsAreRejectedAndLeaveItUsable) {
  DeviceBuffer buf(64);
  const std::vector<int64_t> good = {0, 64};
  Status s = nccl_->Exchange(buf.p, std::vector<int64_t>{0}, buf.p, good, DeadlineIn(kDeadline));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  s = nccl_->Exchange(buf.p, good, buf.p, std::vector<int64_t>{64, 0}, DeadlineIn(kDeadline));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  s = nccl_->Exchange(nullptr, good, buf.p, good, DeadlineIn(kDeadline));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_TRUE(nccl_->usable());
  DeviceBuffer other(64);
  s = nccl_->Exchange(buf.p, good, other.p, good, DeadlineIn(kDeadline));
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// (Two ranks need two GPUs: NCCL refuses two ranks of one communicator on one GPU, "Duplicate
// GPU detected". tests/transport's transport_conformance_nccl_np2 runs them under mpirun.)

// Without a GPU, Create fails with a clear error instead of crashing or hanging.
TEST(NcclNoGpuTest, CreateFailsCleanly) {
  const CudaProbe probe = ProbeCuda();
  if (!probe.devices.empty()) GTEST_SKIP() << "a GPU is present: the no-GPU path is not tested";
  auto fabric = InprocFabric::Create(1);
  auto boot = fabric->Endpoint(0);
  auto x = NcclExchange::Create(*boot, 0, DeadlineIn(std::chrono::seconds(30)));
  ASSERT_FALSE(x.ok());
  EXPECT_EQ(x.status().code(), StatusCode::kUnavailable) << x.status().ToString();
  EXPECT_NE(x.status().message().find("cudaSetDevice(0)"), std::string::npos)
      << x.status().ToString();
  EXPECT_NE(x.status().message().find("rank 0"), std::string::npos) << x.status().ToString();
}

}  // namespace
}  // namespace moerun
