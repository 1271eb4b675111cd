#include "correctness/support/parity.h"

#include <cmath>
#include <sstream>

namespace strata::correctness {

Tolerance tolerance_for(const torch::Device& device) { return device.is_cuda() ? kCudaTolerance : kCpuTolerance; }

std::string ParityCase::to_string() const {
  std::ostringstream out;
  out << model.to_string() << " batch=" << batch_size << " seed=" << seed << " steps=" << steps;
  for (const auto& [k, v] : options) out << " " << k << "=" << v;
  if (!devices.empty()) {
    out << " devices=";
    for (size_t i = 0; i < devices.size(); ++i) out << (i ? "," : "") << devices[i];
  }
  return out.str();
}

namespace {

std::string compare_tensor(const std::string& what, const std::string& name, const torch::Tensor& actual,
                           const torch::Tensor& expected, Tolerance tol) {
  std::ostringstream out;
  if (actual.sizes() != expected.sizes()) {
    out << what << " '" << name << "': shape " << actual.sizes() << " but the baseline has " << expected.sizes();
    return out.str();
  }
  if (expected.numel() == 0) return {};
  auto a = actual.to(torch::kDouble), e = expected.to(torch::kDouble);
  if (!torch::isfinite(a).all().item<bool>()) {
    out << what << " '" << name << "' has non-finite values";
    return out.str();
  }
  const double diff = (a - e).abs().max().item<double>();
  const double scale = e.abs().max().item<double>();
  const double allowed = tol.atol + tol.rtol * scale;
  if (diff <= allowed) return {};
  out << what << " '" << name << "': max|diff|=" << diff << " > allowed " << allowed << " (max|baseline|=" << scale
      << ")";
  return out.str();
}

}  // namespace

std::string compare_named(const std::string& what, const NamedTensors& actual, const NamedTensors& expected,
                          Tolerance tol) {
  if (actual.size() != expected.size()) {
    std::ostringstream out;
    out << what << ": " << actual.size() << " tensors but the baseline has " << expected.size();
    return out.str();
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i].first != expected[i].first)
      return what + " #" + std::to_string(i) + ": name '" + actual[i].first + "' but the baseline has '" +
             expected[i].first + "'";
    auto msg = compare_tensor(what, actual[i].first, actual[i].second, expected[i].second, tol);
    if (!msg.empty()) return msg;
  }
  return {};
}

ParityResult check_parity(const StrategyMaker& make, const ParityCase& c, const torch::Device& device) {
  // The tolerances hold for full fp32: TF32 is off for the check and restored on any exit.
  struct NoTf32 {
    bool saved = at::globalContext().allowTF32CuBLAS();
    NoTf32() { at::globalContext().setAllowTF32CuBLAS(false); }
    ~NoTf32() { at::globalContext().setAllowTF32CuBLAS(saved); }
  } no_tf32;
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw}) {
    StrategyConfig config;
    config.device = device;
    config.optimizer.kind = kind;
    config.optimizer.lr = kind == OptimizerKind::sgd ? 0.05 : 1e-3;
    config.optimizer.eps = kParityAdamwEps;
    StrategyConfig base_config = config;
    config.options = c.options;
    for (const auto& d : c.devices) config.devices.push_back(torch::Device(d));

    auto base = Registry::create("baseline", base_config);
    auto strategy = make(config);
    base->attach(models::build_model(c.model, c.seed));
    strategy->attach(models::build_model(c.model, c.seed));

    const auto strict = tolerance_for(device);
    auto param_tol = strict;
    const std::string opt = kind == OptimizerKind::sgd ? "sgd" : "adamw";
    auto fail = [&](int step, const std::string& msg) {
      ParityResult r;
      r.ok = false;
      r.message = opt + " step " + std::to_string(step) + ": " + msg;
      return r;
    };
    if (auto msg = compare_named("initial parameter", strategy->parameters(), base->parameters(), strict); !msg.empty())
      return fail(0, msg);
    for (int step = 0; step < c.steps; ++step) {
      const auto batch = models::make_batch(c.model, c.batch_size, c.seed + 1000 + static_cast<uint64_t>(step));
      auto tol = strict;
      if (kind == OptimizerKind::adamw && step > 0) tol = {std::max(strict.rtol, kAdamwLaterStepRtol), strict.atol * 10};
      const double expected = base->train_step(batch);
      const double actual = strategy->train_step(batch);
      const double allowed = tol.atol + tol.rtol * std::abs(expected);
      if (!(std::abs(actual - expected) <= allowed)) {
        std::ostringstream out;
        out << "loss " << actual << " but the baseline has " << expected << " (allowed difference " << allowed << ")";
        return fail(step, out.str());
      }
      if (auto msg = compare_named("gradient", strategy->gradients(), base->gradients(), tol); !msg.empty())
        return fail(step, msg);
      base->optimizer_step();
      strategy->optimizer_step();
      if (kind == OptimizerKind::adamw) param_tol.atol += kAdamwUpdateSlack * config.optimizer.lr;
      if (auto msg = compare_named("parameter", strategy->parameters(), base->parameters(), param_tol); !msg.empty())
        return fail(step, msg);
    }
  }
  return {};
}

ParityResult check_parity(const std::string& strategy, const ParityCase& c, const torch::Device& device) {
  return check_parity([&](const StrategyConfig& config) { return Registry::create(strategy, config); }, c, device);
}

}  // namespace strata::correctness
