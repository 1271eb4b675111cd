// Mixed precision: the policy's text form and its refusals, compute copies over fp32 masters, the
// loss scaler, and parity under bf16 (and fp16 where the device has it) against the float64
// reference with bounds from the compute dtype's rounding.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <set>

#include "correctness/support/errors.h"
#include "correctness/support/generators.h"
#include "correctness/support/parity.h"
#include "correctness/support/test_device.h"
#include "models/check.h"
#include "strategies/baseline/baseline.h"
#include "strategies/precision.h"

namespace strata {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A strategy's config on the test device with the options it needs, under `policy`.
StrategyConfig config_for(const std::string& name, const PrecisionPolicy& policy = {}) {
  StrategyConfig config;
  config.device = test::device();
  config.options = Registry::required_options(name);
  config.precision = policy;
  return config;
}

// The registered strategies that train under `policy`.
std::vector<std::string> strategies_under(const PrecisionPolicy& policy) {
  std::vector<std::string> out;
  for (const auto& name : Registry::names())
    if (correctness::strategy_supports(name, policy)) out.push_back(name);
  return out;
}

TEST(Precision, policies_read_back_from_their_text) {
  for (const auto* text : {"fp32", "bf16", "fp16", "bf16,transfer=fp32", "bf16,reduce=bf16", "fp16,scale=1024,growth=50"}) {
    EXPECT_EQ(PrecisionPolicy::parse(text).to_string(), text);
  }
  const auto p = PrecisionPolicy::parse("bf16");
  EXPECT_EQ(p.compute, torch::kBFloat16);
  EXPECT_EQ(p.transfer, torch::kBFloat16);
  EXPECT_EQ(p.reduce, torch::kFloat);  // gradients are summed in fp32 unless asked otherwise
  EXPECT_FALSE(p.scales_loss());
  EXPECT_TRUE(PrecisionPolicy::parse("fp16").scales_loss());
  EXPECT_TRUE(PrecisionPolicy{}.is_fp32());
}

TEST(Precision, invalid_policies_name_what_is_wrong) {
  auto error_of = [](const std::string& text) { return test::error_of([&] { (void)PrecisionPolicy::parse(text); }); };
  EXPECT_THAT(error_of("fp8"), HasSubstr("'fp8'"));
  EXPECT_THAT(error_of("bf16,transfer=fp16"), HasSubstr("transfer=fp16 with compute=bf16"));
  EXPECT_THAT(error_of("fp32,transfer=bf16"), HasSubstr("transfer=bf16 with compute=fp32"));
  EXPECT_THAT(error_of("fp16,reduce=bf16"), HasSubstr("reduce=bf16 with compute=fp16"));
  EXPECT_THAT(error_of("fp32,reduce=fp16"), HasSubstr("reduce=fp16 with compute=fp32"));
  EXPECT_THAT(error_of("bf16,colour=red"), HasSubstr("unknown key 'colour'"));
  EXPECT_THAT(error_of("bf16,reduce"), HasSubstr("'reduce' is not key=value"));
  EXPECT_THAT(error_of("fp16,scale=-2"), HasSubstr("scale=-2"));
  EXPECT_THAT(error_of("fp16,scale=lots"), HasSubstr("scale='lots'"));
  EXPECT_THAT(error_of("fp16,growth=0"), HasSubstr("growth='0'"));
  EXPECT_THAT(error_of("reduce=fp32"), HasSubstr("must start with fp32, bf16 or fp16"));
}

TEST(Precision, a_strategy_without_the_policy_refuses_it_by_name) {
  StrategyConfig config;
  config.device = test::device();
  // sharded gathers straight into the compute dtype: it cannot gather in fp32 and compute in bf16.
  config.precision = PrecisionPolicy::parse("bf16,transfer=fp32");
  const auto message = test::error_of([&] { (void)Registry::create("sharded", config); });
  EXPECT_THAT(message, AllOf(HasSubstr("sharded"), HasSubstr("does not train in precision bf16,transfer=fp32")));
  EXPECT_NO_THROW((void)Registry::create("baseline", config));
  // hook_offload sums gradients on the host in fp32 only.
  config.precision = PrecisionPolicy::parse("bf16,reduce=bf16");
  EXPECT_THAT(test::error_of([&] { (void)Registry::create("hook_offload", config); }),
              AllOf(HasSubstr("hook_offload"), HasSubstr("reduce=bf16")));
}

TEST(Precision, fp16_runs_where_the_device_has_it_and_is_refused_by_name_where_not) {
  StrategyConfig config;
  config.device = test::device();
  config.precision = PrecisionPolicy::parse("fp16");
  std::unique_ptr<Strategy> s;
  try {
    s = Registry::create("baseline", config);
  } catch (const Error& e) {
    ASSERT_TRUE(config.device.is_cpu()) << "fp16 refused on " << config.device << ": " << e.what();
    EXPECT_THAT(e.what(), AllOf(HasSubstr("fp16"), HasSubstr("cpu"), HasSubstr("use bf16")));
    return;
  }
  const auto model_config = models::preset("gpt-tiny").config;
  s->attach(models::build_model(model_config, 0));
  EXPECT_TRUE(std::isfinite(s->train_step(models::make_batch(model_config, 2, 1))));
}

// Under bf16 the blocks see bf16 parameters while a step runs, and the optimizer fp32 masters
// with fp32 gradients; the loss moves by bf16's rounding, not more.
TEST(Precision, blocks_compute_in_bf16_over_fp32_masters) {
  const auto model_config = models::preset("gpt-tiny").config;
  const auto batch = models::make_batch(model_config, 2, 1);
  auto run = [&](const std::string& precision) {
    StrategyConfig config;
    config.device = test::device();
    config.precision = PrecisionPolicy::parse(precision);
    auto s = Registry::create("baseline", config);
    s->attach(models::build_model(model_config, 0));
    const double loss = s->train_step(batch);
    return std::make_pair(loss, std::move(s));
  };
  auto [fp32_loss, fp32] = run("fp32");
  auto [bf16_loss, bf16] = run("bf16");
  EXPECT_NE(bf16_loss, fp32_loss) << "bf16 compute left the loss bit-identical to fp32's";
  EXPECT_NEAR(bf16_loss, fp32_loss, 0.05 * std::abs(fp32_loss));
  for (const auto& [name, g] : bf16->gradients()) EXPECT_EQ(g.scalar_type(), torch::kFloat) << name;
  for (const auto& [name, p] : bf16->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat) << name;
  // The gradients differ from fp32's by rounding: close, and not identical.
  const auto g32 = fp32->gradients(), g16 = bf16->gradients();
  double largest = 0, diff = 0;
  for (size_t i = 0; i < g32.size(); ++i) {
    largest = std::max(largest, g32[i].second.abs().max().item<double>());
    diff = std::max(diff, (g32[i].second - g16[i].second).abs().max().item<double>());
  }
  EXPECT_GT(diff, 0.0);
  EXPECT_LT(diff, 0.1 * largest);
}

// Two steps' gradients, 1 and 2^-9: their sum is exact in fp32 and rounds to 1 in bf16, so the
// reduction dtype shows in the result.
TEST(Precision, compute_copies_sum_gradients_in_the_reduction_dtype_and_restore_the_masters) {
  for (const auto* text : {"bf16", "bf16,reduce=bf16"}) {
    const auto policy = PrecisionPolicy::parse(text);
    auto p = torch::full({4}, 1.0f + 1.0f / 512, torch::TensorOptions().device(test::device())).requires_grad_();
    const auto master = p.data();
    ComputeCopies copies(policy, {p});
    for (const double g : {1.0, 1.0 / 512}) {
      ComputeCopies::Scope bound(copies);
      EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
      EXPECT_EQ(p.data()[0].item<float>(), 1.0f);  // 1 + 2^-9 rounds to 1 in bf16 (8 significant bits)
      (p * g).sum().backward();
      bound.commit();
    }
    EXPECT_EQ(p.scalar_type(), torch::kFloat);
    EXPECT_EQ(p.data_ptr(), master.data_ptr()) << "the fp32 master was not put back";
    EXPECT_EQ(p.data()[0].item<float>(), 1.0f + 1.0f / 512);
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
    EXPECT_EQ(p.grad()[0].item<float>(), policy.reduce == torch::kFloat ? 1.0f + 1.0f / 512 : 1.0f) << text;
    // A step that throws leaves the masters and the earlier gradients as they were.
    const float before = p.grad()[0].item<float>();
    try {
      ComputeCopies::Scope bound(copies);
      (p * 5).sum().backward();
      throw std::runtime_error("step failed");
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(p.scalar_type(), torch::kFloat);
    EXPECT_EQ(p.data_ptr(), master.data_ptr());
    EXPECT_EQ(p.grad()[0].item<float>(), before) << text;
  }
}

// A model with floating-point buffers (a BatchNorm's running statistics) under bf16 is refused by
// every strategy that trains in bf16, naming the buffer (it would otherwise fail inside LibTorch on
// mixed dtypes); in fp32 it trains.
TEST(Precision, a_model_with_floating_buffers_is_refused_in_bf16_by_name) {
  const auto chain = correctness::ChainSpec::parse("chain(in=3 width=4 classes=3 blocks=lin,bn)");
  for (const auto& name : strategies_under(PrecisionPolicy::parse("bf16"))) {
    auto s = Registry::create(name, config_for(name, PrecisionPolicy::parse("bf16")));
    EXPECT_THAT(test::error_of([&] { s->attach(chain.build(0)); }),
                AllOf(HasSubstr(name), HasSubstr("running_mean"), HasSubstr("bf16")))
        << name;
  }
  correctness::ParityCase c;
  c.chain = chain;
  c.batch_size = 4;
  EXPECT_TRUE(correctness::check_parity("baseline", c, test::device()).ok);
}

TEST(Precision, the_loss_scaler_skips_a_step_with_an_overflow_lowers_the_scale_and_grows_it_back) {
  LossScaler scaler(PrecisionPolicy::parse("fp16,scale=1024,growth=2"));
  ASSERT_TRUE(scaler.enabled());
  EXPECT_EQ(scaler.scale(), 1024.0);
  auto g = torch::full({3}, 2048.0f);
  EXPECT_TRUE(scaler.unscale({g}));
  EXPECT_EQ(g[0].item<float>(), 2.0f);
  scaler.update(true);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 2048.0);  // two good steps in a row at growth=2
  auto bad = torch::tensor({1.0f, std::numeric_limits<float>::infinity()});
  EXPECT_FALSE(scaler.unscale({g, bad}));
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 1024.0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  auto nan = torch::tensor({std::nanf("")});
  EXPECT_FALSE(scaler.unscale({nan}));
  // A host tensor large enough to be split over threads, its overflow in the last chunk; and
  // gradients on the test device (one multi-tensor kernel on a GPU), finite and not.
  auto big = torch::full({3 << 19}, 1024.0f);
  big[-1] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.unscale({big}));
  EXPECT_EQ(big[0].item<float>(), 1.0f);
  EXPECT_EQ(big[(3 << 19) - 2].item<float>(), 1.0f);
  auto on_device = torch::full({5}, 3072.0f, torch::TensorOptions().device(test::device()));
  EXPECT_TRUE(scaler.unscale({on_device, torch::full({7}, 1024.0f, torch::TensorOptions().device(test::device()))}));
  EXPECT_EQ(on_device[4].item<float>(), 3.0f);
  auto device_nan = torch::tensor({1.0f, std::nanf("")}, torch::TensorOptions().device(test::device()));
  EXPECT_FALSE(scaler.unscale({on_device, device_nan}));
  // Below a scale of 1, unscaling enlarges: a finite gradient that overflows on the way is not
  // finite (the GPU's fused kernel checks its input only, so that case takes the checked path).
  LossScaler small(PrecisionPolicy::parse("fp16,scale=0.5"));
  auto huge = torch::full({4}, 3e38f, torch::TensorOptions().device(test::device()));
  EXPECT_FALSE(small.unscale({huge}));
  // unscaled() (what gradients() report) is what unscale() leaves, at a scale that is no power of two.
  LossScaler odd(PrecisionPolicy::parse("fp16,scale=1000"));
  auto g3 = torch::randn({1 << 10}, torch::TensorOptions().device(test::device())) * 1000;
  const auto reported = odd.unscaled(g3);
  EXPECT_TRUE(odd.unscale({g3}));
  EXPECT_TRUE(torch::equal(reported, g3));
  // Other dtypes do not scale.
  LossScaler none(PrecisionPolicy::parse("bf16"));
  EXPECT_FALSE(none.enabled());
  EXPECT_EQ(none.scale(), 1.0);
}

// fp16 with a loss scale so large that the gradients overflow: the step is skipped (parameters
// unchanged), the scale halves; at a sane scale the next step trains. Every strategy that trains in
// fp16; on a CPU without fp16 products each refuses it (checked by name above).
TEST(Precision, an_fp16_step_that_overflows_is_skipped_and_the_scale_lowered) {
  for (const auto* name : {"baseline", "manual_split", "pipeline_1f1b", "hook_offload", "sharded"}) {
    StrategyConfig config;
    config.device = test::device();
    config.optimizer.lr = 0.1;
    config.precision = PrecisionPolicy::parse("fp16,scale=1e30");
    std::unique_ptr<Strategy> s;
    try {
      s = Registry::create(name, config);
    } catch (const Error& e) {
      ASSERT_TRUE(config.device.is_cpu()) << name << ": " << e.what();
      EXPECT_THAT(e.what(), HasSubstr("fp16")) << name;
      continue;
    }
    const auto model_config = models::preset("gpt-tiny").config;
    s->attach(models::build_model(model_config, 0));
    const auto batch = models::make_batch(model_config, 2, 1);
    const auto before = s->parameters();
    s->train_step(batch);
    s->optimizer_step();
    const auto after = s->parameters();
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << name << " " << before[i].first;
    EXPECT_EQ(s->stats().skipped_steps, 1) << name;
    EXPECT_EQ(s->stats().loss_scale, 5e29) << name;
    // Halve the scale until a step stays finite (1e30 / 2^k): the first such step trains.
    int skipped = 1;
    while (skipped < 120 && s->stats().skipped_steps == skipped) {
      s->train_step(batch);
      s->optimizer_step();
      if (s->stats().skipped_steps == skipped) break;
      skipped = static_cast<int>(s->stats().skipped_steps);
    }
    const auto trained = s->parameters();
    bool moved = false;
    for (size_t i = 0; i < before.size(); ++i) moved = moved || !torch::equal(before[i].second, trained[i].second);
    EXPECT_TRUE(moved) << name << ": no step trained after " << skipped << " skipped";
  }
}

// Which strategies train under the bf16 policy: every registered one (the refusals that remain,
// of particular combinations, are the tests above).
TEST(Precision, the_strategies_that_train_in_bf16_are_these) {
  EXPECT_THAT(strategies_under(PrecisionPolicy::parse("bf16")),
              ::testing::ElementsAre("baseline", "baseline_checkpoint", "hook_offload", "hook_offload_overlap",
                                     "hook_offload_sync", "manual_split", "pipeline_1f1b", "pipeline_custom",
                                     "pipeline_gpipe", "pipeline_interleaved", "pipeline_zero_bubble", "sharded",
                                     "sharded_offload"));
}

// hook_offload streams the weights in the transfer dtype: under bf16 half the bytes of fp32 a step
// (the batch aside), the same as fp32 with transfer=fp32; gradients come back in fp32 either way.
// sharded_offload sends its shards up in bf16 likewise (on a GPU; on the CPU nothing is copied).
TEST(Precision, offloading_strategies_stream_half_the_bytes_in_bf16) {
  const auto model_config = models::preset("gpt-tiny").config;
  const auto batch = models::make_batch(model_config, 2, 1);
  const int64_t batch_bytes = batch.input.nbytes() + batch.target.nbytes();
  std::string name = "hook_offload";
  auto bytes = [&](const std::string& precision) {
    StrategyConfig config;
    config.device = test::device();
    config.precision = PrecisionPolicy::parse(precision);
    auto s = Registry::create(name, config);
    s->attach(models::build_model(model_config, 0));
    s->train_step(batch);
    s->optimizer_step();
    s->reset_stats();
    s->train_step(batch);
    s->finish_backward();
    const auto st = s->stats();
    return std::make_pair(st.bytes_h2d - batch_bytes, st.bytes_d2h);
  };
  const auto fp32 = bytes("fp32"), bf16 = bytes("bf16"), bf16_fp32_transfer = bytes("bf16,transfer=fp32");
  ASSERT_GT(fp32.first, 0);
  EXPECT_EQ(2 * bf16.first, fp32.first);
  EXPECT_EQ(bf16_fp32_transfer.first, fp32.first);
  EXPECT_EQ(bf16.second, fp32.second);
  if (!test::device().is_cuda()) return;
  name = "sharded_offload";
  const auto sharded_fp32 = bytes("fp32"), sharded_bf16 = bytes("bf16");
  ASSERT_GT(sharded_fp32.first, 0);
  EXPECT_EQ(2 * sharded_bf16.first, sharded_fp32.first);
  EXPECT_EQ(sharded_bf16.second, sharded_fp32.second);
}

// The dtypes the probes saw. A pipeline's ranks run on threads of their own, so its blocks'
// forwards record concurrently.
struct SeenDtypes {
  std::mutex mutex;
  std::vector<torch::ScalarType> dtypes;
};

// A block that records the dtypes it computes with: its weight's and its input's.
class DtypeProbe : public models::Block {
 public:
  DtypeProbe(int64_t in, int64_t out, SeenDtypes* seen) : seen_(seen) {
    linear_ = register_module("linear", torch::nn::Linear(in, out));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    {
      std::lock_guard<std::mutex> lock(seen_->mutex);
      seen_->dtypes.push_back(x.scalar_type());
      seen_->dtypes.push_back(linear_->weight.scalar_type());
    }
    return linear_->forward(x);
  }

 private:
  torch::nn::Linear linear_{nullptr};
  SeenDtypes* seen_;
};

// Under bf16 every block of every supporting strategy sees bf16 weights and bf16 inputs: the
// activations cross stages (and devices) in the compute dtype. A strategy that quietly computed in
// fp32 would pass the parity bound (fp32 is more exact than bf16's bound asks), so this looks.
TEST(Precision, every_supporting_strategy_computes_in_bf16_and_passes_bf16_activations_on) {
  const auto policy = PrecisionPolicy::parse("bf16");
  for (const auto& name : strategies_under(policy)) {
    const auto config = config_for(name, policy);
    SeenDtypes seen;
    models::ModelConfig mc;
    mc.kind = models::ModelKind::custom;
    torch::manual_seed(0);
    std::vector<std::shared_ptr<models::Block>> blocks{std::make_shared<DtypeProbe>(4, 8, &seen),
                                                       std::make_shared<DtypeProbe>(8, 8, &seen),
                                                       std::make_shared<DtypeProbe>(8, 8, &seen),
                                                       std::make_shared<DtypeProbe>(8, 3, &seen)};
    auto s = Registry::create(name, config);
    s->attach(models::BlockModel(mc, blocks));
    models::Batch batch{torch::randn({4, 4}), torch::tensor({0, 1, 2, 0})};
    s->train_step(batch);
    s->optimizer_step();
    ASSERT_FALSE(seen.dtypes.empty()) << name;
    for (auto dtype : seen.dtypes) EXPECT_EQ(dtype, torch::kBFloat16) << name;
    for (const auto& [p, t] : s->parameters()) EXPECT_EQ(t.scalar_type(), torch::kFloat) << name << " " << p;
  }
}

// After training steps, a strategy computes with the bf16 casts of its own fp32 masters: its
// forward output equals, bit for bit, that of a bf16 baseline given those masters. Parity alone
// cannot see a strategy that computes with stale weights (one optimizer step moves a weight by
// about what bf16 rounds away), this does.
TEST(Precision, after_steps_a_strategy_computes_with_the_casts_of_its_own_masters) {
  const auto policy = PrecisionPolicy::parse("bf16");
  const auto model_config = models::preset("gpt-tiny").config;
  const auto batch = models::make_batch(model_config, 2, 3);
  for (const auto& name : strategies_under(policy)) {
    auto config = config_for(name, policy);
    config.optimizer.kind = OptimizerKind::adamw;
    config.optimizer.lr = 1e-3;
    auto s = Registry::create(name, config);
    s->attach(models::build_model(model_config, 0));
    for (int step = 0; step < 2; ++step) {
      s->train_step(models::make_batch(model_config, 2, 10 + step));
      s->optimizer_step();
    }
    // The baseline, loaded with the strategy's masters.
    auto reference_model = models::build_model(model_config, 0);
    const auto masters = s->parameters();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < masters.size(); ++i) reference_model.parameters()[i].tensor.copy_(masters[i].second);
    }
    StrategyConfig base = config;
    base.options.clear();
    auto b = Registry::create("baseline", base);
    b->attach(std::move(reference_model));
    const auto mine = s->forward(batch.input).to(torch::kCPU, torch::kFloat);
    const auto theirs = b->forward(batch.input).to(torch::kCPU, torch::kFloat);
    EXPECT_TRUE(torch::equal(mine, theirs))
        << name << ": max |difference| " << (mine - theirs).abs().max().item<double>() << " of outputs up to "
        << theirs.abs().max().item<double>();
  }
}

// Every strategy that trains in bf16 matches the float64 reference within bf16's bounds, on the
// tiny presets (tied and untied).
TEST(Precision, strategies_that_train_in_bf16_match_the_reference_within_its_bounds) {
  const auto policy = PrecisionPolicy::parse("bf16");
  int checked = 0;
  for (const auto& name : strategies_under(policy)) {
    for (const auto* preset : {"gpt-tiny", "mlp-tiny", "mlp-tied-tiny", "bert-tiny"}) {
      correctness::ParityCase c;
      c.model = models::preset(preset).config;
      c.precision = policy;
      const auto r = correctness::check_parity(name, c, test::device());
      EXPECT_TRUE(r.ok) << name << " " << c.to_string() << ": " << r.message;
    }
    ++checked;
  }
  EXPECT_GE(checked, 2) << "baseline and baseline_checkpoint at least";
}


// The names of `model`'s parameters that several blocks use (a tied embedding and head).
std::set<std::string> shared_parameters(const models::BlockModel& model) {
  std::vector<int> uses(model.parameters().size(), 0);
  for (const auto& block : model.block_parameters())
    for (auto i : block) ++uses[static_cast<size_t>(i)];
  std::set<std::string> out;
  for (size_t i = 0; i < uses.size(); ++i)
    if (uses[i] > 1) out.insert(model.parameters()[i].name);
  return out;
}

// Against the baseline under the same policy, the check is tight: a strategy that runs the
// baseline's operations in the baseline's order (the pipelines with one micro-batch) must give
// its losses, gradients and updated parameters bit for bit, accumulated batches included. The one
// allowed difference: a tied parameter's uses are summed by the baseline's autograd in bf16 and by
// the strategies in fp32 (they take each use's gradient apart), so that parameter's gradient may
// differ by bf16's rounding of the sum (2^-7 of its largest element) and its update by what that
// moves (up to 2 lr an element in AdamW's first step); the tied models take one step. And on a GPU
// the strategies that update on the host (their gradients go down: hook_offload, sharded_offload)
// run the fused host loop where the baseline runs the tensor chain on the device: the same formula
// rounded in another order, so their parameters may differ by a few fp32 ulps (seen on an H200:
// 1-2 ulps, gradients and losses bit for bit). The parity bounds above allow bf16's error
// everywhere; this catches a strategy that rounds once more or once less than the baseline (e.g.
// accumulating in bf16 under reduce=fp32).
TEST(Precision, strategies_in_the_baselines_order_match_the_bf16_baseline_bit_for_bit) {
  const auto policy = PrecisionPolicy::parse("bf16");
  const double lr = 1e-3;
  struct Trace {
    std::vector<double> losses;
    std::vector<NamedTensors> grads, params;
    bool host_optimizer = false;  ///< its gradients went to the host, where its update ran
  };
  for (const auto* preset : {"mlp-tiny", "bert-tiny", "gpt-tiny", "mlp-tied-tiny"}) {
    const auto mc = models::preset(preset).config;
    auto probe = models::build_model(mc, 0);
    const auto shared = shared_parameters(probe);
    const int steps = shared.empty() ? 2 : 1;
    // `micro` batches a step: two where the strategy accumulates (summed in the reduction dtype).
    auto run = [&](const std::string& name, const std::map<std::string, std::string>& options, int micro) {
      auto config = config_for(name, policy);
      for (const auto& [k, v] : options) config.options[k] = v;
      config.optimizer.kind = OptimizerKind::adamw;
      config.optimizer.lr = lr;
      auto s = Registry::create(name, config);
      s->attach(models::build_model(mc, 0));
      Trace t;
      for (int step = 0; step < steps; ++step) {
        for (int k = 0; k < micro; ++k) t.losses.push_back(s->train_step(models::make_batch(mc, 4, 10 * step + k)));
        t.grads.push_back(s->gradients());
        t.host_optimizer = s->stats().bytes_d2h > 0;
        s->optimizer_step();
        t.params.push_back(s->parameters());
      }
      return t;
    };
    const std::map<int, Trace> reference = {{1, run("baseline", {}, 1)}, {2, run("baseline", {}, 2)}};
    int compared = 0;
    for (const auto& name : strategies_under(policy)) {
      if (name == "pipeline_custom") continue;  // its micro-batches are its schedule's
      std::map<std::string, std::string> options;
      if (name.rfind("pipeline_", 0) == 0) options = {{"micro_batches", "1"}};
      if (name == "pipeline_interleaved") options["ranks"] = "1";  // one micro-batch needs one rank
      const int micro = Registry::create(name, config_for(name, policy))->accumulates_gradients() ? 2 : 1;
      const auto got = run(name, options, micro);
      const auto& want = reference.at(micro);
      SCOPED_TRACE(std::string(preset) + " " + name);
      for (size_t k = 0; k < want.losses.size(); ++k) EXPECT_EQ(got.losses[k], want.losses[k]) << "loss " << k;
      auto same = [&](const char* what, const NamedTensors& a, const NamedTensors& b, bool grads, int step) {
        ASSERT_EQ(a.size(), b.size());
        const bool host_rounding = !grads && got.host_optimizer && test::device().is_cuda();
        for (size_t i = 0; i < a.size(); ++i) {
          if (host_rounding && !shared.count(a[i].first)) {  // 4 ulps of the larger of the tensor and lr
            const double scale = std::max(b[i].second.abs().max().item<double>(), lr);
            EXPECT_LE((a[i].second - b[i].second).abs().max().item<double>(), std::ldexp(scale, -21))
                << what << " '" << a[i].first << "' (updated on the host) at step " << step;
            continue;
          }
          if (!shared.count(a[i].first)) {
            EXPECT_TRUE(torch::equal(a[i].second, b[i].second))
                << what << " '" << a[i].first << "' at step " << step << ": max |difference| "
                << (a[i].second - b[i].second).abs().max().item<double>();
            continue;
          }
          const double diff = (a[i].second - b[i].second).abs().max().item<double>();
          const double bound = grads ? std::ldexp(b[i].second.abs().max().item<double>(), -7) : 2 * lr;
          EXPECT_LE(diff, bound) << what << " '" << a[i].first << "' (shared) at step " << step;
        }
      };
      for (int step = 0; step < steps; ++step) {
        same("gradient", got.grads[step], want.grads[step], true, step);
        same("parameter", got.params[step], want.params[step], false, step);
      }
      ++compared;
    }
    EXPECT_GE(compared, 12) << preset;
  }
}

}  // namespace
}  // namespace strata
