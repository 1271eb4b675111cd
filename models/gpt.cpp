// GPT: token embedding (+ fixed sinusoidal positions), pre-norm causal transformer blocks, and a
// final norm + LM head whose weight is the token embedding (tied) or its own.
#include <cmath>

#include "models/builders.h"
#include "models/transformer.h"

namespace strata::models {
namespace {

// Fixed sinusoidal positions: no parameters, so the parameter count matches the seed's 871M model.
torch::Tensor sinusoidal_positions(int64_t T, int64_t d, const torch::TensorOptions& options) {
  auto pos = torch::arange(T, options).unsqueeze(1);
  auto i = torch::arange(d, options).unsqueeze(0);
  auto angle = pos / torch::pow(10000.0, (2.0 * torch::floor(i / 2.0)) / static_cast<double>(d));
  auto even = (torch::remainder(torch::arange(d, options.dtype(torch::kLong)), 2) == 0);
  return torch::where(even, torch::sin(angle), torch::cos(angle));
}

class GptEmbedding : public Block {
 public:
  GptEmbedding(int64_t vocab, int64_t width) {
    tokens_ = register_parameter("tokens", torch::empty({vocab, width}));
  }
  torch::Tensor forward(const torch::Tensor& idx) override {
    auto x = torch::embedding(tokens_, idx);
    return x + sinusoidal_positions(idx.size(1), tokens_.size(1), x.options());
  }
  const torch::Tensor& token_weight() const { return tokens_; }
  int64_t activation_bytes(int64_t batch) const override { return batch * seq_len_ * tokens_.size(1) * 4; }
  int64_t seq_len_ = 1;

 private:
  torch::Tensor tokens_;
};

class GptHead : public Block, public LinearHead {
 public:
  // `weight` is the token embedding when tied; a fresh [vocab, width] tensor otherwise.
  GptHead(int64_t width, torch::Tensor weight) {
    namespace nn = torch::nn;
    norm_ = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({width})));
    weight_ = register_parameter("weight", std::move(weight));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return torch::matmul(norm_->forward(x), weight_.t());
  }
  torch::Tensor features(const torch::Tensor& x) override { return norm_->forward(x); }
  // The normed input, then logits, log-probabilities and the logits' gradient over the vocabulary.
  int64_t activation_bytes(int64_t batch) const override {
    return batch * seq_len_ * (weight_.size(1) + 3 * weight_.size(0)) * 4;
  }
  int64_t seq_len_ = 1;
  torch::Tensor weight() const override { return weight_; }
  torch::Tensor bias() const override { return {}; }

 private:
  torch::nn::LayerNorm norm_{nullptr};
  torch::Tensor weight_;
};

}  // namespace

namespace detail {
std::vector<std::shared_ptr<Block>> build_gpt_blocks(const ModelConfig& c) {
  std::vector<std::shared_ptr<Block>> blocks;
  auto embedding = std::make_shared<GptEmbedding>(c.vocab, c.width);
  embedding->seq_len_ = c.seq_len;
  blocks.push_back(embedding);
  for (int64_t i = 0; i < c.depth; ++i) {
    auto block = std::make_shared<TransformerBlock>(c.width, c.heads, /*causal=*/true, /*pre_norm=*/true);
    block->set_sequence_length(c.seq_len);
    blocks.push_back(block);
  }
  auto head_weight = c.tied ? embedding->token_weight() : torch::empty({c.vocab, c.width});
  auto head = std::make_shared<GptHead>(c.width, head_weight);
  head->seq_len_ = c.seq_len;
  blocks.push_back(head);
  return blocks;
}
}  // namespace detail

}  // namespace strata::models
