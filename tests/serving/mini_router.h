// A router in miniature for the serving tests: the single-process layer (the deepseek_v3
// fixture) behind a Batcher and a ServingEndpoint on a free loopback port, served by one batcher
// thread until destruction. `slow` delays every batch (tests of idle connections and timeouts).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/layer/moe_layer.h"
#include "runtime/serving/batcher.h"
#include "runtime/serving/serving_endpoint.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun::testing {

class MiniRouter {
 public:
  explicit MiniRouter(ServingOptions so = {}, BatcherOptions bo = {},
                      std::chrono::milliseconds slow = std::chrono::milliseconds(0))
      : kernels_(KernelsFor(BestIsa())), pool_(1) {
    layer_ = std::make_unique<MoeLayer>(LoadFixture("deepseek_v3", kernels_), kernels_, &pool_);
    hidden_ = layer_->weights().spec.hidden;
    batcher_ = std::make_unique<Batcher>(bo, hidden_);
    so.framed.listen = HostPort{"127.0.0.1", 0};
    so.framed.name = "test serving";
    ServedModel m;
    m.layers = {0};
    m.hidden = hidden_;
    m.max_request_tokens = 4096;
    auto ep = ServingEndpoint::Start(so, m, batcher_.get(), &metrics_);
    EXPECT_TRUE(ep.ok()) << ep.status().ToString();
    endpoint_ = std::move(*ep);
    runner_ = std::thread([this, slow] {
      batcher_->Run(
          [&](int, const float* x, int64_t t, float* out, std::chrono::steady_clock::time_point,
              BatchStream*) {
            if (slow.count() > 0) std::this_thread::sleep_for(slow);
            return layer_->Forward(x, t, out);
          },
          [&] { return stop_.load(); }, [] {});
    });
  }
  ~MiniRouter() {
    stop_ = true;
    runner_.join();
    endpoint_->Stop();
  }
  MiniRouter(const MiniRouter&) = delete;
  MiniRouter& operator=(const MiniRouter&) = delete;

  uint16_t port() const { return endpoint_->port(); }
  std::string target() const { return "127.0.0.1:" + std::to_string(port()); }
  int64_t hidden() const { return hidden_; }
  ServingEndpoint& endpoint() { return *endpoint_; }
  MetricsRegistry& metrics() { return metrics_; }
  // What the layer computes for x, alone (a layer of its own: the served one belongs to the
  // batcher's thread).
  std::vector<float> Expected(const std::vector<float>& x) const {
    std::vector<float> out(x.size());
    ThreadPool pool(1);
    MoeLayer l(LoadFixture("deepseek_v3", kernels_), kernels_, &pool);
    EXPECT_TRUE(l.Forward(x.data(), static_cast<int64_t>(x.size()) / hidden_, out.data()).ok());
    return out;
  }

 private:
  const CpuKernels& kernels_;
  ThreadPool pool_;
  std::unique_ptr<MoeLayer> layer_;
  int64_t hidden_ = 0;
  MetricsRegistry metrics_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<ServingEndpoint> endpoint_;
  std::atomic<bool> stop_{false};
  std::thread runner_;
};

}  // namespace moerun::testing
