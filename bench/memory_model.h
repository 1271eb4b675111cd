#pragma once
// What each strategy holds in device and host memory for a model, batch, precision and optimizer,
// predicted from the model's config alone (nothing is built), part by part. strata_capacity uses it
// to bracket its search and to print the predicted frontier beside the measured one;
// bench/test_capacity.cpp holds the parameter parts to each strategy's own accounting (exact), and
// the GPU report compares the whole with the allocator's measured peak (bench/notes/memory-model.md).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "models/model.h"
#include "strategies/optim.h"
#include "strategies/precision.h"

namespace strata::bench {

struct MemoryPart {
  std::string what;
  int64_t bytes = 0;
};

struct MemoryPrediction {
  std::vector<MemoryPart> device;  ///< at the device's peak (the end of backward, roughly)
  std::vector<MemoryPart> host;    ///< what the strategy keeps in host memory (pinned or not)
  /// The strategy's own accounting, as Stats reports it: parameter bytes on the device at rest
  /// (after optimizer_step) and at their peak.
  int64_t resident_param_bytes = 0, peak_param_bytes = 0;
  int64_t device_bytes() const;
  int64_t host_bytes() const;
  /// "baseline: 1.2 GiB params + ..." for a progress line.
  std::string summary() const;
};

struct MemoryQuestion {
  std::string strategy;
  std::map<std::string, std::string> options;  ///< the strategy's own, as StrategyConfig holds them
  models::ModelConfig model;
  int64_t batch = 1;
  PrecisionPolicy precision;
  OptimizerConfig optimizer;
};

/// Every registered strategy, in one process on one device: baseline, baseline_checkpoint, the
/// hook_offload family, sharded and sharded_offload (a world of one), manual_split and the
/// pipelines with every stage on that device. Several devices or ranks are an Error naming them.
MemoryPrediction predict_memory(const MemoryQuestion& q);
bool memory_model_covers(const std::string& strategy);

}  // namespace strata::bench
