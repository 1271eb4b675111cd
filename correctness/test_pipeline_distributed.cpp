// The pipeline strategies across processes (the c10d transport): every test runs in every rank of
// a job that strategies/distributed/launch.py (or torchrun) starts, one pipeline rank per process,
// activations and gradients over a channel per direction between neighbouring ranks. Each rank
// checks the same cases in the same order: the loss, gradients and parameters every rank returns
// against the single-process baseline on the whole batch. CTest starts them with 2 and 3 ranks on
// the CPU (Gloo) and with 2 on two GPUs (NCCL); they hold for any world (4 and 8 ranks were run on
// the CPU by hand: bench/notes/world-sizes-on-cpu-ranks.md).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "correctness/support/agreement.h"
#include "correctness/support/chain.h"
#include "correctness/support/errors.h"
#include "correctness/support/failing_block.h"
#include "correctness/support/generators.h"
#include "correctness/support/ranks.h"
#include "correctness/support/regressions.h"
#include "correctness/support/test_device.h"
#include "strategies/distributed/process_group.h"
#include "strategies/pipeline/pipeline.h"
#include "strategies/state_files.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

const std::vector<std::string> kPipelines = {"pipeline_gpipe", "pipeline_1f1b", "pipeline_interleaved",
                                             "pipeline_zero_bubble"};

using test::rank;
using test::world;

// The `ranks` option of a case run here: one rank a process, the world's size (outside a launch, a
// world of one: the case runs as one rank in this process).
std::pair<const std::string, std::string> one_rank_a_process() { return {"ranks", std::to_string(world())}; }

int64_t count(const std::string& list) { return list.empty() ? 0 : std::count(list.begin(), list.end(), ',') + 1; }

// The registry's generated pipeline cases whose rank count is this job's world: the processes are
// the ranks, so the in-process options (devices, replicas on one device) are dropped.
rc::Gen<correctness::ParityCase> gen_case_over_ranks(const std::string& strategy) {
  auto over_world = rc::gen::suchThat(correctness::gen_parity_case(strategy, {test::device().str()}),
                                      [](const correctness::ParityCase& c) { return count(c.options.at("devices")) == world(); });
  return rc::gen::map(over_world, [](correctness::ParityCase c) {
    c.options.erase("devices");
    c.options.erase("replicate_tied");
    c.options["ranks"] = std::to_string(world());  // outside a launch (a world of one): one rank here too
    return c;
  });
}

TEST(DistributedPipeline, prop_matches_the_baseline_over_the_ranks) {
  auto strategies = kPipelines;
  strategies.push_back("pipeline_custom");  // random hand-written schedules, the same in every process
  for (const auto& strategy : strategies) {
    // In a world of one (the explorer's run), a shrunk failure is recorded for CI to replay: its
    // case (ranks=1) runs in one process.
    const bool ok = correctness::check_property(strategy, strategy + " over " + std::to_string(world()) + " processes",
                                                test::device(), [&] { return gen_case_over_ranks(strategy); },
                                                /*record=*/world() == 1);
    EXPECT_TRUE(ok) << strategy;
  }
}

// The GPT's tied embedding and head on the first and last ranks (a copy on each, gradients summed
// over them), an even and an uneven split of the batch, and the CPU's delays on one rank's
// compute and on every send.
TEST(DistributedPipeline, tied_gpt_matches_the_baseline_even_uneven_and_delayed) {
  using namespace std::chrono_literals;
  for (const auto& strategy : kPipelines) {
    const bool interleaved = strategy == "pipeline_interleaved";
    for (const int64_t batch : {int64_t{2} * world(), int64_t{2} * world() + 1}) {
      correctness::ParityCase c;
      c.model = models::preset("gpt-tiny").config;
      c.model.depth = 2 * world();  // depth + 2 blocks: enough for 2 virtual stages per rank
      c.batch_size = batch;
      c.steps = 2;
      c.options = {{"micro_batches", std::to_string(interleaved ? world() : batch - 1)}, one_rank_a_process()};
      if (interleaved) c.options["virtual_stages"] = "2";
      const auto r = correctness::check_parity(strategy, c, test::device());
      EXPECT_TRUE(r.ok) << strategy << " " << c.to_string() << ": " << r.message;
    }
    device::ScopedDelays delays({2ms, 2ms, 0ms});
    correctness::ParityCase c;
    c.model = models::preset("gpt-tiny").config;
    c.model.depth = std::max<int64_t>(c.model.depth, world() - 2);  // a block per rank at any world
    c.batch_size = 2 * world();
    c.steps = 1;
    c.options = {{"micro_batches", std::to_string(2 * world())}, one_rank_a_process()};
    const auto r = correctness::check_parity(strategy, c, test::device());
    EXPECT_TRUE(r.ok) << strategy << " with delays: " << r.message;
  }
}

// Mixed precision over the ranks: bf16 activations and gradients over the channels, the tied
// embedding's copies summed over the ranks, reduction in fp32 and in bf16; against the float64
// reference within bf16's bounds. Two ranks take every pairing of reduction and model; more ranks
// (whose middle ranks add no channel code of their own) take each reduction once, with the tied GPT
// reducing in bf16 (time: at 3 ranks on 2 cores the four pairings took 94 s of a 139 s job).
TEST(DistributedPipeline, bf16_matches_the_reference_within_its_bounds) {
  std::vector<std::pair<const char*, const char*>> cases = {{"bf16", "bert-tiny"}, {"bf16,reduce=bf16", "gpt-tiny"}};
  if (world() == 2) {
    cases.emplace_back("bf16", "gpt-tiny");
    cases.emplace_back("bf16,reduce=bf16", "bert-tiny");
  }
  for (const auto& strategy : kPipelines) {
    const bool interleaved = strategy == "pipeline_interleaved";
    for (const auto& [precision, preset] : cases) {
        correctness::ParityCase c;
        c.model = models::preset(preset).config;
        c.model.depth = std::max<int64_t>(c.model.depth, 2 * world());
        c.batch_size = 2 * world();
        c.precision = PrecisionPolicy::parse(precision);
        c.options = {{"micro_batches", std::to_string(world())}, one_rank_a_process()};
        if (interleaved) c.options["virtual_stages"] = "2";
        const auto r = correctness::check_parity(strategy, c, test::device());
        EXPECT_TRUE(r.ok) << strategy << " " << c.to_string() << ": " << r.message;
      }
  }
}

// A stage that throws on one rank ends the step on every rank with its error (its neighbours get
// it over their channels, the rest from them in turn), and the next step runs normally: every
// channel was drained in its order.
TEST(DistributedPipeline, a_stage_that_throws_ends_the_step_on_every_rank_with_its_error) {
  models::ModelConfig config;
  config.kind = models::ModelKind::mlp;
  config.in_features = 4;
  config.classes = 3;
  std::vector<std::shared_ptr<test::FailingBlock>> failing;
  std::vector<std::shared_ptr<models::Block>> blocks;
  for (int r = 0; r < world(); ++r) {
    failing.push_back(std::make_shared<test::FailingBlock>(4));
    blocks.push_back(failing.back());
  }
  blocks.push_back(std::make_shared<test::LinearHead>(4, 3));  // on the last rank, with its Failing block
  const auto batch = models::Batch{torch::randn({6, 4}, torch::Generator(at::detail::createCPUGenerator(7))),
                                   torch::arange(6, torch::kLong) % 3};
  const int culprit = world() / 2;  // the middle rank of 3 (rank 1 of 2)
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    StrategyConfig sc;
    sc.device = test::device();
    std::string balance;  // one Failing block per rank, the head with the last
    for (int r = 0; r + 1 < world(); ++r) balance += "1,";
    Pipeline p("pipeline", sc, PipelineOptions::parse({{"micro_batches", "3"}, {"schedule", schedule}, {"balance", balance + "2"},
                                                       one_rank_a_process()}));
    for (auto& f : failing) {
      f->calls = 0;
      f->fail_after = -1;
    }
    failing[static_cast<size_t>(culprit)]->fail_after = 1;  // its second micro-batch's forward
    p.attach(models::BlockModel(config, blocks));
    const auto message = test::error_of([&] { p.train_step(batch); });
    EXPECT_THAT(message, HasSubstr("failure injected in a stage")) << schedule << " on rank " << rank();
    EXPECT_THAT(message, HasSubstr("rank " + std::to_string(culprit))) << schedule << " on rank " << rank();
    failing[static_cast<size_t>(culprit)]->fail_after = -1;
    double loss = 0;
    EXPECT_NO_THROW(loss = p.train_step(batch)) << schedule << " on rank " << rank();
    EXPECT_TRUE(std::isfinite(loss)) << schedule;
  }
}

// What a rank's bytes_interconnect says it moved: its channels' messages (an 88-byte header of
// int64s — kind, dtype, dimension count, 8 sizes — then the tensor), activations to the next rank
// and their gradients back, one of each per micro-batch; and its share of the step's ring
// all-reduces, 2 (W - 1) / W of each: the failure flag (a float), the loss (a double), and with a
// tied GPT over several ranks the embedding's gradient (fp32) and its got-a-gradient flag. Worked
// out from the model's own activation sizes; gpipe and 1f1b send the same.
TEST(DistributedPipeline, interconnect_bytes_are_what_the_channels_and_all_reduces_moved) {
  auto config = models::preset("gpt-tiny").config;
  config.depth = std::max<int64_t>(config.depth, world());
  const int64_t batch_size = 2 * world() + 1, micro_batches = world() + 1;  // uneven micro-batches
  const auto batch = models::make_batch(config, batch_size, 3);
  // Bytes of every block's output for the whole batch (all its micro-batches together).
  auto model = models::build_model(config, 0);
  std::vector<int64_t> out_bytes;
  {
    torch::NoGradGuard no_grad;
    auto x = batch.input;
    for (const auto& block : model.blocks()) {
      x = block->forward(x);
      out_bytes.push_back(x.nbytes());
    }
  }
  const double w = world();
  auto ring = [&](int64_t bytes) { return std::llround(static_cast<double>(bytes) * 2 * (w - 1) / w); };
  for (const std::string strategy : {"pipeline_gpipe", "pipeline_1f1b"}) {
    StrategyConfig sc;
    sc.device = test::device();
    sc.options = {{"micro_batches", std::to_string(micro_batches)}, one_rank_a_process()};
    auto s = Registry::create(strategy, sc);
    s->attach(models::build_model(config, 0));
    const auto& balance = dynamic_cast<Pipeline&>(*s).balance();
    s->reset_stats();
    s->train_step(batch);
    int64_t expected = ring(4) + ring(8);
    int64_t last_block = -1;  // the last block of this rank's stage, and of the stage before it
    int64_t before = -1;
    for (int r = 0; r <= rank(); ++r) {
      before = last_block;
      last_block += balance[static_cast<size_t>(r)];
    }
    if (rank() + 1 < world()) expected += micro_batches * 88 + out_bytes[static_cast<size_t>(last_block)];
    if (rank() > 0) expected += micro_batches * 88 + out_bytes[static_cast<size_t>(before)];
    if (world() > 1) expected += ring(config.vocab * config.width * 4) + ring(4);  // the tied matrix
    EXPECT_EQ(s->stats().bytes_interconnect, expected) << strategy << " on rank " << rank();
  }
}

// Checkpoints across processes: each rank saves the parameters of its stages with their moments
// (state_files::save_ranks); a new pipeline over the same ranks loads every file and trains on to
// the bit as if there had been no break, and a baseline in one process loads the files whole.
TEST(DistributedPipeline, a_resume_is_exact_and_its_files_are_the_whole_state) {
  const auto model = models::preset("gpt-tiny").config;
  const int64_t batch_size = 4 * world();
  auto make = [&](const std::string& name) {
    StrategyConfig sc;
    sc.device = test::device();
    sc.optimizer.kind = OptimizerKind::adamw;
    sc.optimizer.lr = 1e-2;
    if (name != "baseline") sc.options = {{"micro_batches", std::to_string(2 * world())}, one_rank_a_process()};
    auto s = Registry::create(name, sc);
    s->attach(models::build_model(model, 3));
    return s;
  };
  auto train = [&](Strategy& s, int first, int steps) {
    for (int i = 0; i < steps; ++i) {
      s.train_step(models::make_batch(model, batch_size, 100 + first + i));
      s.optimizer_step();
    }
  };
  auto barrier = [] { distributed::barrier(*distributed::group_for(torch::Device(torch::kCPU))); };
  const char* port = std::getenv("MASTER_PORT");
  const auto dir = (std::filesystem::temp_directory_path() / (std::string("strata-pp-resume-") + (port ? port : "0"))).string();
  for (const std::string strategy : {"pipeline_1f1b", "pipeline_gpipe"}) {
    SCOPED_TRACE(strategy + " at world " + std::to_string(world()));
    if (rank() == 0) state_files::remove_tree(dir);
    barrier();
    auto whole = make(strategy);
    train(*whole, 0, 5);
    const auto expected = whole->parameters();
    auto first = make(strategy);
    train(*first, 0, 3);
    state_files::Manifest m;
    m.model = model.to_string();
    m.strategy = strategy;
    m.step = 3;
    const auto saved = state_files::save_ranks(dir, m, rank(), world(), first->training_state(), barrier);
    const auto state = state_files::load_all(saved);
    auto resumed = make(strategy);
    resumed->load_training_state(state);
    train(*resumed, 3, 2);
    const auto got = resumed->parameters();
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i].second, expected[i].second)) << got[i].first;
    auto base = make("baseline");
    base->load_training_state(state);
    const auto params = first->parameters(), base_params = base->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(base_params[i].second, params[i].second)) << params[i].first;
    barrier();
    if (rank() == 0) state_files::remove_tree(dir);
  }
}

// A buffer lives on the rank of the stage that uses it and moves as a run over the micro-batches,
// in order, would move it; buffers() returns the owner's on every rank. Worked out here with the
// model alone: a forward of each micro-batch in turn from the step's starting parameters and
// buffers. BatchNorm sits on the last rank's stage, with the head.
TEST(DistributedPipeline, buffers_are_their_stages_on_every_rank) {
  std::string blocks;
  for (int r = 0; r < world(); ++r) blocks += "lin,";
  const auto spec = correctness::ChainSpec::parse("chain(in=3 width=5 classes=4 blocks=" + blocks + "bn)");
  const int64_t batch_size = 8, micro_batches = 2;  // 4 samples a micro-batch: BatchNorm has statistics
  std::string balance;  // the input layer and a lin per rank; the last takes the bn and the head too
  for (int r = 0; r < world(); ++r) balance += r == 0 ? "2" : r + 1 < world() ? ",1" : ",3";
  if (world() == 1) balance = "4";
  StrategyConfig sc;
  sc.device = test::device();
  sc.options = {{"micro_batches", std::to_string(micro_batches)}, {"balance", balance}, one_rank_a_process()};
  auto s = Registry::create("pipeline_1f1b", sc);
  s->attach(spec.build(5));
  auto reference = spec.build(5);
  for (const auto& block : reference.blocks()) block->to(test::device());
  for (int step = 0; step < 2; ++step) {
    const auto params = s->parameters(), buffers = s->buffers();
    const auto batch = spec.make_batch(batch_size, 200 + step);
    s->train_step(batch);
    s->optimizer_step();
    const auto after = s->buffers();
    test::expect_the_same_on_every_rank("pipeline buffers after step " + std::to_string(step), after, test::device());
    test::set_state(reference, params, buffers);
    {
      torch::NoGradGuard no_grad;
      for (int64_t m = 0; m < micro_batches; ++m) {
        auto x = batch.input.narrow(0, batch_size * m / micro_batches, batch_size / micro_batches).to(test::device());
        for (const auto& block : reference.blocks()) x = block->forward(x);
      }
    }
    test::expect_buffers_of(reference, after, "step " + std::to_string(step) + " on rank " + std::to_string(rank()) +
                                                  " (the micro-batches in turn)");
  }
}

TEST(DistributedPipeline, ranks_with_different_models_are_refused_on_every_rank) {
  STRATA_NEEDS_PROCESSES(2);
  auto config = models::preset("gpt-tiny").config;
  config.depth = world();
  if (rank() == world() - 1) config.width = 16;  // the last rank builds another model
  StrategyConfig sc;
  sc.device = test::device();
  Pipeline p("pipeline_1f1b", sc, PipelineOptions::parse({}));
  EXPECT_THAT(test::error_of([&] { p.attach(models::build_model(config, 0)); }),
              HasSubstr("pipeline_1f1b attach: rank " + std::to_string(world() - 1) + " has"));
}

TEST(DistributedPipeline, in_process_options_are_refused_naming_them) {
  STRATA_NEEDS_PROCESSES(2);  // in one process these options are the in-process pipeline's own
  StrategyConfig sc;
  sc.device = test::device();
  Pipeline p("pipeline_1f1b", sc, PipelineOptions::parse({{"devices", "cpu,cpu"}}));
  EXPECT_THAT(test::error_of([&] { p.attach(models::build_model(models::preset("gpt-tiny").config, 0)); }),
              HasSubstr("launched as " + std::to_string(world()) + " processes"));
}

}  // namespace
}  // namespace strata
