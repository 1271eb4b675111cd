// strata_capacity's parts without a device: the bisection against stand-in probes, the model's
// sizes from its config against the built model, and the memory model's parameter bytes against
// each strategy's own accounting after a real step on the CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "bench/capacity.h"
#include "bench/memory_model.h"
#include "models/check.h"
#include "models/sizes.h"
#include "strategies/strategy.h"
#include "strategies/windowed.h"

namespace strata::bench {
namespace {

using ::testing::HasSubstr;

std::string label_of(const std::map<std::string, std::string>& options) {
  std::string out;
  for (const auto& [k, v] : options) out += k + "=" + v + " ";
  return out;
}

// A stand-in probe: sizes up to `largest` train; `broken` (if any) errors.
struct StandIn {
  explicit StandIn(int64_t largest_, int64_t broken_ = -1) : largest(largest_), broken(broken_) {}
  int64_t largest, broken;
  std::vector<int64_t> asked;
  Probe operator()(int64_t size) {
    asked.push_back(size);
    Probe p;
    p.outcome = size == broken     ? ProbeOutcome::error
                : size <= largest ? ProbeOutcome::trains
                                  : ProbeOutcome::device_oom;
    if (size == broken) p.message = "a stand-in failure";
    return p;
  }
};

Frontier search(StandIn& s, int64_t lo, int64_t hi, int64_t resolution) {
  return bisect(lo, hi, resolution, [&](int64_t size) { return s(size); });
}

TEST(CapacitySearch, finds_the_largest_that_fits_probing_the_ends_first_and_halving) {
  for (int64_t lo : {1, 3})
    for (int64_t hi : {4, 17, 100, 1000})
      for (int64_t largest = lo; largest < hi; ++largest) {
        StandIn s{largest};
        const auto f = search(s, lo, hi, 1);
        SCOPED_TRACE("lo " + std::to_string(lo) + " hi " + std::to_string(hi) + " largest " + std::to_string(largest));
        ASSERT_GE(s.asked.size(), 2u);
        EXPECT_EQ(s.asked[0], lo);
        EXPECT_EQ(s.asked[1], hi);
        EXPECT_EQ(f.largest, largest);
        EXPECT_EQ(f.failing, largest + 1);
        EXPECT_TRUE(f.stopped.empty());
        // Each probe after the ends halves the interval between the two answers.
        int64_t fit = lo, fail = hi;
        for (size_t i = 2; i < s.asked.size(); ++i) {
          const int64_t width = fail - fit, mid = s.asked[i];
          EXPECT_GT(mid, fit);
          EXPECT_LT(mid, fail);
          (mid <= largest ? fit : fail) = mid;
          EXPECT_LE(fail - fit, (width + 1) / 2);
        }
        EXPECT_LE(s.asked.size(), 2 + static_cast<size_t>(std::ceil(std::log2(static_cast<double>(hi - lo)))));
        EXPECT_EQ(f.probes.size(), s.asked.size());
        ASSERT_NE(f.at(largest), nullptr);
        EXPECT_EQ(f.at(largest)->outcome, ProbeOutcome::trains);
      }
}

TEST(CapacitySearch, stops_within_the_resolution) {
  for (int64_t resolution : {2, 5, 64})
    for (int64_t largest : {10, 99, 500}) {
      StandIn s{largest};
      const auto f = search(s, 1, 1000, resolution);
      EXPECT_LE(f.largest, largest);
      EXPECT_GT(f.failing, largest);
      EXPECT_LE(f.failing - f.largest, resolution);
    }
}

TEST(CapacitySearch, answers_at_either_end) {
  StandIn none{0};
  auto f = search(none, 5, 50, 1);
  EXPECT_EQ(f.largest, -1) << "nothing from the smallest size fits";
  EXPECT_EQ(f.failing, 5);
  EXPECT_EQ(none.asked, std::vector<int64_t>{5});
  StandIn all{1000};
  f = search(all, 5, 50, 1);
  EXPECT_EQ(f.largest, 50) << "the largest asked fits: the range was too small";
  EXPECT_EQ(f.failing, -1);
  EXPECT_EQ(all.asked, (std::vector<int64_t>{5, 50}));
}

TEST(CapacitySearch, a_probe_that_errors_is_reported_as_such_and_ends_the_search) {
  StandIn s{30, /*broken=*/50};  // 1, 100, then 50
  const auto f = search(s, 1, 100, 1);
  EXPECT_EQ(s.asked, (std::vector<int64_t>{1, 100, 50}));
  EXPECT_THAT(f.stopped, HasSubstr("size 50: a stand-in failure"));
  EXPECT_EQ(f.failing, 100) << "an error is not taken for out of memory";
  EXPECT_EQ(f.largest, 1);
  StandIn top(1000, /*broken=*/100);  // the largest asked errors: not an answer that it trains
  const auto t = search(top, 1, 100, 1);
  EXPECT_EQ(top.asked, (std::vector<int64_t>{1, 100}));
  EXPECT_THAT(t.stopped, HasSubstr("size 100: a stand-in failure"));
  EXPECT_EQ(t.largest, 1);
  EXPECT_EQ(t.failing, -1);
  StandIn first(30, /*broken=*/1);
  EXPECT_THAT(search(first, 1, 100, 1).stopped, HasSubstr("size 1: a stand-in failure"));
}

TEST(CapacitySearch, from_a_guess_probes_it_first_and_pays_for_its_distance_in_doublings) {
  for (int64_t hi : {8, 100, 1000})
    for (int64_t largest = 0; largest <= hi; ++largest)
      for (int64_t guess : {int64_t{1}, largest - 7, largest - 1, largest, largest + 1, largest + 30, hi}) {
        if (guess < 1 || guess > hi) continue;
        StandIn s{largest};
        const auto f = bisect_from(guess, 1, hi, 1, [&](int64_t size) { return s(size); });
        SCOPED_TRACE("hi " + std::to_string(hi) + " largest " + std::to_string(largest) + " guess " + std::to_string(guess));
        ASSERT_FALSE(s.asked.empty());
        EXPECT_EQ(s.asked[0], guess);
        EXPECT_EQ(f.largest, largest == 0 ? -1 : largest);
        EXPECT_EQ(f.failing, largest == hi ? -1 : largest + 1);
        EXPECT_TRUE(f.stopped.empty());
        for (auto size : s.asked) {
          EXPECT_GE(size, 1);
          EXPECT_LE(size, hi);
        }
        const int64_t distance = std::abs(largest - guess) + 1;
        EXPECT_LE(s.asked.size(), 2 + 2 * static_cast<size_t>(std::ceil(std::log2(static_cast<double>(distance)))))
            << "a guess " << distance - 1 << " off costs at most two probes per doubling";
        if (guess == largest && largest < hi && largest > 0) {
          EXPECT_EQ(s.asked, (std::vector<int64_t>{largest, largest + 1}));
        }
      }
  // Within a resolution, and an error ends it, as in bisect.
  StandIn r{500};
  const auto f = bisect_from(300, 1, 1000, 16, [&](int64_t size) { return r(size); });
  EXPECT_LE(f.largest, 500);
  EXPECT_GT(f.failing, 500);
  EXPECT_LE(f.failing - f.largest, 16);
  StandIn broken{500, /*broken=*/301};
  const auto b = bisect_from(300, 1, 1000, 1, [&](int64_t size) { return broken(size); });
  EXPECT_EQ(broken.asked, (std::vector<int64_t>{300, 301}));
  EXPECT_THAT(b.stopped, HasSubstr("size 301: a stand-in failure"));
  EXPECT_EQ(b.largest, 300);
  EXPECT_EQ(b.failing, -1);
  StandIn empty{5};
  EXPECT_THAT([&] { bisect_from(3, 6, 2, 1, [&](int64_t size) { return empty(size); }); },
              ::testing::ThrowsMessage<Error>(HasSubstr("the range [6, 2]")));
}

TEST(CapacitySearch, refuses_an_empty_range_or_resolution_naming_them) {
  StandIn s{10};
  EXPECT_THAT([&] { search(s, 10, 5, 1); }, ::testing::ThrowsMessage<Error>(HasSubstr("the range [10, 5]")));
  EXPECT_THAT([&] { search(s, 0, 5, 1); }, ::testing::ThrowsMessage<Error>(HasSubstr("the range [0, 5]")));
  EXPECT_THAT([&] { search(s, 1, 5, 0); }, ::testing::ThrowsMessage<Error>(HasSubstr("resolution 0")));
  EXPECT_TRUE(s.asked.empty());
}

TEST(CapacityFit, lists_what_trains_fastest_first_then_the_rest_in_order) {
  auto probe = [](ProbeOutcome o, double ms) {
    Probe p;
    p.outcome = o;
    p.step_ms = ms;
    return p;
  };
  std::vector<std::pair<std::string, Probe>> r = {{"a", probe(ProbeOutcome::device_oom, 0)},
                                                  {"b", probe(ProbeOutcome::trains, 30)},
                                                  {"c", probe(ProbeOutcome::host_oom, 0)},
                                                  {"d", probe(ProbeOutcome::trains, 10)},
                                                  {"e", probe(ProbeOutcome::trains, 20)}};
  order_by_fit(r);
  std::string order;
  for (const auto& [name, p] : r) order += name;
  EXPECT_EQ(order, "debac");
}

TEST(CapacityAxes, scale_a_preset_and_name_what_is_not_possible) {
  const auto gpt = models::preset("gpt-871m").config;
  EXPECT_EQ(axis_for("depth", gpt).at(gpt, 40).depth, 40);
  const auto width = axis_for("width", gpt);
  EXPECT_EQ(width.unit, gpt.heads * 8);
  EXPECT_EQ(width.at(gpt, 3 * width.unit).width, 3 * width.unit);
  EXPECT_EQ(axis_for("classes", models::preset("bert-base-6m").config).at(models::preset("bert-base-6m").config, 7000).classes, 7000);
  EXPECT_THAT([&] { axis_for("classes", gpt); }, ::testing::ThrowsMessage<Error>(HasSubstr("has none")));
  EXPECT_THAT([&] { axis_for("height", gpt); }, ::testing::ThrowsMessage<Error>(HasSubstr("--scale=height is not an axis")));
  EXPECT_THAT([&] { axis_for("depth", models::preset("mlp-tiny").config); },
              ::testing::ThrowsMessage<Error>(HasSubstr("gpt and bert")));
}

// The model's sizes from its config are the built model's, block by block.
TEST(ModelSizes, equal_the_built_models_blocks) {
  auto untied = models::preset("gpt-tiny").config;
  untied.tied = false;
  for (const auto& config : {models::preset("gpt-tiny").config, untied, models::preset("bert-tiny").config,
                             models::preset("gpt-cpu").config}) {
    SCOPED_TRACE(config.to_string());
    const auto sizes = models::model_sizes(config);
    auto model = models::build_model(config, 0);
    const auto plan = plan_units(model);
    ASSERT_EQ(sizes.blocks.size(), model.blocks().size());
    EXPECT_EQ(sizes.parameters(), model.parameter_count());
    int64_t shared = 0;
    for (size_t u = 0; u < plan.units.size(); ++u)
      if (plan.users[u] > 1)
        for (auto p : plan.units[u]) shared += model.parameters()[p].tensor.numel();
    EXPECT_EQ(sizes.shared_params, shared);
    int64_t largest = 0;
    for (const auto& p : model.parameters()) largest = std::max(largest, p.tensor.numel());
    EXPECT_EQ(sizes.largest_tensor, largest);
    for (size_t b = 0; b < sizes.blocks.size(); ++b) {
      int64_t own = 0;
      bool uses_shared = false;
      for (auto u : plan.windows[b]) {
        if (plan.users[u] > 1) {
          uses_shared = true;
          continue;
        }
        for (auto p : plan.units[u]) own += model.parameters()[p].tensor.numel();
      }
      EXPECT_EQ(sizes.blocks[b].own_params, own) << "block " << b;
      EXPECT_EQ(sizes.blocks[b].uses_shared, uses_shared) << "block " << b;
      EXPECT_EQ(sizes.blocks[b].activation_bytes, model.blocks()[b]->activation_bytes(1)) << "block " << b;
    }
  }
}


// The memory model's parameter bytes on the device, at rest and at their peak, are what each
// strategy's own accounting reports after real steps on the CPU: exactly.
TEST(MemoryModel, parameter_bytes_equal_each_strategys_own_accounting) {
  struct Case {
    std::string strategy;
    std::map<std::string, std::string> options;
  };
  const std::vector<Case> cases = {{"baseline", {}},
                                   {"baseline_checkpoint", {}},
                                   {"hook_offload", {}},
                                   {"hook_offload", {{"prefetch", "0"}}},
                                   {"hook_offload", {{"prefetch", "1"}, {"lead", "0"}}},
                                   {"hook_offload_overlap", {}},
                                   {"hook_offload_sync", {}},
                                   {"sharded", {}},
                                   {"sharded", {{"prefetch", "2"}}},
                                   {"sharded", {{"reshard_after_forward", "0"}}},
                                   {"sharded_offload", {}},
                                   {"manual_split", {}},
                                   {"pipeline_1f1b", {}},
                                   {"pipeline_gpipe", {}},
                                   {"pipeline_interleaved", {}},
                                   {"pipeline_zero_bubble", {}}};
  int checked = 0;
  for (const auto* preset : {"gpt-tiny", "bert-tiny", "gpt-cpu"})
    for (const auto* precision : {"fp32", "bf16"})
      for (const auto& c : cases) {
        MemoryQuestion q;
        q.strategy = c.strategy;
        q.options = c.options;
        q.model = models::preset(preset).config;
        q.batch = 2;
        q.precision = PrecisionPolicy::parse(precision);
        q.optimizer.kind = OptimizerKind::adamw;
        const auto predicted = predict_memory(q);
        StrategyConfig config;
        config.device = torch::Device(torch::kCPU);
        config.optimizer = q.optimizer;
        config.precision = q.precision;
        config.options = c.options;
        auto s = Registry::create(c.strategy, config);
        s->attach(models::build_model(q.model, 0));
        const auto batch = models::make_batch(q.model, q.batch, 1);
        for (int step = 0; step < 2; ++step) {
          s->train_step(batch);
          s->optimizer_step();
        }
        s->finish_step();
        const auto stats = s->stats();
        ASSERT_EQ(stats.devices.size(), 1u);
        const auto& mem = stats.devices.begin()->second;
        SCOPED_TRACE(c.strategy + " " + label_of(c.options) + " " + preset + " " + precision);
        EXPECT_EQ(predicted.resident_param_bytes, mem.resident_param_bytes);
        EXPECT_EQ(predicted.peak_param_bytes, mem.peak_param_bytes);
        ++checked;
      }
  EXPECT_EQ(checked, 96);
}

TEST(MemoryModel, names_what_it_does_not_model) {
  MemoryQuestion q;
  q.strategy = "nope";
  q.model = models::preset("gpt-tiny").config;
  EXPECT_THAT([&] { predict_memory(q); }, ::testing::ThrowsMessage<Error>(HasSubstr("'nope' is not modelled")));
  q.strategy = "pipeline_1f1b";
  q.options = {{"devices", "cuda:0,cuda:1"}};
  EXPECT_THAT([&] { predict_memory(q); },
              ::testing::ThrowsMessage<Error>(HasSubstr("over several devices (devices=cuda:0,cuda:1) is not modelled")));
  q.options.clear();
  q.strategy = "baseline";
  q.model = models::preset("mlp-tiny").config;
  EXPECT_THAT([&] { predict_memory(q); }, ::testing::ThrowsMessage<Error>(HasSubstr("gpt and bert")));
}

}  // namespace
}  // namespace strata::bench
