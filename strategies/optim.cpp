#include "strategies/optim.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <sstream>

#include "models/check.h"
#include "models/threads.h"

namespace strata {

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adamw") return OptimizerKind::adamw;
  STRATA_FAIL("unknown optimizer '" << name << "'; known: sgd, adamw");
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

namespace {

bool fusable(const torch::Tensor& param, const torch::Tensor& grad) {
  return param.device().is_cpu() && grad.device().is_cpu() && param.scalar_type() == torch::kFloat &&
         grad.scalar_type() == torch::kFloat && param.is_contiguous() && grad.is_contiguous() &&
         param.numel() == grad.numel();
}

// Host updates in one pass over memory, split over threads: a chain of tensor operations reads
// and writes every buffer once per operation (about twice the traffic), and host memory bandwidth
// is what bounds a host optimizer. Same formulas as the tensor chain below, in float.
// Out: void, or the dtype of a rounded copy written in the same loop (c10::BFloat16, c10::Half:
// their conversions from float are the ones copy_() uses).
template <typename Out>
void fused_host_update(const OptimizerConfig& c, torch::Tensor& param, const torch::Tensor& grad,
                       OptimizerState& state, Out* out) {
  const int64_t n = param.numel();
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  if (c.kind == OptimizerKind::sgd) {
    const bool first = !state.exp_avg.defined();
    if (first) state.exp_avg = torch::empty_like(grad);
    float* buf = state.exp_avg.data_ptr<float>();
    const float momentum = static_cast<float>(c.momentum), lr = static_cast<float>(c.lr);
    parallel_chunks(n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float b = first ? g[i] : buf[i] * momentum + g[i];
        buf[i] = b;
        const float pi = p[i] - lr * b;
        p[i] = pi;
        if constexpr (!std::is_void_v<Out>) out[i] = Out(pi);
      }
    });
    return;
  }
  if (!state.exp_avg.defined()) {
    state.exp_avg = torch::zeros_like(grad);
    state.exp_avg_sq = torch::zeros_like(grad);
  }
  float* m = state.exp_avg.data_ptr<float>();
  float* v = state.exp_avg_sq.data_ptr<float>();
  const double t = static_cast<double>(state.step);
  const float decay = static_cast<float>(1.0 - c.lr * c.weight_decay);
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
  const float one_minus_b1 = static_cast<float>(1.0 - c.beta1), one_minus_b2 = static_cast<float>(1.0 - c.beta2);
  const float bias2 = static_cast<float>(1.0 - std::pow(c.beta2, t));
  const float step_size = static_cast<float>(c.lr / (1.0 - std::pow(c.beta1, t)));
  const float eps = static_cast<float>(c.eps);
  parallel_chunks(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float gi = g[i];
      const float mi = m[i] * b1 + gi * one_minus_b1;
      const float vi = v[i] * b2 + gi * gi * one_minus_b2;
      m[i] = mi;
      v[i] = vi;
      const float denom = std::sqrt(vi / bias2) + eps;
      const float pi = p[i] * decay - step_size * mi / denom;
      p[i] = pi;
      if constexpr (!std::is_void_v<Out>) out[i] = Out(pi);
    }
  });
}

// The same update as a chain of tensor operations, for any device and dtype.
void update_with_tensor_ops(const OptimizerConfig& c, torch::Tensor& param, const torch::Tensor& grad,
                            OptimizerState& state) {
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

}  // namespace

void optimizer_update(const OptimizerConfig& c, torch::Tensor& param, const torch::Tensor& grad,
                      OptimizerState& state, const torch::Tensor& rounded) {
  torch::NoGradGuard no_grad;
  if (rounded.defined())
    STRATA_CHECK(rounded.numel() == param.numel(), "optimizer_update: the rounded copy has " << rounded.numel()
                                                       << " elements, the parameter " << param.numel());
  ++state.step;
  if (fusable(param, grad)) {
    const bool fused_copy = rounded.defined() && rounded.is_cpu() && rounded.is_contiguous();
    if (fused_copy && rounded.scalar_type() == torch::kBFloat16) {
      fused_host_update(c, param, grad, state, rounded.data_ptr<c10::BFloat16>());
    } else if (fused_copy && rounded.scalar_type() == torch::kHalf) {
      fused_host_update(c, param, grad, state, rounded.data_ptr<c10::Half>());
    } else {
      fused_host_update<void>(c, param, grad, state, nullptr);
      if (rounded.defined()) rounded.copy_(param);
    }
    return;
  }
  update_with_tensor_ops(c, param, grad, state);
  if (rounded.defined()) rounded.copy_(param);
}

void step_and_release_grad(const OptimizerConfig& config, torch::Tensor& param, OptimizerState& state) {
  if (!param.grad().defined()) return;
  optimizer_update(config, param, param.grad(), state);
  param.mutable_grad() = torch::Tensor();
}

}  // namespace strata
