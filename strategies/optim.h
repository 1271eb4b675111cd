#pragma once
// The optimizers every strategy applies, one tensor at a time, wherever its master parameters live
// (host or device). One implementation, so a strategy and the baseline run the same operations.
#include <torch/torch.h>

#include <string>

namespace strata {

enum class OptimizerKind { sgd, adamw };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::sgd;
  double lr = 0.01;
  double momentum = 0.9;       ///< sgd
  double beta1 = 0.9;          ///< adamw
  double beta2 = 0.999;        ///< adamw
  double eps = 1e-8;           ///< adamw
  double weight_decay = 0.01;  ///< adamw, decoupled

  void validate() const;
  std::string to_string() const;
};
OptimizerKind parse_optimizer_kind(const std::string& name);

/// Per-parameter optimizer state.
struct OptimizerState {
  torch::Tensor exp_avg;     ///< sgd: momentum buffer; adamw: first moment
  torch::Tensor exp_avg_sq;  ///< adamw: second moment
  int64_t step = 0;
};

/// Applies one step to `param` in place from `grad` (same device and dtype). With `rounded` (a
/// tensor of param's size in a narrower dtype, e.g. the bf16 copy that travels to a device), also
/// writes the updated values, rounded as copy_() rounds, into it: in the same pass over memory
/// where the update is the host's fused one, else by a copy after it. `param`, `grad`, the state's
/// tensors and `rounded` must be distinct buffers (the host loop is compiled on that).
void optimizer_update(const OptimizerConfig& config, torch::Tensor& param, const torch::Tensor& grad,
                      OptimizerState& state, const torch::Tensor& rounded = {});

/// optimizer_update()'s step on contiguous fp32 host tensors, read from `from` and `from_state` and
/// written into `to` and `to_state` (and `rounded`, bf16 or fp16), leaving `from` as it was: the
/// step can be taken again, from the same start, for part of the tensor. With `rows` (1-D int64,
/// host, distinct), only those rows of the tensors seen as [numel / cols, cols] are read and
/// written. to_state.step becomes from_state.step + 1. An undefined from_state is a first step (for
/// AdamW it is given zero moments then, the one change to `from`'s side).
void optimizer_update_into(const OptimizerConfig& config, const torch::Tensor& from, OptimizerState& from_state,
                           const torch::Tensor& grad, torch::Tensor& to, OptimizerState& to_state,
                           const torch::Tensor& rounded = {}, const torch::Tensor& rows = {}, int64_t cols = 0);

/// optimizer_update_into() over the `count` elements from `first` of the tensors (the states' and
/// `rounded`'s too), seen as flat: the rest is neither read nor written. The states are made whole
/// where they do not exist yet, as the call over the whole makes them, so that spans taken one after
/// another, in any order, end as the one call over the whole would (an empty span makes them too,
/// and sets to_state.step, and writes nothing else).
void optimizer_update_span_into(const OptimizerConfig& config, const torch::Tensor& from, OptimizerState& from_state,
                                const torch::Tensor& grad, torch::Tensor& to, OptimizerState& to_state,
                                const torch::Tensor& rounded, int64_t first, int64_t count);

/// optimizer_update() from `param`'s own gradient, which is then released (set_to_none); nothing
/// happens to a parameter without a gradient.
void step_and_release_grad(const OptimizerConfig& config, torch::Tensor& param, OptimizerState& state);

}  // namespace strata
