#pragma once
// Per-block autograd, shared by the strategies that run a block inside a custom autograd function:
// keeping a block's own graph between forward and backward, taking its input's and parameters'
// gradients from it, per-block activation checkpointing built on the two, and the buffer
// bookkeeping that makes a recomputed forward leave buffers as the one forward did.
#include <functional>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/edge.h>

#include "models/model.h"

namespace strata {

/// A block's own autograd graph, kept from forward to backward without its output tensor (holding
/// the output would keep e.g. a head's logits alive through the loss).
struct KeptGraph {
  torch::autograd::Edge output;       ///< invalid when the output needs no gradient (nothing upstream trains)
  torch::Tensor input;                ///< the detached input leaf
  /// One edge per parameter of the block, in its parameters() order, as the graph used them; a
  /// frozen parameter (requires_grad=false) has none and gets an invalid edge.
  torch::autograd::edge_list params;
};

/// block(x) with autograd on, from a detached copy of x; returns the output, detached, and the
/// graph to take gradients from later. The parameters' edges are taken now: a parameter whose
/// data later moves to another device gets a new gradient accumulator, which the graph never saw.
std::pair<torch::Tensor, KeptGraph> run_keeping_graph(models::Block& block, const torch::Tensor& x);

/// The graph of block(x) recomputed in backward, for gradients only: the output's values are never
/// read, so the block may skip what only they need (models::GraphOnlyForward).
KeptGraph recompute_graph(models::Block& block, const torch::Tensor& x);

struct BlockGradients {
  torch::Tensor input;                ///< undefined for an input that needs none (token ids)
  std::vector<torch::Tensor> params;  ///< in the block's parameters() order; undefined where unused or frozen
};
/// Called with one parameter's gradient (its index in the block's parameters() order) as soon as
/// autograd has produced it, while the rest of the block's backward is still being issued, by the
/// autograd engine while block_gradients waits for it; the same tensor is returned in
/// BlockGradients::params too.
using GradientSink = std::function<void(size_t param, const torch::Tensor& grad)>;

/// Gradients of a kept graph's input and of the block's parameters for the output gradient
/// `grad_out`, returned rather than accumulated into .grad. Consumes the graph. With a `sink`, each
/// parameter's gradient is also handed to it as soon as it exists (a parameter left without one
/// never is), so its copy elsewhere can start before the block's backward has ended: where the
/// graph reaches every parameter and the input as leaves (a block's own graph does), else never.
BlockGradients block_gradients(KeptGraph graph, const std::vector<torch::Tensor>& grad_out,
                               const GradientSink& sink = {});

/// The gradient of a kept graph's input alone for `grad_out`, keeping the graph for the parameters'
/// gradients later (block_gradients with the same grad_out): a zero-bubble schedule's input-gradient
/// step. Undefined for an input that needs none or an output that depends on nothing that trains.
torch::Tensor input_gradient(const KeptGraph& graph, const std::vector<torch::Tensor>& grad_out);

/// block(x), recomputed in backward. Gradients reach `block`'s parameters through autograd
/// (so a tied parameter sums the gradients of all its uses, as without checkpointing).
torch::Tensor checkpointed_forward(models::Block& block, const torch::Tensor& x);

/// Copies of a block's buffers as they are now; empty for a block without buffers (no cost).
std::vector<torch::Tensor> snapshot_buffers(models::Block& block);

/// For a recompute: while alive, the block's buffers hold `before` (their values before the forward
/// being recomputed, from snapshot_buffers), so the recompute — and the backward of its graph, which
/// may read them — sees what that forward saw; on exit they get back the values they hold now. A buffer the forward updates (BatchNorm's running
/// statistics) is therefore updated once per step, as without recomputation, not twice.
class BuffersAsBefore {
 public:
  BuffersAsBefore(models::Block& block, const std::vector<torch::Tensor>& before);
  ~BuffersAsBefore();
  BuffersAsBefore(const BuffersAsBefore&) = delete;  // restores once
  BuffersAsBefore& operator=(const BuffersAsBefore&) = delete;

 private:
  std::vector<torch::Tensor> live_, after_;
};

/// The random generators a block's forward on `device` may draw from (the CPU's, and the device's own
/// where that is not the CPU), as they were before that forward, kept only for those it drew from:
/// a recompute replays the forward's draws (dropout's masks) from them, as PyTorch's checkpoint
/// does with its preserve_rng_state, so the gradients are those of the loss the forward returned.
struct RandomStates {
  torch::Tensor cpu;     ///< the CPU generator's state; undefined where the forward drew nothing from it
  torch::Tensor device;  ///< the device generator's; undefined likewise, or for a forward on the CPU
  torch::Device on{torch::kCPU};
};

/// The generators' states now, for a forward about to run on `device` (pass to drawn_since after it).
RandomStates random_states(const torch::Device& device);
/// `before` with each generator the forward left as it was dropped: nothing to replay for it, and
/// a recompute then leaves that generator alone.
RandomStates drawn_since(RandomStates before);

/// For a recompute: while alive, the generators a forward drew from are back where they were before
/// it (from drawn_since), so the recompute draws the same numbers; on exit they get back the states
/// they hold now, so later draws (the next step's forward) go on as if nothing had been recomputed.
/// Ranks that share one process share its generators: their draws interleave in whatever order the
/// threads run, with or without this.
class RandomAsBefore {
 public:
  explicit RandomAsBefore(const RandomStates& before);
  ~RandomAsBefore();
  RandomAsBefore(const RandomAsBefore&) = delete;  // restores once
  RandomAsBefore& operator=(const RandomAsBefore&) = delete;

 private:
  RandomStates now_;
};

/// ctx->saved_data entries for RandomStates, and back for the forward's `device` (its input's).
void save_random_states(torch::autograd::AutogradContext* ctx, const RandomStates& states);
RandomStates saved_random_states(torch::autograd::AutogradContext* ctx, const torch::Device& device);

}  // namespace strata
