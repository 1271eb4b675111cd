// The pipeline strategies beyond the registry's parity properties: refusals that name both numbers,
// activations in flight per stage (1F1B's bound against GPipe's m), replicas of a shared parameter
// in sync after steps, parity under injected delays on one rank's compute and on the transport, a
// stage that throws ending the step on every rank with its error, and uneven micro-batches.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>

#include "correctness/support/errors.h"
#include "correctness/support/failing_block.h"
#include "correctness/support/parity.h"
#include "correctness/support/strategy_peers.h"
#include "correctness/support/test_device.h"
#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/pipeline/pipeline.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using test::error_of;

using test::devices;

std::unique_ptr<Pipeline> make_pipeline(const std::map<std::string, std::string>& options) {
  StrategyConfig c;
  c.device = test::device();
  return std::make_unique<Pipeline>("pipeline", c, PipelineOptions::parse(options));
}

models::ModelConfig gpt_of_depth(int64_t depth, bool tied) {
  auto c = models::preset("gpt-tiny").config;
  c.depth = depth;
  c.tied = tied;
  return c;
}

TEST(Pipeline, refusals_name_the_numbers) {
  EXPECT_THAT(error_of([] { make_pipeline({{"schedule", "zigzag"}}); }), HasSubstr("schedule='zigzag'"));
  EXPECT_THAT(error_of([] { make_pipeline({{"micro_batches", "-1"}}); }), HasSubstr("micro_batches=-1"));
  EXPECT_THAT(error_of([] { make_pipeline({{"virtual_stages", "2"}}); }), HasSubstr("virtual_stages=2 needs schedule=interleaved"));
  const auto model = gpt_of_depth(2, true);  // 4 blocks
  auto p = make_pipeline({{"devices", devices(2)}, {"micro_batches", "4"}});
  p->attach(models::build_model(model, 0));
  EXPECT_THAT(error_of([&] { p->train_step(models::make_batch(model, 3, 1)); }),
              HasSubstr("a batch of 3 samples cannot be split into 4 micro-batches"));
  auto q = make_pipeline({{"devices", devices(3)}, {"schedule", "interleaved"}, {"micro_batches", "3"},
                          {"virtual_stages", "2"}});
  EXPECT_THAT(error_of([&] { q->attach(models::build_model(model, 0)); }), HasSubstr("6 stages (3 ranks x 2 virtual stages)"));
  auto r = make_pipeline({{"devices", devices(2)}, {"schedule", "interleaved"}, {"micro_batches", "3"},
                          {"virtual_stages", "2"}});
  EXPECT_THAT(error_of([&] { r->attach(models::build_model(model, 0)); }), HasSubstr("m=3 micro-batches is not a multiple of p=2"));
  auto b = make_pipeline({{"devices", devices(2)}, {"balance", "1,1"}});
  EXPECT_THAT(error_of([&] { b->attach(models::build_model(model, 0)); }), HasSubstr("balance 1,1 must give 2 stages"));
}

// 1F1B keeps at most p - s micro-batches of activations on stage s, GPipe all m of them; counted as
// the kept graphs of micro-batches whose backward has not run.
TEST(Pipeline, one_f_one_b_holds_fewer_micro_batches_than_gpipe) {
  const auto model = gpt_of_depth(4, false);  // 6 blocks: 3 stages of 2
  const auto batch = models::make_batch(model, 8, 3);
  for (const auto& [schedule, expected] :
       std::vector<std::pair<std::string, std::vector<int>>>{{"gpipe", {8, 8, 8}}, {"1f1b", {3, 2, 1}}, {"zb-h1", {3, 3, 3}}}) {
    auto p = make_pipeline({{"devices", devices(3)}, {"micro_batches", "8"}, {"schedule", schedule}});
    p->attach(models::build_model(model, 0));
    p->train_step(batch);
    // ZB-H1 defers weight gradients: a micro-batch stays until its W, at most p per stage.
    if (schedule == "zb-h1") {
      for (auto k : p->peak_in_flight()) EXPECT_LE(k, 3) << schedule;
    } else {
      EXPECT_EQ(p->peak_in_flight(), expected) << schedule;
    }
  }
}

TEST(Pipeline, replicas_of_a_shared_parameter_stay_in_sync) {
  const auto model = gpt_of_depth(2, true);
  auto p = make_pipeline({{"devices", devices(2)}, {"micro_batches", "2"}, {"replicate_tied", "1"}});
  p->attach(models::build_model(model, 0));
  for (int step = 0; step < 3; ++step) {
    p->train_step(models::make_batch(model, 4, step));
    p->optimizer_step();
    EXPECT_EQ(PipelineTestPeer(*p).max_replica_drift(), 0.0) << "after step " << step;
  }
}

// Delays on rank 0's compute and on every message (before its event) change when stages run; the
// results must not change. Every schedule, the tied GPT, uneven micro-batches (5 over 2).
TEST(Pipeline, delays_on_one_rank_and_on_the_transport_keep_parity) {
  device::ScopedDelays delays({/*copy=*/std::chrono::microseconds(3000), /*compute=*/std::chrono::microseconds(5000),
                               /*collective=*/std::chrono::microseconds(0)});
  for (const std::string name : {"pipeline_gpipe", "pipeline_1f1b", "pipeline_interleaved", "pipeline_zero_bubble"}) {
    correctness::ParityCase c;
    c.model = gpt_of_depth(2, true);
    c.batch_size = 5;
    c.steps = 2;
    c.options = {{"devices", devices(2)}, {"micro_batches", "2"}, {"replicate_tied", "1"}};
    if (name == "pipeline_interleaved") c.options["virtual_stages"] = "2";
    const auto r = correctness::check_parity(name, c, test::device());
    EXPECT_TRUE(r.ok) << name << ": " << r.message;
  }
}

// The same delays without the receivers' waits: on CUDA a stage then reads activations and
// gradients before they are written, and the checker must see it (so the test above can fail).
// On the CPU a message is complete when it is sent, and parity holds without the wait.
TEST(Pipeline, without_the_waits_the_delays_break_parity_on_cuda) {
  device::ScopedDelays delays({std::chrono::microseconds(20000), std::chrono::microseconds(20000),
                               std::chrono::microseconds(0)});
  correctness::ParityCase c;
  c.model = gpt_of_depth(2, false);
  c.batch_size = 4;
  c.steps = 1;
  c.options = {{"devices", devices(2)}, {"micro_batches", "2"}, {"debug_skip_waits", "1"}};
  const auto r = correctness::check_parity("pipeline_1f1b", c, test::device());
  if (test::device().is_cuda())
    EXPECT_FALSE(r.ok) << "the missing waits went unnoticed";
  else
    EXPECT_TRUE(r.ok) << r.message;
}

TEST(Pipeline, a_stage_that_throws_ends_the_step_with_its_error) {
  models::ModelConfig config;
  config.kind = models::ModelKind::mlp;
  config.in_features = 4;
  config.classes = 3;
  auto failing = std::make_shared<test::FailingBlock>(4);
  std::vector<std::shared_ptr<models::Block>> blocks{std::make_shared<test::FailingBlock>(4), failing, std::make_shared<test::LinearHead>(4, 3)};
  models::BlockModel model(config, blocks);
  models::Batch batch{torch::randn({6, 4}), torch::randint(0, 3, {6}, torch::kLong)};
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    auto p = make_pipeline({{"devices", devices(3)}, {"micro_batches", "3"}, {"schedule", schedule}});
    failing->calls = 0;
    failing->fail_after = 1;  // the second micro-batch's forward on stage 1
    p->attach(models::BlockModel(config, blocks));
    const auto message = error_of([&] { p->train_step(batch); });
    EXPECT_THAT(message, HasSubstr("failure injected in a stage")) << schedule;
    EXPECT_THAT(message, HasSubstr("rank 1")) << schedule;
    // The micro-batch it ran on: an error of a block needing more samples reads against the split.
    EXPECT_THAT(message, HasSubstr("(micro-batch 1: 2 of the batch's 6 samples, split into 3 micro-batches)"))
        << schedule;
    // The strategy stays usable once the block behaves.
    failing->fail_after = -1;
    EXPECT_NO_THROW(p->train_step(batch)) << schedule;
  }
}

// The loss of a step is the whole batch's mean whatever the split: 7 samples over 3 micro-batches.
TEST(Pipeline, uneven_micro_batches_give_the_batch_mean) {
  const auto model = gpt_of_depth(2, false);
  const auto batch = models::make_batch(model, 7, 9);
  auto reference = models::build_model(model, 0);
  torch::Tensor x = batch.input;
  for (auto& b : reference.blocks()) x = b->forward(x);
  const double expected = reference.loss(x, batch.target).item<double>();
  auto p = make_pipeline({{"devices", devices(2)}, {"micro_batches", "3"}});
  p->attach(models::build_model(model, 0));
  EXPECT_NEAR(p->train_step(batch), expected, 1e-5 * std::abs(expected));
}

// time_actions: every stage's actions are timed, the kinds its schedule uses and no others, and
// the simulator turns them into a step no longer than running every action one after another.
TEST(Pipeline, timed_actions_give_the_simulator_its_costs) {
  const auto model = gpt_of_depth(2, true);
  const auto batch = models::make_batch(model, 4, 3);
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    auto p = make_pipeline({{"devices", devices(2)}, {"micro_batches", "4"}, {"schedule", schedule}, {"time_actions", "1"}});
    p->attach(models::build_model(model, 0));
    p->train_step(batch);
    const auto& costs = p->last_costs().stages;
    ASSERT_EQ(costs.size(), 2u) << schedule;
    double serial = 0;
    for (const auto& c : costs) {
      EXPECT_GT(c.forward, 0) << schedule;
      if (schedule == "1f1b") {
        EXPECT_GT(c.backward, 0);
        EXPECT_EQ(c.input, 0);
        EXPECT_EQ(c.weight, 0);
      } else {
        EXPECT_EQ(c.backward, 0);
        EXPECT_GT(c.input, 0);
        EXPECT_GT(c.weight, 0);
      }
      serial += 4 * (c.forward + c.backward + c.input + c.weight);
    }
    const double simulated = p->simulated_ms();
    EXPECT_GT(simulated, 0) << schedule;
    EXPECT_LE(simulated, serial * (1 + 1e-9)) << schedule;
  }
  auto untimed = make_pipeline({{"devices", devices(2)}});
  untimed->attach(models::build_model(model, 0));
  untimed->train_step(batch);
  EXPECT_THAT(error_of([&] { untimed->simulated_ms(); }), HasSubstr("needs time_actions=1"));
}

// Steps leave the device's allocated memory where they found it. On CUDA, cuBLAS keeps a workspace
// (32 MiB on Hopper) for every stream a matmul ran on, for the life of the process: an executor
// that took a fresh stream each step would grow by that much a step until the stream pool cycles,
// and every later measurement would carry it. The control half shows the measurement sees such
// growth. On the CPU there are no allocator statistics, and only the steps' running is checked.
TEST(Pipeline, steps_leave_allocated_memory_steady) {
  const auto dev = test::device();
  device::release_cached_memory(dev);
  const auto model = gpt_of_depth(2, true);
  const auto batch = models::make_batch(model, 4, 3);
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    auto p = make_pipeline({{"devices", devices(2)}, {"micro_batches", "2"}, {"schedule", schedule}});
    p->attach(models::build_model(model, 0));
    auto step = [&] {
      p->train_step(batch);
      p->optimizer_step();
      device::synchronize(dev);
      return device::allocator_stats(dev).allocated;
    };
    step();
    const auto settled = step();  // optimizer state exists from the first step on
    for (int k = 0; k < 4; ++k) EXPECT_EQ(step(), settled) << schedule << ", step " << k + 3;
  }
  if (!dev.is_cuda()) return;
  const auto before = device::allocator_stats(dev).allocated;
  auto a = torch::randn({64, 64}, torch::TensorOptions().device(dev));
  for (int k = 0; k < 3; ++k) {  // the failure mode: a matmul on a fresh stream each time
    auto fresh = device::Stream::side(dev);
    device::Stream::Guard on(fresh);
    (void)torch::mm(a, a);
    fresh.synchronize();
  }
  EXPECT_GT(device::allocator_stats(dev).allocated, before + a.nbytes()) << "the control's growth went unseen";
}

// A schedule written by hand in a file (comments, a rank that runs ahead, forwards and backwards
// out of micro-batch order, one backward split into I and W) runs through pipeline_custom and matches the
// baseline; the strategy runs exactly the file's actions.
TEST(Pipeline, a_hand_written_schedule_file_runs_and_matches_the_baseline) {
  const std::string rank1 = "F0 F1 I1 B0 W1 F2 B2";
  const std::string file = testing::TempDir() + "strata_hand_written_schedule.txt";
  {
    std::ofstream out(file);
    out << "# two ranks, three micro-batches\n"
        << "F1 F0 F2 B1 B0 B2   # rank 0: every forward first, micro-batch 1 leading\n"
        << rank1 << "          # rank 1: micro-batch 1's backward split, its W after B0\n";
  }
  correctness::ParityCase c;
  c.model = gpt_of_depth(2, true);  // 4 blocks: the tied embedding and head on different ranks
  c.batch_size = 5;        // three micro-batches of 2, 2 and 1 samples
  c.seed = 9;
  c.options = {{"schedule_file", file}, {"devices", devices(2)}};
  const auto r = correctness::check_parity("pipeline_custom", c, test::device());
  EXPECT_TRUE(r.ok) << r.message;

  StrategyConfig config;
  config.device = test::device();
  config.options = c.options;
  auto s = Registry::create("pipeline_custom", config);
  s->attach(models::build_model(c.model, 1));
  s->train_step(models::make_batch(c.model, 5, 2));
  const auto& run = dynamic_cast<Pipeline&>(*s).schedule();
  EXPECT_EQ(pipeline::to_text(run), "F1 F0 F2 B1 B0 B2\n" + rank1 + "\n");
}

TEST(Pipeline, a_custom_schedule_refuses_what_it_cannot_run_naming_it) {
  const std::string missing = testing::TempDir() + "strata_no_such_schedule.txt";
  EXPECT_THAT(error_of([&] { make_pipeline({{"schedule", "custom"}, {"schedule_file", missing}}); }),
              HasSubstr("schedule_file=" + missing + " cannot be read"));
  EXPECT_THAT(error_of([] { make_pipeline({{"schedule", "custom"}}); }), HasSubstr("needs the schedule"));
  EXPECT_THAT(error_of([] { make_pipeline({{"schedule_text", "F0 B0"}}); }), HasSubstr("go with schedule=custom"));
  EXPECT_THAT(error_of([] { make_pipeline({{"schedule", "custom"}, {"schedule_text", "F0 B0"}, {"micro_batches", "2"}}); }),
              HasSubstr("fixes the micro-batches; leave out micro_batches=2"));
  // Deadlocks and malformed tokens are refused when the strategy is built, with the validator's words.
  EXPECT_THAT(error_of([] { make_pipeline({{"schedule", "custom"}, {"schedule_text", "F0,B0,F1,B1/F1,B1,F0,B0"}}); }),
              HasSubstr("not runnable: schedule deadlocks"));
  EXPECT_THAT(error_of([] { make_pipeline({{"schedule", "custom"}, {"schedule_text", "F0,X0/F0,B0"}}); }),
              HasSubstr("rank 0 token 1 'X0': unknown op"));
  // Ranks: the text's lines against the devices; micro-batches against the batch.
  const auto model = gpt_of_depth(2, false);
  auto p = make_pipeline({{"schedule", "custom"}, {"schedule_text", "F0,F1,B0,B1/F0,B0,F1,B1"}, {"devices", devices(3)}});
  EXPECT_THAT(error_of([&] { p->attach(models::build_model(model, 0)); }),
              HasSubstr("the custom schedule has 2 rank lines but the strategy runs 3 ranks"));
  auto q = make_pipeline({{"schedule", "custom"}, {"schedule_text", "F0,F1,B0,B1/F0,B0,F1,B1"}});
  q->attach(models::build_model(model, 0));
  EXPECT_THAT(error_of([&] { q->train_step(models::make_batch(model, 1, 1)); }),
              HasSubstr("a batch of 1 samples cannot be split into the 2 micro-batches of the custom schedule"));
  EXPECT_EQ(q->schedule().ranks, 2);
}

// What the benchmark tells the gate: ranks that share a device interleave their allocations by
// host timing, and only then (bench/METRICS.md, ranks_share_a_device).
TEST(Pipeline, ranks_sharing_a_device_are_reported_as_such) {
  for (int ranks : {1, 2, 3}) {
    auto p = make_pipeline({{"devices", devices(ranks)}});
    p->attach(models::build_model(gpt_of_depth(3, true), 0));
    EXPECT_EQ(p->ranks_share_a_device(), ranks > 1) << ranks << " ranks on " << test::device();
  }
}

// Stages on two GPUs: activations and gradients cross devices between streams, the tied embedding
// and head live on different devices (home and replica, swapped under a lock).
TEST(MultiGpu, pipeline_over_two_devices_matches_the_baseline) {
  {
    auto p = make_pipeline({{"devices", "cuda:0,cuda:1"}});
    p->attach(models::build_model(gpt_of_depth(3, true), 0));
    EXPECT_FALSE(p->ranks_share_a_device()) << "one rank per GPU shares none";
  }
  for (const std::string name : {"pipeline_gpipe", "pipeline_1f1b", "pipeline_interleaved", "pipeline_zero_bubble"}) {
    for (bool tied : {true, false}) {
      correctness::ParityCase c;
      c.model = gpt_of_depth(3, tied);
      c.batch_size = 6;
      c.steps = 3;
      c.options = {{"devices", "cuda:0,cuda:1"}, {"micro_batches", "4"}};
      if (name == "pipeline_interleaved") c.options["virtual_stages"] = "2";
      const auto r = correctness::check_parity(name, c, torch::Device("cuda:0"));
      EXPECT_TRUE(r.ok) << name << " tied=" << tied << ": " << r.message;
    }
  }
}

}  // namespace
}  // namespace strata
