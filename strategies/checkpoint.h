#pragma once
// Per-block autograd, shared by the strategies that run a block inside a custom autograd function:
// keeping a block's own graph between forward and backward, taking its input's and parameters'
// gradients from it, and per-block activation checkpointing built on the two.
#include <torch/csrc/autograd/edge.h>

#include "models/model.h"

namespace strata {

/// A block's own autograd graph, kept from forward to backward without its output tensor (holding
/// the output would keep e.g. a head's logits alive through the loss).
struct KeptGraph {
  torch::autograd::Edge output;
  torch::Tensor input;                ///< the detached input leaf
  torch::autograd::edge_list params;  ///< the block's parameters' gradient edges as the graph used them
};

/// block(x) with autograd on, from a detached copy of x; returns the output, detached, and the
/// graph to take gradients from later. The parameters' edges are taken now: a parameter whose
/// data later moves to another device gets a new gradient accumulator, which the graph never saw.
std::pair<torch::Tensor, KeptGraph> run_keeping_graph(models::Block& block, const torch::Tensor& x);

struct BlockGradients {
  torch::Tensor input;                ///< undefined for an input that needs none (token ids)
  std::vector<torch::Tensor> params;  ///< in the block's parameters() order, undefined where unused
};
/// Gradients of a kept graph's input and of the block's parameters for the output gradient
/// `grad_out`, returned rather than accumulated into .grad. Consumes the graph.
BlockGradients block_gradients(KeptGraph graph, const std::vector<torch::Tensor>& grad_out);

/// block(x), recomputed in backward. Gradients reach `block`'s parameters through autograd
/// (so a tied parameter sums the gradients of all its uses, as without checkpointing).
torch::Tensor checkpointed_forward(models::Block& block, const torch::Tensor& x);

}  // namespace strata
