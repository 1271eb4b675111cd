// A trainer of its own, using strata as a library: its own blocks and training loop, a strategy
// picked by name from the registry, a strategy it registers itself, the parity checker on both, and
// the parity property over generated models for its own strategy (rapidcheck; RC_PARAMS applies).
//
//   trainer [STRATEGY=hook_offload] [STEPS=30]     exit 0 when training and every parity check pass
#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "correctness/support/generators.h"
#include "correctness/support/parity.h"
#include "strategies/strategy.h"

namespace {

using strata::models::Block;

constexpr int64_t kFeatures = 12, kWidth = 32, kClasses = 5;

// The trainer's blocks: a projection, residual blocks with a norm, a head.
struct Project : Block {
  Project() : fc(register_module("fc", torch::nn::Linear(kFeatures, kWidth))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return torch::gelu(fc(x)); }
  torch::nn::Linear fc;
};

struct Residual : Block {
  Residual()
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        fc(register_module("fc", torch::nn::Linear(kWidth, kWidth))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return x + fc(torch::relu(norm(x))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc;
};

struct Head : Block {
  Head() : fc(register_module("fc", torch::nn::Linear(kWidth, kClasses))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return fc(x); }
  torch::nn::Linear fc;
};

strata::models::BlockModel build_model(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<std::shared_ptr<Block>> blocks{std::make_shared<Project>()};
  for (int i = 0; i < 3; ++i) blocks.push_back(std::make_shared<Residual>());
  blocks.push_back(std::make_shared<Head>());
  strata::models::ModelConfig config;
  config.kind = strata::models::ModelKind::custom;
  return strata::models::BlockModel(config, blocks);
}

strata::models::Batch make_batch(int64_t size, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto input = torch::randn({size, kFeatures}, gen);
  // Learnable targets: the class of the largest of the first kClasses features.
  auto target = input.narrow(1, 0, kClasses).argmax(1);
  return {input, target};
}

// The trainer's own strategy: the baseline, counting the steps it trains.
class Counting : public strata::Strategy {
 public:
  explicit Counting(const strata::StrategyConfig& config) : inner_(strata::Registry::create("baseline", config)) {}
  std::string name() const override { return "counting"; }
  double train_step(const strata::models::Batch& batch) override {
    ++steps_;
    return inner_->train_step(batch);
  }
  torch::Tensor forward(const torch::Tensor& input) override { return inner_->forward(input); }
  void optimizer_step() override { inner_->optimizer_step(); }
  strata::NamedTensors gradients() override { return inner_->gradients(); }
  strata::NamedTensors parameters() override { return inner_->parameters(); }
  strata::NamedTensors buffers() override { return inner_->buffers(); }
  strata::Stats stats() override { return inner_->stats(); }
  void reset_stats() override { inner_->reset_stats(); }
  int64_t steps() const { return steps_; }

 protected:
  void attach_model(strata::models::BlockModel model) override { inner_->attach(std::move(model)); }

 private:
  std::unique_ptr<strata::Strategy> inner_;
  int64_t steps_ = 0;
};

STRATA_REGISTER_STRATEGY("counting", "the trainer's own: the baseline, counting its steps",
                         [](const strata::StrategyConfig& c) { return std::make_unique<Counting>(c); });

int fail(const std::string& what) {
  std::cerr << "trainer: " << what << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string name = argc > 1 ? argv[1] : "hook_offload";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 30;

  // Every strategy of the package registered itself, though this program names none of them.
  const auto names = strata::Registry::names();
  for (const char* builtin : {"baseline", "baseline_checkpoint", "hook_offload", "manual_split", "sharded",
                              "pipeline_1f1b", "counting"})
    if (std::find(names.begin(), names.end(), builtin) == names.end())
      return fail(std::string("strategy '") + builtin + "' is not registered (lost at link time?)");

  // The training loop: the strategy owns placement; the trainer owns the data and the schedule.
  strata::StrategyConfig config;
  config.optimizer.kind = strata::OptimizerKind::adamw;
  config.optimizer.lr = 3e-3;
  auto strategy = strata::Registry::create(name, config);
  strategy->attach(build_model(0));
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    last = strategy->train_step(make_batch(64, 100 + step % 4));
    strategy->optimizer_step();
    if (step == 0) first = last;
    if (step % 10 == 0 || step == steps - 1) std::cout << name << " step " << step << " loss " << last << "\n";
  }
  if (!(last < 0.8 * first)) return fail(name + " did not learn: loss " + std::to_string(first) + " -> " + std::to_string(last));

  // The parity checker on the trainer's own model, for the chosen strategy and its own.
  strata::correctness::ParityCase c;
  c.own = strata::correctness::OwnModel{"trainer-mlp", build_model, make_batch};
  c.batch_size = 4;
  c.seed = 7;
  for (const std::string& checked : {name, std::string("counting")}) {
    const auto result = strata::correctness::check_parity(checked, c, torch::Device(torch::kCPU));
    std::cout << "parity of " << checked << " on " << c.to_string() << ": " << (result.ok ? "ok" : result.message) << "\n";
    if (!result.ok) return 1;
  }

  // The property strata's suite runs for each of its strategies, here for the trainer's own: parity
  // on generated models (preset kinds and chains of library blocks, tied weights, buffers, frozen
  // parameters), shrunk to a smallest failing case when it fails.
  const bool held = rc::check("counting matches the baseline on generated models", [] {
    const auto generated = *strata::correctness::gen_parity_case("counting", {"cpu"});
    const auto result = strata::correctness::check_parity("counting", generated, torch::Device(torch::kCPU));
    RC_ASSERT(result.ok);
  });
  return held ? 0 : 1;
} catch (const std::exception& e) {
  return fail(e.what());
}
