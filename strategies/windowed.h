#pragma once
// What strategies that bring a block's parameters in around its compute share (hook_offload
// streams them from host memory, sharded gathers them from every rank's shard): how a model's
// parameters fall into units that travel as one, and the per-block autograd function that asks for
// a block's window before its forward, its backward and its recompute, and hands back its
// gradients. LibTorch modules have no hooks; this function is where those hooks live.
#include <vector>

#include "strategies/checkpoint.h"

namespace strata {

/// Units: each block's own parameters (used by that block only) form one unit, and each parameter
/// several blocks share (a tied weight) is a unit of its own, so it travels once per use window.
struct UnitPlan {
  std::vector<std::vector<int64_t>> units;    ///< unit -> indices into model.parameters(): trainable first
  std::vector<std::vector<int64_t>> windows;  ///< block -> the units it uses
  std::vector<int> users;                     ///< unit -> blocks whose window holds it
};
UnitPlan plan_units(const models::BlockModel& model);

/// The strategy side of the per-block autograd function.
class WindowedRunner {
 public:
  virtual ~WindowedRunner() = default;
  virtual models::BlockModel& model() = 0;
  /// The block's parameters are usable on the compute device after this (and the next ones are
  /// on their way).
  virtual void before_compute(int64_t block, bool backward) = 0;
  virtual void after_compute(int64_t block, bool backward) = 0;
  /// Where the block's parameter gradients go one by one while its backward runs (block_gradients'
  /// sink), or none (the default). flush_gradients gets all of them at the end either way.
  virtual GradientSink gradient_sink(int64_t /*block*/) { return {}; }
  /// The block's parameter gradients, in its parameters() order (undefined where none).
  virtual void flush_gradients(int64_t block, const std::vector<torch::Tensor>& grads) = 0;
  /// True: the block's forward is recomputed in backward; false: its graph is kept from forward.
  virtual bool recompute_block(int64_t block) const = 0;
  /// Block -> its own graph from forward to backward, where kept.
  virtual std::vector<KeptGraph>& kept_graphs() = 0;
};

/// Block `block` of the runner's model on x, as an autograd operation. `anchor` requires grad, so
/// every block's output does (even from token ids) and every block's backward runs.
torch::Tensor run_windowed(WindowedRunner& runner, int64_t block, const torch::Tensor& x, const torch::Tensor& anchor);

}  // namespace strata
