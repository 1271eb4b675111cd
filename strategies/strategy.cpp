#include "strategies/strategy.h"

#include "models/check.h"
#include "strategies/device/device.h"

namespace strata {

void Strategy::attach(models::BlockModel model) {
  // Refused rather than re-done: a strategy's device buffers, streams, replicas and optimizer state
  // are built for one model, and rebuilding all of them in place is where state of the first
  // model leaks into the second. A failed attach counts too: its partial state is not reusable.
  STRATA_CHECK(!attached_, name() << ": attach() was already called on this strategy; a strategy serves one "
                                     "model, so create a new one (Registry::create) for another");
  attached_ = true;
  device::guard_onednn_cache();  // before the strategy builds anything or starts threads
  attach_model(std::move(model));
}

NamedTensors Strategy::training_state() {
  STRATA_FAIL(name() << ": does not save its training state yet (baseline and baseline_checkpoint do)");
}

void Strategy::load_training_state(const NamedTensors&) {
  STRATA_FAIL(name() << ": does not load a training state yet (baseline and baseline_checkpoint do)");
}

NamedTensors host_copies(const std::vector<models::NamedParameter>& tensors) {
  NamedTensors out;
  out.reserve(tensors.size());
  // .to(kCPU, copy=true) also on the CPU, where .cpu() would hand out the live tensor.
  for (const auto& t : tensors) out.emplace_back(t.name, t.tensor.detach().to(torch::kCPU, false, /*copy=*/true));
  return out;
}

}  // namespace strata
