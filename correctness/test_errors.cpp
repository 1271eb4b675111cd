// Bad input: every rejected value reaches the user as an Error whose message names it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "correctness/support/test_device.h"
#include "correctness/support/errors.h"
#include "models/check.h"
#include "models/model.h"
#include "strategies/device/device.h"
#include "strategies/strategy.h"

namespace strata {
namespace {

using test::error_of;

using ::testing::HasSubstr;

TEST(Errors, unknown_strategy_names_itself_and_lists_the_known_ones) {
  auto msg = error_of([] { Registry::create("zero4", StrategyConfig{}); });
  EXPECT_THAT(msg, HasSubstr("unknown strategy 'zero4'"));
  EXPECT_THAT(msg, HasSubstr("baseline"));
}

TEST(Errors, duplicate_registration_is_an_error) {
  auto msg = error_of([] { Registry::add("baseline", "again", nullptr); });
  EXPECT_THAT(msg, HasSubstr("'baseline' is registered twice"));
}

TEST(Errors, unknown_model_kind_and_preset) {
  EXPECT_THAT(error_of([] { models::parse_model_kind("cnn"); }), HasSubstr("unknown model kind 'cnn'"));
  auto msg = error_of([] { models::preset("gpt-huge"); });
  EXPECT_THAT(msg, HasSubstr("unknown model preset 'gpt-huge'"));
  EXPECT_THAT(msg, HasSubstr("gpt-tiny"));
}

TEST(Errors, invalid_model_configs_name_the_value) {
  auto config = [](auto edit) {
    models::ModelConfig c = models::preset("gpt-tiny").config;
    edit(c);
    return c;
  };
  EXPECT_THAT(error_of([&] { models::build_model(config([](auto& c) { c.width = 0; }), 0); }), HasSubstr("width=0"));
  EXPECT_THAT(error_of([&] { models::build_model(config([](auto& c) { c.depth = -1; }), 0); }), HasSubstr("depth=-1"));
  EXPECT_THAT(error_of([&] { models::build_model(config([](auto& c) { c.heads = 3; }), 0); }),
              HasSubstr("heads=3 does not divide width=32"));
  EXPECT_THAT(error_of([&] { models::build_model(config([](auto& c) { c.vocab = 1; }), 0); }), HasSubstr("vocab=1"));
  EXPECT_THAT(error_of([&] { models::build_model(config([](auto& c) { c.seq_len = 0; }), 0); }), HasSubstr("seq_len=0"));
  EXPECT_THAT(error_of([&] {
                models::build_model(config([](auto& c) {
                                      c.kind = models::ModelKind::mlp;
                                      c.classes = 5;
                                      c.in_features = 8;
                                    }),
                                    0);
              }),
              HasSubstr("classes=5 in_features=8"));
  EXPECT_THAT(error_of([&] { models::build_model(config([](auto& c) { c.kind = models::ModelKind::bert; }), 0); }),
              HasSubstr("bert: tied=1"));
  EXPECT_THAT(error_of([] { models::make_batch(models::preset("gpt-tiny").config, 0, 1); }), HasSubstr("batch_size=0"));
}

TEST(Errors, bad_devices_name_the_value) {
  EXPECT_THAT(error_of([] { device::parse("gpu"); }), HasSubstr("device 'gpu' is not valid"));
  EXPECT_THAT(error_of([] { device::parse("cpu:1"); }), HasSubstr("'cpu:1'"));
  EXPECT_THAT(error_of([] { device::parse("cuda:99"); }), HasSubstr("'cuda:99' is not available"));
  StrategyConfig c;
  c.device = torch::Device(torch::kCUDA, 99);
  EXPECT_THAT(error_of([&] { Registry::create("baseline", c); }), HasSubstr("cuda:99"));
}

TEST(Errors, bad_strategy_options_name_the_key_and_value) {
  StrategyConfig c;
  c.device = test::device();
  c.options = {{"checkpoint", "maybe"}};
  EXPECT_THAT(error_of([&] { Registry::create("baseline", c); }), HasSubstr("checkpoint='maybe' is not a boolean"));
  c.options = {{"chekpoint", "1"}};
  auto msg = error_of([&] { Registry::create("baseline", c); });
  EXPECT_THAT(msg, HasSubstr("unknown option 'chekpoint'"));
  EXPECT_THAT(msg, HasSubstr("known options: checkpoint"));
}

TEST(Errors, bad_optimizer_settings_name_the_value) {
  StrategyConfig c;
  c.optimizer.lr = 0;
  EXPECT_THAT(error_of([&] { Registry::create("baseline", c); }), HasSubstr("lr=0"));
  c.optimizer.lr = 0.1;
  c.optimizer.momentum = 1.5;
  EXPECT_THAT(error_of([&] { Registry::create("baseline", c); }), HasSubstr("momentum=1.5"));
  EXPECT_THAT(error_of([] { parse_optimizer_kind("lion"); }), HasSubstr("unknown optimizer 'lion'"));
}

TEST(Errors, using_a_strategy_before_attach_is_an_error_for_every_strategy) {
  for (const auto& name : Registry::names()) {
    StrategyConfig c;
    c.device = test::device();
    c.options = Registry::required_options(name);
    auto s = Registry::create(name, c);
    auto batch = models::make_batch(models::preset("gpt-tiny").config, 1, 0);
    EXPECT_THAT(error_of([&] { s->train_step(batch); }), HasSubstr("attach")) << name;
  }
}

}  // namespace
}  // namespace strata
