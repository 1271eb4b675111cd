#include "strategies/strategy.h"

#include <map>
#include <set>

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
  STRATA_FAIL(name() << ": does not save its training state yet (training_state(); every strategy strata registers does)");
}

void Strategy::load_training_state(const NamedTensors&) {
  STRATA_FAIL(name() << ": does not load a training state yet (load_training_state(); every strategy strata registers does)");
}

NamedTensors host_copies(const std::vector<models::NamedParameter>& tensors) {
  NamedTensors out;
  out.reserve(tensors.size());
  // .to(kCPU, copy=true) also on the CPU, where .cpu() would hand out the live tensor.
  for (const auto& t : tensors) out.emplace_back(t.name, t.tensor.detach().to(torch::kCPU, false, /*copy=*/true));
  return out;
}

StateIndex checked_training_state(const std::string& strategy, const std::vector<models::NamedParameter>& params,
                                  const std::vector<models::NamedBuffer>& buffers, const NamedTensors& state) {
  StateIndex index;
  try {
    index.add(state);
  } catch (const Error& e) {
    STRATA_FAIL(strategy << ": " << e.what());
  }
  std::set<std::string> known = {"loss_scaler"};
  auto check = [&](const models::NamedParameter& p) {
    STRATA_CHECK(index.has(p.name), strategy << ": the state has no '" << p.name << "' (another model?)");
    try {
      index.whole(p.name, p.tensor.sizes());  // shape, or pieces that cover it exactly
    } catch (const Error& e) {
      STRATA_FAIL(strategy << ": " << e.what());
    }
  };
  for (const auto& p : params) {
    check(p);
    for (const auto* slot : {"", "/exp_avg", "/exp_avg_sq", "/step"}) known.insert(p.name + slot);
  }
  for (const auto& b : buffers) {
    check(b);
    known.insert(b.name);
  }
  for (const auto& name : index.names())
    STRATA_CHECK(known.count(name), strategy << ": the state has '" << name << "', which this model has not");
  return index;
}

void load_buffers(const std::vector<models::NamedBuffer>& buffers, const StateIndex& state) {
  torch::NoGradGuard no_grad;
  for (const auto& b : buffers) b.tensor.copy_(state.whole(b.name, b.tensor.sizes()));
}

}  // namespace strata
