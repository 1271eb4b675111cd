#include "strategies/precision.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>

#include "models/check.h"
#include "models/threads.h"

namespace strata {

std::string dtype_name(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat: return "fp32";
    case torch::kBFloat16: return "bf16";
    case torch::kHalf: return "fp16";
    default: STRATA_FAIL("dtype " << dtype << " is not a training precision; use fp32, bf16 or fp16");
  }
}

torch::ScalarType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32") return torch::kFloat;
  if (name == "bf16" || name == "bfloat16") return torch::kBFloat16;
  if (name == "fp16" || name == "float16") return torch::kHalf;
  STRATA_FAIL("precision dtype '" << name << "' is not known; use fp32, bf16 or fp16");
}

double unit_roundoff(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat: return std::ldexp(1.0, -24);
    case torch::kBFloat16: return std::ldexp(1.0, -8);
    case torch::kHalf: return std::ldexp(1.0, -11);
    case torch::kDouble: return std::ldexp(1.0, -53);
    default: STRATA_FAIL("dtype " << dtype << " has no unit roundoff here");
  }
}

void check_precision_on(const PrecisionPolicy& policy, const torch::Device& device) {
  if (!device.is_cpu() || policy.compute != torch::kHalf) return;
  static const bool cpu_has_fp16_products = [] {
    try {
      auto a = torch::ones({2, 2}, torch::kHalf);
      (void)torch::matmul(a, a);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  STRATA_CHECK(cpu_has_fp16_products, "precision " << policy.to_string() << " on " << device
                                                   << ": this LibTorch has no fp16 matrix products on the CPU; "
                                                      "use bf16 there, or fp16 on a CUDA device");
}

void check_buffers_under(const PrecisionPolicy& policy, const models::BlockModel& model, const std::string& strategy) {
  if (policy.is_fp32()) return;
  for (const auto& b : model.buffers())
    STRATA_CHECK(!b.tensor.is_floating_point(),
                 strategy << ": precision " << policy.to_string() << " with the floating-point buffer '" << b.name
                          << "' (block " << b.owner_block << "): models with such buffers (BatchNorm's running "
                          << "statistics) train in fp32 only for now");
}

PrecisionPolicy PrecisionPolicy::parse(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) items.push_back(item);
  STRATA_CHECK(!items.empty() && !items[0].empty() && items[0].find('=') == std::string::npos,
               "precision '" << text << "' must start with fp32, bf16 or fp16 (e.g. bf16,reduce=fp32)");
  PrecisionPolicy p;
  p.compute = p.transfer = parse_dtype(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    const auto eq = items[i].find('=');
    STRATA_CHECK(eq != std::string::npos && eq > 0,
                 "precision '" << text << "': '" << items[i] << "' is not key=value (transfer, reduce, scale, growth)");
    const auto key = items[i].substr(0, eq), value = items[i].substr(eq + 1);
    if (key == "transfer") {
      p.transfer = parse_dtype(value);
    } else if (key == "reduce") {
      p.reduce = parse_dtype(value);
    } else if (key == "scale" || key == "growth") {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      STRATA_CHECK(!value.empty() && end && *end == '\0' && std::isfinite(v),
                   "precision '" << text << "': " << key << "='" << value << "' is not a number");
      if (key == "scale") {
        p.initial_scale = v;
      } else {
        STRATA_CHECK(v == std::floor(v) && v >= 1 && v <= 1e12,
                     "precision '" << text << "': growth='" << value << "' must be a whole number of steps, at least 1");
        p.scale_growth_interval = static_cast<int64_t>(v);
      }
    } else {
      STRATA_FAIL("precision '" << text << "': unknown key '" << key << "'; known: transfer, reduce, scale, growth");
    }
  }
  p.validate();
  return p;
}

void PrecisionPolicy::validate() const {
  const auto c = dtype_name(compute), t = dtype_name(transfer), r = dtype_name(reduce);
  STRATA_CHECK(transfer == compute || transfer == torch::kFloat,
               "precision: transfer=" << t << " with compute=" << c << " makes no sense: parameters travel in the "
                                      << "compute dtype or in fp32 (transfer=" << c << " or transfer=fp32)");
  STRATA_CHECK(reduce == compute || reduce == torch::kFloat,
               "precision: reduce=" << r << " with compute=" << c << " makes no sense: gradients are summed in the "
                                    << "compute dtype or in fp32 (reduce=" << c << " or reduce=fp32)");
  STRATA_CHECK(initial_scale > 0 && std::isfinite(initial_scale),
               "precision: scale=" << initial_scale << " must be a positive number");
  STRATA_CHECK(scale_growth_interval >= 1, "precision: growth=" << scale_growth_interval << " must be at least 1");
}

std::string PrecisionPolicy::to_string() const {
  std::ostringstream out;
  out << dtype_name(compute);
  if (transfer != compute) out << ",transfer=" << dtype_name(transfer);
  if (reduce != torch::kFloat) out << ",reduce=" << dtype_name(reduce);
  const PrecisionPolicy defaults;
  if (initial_scale != defaults.initial_scale) out << ",scale=" << initial_scale;
  if (scale_growth_interval != defaults.scale_growth_interval) out << ",growth=" << scale_growth_interval;
  return out.str();
}

torch::Tensor PrecisionPolicy::cast_input(const torch::Tensor& input) const {
  // Under fp32 nothing is cast (a float64 reference model keeps its float64 inputs).
  return compute != torch::kFloat && input.is_floating_point() && input.scalar_type() != compute ? input.to(compute)
                                                                                                  : input;
}

// ---------------------------------------------------------------------------------------------
ComputeCopies::ComputeCopies(const PrecisionPolicy& policy, std::vector<torch::Tensor> parameters)
    : policy_(policy), parameters_(std::move(parameters)) {}

void ComputeCopies::bind() {
  if (policy_.compute == torch::kFloat || bound_) return;
  torch::NoGradGuard no_grad;
  masters_.clear();
  master_grads_.clear();
  // The copies first (an allocation may fail): nothing is swapped until every copy exists.
  std::vector<torch::Tensor> copies;
  for (auto& p : parameters_) copies.push_back(p.is_floating_point() ? p.data().to(policy_.compute) : p.data());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    auto& p = parameters_[i];
    masters_.push_back(p.data());
    master_grads_.push_back(p.grad());
    p.mutable_grad() = torch::Tensor();
    // The copy rounds once from fp32, as the master would be rounded wherever it travels.
    p.set_data(copies[i]);
  }
  bound_ = true;
}

void ComputeCopies::unbind(bool keep_gradients) {
  if (!bound_) return;
  torch::NoGradGuard no_grad;
  // The masters and their earlier gradients go back first, without allocating; then the step's
  // gradients are added (which allocates, and may throw: the masters are in place by then).
  std::vector<torch::Tensor> produced;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    auto& p = parameters_[i];
    produced.push_back(p.grad());
    p.set_data(masters_[i]);
    p.mutable_grad() = master_grads_[i];
  }
  const auto masters = std::move(masters_);
  masters_.clear();
  master_grads_.clear();
  bound_ = false;
  if (!keep_gradients) return;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!produced[i].defined()) continue;
    auto& p = parameters_[i];
    const auto& earlier = p.grad();
    // Summed with what earlier steps accumulated, in the reduction dtype; kept in the master's.
    p.mutable_grad() = earlier.defined()
                           ? (earlier.to(policy_.reduce) + produced[i].to(policy_.reduce)).to(masters[i].scalar_type())
                           : produced[i].to(policy_.reduce).to(masters[i].scalar_type());
  }
}

// ---------------------------------------------------------------------------------------------
LossScaler::LossScaler(const PrecisionPolicy& policy)
    : enabled_(policy.scales_loss()),
      scale_(policy.scales_loss() ? policy.initial_scale : 1.0),
      interval_(policy.scale_growth_interval) {}

namespace {

// A contiguous fp32 host tensor multiplied by `factor` in place, in one pass over memory split
// over the cores; true if every result is finite. (x - x is 0 for a finite x, NaN for an inf or
// a NaN: a test the compiler can vectorise.)
bool scale_host_and_check(torch::Tensor& t, float factor) {
  float* x = t.data_ptr<float>();
  std::atomic<bool> finite{true};
  parallel_chunks(t.numel(), [&](int64_t begin, int64_t end) {
    bool ok = true;
    for (int64_t i = begin; i < end; ++i) {
      const float v = x[i] * factor;
      x[i] = v;
      ok &= (v - v) == 0.0f;
    }
    if (!ok) finite = false;
  });
  return finite;
}

}  // namespace

bool LossScaler::unscale(const std::vector<torch::Tensor>& gradients) const {
  if (!enabled_) return true;
  torch::NoGradGuard no_grad;
  // Multiplied by 1 / scale as an fp32 factor, the same operation on every device and in
  // unscaled(). On a GPU, one multi-tensor kernel per device that also records any inf or nan on
  // the device; on the host, one threaded pass per tensor. One host synchronisation per device,
  // when all of them are queued. The GPU kernel checks its input, not its result: with a scale
  // below 1 (after many skipped steps, or so chosen) a finite gradient can overflow when
  // unscaled, so then every tensor takes the general path, which checks the result.
  const float inverse = static_cast<float>(1.0 / scale_);
  std::map<std::string, std::vector<torch::Tensor>> on_gpu, flags_by_device;
  bool finite = true;
  for (const auto& g : gradients) {
    if (!g.defined()) continue;
    auto t = g;
    if (t.is_cuda() && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kHalf) && inverse <= 1.0f) {
      on_gpu[t.device().str() + dtype_name(t.scalar_type())].push_back(t);
    } else if (t.is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous()) {
      finite = scale_host_and_check(t, inverse) && finite;
    } else {
      t.mul_(inverse);
      flags_by_device[t.device().str()].push_back(torch::isfinite(t).all());
    }
  }
  for (auto& [key, list] : on_gpu) {
    const auto options = torch::TensorOptions().dtype(torch::kFloat).device(list.front().device());
    auto found = torch::zeros({1}, options);
    at::_amp_foreach_non_finite_check_and_unscale_(list, found, torch::full({1}, inverse, options));
    flags_by_device[found.device().str()].push_back(found.eq(0).all());
  }
  for (const auto& [device, flags] : flags_by_device) finite = torch::stack(flags).all().item<bool>() && finite;
  return finite;
}

torch::Tensor LossScaler::scaled(const torch::Tensor& loss) const { return enabled_ ? loss * scale_ : loss; }

torch::Tensor LossScaler::unscaled(const torch::Tensor& gradient) const {
  return enabled_ ? gradient * static_cast<float>(1.0 / scale_) : gradient;
}

torch::Tensor LossScaler::state() const {
  return torch::tensor({scale_, static_cast<double>(good_in_a_row_), static_cast<double>(skipped_)}, torch::kDouble);
}

void LossScaler::restore(const torch::Tensor& state) {
  STRATA_CHECK(state.numel() == 3 && state.scalar_type() == torch::kDouble,
               "loss scaler: a saved state is 3 float64 values (scale, good steps in a row, skipped), not "
                   << state.sizes() << " " << state.scalar_type());
  const auto v = state.contiguous();
  scale_ = v[0].item<double>();
  good_in_a_row_ = static_cast<int64_t>(v[1].item<double>());
  skipped_ = static_cast<int64_t>(v[2].item<double>());
}

void LossScaler::update(bool finite) {
  if (!enabled_) return;
  if (!finite) {
    scale_ *= 0.5;
    good_in_a_row_ = 0;
    ++skipped_;
  } else if (++good_in_a_row_ >= interval_) {
    scale_ *= 2.0;
    good_in_a_row_ = 0;
  }
}

}  // namespace strata
