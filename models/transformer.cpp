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
  auto qkv = qkv_->forward(x).view({B, T, 3, heads_, C / heads_}).permute({2, 0, 3, 1, 4});
  auto y = compat::attention(qkv[0], qkv[1], qkv[2], causal_);
  return proj_->forward(y.transpose(1, 2).reshape({B, T, C}));
}

torch::Tensor TransformerBlock::feed_forward(const torch::Tensor& x) {
  return fc2_->forward(torch::gelu(fc1_->forward(x)));
}

torch::Tensor TransformerBlock::forward(const torch::Tensor& x) {
  if (pre_norm_) {
    auto h = x + attention(ln1_->forward(x));
    return h + feed_forward(ln2_->forward(h));
  }
  auto h = ln1_->forward(x + attention(x));
  return ln2_->forward(h + feed_forward(h));
}

}  // namespace strata::models
