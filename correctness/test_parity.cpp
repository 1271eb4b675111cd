// Parity of every registered strategy with the baseline: rapidcheck properties over generated
// models (tied and untied, odd sizes), batch sizes and seeds, plus the tiny presets; and a check
// that the checker itself catches a wrong strategy.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include "correctness/support/generators.h"
#include "correctness/support/test_device.h"
#include "strategies/baseline/baseline.h"

namespace strata::correctness {
namespace {

std::vector<std::string> machine_devices() {
  std::vector<std::string> out{test::device().str()};
  return out;
}

class Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Parity, prop_matches_baseline) {
  const auto strategy = GetParam();
  const auto device = test::device();
  const bool ok = rc::check("parity of " + strategy + " on " + device.str(), [&] {
    const auto c = *gen_parity_case(strategy, machine_devices());
    RC_CLASSIFY(c.model.tied, "tied");
    RC_TAG(models::to_string(c.model.kind));
    const auto r = check_parity(strategy, c, device);
    if (!r.ok) RC_FAIL(r.message);
  });
  EXPECT_TRUE(ok);
}

TEST_P(Parity, tiny_presets_match_baseline) {
  for (const auto& preset : {"mlp-tiny", "mlp-tied-tiny", "gpt-tiny", "bert-tiny"}) {
    ParityCase c;
    c.model = models::preset(preset).config;
    c.batch_size = models::preset(preset).batch_size;
    c.seed = 42;
    const auto r = check_parity(GetParam(), c, test::device());
    EXPECT_TRUE(r.ok) << preset << ": " << r.message;
  }
}

TEST_P(Parity, leaves_the_model_usable_for_more_steps) {
  // Ten steps in a row, forward-only in between: the state a step leaves must serve the next.
  ParityCase c;
  c.model = models::preset("gpt-tiny").config;
  c.steps = 10;
  StrategyConfig config;
  config.device = test::device();
  auto s = Registry::create(GetParam(), config);
  s->attach(models::build_model(c.model, 1));
  auto batch = models::make_batch(c.model, 2, 5);
  const double first = s->train_step(batch);
  s->optimizer_step();
  for (int i = 0; i < c.steps; ++i) {
    s->forward(batch.input);
    s->train_step(batch);
    s->optimizer_step();
  }
  // Training on one batch must lower its loss.
  EXPECT_LT(s->train_step(batch), first);
}

INSTANTIATE_TEST_SUITE_P(Registered, Parity, ::testing::ValuesIn(Registry::names()),
                         [](const auto& info) { return info.param; });

// A strategy with a classic bug: it runs backward twice, so every gradient is doubled.
class DoubleBackward : public Baseline {
 public:
  explicit DoubleBackward(const StrategyConfig& c) : Baseline("double_backward", c, {}) {}
  double train_step(const models::Batch& batch) override {
    Baseline::train_step(batch);
    return Baseline::train_step(batch);
  }
};

TEST(ParityChecker, catches_a_doubled_gradient) {
  ParityCase c;
  c.model = models::preset("gpt-tiny").config;
  const auto r = check_parity([](const StrategyConfig& cfg) { return std::make_unique<DoubleBackward>(cfg); }, c,
                              test::device());
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("gradient"), std::string::npos) << r.message;
}

TEST(ParityChecker, property_fails_and_shrinks_for_a_wrong_strategy) {
  // rapidcheck prints the shrunk case; the property must fail for every case.
  const bool ok = rc::check("parity of a doubled-gradient strategy (expected to fail)", [] {
    const auto c = *gen_parity_case("double_backward", {"cpu"});
    const auto r = check_parity([](const StrategyConfig& cfg) { return std::make_unique<DoubleBackward>(cfg); }, c,
                                torch::Device(torch::kCPU));
    RC_ASSERT(r.ok);
  });
  EXPECT_FALSE(ok);
}

TEST(ParityChecker, compares_names_shapes_and_values) {
  NamedTensors a{{"w", torch::ones({2, 2})}}, b{{"w", torch::ones({2, 2})}};
  EXPECT_EQ(compare_named("x", a, b, kCpuTolerance), "");
  NamedTensors renamed{{"v", torch::ones({2, 2})}};
  EXPECT_NE(compare_named("x", renamed, b, kCpuTolerance).find("name 'v'"), std::string::npos);
  NamedTensors reshaped{{"w", torch::ones({4})}};
  EXPECT_NE(compare_named("x", reshaped, b, kCpuTolerance).find("shape"), std::string::npos);
  NamedTensors off{{"w", torch::ones({2, 2}) * (1 + 1e-3)}};
  EXPECT_NE(compare_named("x", off, b, kCpuTolerance).find("max|diff|"), std::string::npos);
  NamedTensors nan{{"w", torch::full({2, 2}, std::nan(""))}};
  EXPECT_NE(compare_named("x", nan, b, kCpuTolerance).find("non-finite"), std::string::npos);
}

}  // namespace
}  // namespace strata::correctness

namespace strata::correctness {
namespace {
TEST(Generators, block_count_matches_the_built_model) {
  for (const auto* name : {"mlp-tiny", "mlp-tied-tiny", "gpt-tiny", "bert-tiny"}) {
    const auto& c = models::preset(name).config;
    EXPECT_EQ(block_count(c), models::build_model(c, 0).num_blocks()) << name;
  }
}
}  // namespace
}  // namespace strata::correctness
