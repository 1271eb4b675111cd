#pragma once
// The transformer layer shared by the GPT (pre-norm, causal) and the BERT-like encoder (post-norm,
// bidirectional).
#include "models/model.h"

namespace strata::models {

class TransformerBlock : public Block {
 public:
  TransformerBlock(int64_t width, int64_t heads, bool causal, bool pre_norm);
  torch::Tensor forward(const torch::Tensor& x) override;
  void set_sequence_length(int64_t seq_len) { seq_len_ = seq_len; }
  /// About 16 floats per token and feature: input, two norms, q/k/v, attention output, the two
  /// residual sums, and the 4x-wide hidden layer before and after its GELU.
  int64_t activation_bytes(int64_t batch) const override { return batch * seq_len_ * width_ * 16 * 4; }

 private:
  torch::Tensor attention(const torch::Tensor& x);
  torch::Tensor feed_forward(const torch::Tensor& x, bool graph_only);

  int64_t heads_, width_, seq_len_ = 1;
  bool causal_, pre_norm_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};

}  // namespace strata::models
