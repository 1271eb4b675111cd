#pragma once
// The transformer layer shared by the GPT (pre-norm, causal) and the BERT-like encoder (post-norm,
// bidirectional).
#include "models/model.h"

namespace strata::models {

class TransformerBlock : public Block {
 public:
  TransformerBlock(int64_t width, int64_t heads, bool causal, bool pre_norm);
  torch::Tensor forward(const torch::Tensor& x) override;

 private:
  torch::Tensor attention(const torch::Tensor& x);
  torch::Tensor feed_forward(const torch::Tensor& x);

  int64_t heads_;
  bool causal_, pre_norm_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};

}  // namespace strata::models
