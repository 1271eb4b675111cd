#include "models/transformer.h"

#include "models/compat.h"

namespace strata::models {

TransformerBlock::TransformerBlock(int64_t width, int64_t heads, bool causal, bool pre_norm)
    : heads_(heads), width_(width), causal_(causal), pre_norm_(pre_norm) {
  namespace nn = torch::nn;
  ln1_ = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({width})));
  qkv_ = register_module("qkv", nn::Linear(width, 3 * width));
  proj_ = register_module("proj", nn::Linear(width, width));
  ln2_ = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({width})));
  fc1_ = register_module("fc1", nn::Linear(width, 4 * width));
  fc2_ = register_module("fc2", nn::Linear(4 * width, width));
}

torch::Tensor TransformerBlock::attention(const torch::Tensor& x) {
  const auto B = x.size(0), T = x.size(1), C = x.size(2);
  // unbind, not qkv[0..2]: the backward of three selects fills three zeroed copies of the whole
  // tensor and sums them; unbind's stacks the three gradients once.
  const auto qkv = linear(qkv_, x).view({B, T, 3, heads_, C / heads_}).permute({2, 0, 3, 1, 4}).unbind(0);
  auto y = compat::attention(qkv[0], qkv[1], qkv[2], causal_);
  return linear(proj_, y.transpose(1, 2).reshape({B, T, C}));
}

torch::Tensor TransformerBlock::feed_forward(const torch::Tensor& x, bool graph_only) {
  const auto hidden = torch::gelu(linear(fc1_, x));
  return graph_only ? linear_graph_only(fc2_, hidden) : linear(fc2_, hidden);
}

torch::Tensor TransformerBlock::forward(const torch::Tensor& x) {
  if (pre_norm_) {
    auto h = x + attention(ln1_->forward(x));
    // The sum's backward reads no values: a recompute for gradients skips the last product.
    return h + feed_forward(ln2_->forward(h), GraphOnlyForward::active());
  }
  auto h = ln1_->forward(x + attention(x));
  return ln2_->forward(h + feed_forward(h, /*graph_only=*/false));  // the norm's backward reads its input
}

}  // namespace strata::models
