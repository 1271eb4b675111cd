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
  STRATA_FAIL(name() << ": does not save its training state yet (baseline, baseline_checkpoint and the hook_offload family do)");
}

void Strategy::load_training_state(const NamedTensors&) {
  STRATA_FAIL(name() << ": does not load a training state yet (baseline, baseline_checkpoint and the hook_offload family do)");
}

NamedTensors host_copies(const std::vector<models::NamedParameter>& tensors) {
  NamedTensors out;
  out.reserve(tensors.size());
  // .to(kCPU, copy=true) also on the CPU, where .cpu() would hand out the live tensor.
  for (const auto& t : tensors) out.emplace_back(t.name, t.tensor.detach().to(torch::kCPU, false, /*copy=*/true));
  return out;
}

std::map<std::string, torch::Tensor> checked_training_state(const std::string& strategy,
                                                            const std::vector<models::NamedParameter>& params,
                                                            const std::vector<models::NamedBuffer>& buffers,
                                                            const NamedTensors& state) {
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& [key, t] : state)
    STRATA_CHECK(by_name.emplace(key, t).second, strategy << ": the state has '" << key << "' twice");
  std::set<std::string> known = {"loss_scaler"};
  auto check = [&](const models::NamedParameter& p) {
    const auto it = by_name.find(p.name);
    STRATA_CHECK(it != by_name.end(), strategy << ": the state has no '" << p.name << "' (another model?)");
    STRATA_CHECK(it->second.sizes() == p.tensor.sizes(), strategy << ": '" << p.name << "' is " << it->second.sizes()
                                                                  << " in the state, " << p.tensor.sizes()
                                                                  << " here (another model?)");
  };
  for (const auto& p : params) {
    check(p);
    for (const auto* slot : {"", "/exp_avg", "/exp_avg_sq", "/step"}) known.insert(p.name + slot);
  }
  for (const auto& b : buffers) {
    check(b);
    known.insert(b.name);
  }
  for (const auto& [key, t] : by_name)
    STRATA_CHECK(known.count(key), strategy << ": the state has '" << key << "', which this model has not");
  return by_name;
}

void load_buffers(const std::vector<models::NamedBuffer>& buffers, const std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  for (const auto& b : buffers) b.tensor.copy_(state.at(b.name));
}

}  // namespace strata
