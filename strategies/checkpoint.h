#pragma once
// Per-block activation checkpointing: the forward keeps only the block's input; the backward
// recomputes the block with autograd on and returns the input's and the parameters' gradients.
#include "models/model.h"

namespace strata {

/// block(x), recomputed in backward. Gradients reach `block`'s parameters through autograd
/// (so a tied parameter sums the gradients of all its uses, as without checkpointing).
torch::Tensor checkpointed_forward(models::Block& block, const torch::Tensor& x);

}  // namespace strata
