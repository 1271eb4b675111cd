#include "strategies/baseline/baseline.h"

#include <map>

#include "models/check.h"
#include "strategies/checkpoint.h"
#include "strategies/device/device.h"
#include "strategies/optimizer_state_io.h"
#include "strategies/options.h"

namespace strata {

BaselineOptions BaselineOptions::parse(const std::map<std::string, std::string>& options) {
  OptionReader reader("baseline", options);
  BaselineOptions out;
  out.checkpoint = reader.get_bool("checkpoint", out.checkpoint);
  reader.finish();
  out.validate();
  return out;
}

Baseline::Baseline(std::string name, const StrategyConfig& config, BaselineOptions options)
    : name_(std::move(name)), config_(config), options_(options), scaler_(config.precision) {
  device::check_available(config_.device);
}

models::BlockModel& Baseline::model() {
  STRATA_CHECK(model_.has_value(), name_ << ": attach() a model first");
  return *model_;
}

void Baseline::attach_model(models::BlockModel model) {
  check_buffers_under(config_.precision, model, name_);
  // Module::to() swaps each parameter's (and buffer's) data in place, so a tied parameter stays one
  // tensor.
  for (const auto& block : model.blocks()) block->to(config_.device);
  optimizer_state_.assign(model.parameters().size(), {});
  std::vector<torch::Tensor> params;
  for (const auto& p : model.parameters()) params.push_back(p.tensor);
  copies_ = ComputeCopies(config_.precision, std::move(params));
  model_.emplace(std::move(model));
}

torch::Tensor Baseline::run_blocks(torch::Tensor x, bool checkpoint) {
  // Checkpointed: every block but the last, whose output (a head's logits) goes straight into the
  // loss — recomputing it would redo the widest product for nothing, and PyTorch's checkpointed
  // reference keeps its head too.
  const auto& blocks = model().blocks();
  for (size_t b = 0; b < blocks.size(); ++b)
    x = checkpoint && b + 1 < blocks.size() ? checkpointed_forward(*blocks[b], x) : blocks[b]->forward(x);
  return x;
}

double Baseline::train_step(const models::Batch& batch) {
  auto input = config_.precision.cast_input(batch.input.to(config_.device));
  auto target = batch.target.to(config_.device);
  bytes_h2d_ += batch.input.nbytes() + batch.target.nbytes();
  auto& m = model();
  ComputeCopies::Scope bound(copies_);  // the blocks compute in the policy's dtype until backward is done
  auto loss = m.loss(run_blocks(input, options_.checkpoint), target);
  scaler_.scaled(loss).backward();
  bound.commit();
  return loss.item<double>();
}

torch::Tensor Baseline::forward(const torch::Tensor& input) {
  torch::NoGradGuard no_grad;
  bytes_h2d_ += input.nbytes();
  auto x = config_.precision.cast_input(input.to(config_.device));
  ComputeCopies::Scope bound(copies_);
  return run_blocks(x, /*checkpoint=*/false);
}

void Baseline::optimizer_step() {
  const auto& params = model().parameters();
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.tensor.grad());
  // fp16: the gradients carry the loss scale; a step with an inf or nan in any of them is skipped.
  const bool finite = scaler_.unscale(grads);
  for (size_t i = 0; i < params.size(); ++i) {
    auto p = params[i].tensor;
    if (finite)
      step_and_release_grad(config_.optimizer, p, optimizer_state_[i]);
    else
      p.mutable_grad() = torch::Tensor();
  }
  scaler_.update(finite);
}

NamedTensors Baseline::gradients() {
  std::vector<models::NamedParameter> grads;
  for (const auto& p : model().parameters()) {
    const auto& g = p.tensor.grad();
    // Reported unscaled: what the optimizer will apply.
    grads.push_back({p.name, g.defined() ? scaler_.unscaled(g) : torch::zeros_like(p.tensor), p.owner_block});
  }
  return host_copies(grads);
}

NamedTensors Baseline::parameters() { return host_copies(model().parameters()); }

NamedTensors Baseline::buffers() { return host_copies(model().buffers()); }

NamedTensors Baseline::training_state() {
  const auto& params = model().parameters();
  NamedTensors out = host_copies(params);
  for (size_t i = 0; i < params.size(); ++i) {
    STRATA_CHECK(!params[i].tensor.grad().defined(),
                 name_ << ": training_state() after optimizer_step, with no gradient accumulated ('" << params[i].name
                       << "' has one)");
    append_optimizer_state(out, params[i].name, optimizer_state_[i]);
  }
  for (auto& b : host_copies(model().buffers())) out.push_back(std::move(b));
  out.emplace_back("loss_scaler", scaler_.state());
  return out;
}

void Baseline::load_training_state(const NamedTensors& state) {
  const auto& params = model().parameters();
  // Everything checked before anything changes: a bad state leaves this strategy as it was.
  const auto by_name = checked_training_state(name_, params, model().buffers(), state);
  auto get = [&](const std::string& key) { return by_name.find(key); };
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& name = params[i].name;
    params[i].tensor.copy_(get(name).view(params[i].tensor.sizes()));
    optimizer_state_[i] = optimizer_state_from(by_name, name, params[i].tensor.sizes(), params[i].tensor.device());
  }
  load_buffers(model().buffers(), by_name);
  if (auto sc = get("loss_scaler"); sc.defined()) scaler_.restore(sc);
}

Stats Baseline::stats() {
  Stats s;
  s.bytes_h2d = bytes_h2d_;
  s.loss_scale = scaler_.scale();
  s.skipped_steps = scaler_.skipped_steps();
  auto& mem = s.devices[config_.device.str()];
  mem.resident_param_bytes = mem.peak_param_bytes = model().parameter_bytes();
  const auto alloc = device::allocator_stats(config_.device);
  mem.peak_allocated = alloc.peak_allocated;
  mem.peak_reserved = alloc.peak_reserved;
  return s;
}

void Baseline::reset_stats() {
  bytes_h2d_ = 0;
  device::reset_peak_stats(config_.device);
}

static const OptionDocumenter baseline_docs(
    {"baseline", "baseline_checkpoint"},
    {{"checkpoint", "0/1", "recompute every block but the last (the head) in backward"}});

STRATA_REGISTER_STRATEGY("baseline", "whole model on one device, plain autograd (the ground truth)",
                         [](const StrategyConfig& c) {
                           return std::make_unique<Baseline>("baseline", c, BaselineOptions::parse(c.options));
                         });

STRATA_REGISTER_STRATEGY("baseline_checkpoint", "baseline with every block but the last (the head) recomputed in backward",
                         [](const StrategyConfig& c) {
                           auto options = c.options;
                           options.emplace("checkpoint", "1");  // the variant's own; given, it must agree
                           const auto parsed = BaselineOptions::parse(options);
                           STRATA_CHECK(parsed.checkpoint, "baseline_checkpoint: option checkpoint='"
                                                               << options.at("checkpoint")
                                                               << "' contradicts the strategy; use baseline");
                           return std::make_unique<Baseline>("baseline_checkpoint", c, parsed);
                         });

}  // namespace strata
