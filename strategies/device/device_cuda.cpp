// CUDA implementation of the device layer; compiled only against a LibTorch with CUDA.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "strategies/device/device.h"

namespace strata::device::detail {
namespace {

// at::cuda::sleep spins for a number of clock cycles; ~2 GHz is close enough for a delay.
constexpr int64_t kCyclesPerMicrosecond = 2000;

class CudaEvent : public EventImpl {
 public:
  explicit CudaEvent(const c10::cuda::CUDAStream& stream) { event_.record(stream); }
  void synchronize() override { event_.synchronize(); }
  bool done() override { return event_.query(); }
  void block(const c10::cuda::CUDAStream& stream) { event_.block(stream); }

 private:
  at::cuda::CUDAEvent event_;
};

class CudaStream : public StreamImpl {
 public:
  CudaStream(const torch::Device& device, c10::cuda::CUDAStream stream) : device_(device), stream_(stream) {}
  const torch::Device& device() const override { return device_; }
  void copy(const torch::Tensor& dst, const torch::Tensor& src) override {
    c10::cuda::CUDAStreamGuard guard(stream_);
    delay(injected_delays().copy);
    torch::NoGradGuard no_grad;
    dst.copy_(src, /*non_blocking=*/true);
  }
  void copy_parts(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                  const std::vector<int64_t>& offsets) override {
    c10::cuda::CUDAStreamGuard guard(stream_);
    delay(injected_delays().copy);
    detail::copy_parts_into(dst, parts, offsets, /*non_blocking=*/true);
  }
  void copy_rows(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src) override {
    c10::cuda::CUDAStreamGuard guard(stream_);
    delay(injected_delays().copy);
    // The rows' buffer on the device is allocated on this stream, so it is freed behind its use.
    detail::copy_rows_into(dst, index, src, /*non_blocking=*/true);
  }
  std::shared_ptr<EventImpl> record() override { return std::make_shared<CudaEvent>(stream_); }
  void wait(const std::shared_ptr<EventImpl>& event) override {
    if (event) static_cast<CudaEvent&>(*event).block(stream_);
  }
  void synchronize() override { stream_.synchronize(); }
  void keep_alive(const torch::Tensor& t) override {
    if (t.defined() && t.is_cuda() && t.storage().data())
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
  }
  void delay(std::chrono::microseconds d) override {
    if (d.count() <= 0) return;
    c10::cuda::CUDAStreamGuard guard(stream_);
    at::cuda::sleep(d.count() * kCyclesPerMicrosecond);
  }
  void hold(std::shared_ptr<const Gate> gate) override {
    // The host function owns a reference to the gate until it has run.
    auto* owned = new std::shared_ptr<const Gate>(std::move(gate));
    const auto rc = cudaLaunchHostFunc(
        stream_.stream(),
        [](void* p) {
          std::unique_ptr<std::shared_ptr<const Gate>> g(static_cast<std::shared_ptr<const Gate>*>(p));
          (*g)->wait();
        },
        owned);
    if (rc != cudaSuccess) delete owned;
    C10_CUDA_CHECK(rc);
  }
  std::shared_ptr<void> make_current() override {
    return std::make_shared<c10::cuda::CUDAStreamGuard>(stream_);
  }

 private:
  torch::Device device_;
  c10::cuda::CUDAStream stream_;
};

}  // namespace

std::shared_ptr<StreamImpl> cuda_compute_stream(const torch::Device& device) {
  return std::make_shared<CudaStream>(device, c10::cuda::getCurrentCUDAStream(device.index()));
}

std::shared_ptr<StreamImpl> cuda_side_stream(const torch::Device& device) {
  return std::make_shared<CudaStream>(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
}

// The caching allocator sets up its per-device state on first use; asking for statistics before
// any allocation would be refused ("Invalid device argument").
void ensure_allocator(const torch::Device& device) {
  (void)torch::empty({1}, torch::TensorOptions().device(device));
}

AllocatorStats cuda_allocator_stats(const torch::Device& device) {
  ensure_allocator(device);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  constexpr auto all = 0;  // StatType::AGGREGATE
  AllocatorStats out;
  out.allocated = stats.allocated_bytes[all].current;
  out.reserved = stats.reserved_bytes[all].current;
  out.peak_allocated = stats.allocated_bytes[all].peak;
  out.peak_reserved = stats.reserved_bytes[all].peak;
  return out;
}

void cuda_reset_peak_stats(const torch::Device& device) {
  ensure_allocator(device);
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
}

void cuda_release_cached_memory(const torch::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
  // cuBLAS keeps a workspace (32 MiB on Hopper) for every handle and stream that ran a matmul, in
  // allocated memory, for the life of the process: without this, one measurement's streams would
  // count in every later measurement's allocated bytes and peak.
  at::cuda::clearCublasWorkspaces();
  c10::cuda::CUDACachingAllocator::emptyCache();
}

int64_t cuda_total_memory(const torch::Device& device) {
  return static_cast<int64_t>(at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->totalGlobalMem);
}

void cuda_set_memory_fraction(const torch::Device& device, double fraction) {
  ensure_allocator(device);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device.index() < 0 ? 0 : device.index());
}

std::shared_ptr<void> cuda_timing_event(const torch::Device& device) {
  auto event = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);  // with timing
  event->record(c10::cuda::getCurrentCUDAStream(device.index()));
  return event;
}

double cuda_elapsed_ms(const std::shared_ptr<void>& start, const std::shared_ptr<void>& stop) {
  auto& a = *static_cast<at::cuda::CUDAEvent*>(start.get());
  auto& b = *static_cast<at::cuda::CUDAEvent*>(stop.get());
  b.synchronize();
  return a.elapsed_time(b);
}

std::string cuda_name(const torch::Device& device) {
  return at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->name;
}

void cuda_synchronize(const torch::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
}

}  // namespace strata::device::detail
