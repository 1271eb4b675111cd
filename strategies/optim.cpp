#include "strategies/optim.h"

#include <cmath>
#include <sstream>

#include "models/check.h"

namespace strata {

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adamw") return OptimizerKind::adamw;
  STRATA_CHECK(false, "unknown optimizer '" << name << "'; known: sgd, adamw");
}

void OptimizerConfig::validate() const {
  STRATA_CHECK(lr > 0 && std::isfinite(lr), "optimizer lr=" << lr << " must be a positive number");
  STRATA_CHECK(momentum >= 0 && momentum < 1, "optimizer momentum=" << momentum << " must be in [0, 1)");
  STRATA_CHECK(beta1 >= 0 && beta1 < 1, "optimizer beta1=" << beta1 << " must be in [0, 1)");
  STRATA_CHECK(beta2 >= 0 && beta2 < 1, "optimizer beta2=" << beta2 << " must be in [0, 1)");
  STRATA_CHECK(eps > 0, "optimizer eps=" << eps << " must be positive");
  STRATA_CHECK(weight_decay >= 0, "optimizer weight_decay=" << weight_decay << " must not be negative");
}

std::string OptimizerConfig::to_string() const {
  std::ostringstream out;
  if (kind == OptimizerKind::sgd)
    out << "sgd(lr=" << lr << " momentum=" << momentum << ")";
  else
    out << "adamw(lr=" << lr << " betas=" << beta1 << "," << beta2 << " eps=" << eps << " wd=" << weight_decay << ")";
  return out.str();
}

void optimizer_update(const OptimizerConfig& c, torch::Tensor& param, const torch::Tensor& grad,
                      OptimizerState& state) {
  torch::NoGradGuard no_grad;
  ++state.step;
  if (c.kind == OptimizerKind::sgd) {
    if (!state.exp_avg.defined())
      state.exp_avg = grad.clone();
    else
      state.exp_avg.mul_(c.momentum).add_(grad);
    param.add_(state.exp_avg, -c.lr);
    return;
  }
  if (!state.exp_avg.defined()) {
    state.exp_avg = torch::zeros_like(grad);
    state.exp_avg_sq = torch::zeros_like(grad);
  }
  const double t = static_cast<double>(state.step);
  const double bias1 = 1.0 - std::pow(c.beta1, t);
  const double bias2 = 1.0 - std::pow(c.beta2, t);
  param.mul_(1.0 - c.lr * c.weight_decay);
  state.exp_avg.mul_(c.beta1).add_(grad, 1.0 - c.beta1);
  state.exp_avg_sq.mul_(c.beta2).addcmul_(grad, grad, 1.0 - c.beta2);
  auto denom = (state.exp_avg_sq / bias2).sqrt_().add_(c.eps);
  param.addcdiv_(state.exp_avg, denom, -c.lr / bias1);
}

}  // namespace strata
