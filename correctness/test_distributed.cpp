// The data-parallel strategies across processes: every test here runs in every rank of a job that
// strategies/distributed/launch.py (or torchrun) starts, each rank checking the same cases in the
// same order — the strategy's gathered loss, gradients and parameters against the single-process
// baseline on the global batch. CTest starts them with 2 and 3 ranks (3: uneven shards, batches the
// world does not divide) under a timeout. Faults: a rank that throws or dies, and ranks that
// disagree, end every rank with a message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "correctness/support/agreement.h"
#include "correctness/support/chain.h"
#include "correctness/support/errors.h"
#include "correctness/support/generators.h"
#include "correctness/support/ranks.h"
#include "correctness/support/strategy_peers.h"
#include "correctness/support/test_device.h"
#include "strategies/distributed/process_group.h"
#include "strategies/sharded/sharded.h"
#include "strategies/state_files.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

const std::vector<std::string> kDataParallel = {"sharded", "sharded_offload"};

using test::rank;
using test::world;

std::unique_ptr<Sharded> make_sharded(const std::map<std::string, std::string>& options, bool offload = false,
                                      const std::string& precision = "fp32") {
  StrategyConfig c;
  c.device = test::device();
  c.precision = PrecisionPolicy::parse(precision);
  auto all = options;
  if (offload) all["offload"] = "1";
  return std::make_unique<Sharded>(offload ? "sharded_offload" : "sharded", c, ShardedOptions::parse(all));
}

TEST(Distributed, every_rank_draws_the_same_cases) {
  // The properties below need one seed on every rank: a fixed one, and the same.
  const char* params = std::getenv("RC_PARAMS");
  ASSERT_TRUE(params && std::string(params).find("seed=") != std::string::npos)
      << "multi-process properties need RC_PARAMS with seed=...";
  distributed::group_for(test::device())->agree("RC_PARAMS", params);
}

TEST(Distributed, prop_matches_the_baseline_on_the_global_batch) {
  for (const auto& strategy : kDataParallel) {
    const bool ok = rc::check(strategy + " over " + std::to_string(world()) + " ranks", [&] {
      const auto c = *correctness::gen_parity_case(strategy, {test::device().str()});
      const auto r = correctness::check_parity(strategy, c, test::device());
      if (!r.ok) RC_FAIL(r.message);
    });
    EXPECT_TRUE(ok) << strategy;
  }
}

TEST(Distributed, tied_presets_and_own_models_match_the_baseline) {
  std::vector<correctness::ParityCase> cases;
  for (const auto* preset : {"gpt-tiny", "mlp-tied-tiny", "bert-tiny"}) {
    correctness::ParityCase c;
    c.model = models::preset(preset).config;
    c.batch_size = world() + 2;  // 4 over 2 ranks (even), 5 over 3 (uneven)
    cases.push_back(c);
  }
  correctness::ParityCase chain;
  chain.chain = correctness::ChainSpec::parse("chain(in=3 width=5 classes=4 blocks=shared0,frozen,act,shared0,table,frozen_block,conv1)");
  chain.batch_size = world() + 1;
  chain.ignore_targets = true;
  cases.push_back(chain);
  for (const auto& strategy : kDataParallel)
    for (auto c : cases)
      for (const auto* reshard : {"1", "0"}) {
        c.options = {{"reshard_after_forward", reshard}, {"prefetch", "2"}};
        const auto r = correctness::check_parity(strategy, c, test::device());
        EXPECT_TRUE(r.ok) << strategy << " " << c.to_string() << ": " << r.message;
      }
}

TEST(Distributed, shards_are_all_that_stays_and_bytes_follow_the_analytic_count) {
  // gpt-tiny with prefetch 1: no two windows that share a unit are ever held at once, so with
  // resharding every unit is gathered once per use in forward and once per use in backward, except
  // in the last block, whose window is kept from its forward to its backward; each gather receives
  // (W-1)/W of the padded unit. Each unit is reduce-scattered once: (W-1)/W of it
  // with NCCL, 2 (W-1)/W with Gloo (an all-reduce). The loss's all-reduce adds 2 (W-1)/W x 8 bytes.
  // Under bf16 the units are gathered in bf16 (half the gathers' bytes and of the gathered peak);
  // the shards stay fp32, and so does the reduction unless reduce=bf16: then half the bytes with
  // NCCL, and with Gloo (no bf16 there) an all-gather of every rank's whole buffer, (W-1) of it.
  const auto config = models::preset("gpt-tiny").config;
  auto model = models::build_model(config, 0);
  const auto plan = plan_units(model);
  const double w = world();
  const bool nccl = distributed::group_for(test::device())->backend() == "nccl";
  for (const auto* precision : {"fp32", "bf16", "bf16,reduce=bf16"}) {
  const double gathered = std::string(precision) == "fp32" ? 1.0 : 0.5;
  const bool reduce_bf16 = std::string(precision) == "bf16,reduce=bf16";
  const double reduced = nccl ? (reduce_bf16 ? 0.5 : 1.0) * (w - 1) / w : reduce_bf16 ? 0.5 * (w - 1) : 2.0 * (w - 1) / w;
  double expected = 2.0 * 8 * (w - 1) / w;
  int64_t shard_bytes = 0, widest_window = 0;
  std::vector<int64_t> padded(plan.units.size());
  for (size_t u = 0; u < plan.units.size(); ++u) {
    int64_t numel = 0;
    for (auto p : plan.units[u]) numel += model.parameters()[p].tensor.numel();
    padded[u] = (numel + world() - 1) / world() * world() * 4;
    shard_bytes += padded[u] / world();
    const auto& last = plan.windows.back();
    const int gathers = 2 * plan.users[u] - (std::find(last.begin(), last.end(), u) != last.end() ? 1 : 0);
    expected += gathered * gathers * padded[u] * (w - 1) / w + padded[u] * reduced;
  }
  for (const auto& window : plan.windows) {
    int64_t bytes = 0;
    for (auto u : window) bytes += padded[u];
    widest_window = std::max(widest_window, static_cast<int64_t>(gathered * bytes));
  }
  for (bool offload : {false, true}) {
    if (std::string(precision) != "fp32" && offload) continue;  // as fp32's; its host copies: test_precision
    SCOPED_TRACE(precision);
    auto s = make_sharded({{"prefetch", "1"}}, offload, precision);
    s->attach(models::build_model(config, 0));
    s->reset_stats();
    s->train_step(models::make_batch(config, world() + 1, 1));
    const auto stats = s->stats();
    EXPECT_NEAR(static_cast<double>(stats.bytes_interconnect), expected, 2.0 * plan.units.size() + 2)
        << "offload=" << offload;
    // At rest only the shards (on the host with offload: nothing on the device); at the peak at
    // most the computing block's window and the one prefetched beside them.
    ASSERT_EQ(stats.devices.size(), 1u);
    const auto& mem = stats.devices.begin()->second;
    const int64_t shards_on_device = offload ? 0 : shard_bytes;
    EXPECT_EQ(ShardedTestPeer(*s).gathered_bytes(), 0);
    EXPECT_EQ(mem.resident_param_bytes, shards_on_device) << "offload=" << offload;
    EXPECT_LE(mem.peak_param_bytes, shards_on_device + 2 * widest_window) << "offload=" << offload;
    EXPECT_GT(mem.peak_param_bytes, shards_on_device) << "offload=" << offload;
    s->optimizer_step();
    EXPECT_EQ(s->stats().devices.begin()->second.resident_param_bytes, shards_on_device);
    // The host optimizer's time: counted where shards are stepped on the host, and only there.
    if (offload)
      EXPECT_GT(s->stats().host_update_ms, 0.0) << "world " << world();
    else
      EXPECT_EQ(s->stats().host_update_ms, 0.0);
  }
  }
}

// The collectives under mixed precision, by value: bf16 sums and maxima over Gloo (which has no
// bfloat16 in LibTorch 1.13: every rank's part gathered and added) and over NCCL, a bf16
// reduce-scatter and gather, and the flag that makes one skip decision for every rank. The values
// are small integers, exact in bf16 in any order of summing: this checks what is summed, not the
// order.
TEST(Distributed, bf16_collectives_and_the_every_rank_flag_hold_by_value) {
  const auto device = test::device();
  auto group = distributed::group_for(device);
  const int64_t w = world(), r = rank();
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  // Small integers: exact in bf16, so any order of summing gives the same.
  auto sum = torch::full({5}, static_cast<double>(r + 1), bf16);
  group->all_reduce(sum).wait();
  EXPECT_TRUE(torch::equal(sum.cpu(), torch::full({5}, static_cast<double>(w * (w + 1) / 2), torch::kBFloat16)));
  auto largest = torch::full({3}, static_cast<double>(r + 1), bf16);  // from two ranks on, not the sum
  group->all_reduce(largest, /*max=*/true).wait();
  EXPECT_TRUE(torch::equal(largest.cpu(), torch::full({3}, static_cast<double>(w), torch::kBFloat16)));
  // Reduce-scatter: element k of every rank's input is k; this rank's slice sums to w x k.
  auto in = torch::arange(2 * w, bf16);
  auto out = torch::empty({2}, bf16);
  group->reduce_scatter(out, in).wait();
  EXPECT_TRUE(torch::equal(out.cpu(), (torch::arange(2 * r, 2 * r + 2) * w).to(torch::kBFloat16)));
  auto gathered = torch::empty({3 * w}, bf16);
  group->all_gather(gathered, torch::full({3}, static_cast<double>(r), bf16)).wait();
  EXPECT_TRUE(torch::equal(gathered.cpu(), torch::arange(w).repeat_interleave(3).to(torch::kBFloat16)));
  EXPECT_TRUE(distributed::on_every_rank(*group, true, device));
  EXPECT_EQ(distributed::on_every_rank(*group, r != w - 1, device), false) << "the last rank said no";
}

// Mixed precision over the ranks: gathered in bf16, gradients reduce-scattered in fp32 or in bf16
// (over Gloo a bf16 sum is every rank's part added in rank order), against the float64 reference
// within bf16's bounds; tied presets and BERT.
TEST(Distributed, bf16_matches_the_reference_within_its_bounds) {
  for (const auto& strategy : kDataParallel)
    for (const auto* precision : {"bf16", "bf16,reduce=bf16"})
      for (const auto* preset : {"gpt-tiny", "mlp-tied-tiny", "bert-tiny"}) {
        correctness::ParityCase c;
        c.model = models::preset(preset).config;
        c.batch_size = world() + 2;
        c.precision = PrecisionPolicy::parse(precision);
        c.options = {{"prefetch", "2"}};
        const auto r = correctness::check_parity(strategy, c, test::device());
        EXPECT_TRUE(r.ok) << strategy << " " << c.to_string() << ": " << r.message;
      }
}

TEST(Distributed, parity_holds_with_injected_delays_and_a_missing_wait_is_caught) {
  using namespace std::chrono_literals;
  correctness::ParityCase c;
  c.model = models::preset("gpt-tiny").config;
  c.batch_size = world() + 1;
  c.steps = 2;
  {
    device::ScopedDelays delays({1ms, 1ms, 3ms});
    for (const auto& strategy : kDataParallel)
      for (const bool trainer_order : {false, true}) {
        c.options = {{"prefetch", "2"}, {"debug_poison", "1"}};
        c.trainer_order = trainer_order;
        const auto r = correctness::check_parity(strategy, c, test::device());
        EXPECT_TRUE(r.ok) << strategy << " " << c.to_string() << ": " << r.message;
      }
    c.trainer_order = false;
  }
  // The same check must fail when compute does not wait for its gathers (every rank reads
  // a buffer its gather has not filled yet: NaN), or it proves nothing.
  device::ScopedDelays delays({0ms, 0ms, 20ms});
  c.options = {{"prefetch", "0"}, {"debug_poison", "1"}, {"debug_skip_waits", "1"}};
  c.steps = 1;
  const auto r = correctness::check_parity("sharded", c, test::device());
  EXPECT_FALSE(r.ok) << "a missing wait went unnoticed";
}

// Buffers under sharded follow DDP's default: rank 0's slice moves them and every rank takes rank
// 0's. So after each step buffers() is the same on every rank, and it is what a forward of the
// model (the step's starting parameters and buffers) over rank 0's slice of the batch leaves,
// worked out here with the model alone. A BatchNorm's running statistics differ slice by slice.
// Checkpoints of a sharded run: each rank saves its shard (state_files::save_ranks), and the
// files together are the whole state, which loads into any strategy at any world.
void barrier() { distributed::barrier(*distributed::group_for(torch::Device(torch::kCPU))); }
std::string shared_dir(const std::string& what) {  // the same on every rank of this launch
  const char* port = std::getenv("MASTER_PORT");
  return (std::filesystem::temp_directory_path() / ("strata-" + what + "-" + (port ? port : "0"))).string();
}
std::unique_ptr<Strategy> trained_on(std::unique_ptr<Strategy> s, const models::ModelConfig& model, int first, int steps,
                                     const NamedTensors* state = nullptr) {
  s->attach(models::build_model(model, 3));
  if (state) s->load_training_state(*state);
  for (int i = 0; i < steps; ++i) {
    s->train_step(models::make_batch(model, 2 * world() + 1, 100 + first + i));
    s->optimizer_step();
  }
  return s;
}
std::unique_ptr<Strategy> create(const std::string& name, const std::string& precision = "fp32") {
  StrategyConfig c;
  c.device = test::device();
  c.optimizer.kind = OptimizerKind::adamw;
  c.optimizer.lr = 1e-2;
  c.optimizer.eps = 1e-5;  // an update of a gradient of pure rounding noise stays small (as in parity)
  c.precision = PrecisionPolicy::parse(precision);
  return Registry::create(name, c);
}

// Three steps, each rank's shard to its file, a new instance loads every file, two more steps:
// equal to the bit to five steps without the break. The files, read whole by a baseline in one
// process, hold exactly the sharded run's parameters and moments (the consolidated state).
TEST(Distributed, a_sharded_resume_is_exact_and_its_files_are_the_whole_state) {
  const auto model = models::preset("gpt-tiny").config;
  for (const auto& strategy : kDataParallel)
    for (const auto* precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(strategy + " " + precision + " at world " + std::to_string(world()));
      const auto dir = shared_dir("resume");
      if (rank() == 0) state_files::remove_tree(dir);
      barrier();
      const auto whole = trained_on(create(strategy, precision), model, 0, 5)->parameters();
      auto first = trained_on(create(strategy, precision), model, 0, 3);
      state_files::Manifest m;
      m.model = model.to_string();
      m.strategy = strategy;
      m.step = 3;
      const auto saved = state_files::save_ranks(dir, m, rank(), world(), first->training_state(), barrier);
      EXPECT_EQ(state_files::read_manifest(saved).world, world());
      const auto state = state_files::load_all(saved);
      const auto resumed = trained_on(create(strategy, precision), model, 3, 2, &state)->parameters();
      ASSERT_EQ(resumed.size(), whole.size());
      for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(torch::equal(resumed[i].second, whole[i].second)) << whole[i].first;
      // Consolidated: a baseline here takes every rank's file and holds the run's state whole.
      auto base = create("baseline", precision);
      base->attach(models::build_model(model, 3));
      base->load_training_state(state);
      const auto params = first->parameters();
      const auto base_params = base->parameters();
      for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(base_params[i].second, params[i].second)) << params[i].first;
      StateIndex shards;
      shards.add(state);
      for (const auto& [name, t] : base->training_state())
        EXPECT_TRUE(torch::equal(shards.whole(name, t.sizes()), t)) << name;
      barrier();
      if (rank() == 0) state_files::remove_tree(dir);
    }
}

// For the tools (ctest cpu.checkpoint.*): a sharded run of gpt-tiny saved after two steps into
// $STRATA_CHECKPOINT_DIR by every rank, and its parameters beside it (rank 0, "expected.pt").
TEST(DistributedCheckpoint, a_sharded_run_saves_for_the_tools) {
  const char* dir = std::getenv("STRATA_CHECKPOINT_DIR");
  ASSERT_NE(dir, nullptr) << "STRATA_CHECKPOINT_DIR names where to save";
  const auto model = models::preset("gpt-tiny").config;
  auto s = trained_on(create("sharded"), model, 0, 2);
  state_files::Manifest m;
  m.model = model.to_string();
  m.strategy = "sharded";
  m.step = 2;
  const auto saved = state_files::save_ranks(dir, m, rank(), world(), s->training_state(), barrier);
  const auto params = s->parameters();
  if (rank() == 0) state_files::save(std::string(dir) + "/expected", m, {{"parameters.pt", params}});
  EXPECT_FALSE(saved.empty());
}

// The tools' checkpoint (saved by the test above at another world) loads into sharded here: every
// rank holds exactly the saved values, so the parameters are the run's and each rank's pieces of
// the moments are the saved moments'.
TEST(DistributedCheckpoint, a_sharded_save_loads_at_this_world) {
  const char* dir = std::getenv("STRATA_CHECKPOINT_DIR");
  ASSERT_NE(dir, nullptr) << "STRATA_CHECKPOINT_DIR names the checkpoint";
  const auto saved = state_files::latest(dir);
  ASSERT_FALSE(saved.empty()) << "no checkpoint in " << dir;
  const auto manifest = state_files::read_manifest(saved);
  ASSERT_NE(manifest.world, world()) << "the checkpoint should come from another world";
  const auto state = state_files::load_all(saved);
  const auto expected_dir = std::string(dir) + "/expected/step-000000002";
  const auto expected = state_files::load_file(expected_dir, state_files::read_manifest(expected_dir), "parameters.pt");
  auto s = trained_on(create("sharded"), models::ModelConfig::parse(manifest.model), 0, 0, &state);
  const auto params = s->parameters();
  ASSERT_EQ(params.size(), expected.size());
  const std::map<std::string, torch::Tensor> want(expected.begin(), expected.end());
  for (const auto& [name, t] : params) EXPECT_TRUE(torch::equal(t, want.at(name))) << name;
  StateIndex saved_index, mine;
  saved_index.add(state);
  for (const auto& [key, t] : s->training_state()) {
    const auto at = key.rfind('@');
    if (at == std::string::npos) continue;
    const auto offset = std::stoll(key.substr(at + 1));
    EXPECT_TRUE(torch::equal(t, saved_index.range(key.substr(0, at), offset, offset + t.numel()))) << key;
  }
}

// A whole state (a baseline's, one process) loads into sharded at this world: each rank's pieces
// hold exactly the state's values, moments and step counts included, and two more steps land where
// the baseline's two more do (to rounding: the ranks sum gradients in another order).
TEST(Distributed, a_whole_state_loads_into_sharded_at_any_world) {
  const auto model = models::preset("gpt-tiny").config;
  const auto state = trained_on(create("baseline"), model, 0, 3)->training_state();
  const std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  const auto base_after = trained_on(create("baseline"), model, 3, 2, &state)->parameters();
  for (const auto& strategy : kDataParallel) {
    SCOPED_TRACE(strategy + " at world " + std::to_string(world()));
    auto s = trained_on(create(strategy), model, 0, 0, &state);
    for (const auto& [key, t] : s->training_state()) {
      const auto at = key.rfind('@');
      const auto name = key.substr(0, at);
      ASSERT_TRUE(by_name.count(name)) << key;
      const auto& saved = by_name.at(name);
      if (at == std::string::npos)
        EXPECT_TRUE(torch::equal(t, saved)) << key;
      else
        EXPECT_TRUE(torch::equal(t, saved.reshape({-1}).narrow(0, std::stoll(key.substr(at + 1)), t.numel()))) << key;
    }
    for (int i = 0; i < 2; ++i) {
      s->train_step(models::make_batch(model, 2 * world() + 1, 100 + 3 + i));
      s->optimizer_step();
    }
    const auto after = s->parameters();
    for (size_t i = 0; i < after.size(); ++i)
      EXPECT_LE((after[i].second - base_after[i].second).abs().max().item<double>(), 1e-5) << after[i].first;
  }
}

// A group of the first n ranks: its collectives reach those ranks alone, and a rank outside it that
// asks to join is told so.
TEST(Distributed, a_group_of_the_first_ranks_reduces_over_them_alone) {
  STRATA_NEEDS_PROCESSES(2);
  for (int n = 1; n <= world(); ++n) {
    SCOPED_TRACE("the first " + std::to_string(n) + " of " + std::to_string(world()) + " ranks");
    if (rank() < n) {
      auto g = distributed::first_ranks(test::device(), n);
      EXPECT_EQ(g->size(), n);
      EXPECT_EQ(g->rank(), rank());
      auto t = torch::full({3}, static_cast<float>(rank() + 1), torch::TensorOptions().device(test::device()));
      g->all_reduce(t).wait();
      EXPECT_TRUE(torch::equal(t.cpu(), torch::full({3}, n * (n + 1) / 2.0f)));
    } else {
      EXPECT_THAT([&] { distributed::first_ranks(test::device(), n); },
                  ThrowsMessage<Error>(HasSubstr("rank " + std::to_string(rank()) + " asked to join the group of ranks 0.." +
                                                 std::to_string(n - 1))));
    }
    barrier();
  }
  EXPECT_THAT([&] { distributed::first_ranks(test::device(), world() + 1); },
              ThrowsMessage<Error>(HasSubstr("first " + std::to_string(world() + 1) + " ranks in a world of")));
}

// Resume anywhere across world sizes: the first steps in one saving strategy at one world size
// (its ranks saving their pieces), the rest in another at another (every one of its ranks loading
// all the pieces), each step against the baseline. Ranks outside a world run a baseline in its
// place, which loads the same files. The pipelines span the whole launch: they resume across
// worlds in DistributedPipeline.a_resume_is_exact_and_its_files_are_the_whole_state.
TEST(Distributed, prop_resume_anywhere_across_world_sizes) {
  const auto sliced = [](const std::string& s) {
    const auto traits = correctness::strategy_traits().find(s);
    return traits != correctness::strategy_traits().end() && traits->second.data_parallel;
  };
  // Half the cases resume into a data-parallel strategy, whose world the case draws: drawn from
  // all the saving strategies alike, few cases would change world size.
  std::vector<std::string> sliced_targets, whole_targets;
  for (const auto& s : correctness::saving_strategies())
    if (s.rfind("pipeline_", 0) != 0) (sliced(s) ? sliced_targets : whole_targets).push_back(s);
  const auto device = test::device();
  int handovers = 0, moved_world = 0;
  const bool ok = rc::check("resume across world sizes of 1.." + std::to_string(world()), [&] {
    const bool into_sliced = *rc::gen::arbitrary<bool>();
    const auto strategy = *rc::gen::elementOf(into_sliced ? sliced_targets : whole_targets);
    const auto r = *correctness::gen_resume_across(strategy, {device.str()}, world());
    const auto group = [&](const std::string& s, int w) {
      return sliced(s) ? distributed::first_ranks(device, w) : nullptr;
    };
    correctness::ResumeAcross across;
    across.first = [&](StrategyConfig config) {
      if (rank() >= r.first_world) {
        config.options.clear();
        return Registry::create("baseline", config);
      }
      config.group = group(r.c.resume_from, r.first_world);
      return Registry::create(r.c.resume_from, config);
    };
    across.hand_over = [&](Strategy& from, Strategy& to) {
      const auto dir = shared_dir("across-" + std::to_string(handovers++));
      if (rank() == 0) state_files::remove_tree(dir);
      barrier();
      state_files::Manifest m;
      m.model = r.c.model_text();
      m.strategy = from.name();
      m.step = r.c.resume_at;
      if (rank() < r.first_world && from.world_size() > 1) {
        auto ranks = distributed::first_ranks(torch::Device(torch::kCPU), r.first_world);
        state_files::save_ranks(dir, m, rank(), r.first_world, from.training_state(), [&] { distributed::barrier(*ranks); });
      } else if (rank() == 0) {
        state_files::save(dir, m, {{"state.pt", from.training_state()}});
      }
      barrier();
      to.load_training_state(state_files::load_all(state_files::latest(dir)));
      barrier();
      if (rank() == 0) state_files::remove_tree(dir);
    };
    const auto make = [&](StrategyConfig config) -> std::unique_ptr<Strategy> {
      if (rank() >= r.then_world) {
        config.options.clear();
        return Registry::create("baseline", config);
      }
      if (config.options.empty()) config.options = Registry::required_options(strategy);
      config.group = group(strategy, r.then_world);
      return Registry::create(strategy, config);
    };
    if (r.first_world != r.then_world) ++moved_world;
    const auto result = correctness::check_parity(make, r.c, device, &across);
    if (!result.ok) RC_FAIL(strategy + " " + r.to_string() + ": " + result.message);
  });
  EXPECT_TRUE(ok);
  if (world() > 1) {
    EXPECT_GT(moved_world, 0) << "no case resumed at another world size";
  }
}

TEST(Distributed, buffers_are_rank_zeros_on_every_rank) {
  const auto spec = correctness::ChainSpec::parse("chain(in=3 width=5 classes=4 blocks=lin,bn,act,lin)");
  const int64_t batch_size = 2 * world() + 3;  // uneven slices from 3 ranks on
  for (const auto& strategy : kDataParallel) {
    StrategyConfig c;
    c.device = test::device();
    auto s = Registry::create(strategy, c);
    s->attach(spec.build(5));
    auto reference = spec.build(5);
    for (const auto& block : reference.blocks()) block->to(test::device());
    for (int step = 0; step < 3; ++step) {
      const auto params = s->parameters(), buffers = s->buffers();
      const auto batch = spec.make_batch(batch_size, 100 + step);
      s->train_step(batch);
      s->optimizer_step();
      const auto after = s->buffers();
      test::expect_the_same_on_every_rank(strategy + " buffers after step " + std::to_string(step), after,
                                          test::device());
      test::set_state(reference, params, buffers);
      {
        torch::NoGradGuard no_grad;
        auto x = batch.input.narrow(0, 0, batch_size / world()).to(test::device());  // rank 0's slice
        for (const auto& block : reference.blocks()) x = block->forward(x);
      }
      test::expect_buffers_of(reference, after, strategy + " step " + std::to_string(step) + " on rank " +
                                                    std::to_string(rank()) + " (rank 0's slice)");
    }
  }
}

TEST(Distributed, ranks_with_different_models_are_refused_on_every_rank) {
  auto config = models::preset("gpt-tiny").config;
  if (rank() == world() - 1) config.width = 16;  // the last rank builds another model
  auto s = make_sharded({});
  const auto message = test::error_of([&] { s->attach(models::build_model(config, 0)); });
  if (world() > 1)
    EXPECT_THAT(message, HasSubstr("sharded attach: rank " + std::to_string(world() - 1) + " has"));
  else
    EXPECT_EQ(message, "<no error>");
}

TEST(Distributed, a_batch_smaller_than_the_world_is_refused_naming_both) {
  auto s = make_sharded({});
  const auto config = models::preset("mlp-tiny").config;
  s->attach(models::build_model(config, 0));
  if (world() > 1) {
    EXPECT_THAT(test::error_of([&] { s->train_step(models::make_batch(config, world() - 1, 1)); }),
                HasSubstr("a global batch of " + std::to_string(world() - 1) + " samples cannot be split over " +
                          std::to_string(world()) + " ranks"));
  }
}

// A model whose head is most of it (a classifier of 200,000 classes on 64 features: 52 MB of its
// 52.1): sharded_offload in a world of one holds at its peak the head's gathered weight and the
// gradient its backward produced, plus a few pieces of the reduction (1 MiB each here) and the
// activations, never a second or third copy of the head (the gather's source, a flat gradient
// buffer, the reduction's result). Measured by the allocator above what the step starts with,
// beside hook_offload on the same model, which holds the head and its gradient too.
TEST(CudaOnly, sharded_offload_holds_a_dominant_unit_and_its_gradient_and_a_few_pieces) {
  const auto spec = correctness::ChainSpec::parse("chain(in=8 width=64 classes=200000 blocks=lin)");
  const int64_t batch_size = 4;
  const int64_t head = (64 * 200000 + 200000) * 4, piece = 1 << 20;
  const int64_t logits = batch_size * 200000 * 4;
  auto above_rest = [&](const std::string& strategy, const std::map<std::string, std::string>& options) {
    StrategyConfig c;
    c.device = test::device();
    c.options = options;
    auto s = Registry::create(strategy, c);
    s->attach(spec.build(1));
    s->train_step(spec.make_batch(batch_size, 1));  // allocations that stay (workspaces) made once
    s->optimizer_step();
    s->finish_step();
    device::synchronize(test::device());
    const auto rest = device::allocator_stats(test::device()).allocated;
    s->reset_stats();
    s->train_step(spec.make_batch(batch_size, 2));
    s->finish_backward();
    const auto peak = s->stats().devices.at(test::device().str()).peak_allocated - rest;
    s->optimizer_step();
    s->finish_step();
    return peak;
  };
  const int64_t bound = 2 * head + 3 * piece + 8 * logits + (2 << 20);
  const auto sharded = above_rest("sharded_offload", {{"piece_kib", "1024"}});
  // opening=0: hook_offload fetches no window for the next forward in optimizer_step, so at rest it
  // too holds nothing of the model (its default opening would hold the head there already).
  const auto hook = above_rest("hook_offload", {{"opening", "0"}});
  // The bound can fail: with one piece as large as the head, its reduction is a third copy of it.
  const auto whole = above_rest("sharded_offload", {{"piece_kib", std::to_string(2 * head / 1024)}});
  std::cout << "peak above rest: sharded_offload " << sharded << " B (one piece: " << whole << " B), hook_offload "
            << hook << " B; head " << head << " B, bound " << bound << " B" << std::endl;
  EXPECT_LE(sharded, bound);
  EXPECT_LE(static_cast<double>(sharded), 1.2 * static_cast<double>(hook));
  EXPECT_GT(whole, bound);
}

// Run alone, by the fault tests of correctness/CMakeLists.txt: one rank fails mid-step (throws, or
// dies when STRATA_FAULT=exit); every rank must end non-zero with a message.
TEST(DistributedFault, a_failing_rank_ends_every_rank) {
  STRATA_NEEDS_PROCESSES(2);
  const char* kind = std::getenv("STRATA_FAULT");
  const bool die = kind && std::string(kind) == "exit";
  const auto config = models::preset("gpt-tiny").config;
  auto s = make_sharded({{"debug_fail_rank", std::to_string(world() - 1)}});
  s->attach(models::build_model(config, 0));
  const auto batch = models::make_batch(config, world() + 1, 1);
  if (die && rank() == world() - 1) {
    try {
      s->train_step(batch);
    } catch (const Error& e) {
      std::cout << "dying now: " << e.what() << std::endl;
      std::_Exit(3);
    }
  }
  s->train_step(batch);  // throws on the failing rank, and on the others once their collectives fail
  ADD_FAILURE() << "rank " << rank() << " finished a step that rank " << world() - 1 << " failed";
}

}  // namespace
}  // namespace strata
