// BERT-like encoder + classifier (seed 000): learned token and position embeddings with a norm,
// post-norm bidirectional transformer blocks, a pooler on the first token, and a linear classifier
// over a configurable (very large) number of classes.
#include "models/builders.h"
#include "models/transformer.h"

namespace strata::models {
namespace {

class BertEmbedding : public Block {
 public:
  BertEmbedding(int64_t vocab, int64_t seq_len, int64_t width) {
    namespace nn = torch::nn;
    tokens_ = register_parameter("tokens", torch::empty({vocab, width}));
    positions_ = register_parameter("positions", torch::empty({seq_len, width}));
    norm_ = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({width})));
  }
  torch::Tensor forward(const torch::Tensor& idx) override {
    using torch::indexing::Slice;
    auto x = torch::embedding(tokens_, idx) + positions_.index({Slice(0, idx.size(1))});
    return norm_->forward(x);
  }
  int64_t activation_bytes(int64_t batch) const override { return batch * positions_.numel() * 2 * 4; }

 private:
  torch::Tensor tokens_, positions_;
  torch::nn::LayerNorm norm_{nullptr};
};

class BertPooler : public Block {
 public:
  explicit BertPooler(int64_t width) { dense_ = register_module("dense", torch::nn::Linear(width, width)); }
  torch::Tensor forward(const torch::Tensor& x) override {
    using torch::indexing::Slice;
    return torch::tanh(linear(dense_, x.index({Slice(), 0})));
  }

 private:
  torch::nn::Linear dense_{nullptr};
};

// Raw parameters rather than nn::Linear: its constructor would draw millions of classes' weights
// once more, single-threaded, before build_model initialises them anyway.
class Classifier : public Block, public LinearHead {
 public:
  Classifier(int64_t width, int64_t classes) {
    weight_ = register_parameter("weight", torch::empty({classes, width}));
    bias_ = register_parameter("bias", torch::empty({classes}));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return torch::nn::functional::linear(x, weight_, bias_); }
  // Logits, log-probabilities and the logits' gradient.
  int64_t activation_bytes(int64_t batch) const override { return batch * weight_.size(0) * 3 * 4; }
  torch::Tensor features(const torch::Tensor& x) override { return x; }
  torch::Tensor weight() const override { return weight_; }
  torch::Tensor bias() const override { return bias_; }

 private:
  torch::Tensor weight_, bias_;
};

}  // namespace

namespace detail {
std::vector<std::shared_ptr<Block>> build_bert_blocks(const ModelConfig& c) {
  std::vector<std::shared_ptr<Block>> blocks;
  blocks.push_back(std::make_shared<BertEmbedding>(c.vocab, c.seq_len, c.width));
  for (int64_t i = 0; i < c.depth; ++i)
  {
    auto block = std::make_shared<TransformerBlock>(c.width, c.heads, /*causal=*/false, /*pre_norm=*/false);
    block->set_sequence_length(c.seq_len);
    blocks.push_back(block);
  }
  blocks.push_back(std::make_shared<BertPooler>(c.width));
  blocks.push_back(std::make_shared<Classifier>(c.width, c.classes));
  return blocks;
}
}  // namespace detail

}  // namespace strata::models
