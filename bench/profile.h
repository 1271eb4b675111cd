#pragma once
// One profiled region of a strata run written as a Chrome trace, the format torch.profiler's
// export_chrome_trace writes for PyTorch's peers, so bench/kernel_table.py reads both sides alike.
// Needs a LibTorch built with Kineto (the CUDA wheels have it; Debian's CPU 1.13 does not, and
// says so when the trace is saved).
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <set>
#include <string>

#include "models/check.h"

namespace strata::bench {

class TraceRecorder {
 public:
  /// Starts recording CPU operators and, with `cuda`, the GPU's kernels and copies.
  explicit TraceRecorder(bool cuda) : config_(torch::profiler::impl::ProfilerState::KINETO) {
    activities_.insert(torch::profiler::impl::ActivityType::CPU);
    if (cuda) activities_.insert(torch::profiler::impl::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config_, activities_);
    torch::autograd::profiler::enableProfiler(config_, activities_);
  }
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;
  ~TraceRecorder() {
    if (!stopped_) torch::autograd::profiler::disableProfiler();
  }

  /// Stops recording (call after the devices are synchronised) and writes the trace to `path`.
  void save(const std::string& path) {
    stopped_ = true;
    auto result = torch::autograd::profiler::disableProfiler();
    try {
      result->save(path);
    } catch (const std::exception& e) {
      STRATA_FAIL("the trace " << path << " could not be written (a LibTorch without Kineto cannot save traces; "
                               << "profile on a CUDA build): " << e.what());
    }
  }

 private:
  torch::profiler::impl::ProfilerConfig config_;
  std::set<torch::profiler::impl::ActivityType> activities_;
  bool stopped_ = false;
};

}  // namespace strata::bench
