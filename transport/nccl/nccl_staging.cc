// The nccl transport's memory (nccl_transport_impl.h): which buffers are on this rank's GPU, the
// device staging buffers of host messages (one StagingPool per stream), the pool of CUDA events,
// and the pinning of registered host memory (cudaHostRegister).
#include <cuda_runtime.h>

#include <string>

#include "base/log.h"
#include "transport/nccl/nccl_common.h"
#include "transport/nccl/nccl_transport_impl.h"

namespace moerun::nccl {

Result<bool> NcclTransport::IsDevicePointer(const void* p) const {
  if (p == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (a.type != cudaMemoryTypeDevice) return false;
  if (a.device != device_) {
    return Status::InvalidArgument("nccl: a device buffer on GPU " + std::to_string(a.device) +
                                   ", but this rank's GPU is " + std::to_string(device_));
  }
  return true;
}

Status NcclTransport::AcquireStaging(Op& o, int pool) {
  const StagingPool::Grant g = pools_[static_cast<size_t>(pool)].Acquire(o.bytes);
  o.pool = pool;
  o.slot = g.slot;
  auto& ptrs = staging_[static_cast<size_t>(pool)];
  if (ptrs.size() < static_cast<size_t>(pools_[static_cast<size_t>(pool)].slots())) {
    ptrs.resize(static_cast<size_t>(pools_[static_cast<size_t>(pool)].slots()), nullptr);
  }
  if (g.allocate) {
    // Stream-ordered on the slot's own stream: no device-wide synchronisation, which could wait
    // on an NCCL kernel that waits for a peer that waits for this thread.
    void*& p = ptrs[static_cast<size_t>(g.slot)];
    cudaStream_t s = stream_[static_cast<size_t>(pool)];
    if (p != nullptr) (void)cudaFreeAsync(p, s);
    p = nullptr;
    if (const cudaError_t e = cudaMallocAsync(&p, g.capacity, s); e != cudaSuccess) {
      pools_[static_cast<size_t>(pool)].Release(g.slot);
      o.slot = -1;
      return Status::ResourceExhausted("nccl: staging buffer of " + std::to_string(g.capacity) +
                                       " bytes on GPU " + std::to_string(device_) + ": " +
                                       CudaError(e));
    }
  }
  return Status::Ok();
}

void NcclTransport::ReleaseStaging(Op& o) {
  if (o.slot >= 0) pools_[static_cast<size_t>(o.pool)].Release(o.slot);
  o.slot = -1;
}

Result<cudaEvent_t> NcclTransport::TakeEvent() {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (const cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      r != cudaSuccess) {
    return Status::Unavailable("nccl: cudaEventCreate: " + CudaError(r));
  }
  all_events_.push_back(e);
  return e;
}

void NcclTransport::ReturnEvent(cudaEvent_t& e) {
  if (e != nullptr) free_events_.push_back(e);
  e = nullptr;
}

Status NcclTransport::RegisterMemory(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return Status::Ok();
  UseDevice();
  MOERUN_ASSIGN_OR_RETURN(const bool device, IsDevicePointer(p));
  if (device) return Status::Ok();
  const auto* lo = static_cast<const char*>(p);
  for (auto it = registered_.begin(); it != registered_.end();) {
    const auto* a = static_cast<const char*>(it->first);
    if (a < lo + bytes && lo < a + it->second) {
      (void)cudaHostUnregister(it->first);
      it = registered_.erase(it);
    } else {
      ++it;
    }
  }
  if (const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault); e != cudaSuccess) {
    (void)cudaGetLastError();
    // Page-locked already by another user of this process (the CUDA layer's host pinning of the
    // same buffer): pinned all the same, and that user unregisters it.
    if (e == cudaErrorHostMemoryAlreadyRegistered) return Status::Ok();
    // Pinning is an optimisation: unpinned memory is staged all the same, only slower.
    if (!warned_register_) {
      spdlog::warn("nccl: cudaHostRegister of {} bytes: {} (staging copies run unpinned)", bytes,
                   CudaError(e));
      warned_register_ = true;
    }
    return Status::Ok();
  }
  registered_.emplace_back(p, bytes);
  ++counters_.registrations;
  return Status::Ok();
}

void NcclTransport::UnregisterMemory(void* p) {
  UseDevice();
  for (auto it = registered_.begin(); it != registered_.end(); ++it) {
    if (it->first == p) {
      (void)cudaHostUnregister(p);
      registered_.erase(it);
      return;
    }
  }
}

}  // namespace moerun::nccl
