// MLP: an input layer, depth-1 hidden layers (each Linear + GELU), and an output layer that is its
// own Linear or, tied, the transpose of the input layer's weight plus its own bias.
#include "models/builders.h"

namespace strata::models {
namespace {

class Dense : public Block {
 public:
  Dense(int64_t in, int64_t out) { linear_ = register_module("linear", torch::nn::Linear(in, out)); }
  torch::Tensor forward(const torch::Tensor& x) override { return torch::gelu(linear(linear_, x)); }
  const torch::Tensor& weight() const { return linear_->weight; }
  int64_t activation_bytes(int64_t batch) const override { return batch * linear_->weight.size(0) * 2 * 4; }

 private:
  torch::nn::Linear linear_{nullptr};
};

class Output : public Block, public LinearHead {
 public:
  // Untied: `weight` is [classes, width]. Tied: it is the input layer's [width, in_features]
  // weight, used transposed.
  Output(torch::Tensor weight, int64_t classes, bool tied) : tied_(tied) {
    weight_ = register_parameter("weight", std::move(weight));
    bias_ = register_parameter("bias", torch::empty({classes}));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return tied_ ? torch::matmul(x, weight_) + bias_ : torch::nn::functional::linear(x, weight_, bias_);
  }
  torch::Tensor features(const torch::Tensor& x) override { return x; }
  // Tied, the stored weight is the input layer's [width, in_features]; as a head it is its transpose.
  torch::Tensor weight() const override { return tied_ ? weight_.t() : weight_; }
  torch::Tensor bias() const override { return bias_; }
  int64_t activation_bytes(int64_t batch) const override { return batch * bias_.numel() * 3 * 4; }

 private:
  bool tied_;
  torch::Tensor weight_, bias_;
};

}  // namespace

namespace detail {
std::vector<std::shared_ptr<Block>> build_mlp_blocks(const ModelConfig& c) {
  std::vector<std::shared_ptr<Block>> blocks;
  auto input = std::make_shared<Dense>(c.in_features, c.width);
  blocks.push_back(input);
  for (int64_t i = 1; i < c.depth; ++i) blocks.push_back(std::make_shared<Dense>(c.width, c.width));
  auto weight = c.tied ? input->weight() : torch::empty({c.classes, c.width});
  blocks.push_back(std::make_shared<Output>(weight, c.classes, c.tied));
  return blocks;
}
}  // namespace detail

}  // namespace strata::models
