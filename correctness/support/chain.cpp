#include "correctness/support/chain.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <map>
#include <sstream>

#include "models/check.h"
#include "models/text.h"
#include "strategies/options.h"

namespace strata::correctness {
namespace {

namespace nn = torch::nn;

// Token "conv3" -> 3; "shared" with no digits -> 0.
int64_t suffix_number(const std::string& token, const std::string& prefix) {
  const auto digits = token.substr(prefix.size());
  if (digits.empty()) return 0;
  STRATA_CHECK(digits.find_first_not_of("0123456789") == std::string::npos,
               "chain block '" << token << "': '" << digits << "' after " << prefix << " is not a number");
  return std::stoll(digits);
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

class Dense : public models::Block {
 public:
  Dense(int64_t in, int64_t out) { linear_ = register_module("linear", nn::Linear(in, out)); }
  // A linear map whose weight is `weight` (registered under this block too: a shared parameter).
  Dense(torch::Tensor weight, int64_t out) {
    weight_ = register_parameter("weight", std::move(weight));
    bias_ = register_parameter("bias", torch::empty({out}));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return linear_ ? linear_->forward(x) : nn::functional::linear(x, weight_, bias_);
  }
  nn::Linear linear_{nullptr};
  torch::Tensor weight_, bias_;
};

class Activation : public models::Block {
 public:
  torch::Tensor forward(const torch::Tensor& x) override { return torch::gelu(x); }
};

class Norm : public models::Block {
 public:
  explicit Norm(int64_t width) { norm_ = register_module("norm", nn::BatchNorm1d(width)); }
  torch::Tensor forward(const torch::Tensor& x) override { return norm_->forward(x); }
  nn::BatchNorm1d norm_{nullptr};
};

class Conv : public models::Block {
 public:
  Conv(int64_t width, int64_t channels) : channels_(channels) {
    conv_ = register_module("conv", nn::Conv1d(nn::Conv1dOptions(channels, channels, 3).padding(1)));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return conv_->forward(x.reshape({x.size(0), channels_, -1})).reshape({x.size(0), -1});
  }
  int64_t channels_;
  nn::Conv1d conv_{nullptr};
};

class Table : public models::Block {
 public:
  explicit Table(int64_t width) {
    scale_ = register_buffer("scale", torch::empty({width}));
    shift_ = register_buffer("shift", torch::empty({width}));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return x * scale_ + shift_; }
  torch::Tensor scale_, shift_;
};

class Head : public models::Block, public models::LinearHead {
 public:
  Head(int64_t width, int64_t classes) {
    weight_ = register_parameter("weight", torch::empty({classes, width}));
    bias_ = register_parameter("bias", torch::empty({classes}));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return nn::functional::linear(x, weight_, bias_); }
  torch::Tensor features(const torch::Tensor& x) override { return x; }
  torch::Tensor weight() const override { return weight_; }
  torch::Tensor bias() const override { return bias_; }
  torch::Tensor weight_, bias_;
};

}  // namespace

void ChainSpec::validate() const {
  STRATA_CHECK(in_features >= 1, "chain: in=" << in_features << " must be at least 1");
  STRATA_CHECK(width >= 1, "chain: width=" << width << " must be at least 1");
  STRATA_CHECK(classes >= 2, "chain: classes=" << classes << " must be at least 2");
  for (const auto& t : blocks) {
    if (t == "lin" || t == "act" || t == "bn" || t == "table" || t == "frozen" || t == "frozen_block") continue;
    if (starts_with(t, "conv")) {
      const auto c = suffix_number(t, "conv");
      STRATA_CHECK(c >= 1 && width % c == 0,
                   "chain: block '" << t << "' needs a channel count dividing width=" << width);
      continue;
    }
    if (starts_with(t, "shared")) {
      suffix_number(t, "shared");
      continue;
    }
    STRATA_FAIL("chain: unknown block '" << t << "'; known: lin, act, bn, conv<c>, table, frozen, frozen_block, shared<g>");
  }
}

std::string ChainSpec::to_string() const {
  std::ostringstream out;
  out << "chain(in=" << in_features << " width=" << width << " classes=" << classes << " blocks=";
  for (size_t i = 0; i < blocks.size(); ++i) out << (i ? "," : "") << blocks[i];
  out << ")";
  return out.str();
}

ChainSpec ChainSpec::parse(const std::string& text) {
  const auto call = models::parse_call(text);
  STRATA_CHECK(call.name == "chain", "'" << text << "' is not a chain(...)");
  for (const auto& [key, value] : call.args)
    STRATA_CHECK(key == "in" || key == "width" || key == "classes" || key == "blocks",
                 "'" << text << "': chain has no field '" << key << "'");
  ChainSpec spec;
  spec.in_features = models::int_arg(call, "in");
  spec.width = models::int_arg(call, "width");
  spec.classes = models::int_arg(call, "classes");
  auto blocks = call.args.find("blocks");
  STRATA_CHECK(blocks != call.args.end(), "'" << text << "': chain needs blocks=... (may be empty)");
  spec.blocks = split(blocks->second);
  spec.validate();
  return spec;
}

bool ChainSpec::has(const std::string& prefix) const {
  return std::any_of(blocks.begin(), blocks.end(), [&](const std::string& t) { return starts_with(t, prefix); });
}

models::BlockModel ChainSpec::build(uint64_t seed) const {
  validate();
  const int64_t w = width;
  std::vector<std::shared_ptr<models::Block>> list;
  std::map<int64_t, torch::Tensor> shared;
  list.push_back(std::make_shared<Dense>(in_features, w));
  for (const auto& t : blocks) {
    if (t == "lin") {
      list.push_back(std::make_shared<Dense>(w, w));
    } else if (t == "act") {
      list.push_back(std::make_shared<Activation>());
    } else if (t == "bn") {
      list.push_back(std::make_shared<Norm>(w));
    } else if (t == "table") {
      list.push_back(std::make_shared<Table>(w));
    } else if (t == "frozen" || t == "frozen_block") {
      auto block = std::make_shared<Dense>(w, w);
      block->linear_->weight.requires_grad_(false);
      if (t == "frozen_block") block->linear_->bias.requires_grad_(false);
      list.push_back(block);
    } else if (starts_with(t, "conv")) {
      list.push_back(std::make_shared<Conv>(w, suffix_number(t, "conv")));
    } else {  // shared<g>
      auto& weight = shared[suffix_number(t, "shared")];
      if (!weight.defined()) weight = torch::empty({w, w});
      list.push_back(std::make_shared<Dense>(weight, w));
    }
  }
  list.push_back(std::make_shared<Head>(w, classes));
  models::ModelConfig config;
  config.kind = models::ModelKind::custom;
  models::BlockModel model(config, std::move(list));

  // Values drawn in canonical order from one generator: scaled so activations stay of order one
  // through any chain (weights ~ 1/sqrt(fan-in)), biases and tables away from zero, so nothing is
  // exact by accident.
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed * 0x9E3779B97F4A7C15ULL + 0xC4A1);
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (const auto& p : model.parameters()) {
    auto& t = p.tensor;
    if (t.dim() >= 2) {
      const double fan_in = static_cast<double>(t.numel() / t.size(0));
      t.normal_(0.0, 1.0 / std::sqrt(fan_in), gen);
    } else if (ends_with(p.name, "norm.weight")) {
      t.normal_(1.0, 0.1, gen);
    } else {
      t.normal_(0.0, 0.1, gen);
    }
  }
  for (const auto& b : model.buffers()) {
    auto& t = b.tensor;
    if (ends_with(b.name, ".scale")) t.normal_(1.0, 0.3, gen);
    if (ends_with(b.name, ".shift")) t.normal_(0.0, 0.3, gen);
  }
  return model;
}

models::Batch ChainSpec::make_batch(int64_t batch_size, uint64_t seed) const {
  STRATA_CHECK(batch_size >= 1, "batch_size=" << batch_size << " must be at least 1");
  auto gen = at::detail::createCPUGenerator(seed ^ 0xC4A1BA7CULL);
  auto x = torch::randn({batch_size, in_features}, gen);
  auto y = torch::randint(classes, {batch_size}, gen, torch::TensorOptions().dtype(torch::kLong));
  return {x, y};
}

}  // namespace strata::correctness
