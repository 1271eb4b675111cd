#pragma once
// The ground truth: the whole model on one device, plain autograd, optionally with per-block
// activation checkpointing. Every parity property compares a strategy against this.
#include <optional>

#include "strategies/strategy.h"

namespace strata {

struct BaselineOptions {
  bool checkpoint = false;  ///< recompute each block in backward instead of keeping activations

  static BaselineOptions parse(const std::map<std::string, std::string>& options);
  void validate() const {}
};

class Baseline : public Strategy {
 public:
  Baseline(std::string name, const StrategyConfig& config, BaselineOptions options);

  std::string name() const override { return name_; }
  double train_step(const models::Batch& batch) override;
  torch::Tensor forward(const torch::Tensor& input) override;
  void optimizer_step() override;
  NamedTensors gradients() override;
  NamedTensors parameters() override;
  NamedTensors buffers() override;
  NamedTensors training_state() override;
  void load_training_state(const NamedTensors& state) override;
  Stats stats() override;
  void reset_stats() override;
  /// Every policy: compute copies of the parameters, fp32 masters, loss scaling for fp16.
  bool supports(const PrecisionPolicy&) const override { return true; }

 protected:
  void attach_model(models::BlockModel model) override;

 private:
  torch::Tensor run_blocks(torch::Tensor x, bool checkpoint);
  models::BlockModel& model();

  std::string name_;
  StrategyConfig config_;
  BaselineOptions options_;
  std::optional<models::BlockModel> model_;
  std::vector<OptimizerState> optimizer_state_;
  ComputeCopies copies_;
  LossScaler scaler_;
  int64_t bytes_h2d_ = 0;
};

}  // namespace strata
