// The reference models: deterministic construction, canonical names with tied parameters once,
// parameter counts against the architecture's formulas, and sane outputs.
#include <gtest/gtest.h>

#include <ATen/record_function.h>

#include <cmath>

#include "correctness/support/test_device.h"
#include "models/model.h"
#include "models/sizes.h"

namespace strata {
namespace {

using models::ModelConfig;
using models::ModelKind;

ModelConfig gpt(int64_t depth, int64_t width, int64_t vocab, bool tied) {
  ModelConfig c;
  c.kind = ModelKind::gpt; c.depth = depth; c.width = width; c.heads = 2; c.vocab = vocab; c.seq_len = 5; c.tied = tied;
  return c;
}

TEST(Models, same_seed_same_parameters_other_seed_other_parameters) {
  for (const auto& name : {"mlp-tiny", "mlp-tied-tiny", "gpt-tiny", "bert-tiny"}) {
    const auto& config = models::preset(name).config;
    auto a = models::build_model(config, 7), b = models::build_model(config, 7), c = models::build_model(config, 8);
    ASSERT_EQ(a.parameters().size(), b.parameters().size());
    bool any_differs = false;
    for (size_t i = 0; i < a.parameters().size(); ++i) {
      EXPECT_EQ(a.parameters()[i].name, b.parameters()[i].name);
      EXPECT_TRUE(torch::equal(a.parameters()[i].tensor, b.parameters()[i].tensor)) << name << " " << a.parameters()[i].name;
      any_differs |= !torch::equal(a.parameters()[i].tensor, c.parameters()[i].tensor);
    }
    EXPECT_TRUE(any_differs) << name;
  }
}

TEST(Models, gpt_parameter_count_follows_the_architecture) {
  // Per block: qkv 3d^2+3d, proj d^2+d, fc1 4d^2+4d, fc2 4d^2+d, two norms 4d = 12d^2+13d.
  // Embedding V*d (positions are fixed sinusoids), final norm 2d, untied head another V*d.
  for (bool tied : {true, false}) {
    const int64_t L = 3, d = 6, V = 11;
    auto model = models::build_model(gpt(L, d, V, tied), 0);
    const int64_t expected = L * (12 * d * d + 13 * d) + V * d + 2 * d + (tied ? 0 : V * d);
    EXPECT_EQ(model.parameter_count(), expected) << "tied=" << tied;
    EXPECT_EQ(model.has_tied_parameters(), tied);
  }
  // The measurement model: 805.7M parameters in blocks, 871M in all (d=2048, L=16, V=32000).
  const int64_t d = 2048, L = 16, V = 32000;
  EXPECT_EQ(L * (12 * d * d + 13 * d), 805732352);
  EXPECT_NEAR(static_cast<double>(L * (12 * d * d + 13 * d) + V * d + 2 * d) / 1e6, 871.3, 0.05);
}

TEST(Models, tied_parameter_is_one_tensor_under_its_first_name) {
  auto model = models::build_model(gpt(2, 4, 9, true), 0);
  const auto& params = model.parameters();
  const auto& uses = model.block_parameters();
  ASSERT_EQ(params.front().name, "0.tokens");
  const int64_t head = model.num_blocks() - 1;
  EXPECT_NE(std::find(uses[head].begin(), uses[head].end(), 0), uses[head].end()) << "head does not use 0.tokens";
  for (const auto& p : params) EXPECT_NE(p.name, std::to_string(head) + ".weight");
  // Same tensor in both blocks.
  auto head_params = model.blocks()[head]->named_parameters();
  EXPECT_EQ(head_params["weight"].unsafeGetTensorImpl(), params.front().tensor.unsafeGetTensorImpl());
}

TEST(Models, parameter_count_from_the_config_equals_the_built_models) {
  // Every preset small enough to build here, and each kind tied and untied at other sizes: the
  // count that --list prints for presets too large to build must be the built model's.
  int built = 0;
  for (const auto& p : models::presets()) {
    if (models::parameter_count(p.config) > 30'000'000) continue;
    EXPECT_EQ(models::parameter_count(p.config), models::build_model(p.config, 0).parameter_count()) << p.name;
    ++built;
  }
  EXPECT_GE(built, 5);
  for (const char* text : {"mlp(depth=3 width=24 classes=6 in_features=6 tied=1)", "mlp(depth=1 width=8 classes=3 in_features=5 tied=0)",
                           "gpt(depth=3 width=16 heads=2 vocab=40 seq_len=6 tied=0)",
                           "bert(depth=1 width=16 heads=4 vocab=30 seq_len=5 classes=7)"}) {
    const auto c = models::ModelConfig::parse(text);
    EXPECT_EQ(models::parameter_count(c), models::build_model(c, 0).parameter_count()) << text;
  }
}

TEST(Models, mlp_tied_output_uses_the_input_weight) {
  const auto c = models::preset("mlp-tied-tiny").config;
  auto model = models::build_model(c, 0);
  EXPECT_TRUE(model.has_tied_parameters());
  const int64_t d = c.width, in = c.in_features, L = c.depth;
  // input in*d+d, hidden (L-1)(d*d+d), output bias only (weight is the input's).
  EXPECT_EQ(model.parameter_count(), in * d + d + (L - 1) * (d * d + d) + c.classes);
}

TEST(Models, outputs_have_the_right_shape_and_an_initial_loss_near_log_classes) {
  const auto& device = test::device();
  for (const auto& name : {"mlp-tiny", "mlp-tied-tiny", "gpt-tiny", "bert-tiny"}) {
    const auto& p = models::preset(name);
    auto model = models::build_model(p.config, 3);
    for (auto& b : model.blocks()) b->to(device);
    auto batch = models::make_batch(p.config, p.batch_size, 4);
    torch::NoGradGuard no_grad;
    auto x = batch.input.to(device);
    for (auto& b : model.blocks()) x = b->forward(x);
    const int64_t classes = p.config.kind == ModelKind::gpt ? p.config.vocab : p.config.classes;
    EXPECT_EQ(x.size(-1), classes) << name;
    EXPECT_EQ(x.size(0), p.batch_size) << name;
    const double loss = model.loss(x, batch.target.to(device)).item<double>();
    // Initial weights are N(0, 0.02): logits are near zero, so the loss is near log(C).
    EXPECT_NEAR(loss, std::log(static_cast<double>(classes)), 0.5) << name;
  }
}

TEST(Models, batches_are_deterministic_and_in_range) {
  const auto c = models::preset("gpt-tiny").config;
  auto a = models::make_batch(c, 3, 11), b = models::make_batch(c, 3, 11);
  EXPECT_TRUE(torch::equal(a.input, b.input));
  EXPECT_TRUE(torch::equal(a.target, b.target));
  EXPECT_GE(a.input.min().item<int64_t>(), 0);
  EXPECT_LT(a.input.max().item<int64_t>(), c.vocab);
  // GPT targets are the inputs shifted by one token.
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::equal(a.input.index({Slice(), Slice(1, torch::indexing::None)}),
                           a.target.index({Slice(), Slice(0, c.seq_len - 1)})));
}

// FLOPs of the matrix products a forward really runs, counted from the operators' input shapes as
// the dispatcher sees them (two per multiply-add; attention as one fused operator counts its two
// products over the full square, as the formula does). Independent of models/model.cpp's formula.
namespace flop_count {
thread_local double total = 0;
thread_local int inside_attention = 0;
struct Attention : at::ObserverContext {};

int64_t dim(const c10::IValue& v, int64_t i) { return v.toTensor().size(i); }

std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  if (inside_attention > 0) return nullptr;  // a fused operator's own pieces are counted with it
  const bool product = name == "aten::mm" || name == "aten::addmm" || name == "aten::bmm" || name == "aten::baddbmm";
  const bool attention = name.find("scaled_dot_product") != std::string::npos;
  if (!product && !attention) return nullptr;  // inputs() of other records may not be captured
  const auto in = fn.inputs();
  if (in.size() < 3 && name != "aten::mm" && name != "aten::bmm") return nullptr;
  if (in.size() < 2) return nullptr;
  if (name == "aten::mm") total += 2.0 * dim(in[0], 0) * dim(in[0], 1) * dim(in[1], 1);
  if (name == "aten::addmm") total += 2.0 * dim(in[1], 0) * dim(in[1], 1) * dim(in[2], 1);
  if (name == "aten::bmm") total += 2.0 * dim(in[0], 0) * dim(in[0], 1) * dim(in[0], 2) * dim(in[1], 2);
  if (name == "aten::baddbmm") total += 2.0 * dim(in[1], 0) * dim(in[1], 1) * dim(in[1], 2) * dim(in[2], 2);
  if (name.find("scaled_dot_product") != std::string::npos) {
    const auto& q = in[0].toTensor();
    total += 4.0 * q.size(0) * q.size(1) * q.size(2) * in[1].toTensor().size(2) * q.size(3);
    ++inside_attention;
    return std::make_unique<Attention>();
  }
  return nullptr;
}
void end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx) --inside_attention;
}

double of_forward(models::BlockModel& model, const torch::Tensor& input) {
  torch::NoGradGuard no_grad;
  // One forward first: work a library does once on first use (seen in a Debug build: one extra
  // product of the first layer's shape) is not the model's.
  auto warm = input;
  for (auto& b : model.blocks()) warm = b->forward(warm);
  total = 0;
  auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(start, end).needsInputs(true));
  auto x = input;
  for (auto& b : model.blocks()) x = b->forward(x);
  at::removeCallback(handle);
  return total;
}
}  // namespace flop_count

TEST(Models, flops_per_item_match_the_products_a_forward_runs) {
  for (const auto* name : {"mlp-tiny", "mlp-tied-tiny", "gpt-tiny", "bert-tiny"}) {
    auto config = models::preset(name).config;
    auto model = models::build_model(config, 0);
    const int64_t batch = 3;
    const double counted = flop_count::of_forward(model, models::make_batch(config, batch, 1).input);
    EXPECT_GT(counted, 0) << name;
    EXPECT_NEAR(model.forward_flops_per_item() * model.items_per_batch(batch), counted, 1e-9 * counted) << name;
  }
}

}  // namespace
}  // namespace strata

#include "correctness/support/chain.h"
#include "models/check.h"

namespace strata {
namespace {

TEST(Models, config_text_reads_back) {
  for (const auto& p : models::presets()) {
    const auto text = p.config.to_string();
    EXPECT_EQ(models::ModelConfig::parse(text).to_string(), text);
  }
  EXPECT_THROW(models::ModelConfig::parse("gpt(depth=1 width=2 heads=1 vocab=5 seq_len=2 tied=0 colour=3)"), Error);
  EXPECT_THROW(models::ModelConfig::parse("gpt(depth=1 width=2)"), Error);
  EXPECT_THROW(models::ModelConfig::parse("gpt(depth=x width=2 heads=1 vocab=5 seq_len=2 tied=0)"), Error);
}

TEST(Models, buffers_have_canonical_names_and_a_shared_one_appears_once) {
  auto model = correctness::ChainSpec::parse("chain(in=2 width=4 classes=3 blocks=bn,table)").build(0);
  std::vector<std::string> names;
  for (const auto& b : model.buffers()) names.push_back(b.name);
  EXPECT_EQ(names, (std::vector<std::string>{"1.norm.running_mean", "1.norm.running_var", "1.norm.num_batches_tracked",
                                             "2.scale", "2.shift"}));
  // A user's table held by two blocks is one buffer, under the first block's name.
  struct Holder : models::Block {
    explicit Holder(torch::Tensor t) { table = register_buffer("table", std::move(t)); }
    torch::Tensor forward(const torch::Tensor& x) override { return x + table; }
    torch::Tensor table;
  };
  auto shared = torch::ones({4});
  models::BlockModel two(models::ModelConfig{}, {std::make_shared<Holder>(shared), std::make_shared<Holder>(shared)});
  ASSERT_EQ(two.buffers().size(), 1u);
  EXPECT_EQ(two.buffers()[0].name, "0.table");
  EXPECT_EQ(two.block_buffers()[1], std::vector<int64_t>{0});
}

TEST(Models, loss_leaves_ignored_targets_out_of_sum_and_count) {
  auto model = models::build_model(models::preset("mlp-tiny").config, 0);
  auto logits = torch::randn({5, 8});
  const int64_t ignored = models::kIgnoreIndex;
  auto target = torch::tensor({int64_t{1}, ignored, int64_t{3}, ignored, int64_t{0}});
  auto kept = torch::tensor({0, 2, 4});
  const double with_ignored = model.loss(logits, target).item<double>();
  const double on_kept = model.loss(logits.index_select(0, kept), target.index_select(0, kept)).item<double>();
  EXPECT_NEAR(with_ignored, on_kept, 1e-6);
}

TEST(Models, chains_are_deterministic_and_freeze_what_they_say) {
  const auto spec = correctness::ChainSpec::parse("chain(in=3 width=4 classes=5 blocks=frozen,shared0,frozen_block,shared0)");
  auto a = spec.build(9), b = spec.build(9);
  ASSERT_EQ(a.parameters().size(), b.parameters().size());
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(a.parameters()[i].tensor, b.parameters()[i].tensor)) << a.parameters()[i].name;
  std::map<std::string, bool> trains;
  for (const auto& p : a.parameters()) trains[p.name] = p.tensor.requires_grad();
  EXPECT_FALSE(trains.at("1.linear.weight"));
  EXPECT_TRUE(trains.at("1.linear.bias"));
  EXPECT_FALSE(trains.at("3.linear.weight"));
  EXPECT_FALSE(trains.at("3.linear.bias"));
  // shared0 is one parameter of blocks 2 and 4, named after block 2.
  EXPECT_TRUE(a.has_tied_parameters());
  EXPECT_EQ(trains.count("4.weight"), 0u);
  EXPECT_TRUE(trains.at("2.weight"));
}

}  // namespace
}  // namespace strata
