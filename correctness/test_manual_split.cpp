// manual_split beyond parity: validation messages, the balancer, placement and replicas, the tied
// replica's sync (and the drift without it), the column-split classifier, bytes across stages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include "correctness/support/chain.h"
#include "correctness/support/generators.h"
#include "correctness/support/parity.h"
#include "correctness/support/strategy_peers.h"
#include "correctness/support/test_device.h"
#include "correctness/support/errors.h"
#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/manual_split/manual_split.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<ManualSplit> make_split(const std::map<std::string, std::string>& options) {
  StrategyConfig c;
  c.device = test::device();
  return std::make_unique<ManualSplit>("manual_split", c, ManualSplitOptions::parse(options));
}

using test::devices;

using test::error_of;

TEST(ManualSplit, validation_names_the_bad_value) {
  const auto gpt = models::preset("gpt-tiny").config;  // 4 blocks
  auto attach = [&](const std::map<std::string, std::string>& o, const models::ModelConfig& m) {
    make_split(o)->attach(models::build_model(m, 0));
  };
  EXPECT_THAT(error_of([&] { attach({{"balance", "3,2"}}, gpt); }), HasSubstr("balance {3,2} sums to 5 but the model has 4 blocks"));
  EXPECT_THAT(error_of([&] { attach({{"balance", "2,0,2"}}, gpt); }), HasSubstr("balance {2,0,2} has an empty stage (stage 1"));
  EXPECT_THAT(error_of([&] { attach({{"balance", "2,2"}, {"devices", devices(3)}}, gpt); }),
              HasSubstr("balance {2,2} has 2 stages but 3 devices were given"));
  EXPECT_THAT(error_of([&] { attach({{"devices", "cpu,cuda:9"}}, gpt); }), HasSubstr("'cuda:9'"));
  EXPECT_THAT(error_of([&] { attach({{"devices", "tpu:0"}}, gpt); }), HasSubstr("device 'tpu:0' is not valid"));
  EXPECT_THAT(error_of([&] { attach({{"stages", "5"}}, gpt); }), HasSubstr("5 stages for a model of 4 blocks"));
  EXPECT_THAT(error_of([&] { attach({{"weigh", "flops"}}, gpt); }), HasSubstr("weigh='flops'"));
  EXPECT_THAT(error_of([&] { attach({{"classifier_shards", "2"}}, gpt); }), HasSubstr("tied to another block"));
  EXPECT_THAT(error_of([&] { attach({{"classifier_shards", "0"}}, gpt); }), HasSubstr("classifier_shards=0"));
  auto bert = models::preset("bert-tiny").config;  // 100 classes
  EXPECT_THAT(error_of([&] { attach({{"classifier_shards", "101"}}, bert); }), HasSubstr("exceeds the 100 classes"));
}

TEST(ManualSplit, partition_minimises_the_heaviest_stage) {
  EXPECT_EQ(ManualSplit::partition({1, 1, 1, 1}, 2), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(ManualSplit::partition({10, 1, 1, 1}, 2), (std::vector<int64_t>{1, 3}));
  // Against brute force over every way to cut.
  const bool ok = rc::check("partition is optimal", [] {
    const auto n = *correctness::uniform<int64_t>(2, 9);
    const auto stages = *correctness::uniform<int64_t>(1, n + 1);
    const auto w = *rc::gen::container<std::vector<double>>(static_cast<size_t>(n), rc::gen::map(correctness::uniform(1, 100), [](int x) { return double(x); }));
    const auto balance = ManualSplit::partition(w, stages);
    RC_ASSERT(static_cast<int64_t>(balance.size()) == stages);
    double heaviest = 0, start = 0;
    for (auto b : balance) {
      RC_ASSERT(b >= 1);
      heaviest = std::max(heaviest, std::accumulate(w.begin() + start, w.begin() + start + b, 0.0));
      start += b;
    }
    RC_ASSERT(start == n);
    double best = 1e18;
    for (int64_t mask = 0; mask < (1 << (n - 1)); ++mask) {  // bit i set: cut after block i
      if (__builtin_popcountll(mask) != stages - 1) continue;
      double worst = 0, sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        sum += w[i];
        if (i == n - 1 || (mask >> i) & 1) {
          worst = std::max(worst, sum);
          sum = 0;
        }
      }
      best = std::min(best, worst);
    }
    RC_ASSERT(heaviest == best);
  });
  EXPECT_TRUE(ok);
}

TEST(ManualSplit, every_parameter_is_resident_only_on_its_stage_device) {
  auto s = make_split({{"balance", "1,2,1"}, {"devices", devices(3)}});
  const auto config = models::preset("gpt-tiny").config;  // embedding, 2 blocks, head (tied)
  s->attach(models::build_model(config, 0));
  std::vector<int64_t> stage_of;
  for (size_t st = 0; st < s->balance().size(); ++st)
    for (int64_t i = 0; i < s->balance()[st]; ++i) stage_of.push_back(static_cast<int64_t>(st));
  for (const auto& [where, dev] : s->placement()) {
    const auto block = std::stoll(where.substr(0, where.find(':')));
    EXPECT_EQ(dev, s->stage_devices()[stage_of[block]]) << where;
  }
  // The tied embedding: home in stage 0, one replica in stage 2; nothing else is duplicated.
  const auto stats = s->stats();
  int64_t held = 0;
  for (const auto& [d, mem] : stats.devices) held += mem.resident_param_bytes;
  const auto model = models::build_model(config, 0);
  const int64_t tied = model.parameters().front().tensor.nbytes();
  EXPECT_EQ(held, model.parameter_bytes() + tied);
}

TEST(ManualSplit, tied_replica_is_synced_and_drifts_without_the_sync) {
  const auto config = models::preset("gpt-tiny").config;
  correctness::ParityCase pc;
  pc.model = config;
  pc.options = {{"balance", "2,2"}, {"devices", devices(2)}};
  EXPECT_TRUE(correctness::check_parity("manual_split", pc, test::device()).ok);

  for (bool sync : {true, false}) {
    auto s = make_split({{"balance", "2,2"}, {"devices", devices(2)}, {"sync_replicas", sync ? "1" : "0"}});
    s->attach(models::build_model(config, 0));
    for (int step = 0; step < 3; ++step) {
      s->train_step(models::make_batch(config, 2, step));
      s->optimizer_step();
    }
    if (sync)
      EXPECT_EQ(ManualSplitTestPeer(*s).max_replica_drift(), 0.0);
    else
      EXPECT_GT(ManualSplitTestPeer(*s).max_replica_drift(), 1e-4) << "without the sync the replica must drift from its home";
  }
  // And the parity checker sees the missing head contribution to the tied gradient.
  pc.options["sync_replicas"] = "0";
  const auto r = correctness::check_parity("manual_split", pc, test::device());
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.message, HasSubstr("0.tokens"));
}

TEST(ManualSplit, column_split_classifier_matches_the_baseline) {
  for (const auto* preset : {"bert-tiny", "mlp-tiny"}) {
    for (int shards : {2, 3}) {
      correctness::ParityCase pc;
      pc.model = models::preset(preset).config;
      pc.batch_size = 3;
      pc.options = {{"devices", devices(2)}, {"classifier_shards", std::to_string(shards)}};
      const auto r = correctness::check_parity("manual_split", pc, test::device());
      EXPECT_TRUE(r.ok) << preset << " shards=" << shards << ": " << r.message;
    }
  }
  // Ignored targets leave the sum and the count of the loss across the shards (item 3 of issue 10:
  // the mean once counted them).
  for (int shards : {2, 3}) {
    correctness::ParityCase pc;
    pc.model = models::preset("gpt-tiny").config;
    pc.model.tied = false;
    pc.ignore_targets = true;
    pc.options = {{"devices", devices(2)}, {"classifier_shards", std::to_string(shards)}};
    const auto r = correctness::check_parity("manual_split", pc, test::device());
    EXPECT_TRUE(r.ok) << "ignored targets, shards=" << shards << ": " << r.message;
  }
  auto gpt = models::preset("gpt-tiny").config;
  gpt.tied = false;
  correctness::ParityCase pc;
  pc.model = gpt;
  pc.options = {{"devices", devices(2)}, {"classifier_shards", "2"}};
  const auto r = correctness::check_parity("manual_split", pc, test::device());
  EXPECT_TRUE(r.ok) << "untied gpt: " << r.message;
}

TEST(ManualSplit, forward_only_matches_the_baseline) {
  for (const auto& options : std::vector<std::map<std::string, std::string>>{
           {{"balance", "1,4"}, {"devices", devices(2)}}, {{"devices", devices(3)}, {"classifier_shards", "3"}}}) {
    const auto config = models::preset("bert-tiny").config;
    const auto batch = models::make_batch(config, 2, 1);
    StrategyConfig c;
    c.device = test::device();
    auto base = Registry::create("baseline", c);
    base->attach(models::build_model(config, 0));
    auto s = make_split(options);
    s->attach(models::build_model(config, 0));
    EXPECT_TRUE(torch::allclose(s->forward(batch.input).cpu(), base->forward(batch.input).cpu(), 1e-5, 1e-6));
  }
}

TEST(ManualSplit, stages_sharing_a_device_move_nothing_across_devices) {
  // Two stages on one device: the activation never leaves it, so no interconnect byte is counted.
  const auto config = models::preset("gpt-tiny").config;
  auto s = make_split({{"balance", "2,2"}, {"devices", devices(2)}});
  s->attach(models::build_model(config, 0));
  s->reset_stats();
  s->train_step(models::make_batch(config, 3, 1));
  s->optimizer_step();
  EXPECT_EQ(s->stats().bytes_interconnect, 0);
}

}  // namespace
}  // namespace strata

// Two real devices (label multigpu): the split across cuda:0 and cuda:1, the tied embedding's
// replica on the second device, and the classifier split over both.
namespace strata {
namespace {

TEST(MultiGpu, split_across_two_devices_matches_the_baseline) {
  for (const auto* preset : {"gpt-tiny", "bert-tiny", "mlp-tied-tiny"}) {
    correctness::ParityCase pc;
    pc.model = models::preset(preset).config;
    pc.options = {{"devices", "cuda:0,cuda:1"}};
    const auto r = correctness::check_parity("manual_split", pc, torch::Device(torch::kCUDA, 0));
    EXPECT_TRUE(r.ok) << preset << ": " << r.message;
  }
}

TEST(MultiGpu, seed_case_classifier_on_the_second_device_and_split_over_both) {
  const auto config = models::preset("bert-tiny").config;  // 5 blocks; the classifier is the last
  for (const auto& options : std::vector<std::map<std::string, std::string>>{
           {{"devices", "cuda:0,cuda:1"}, {"balance", "4,1"}},
           {{"devices", "cuda:0,cuda:1"}, {"balance", "4,1"}, {"classifier_shards", "2"}}}) {
    correctness::ParityCase pc;
    pc.model = config;
    pc.options = options;
    const auto r = correctness::check_parity("manual_split", pc, torch::Device(torch::kCUDA, 0));
    EXPECT_TRUE(r.ok) << pc.to_string() << ": " << r.message;
  }
}

TEST(MultiGpu, each_device_holds_its_stage_and_reports_its_own_peak) {
  // gpt-tiny: embedding, 2 blocks, head tied to the embedding. Balance {2,2}: the embedding and
  // block 1 on cuda:0; block 2 and the head on cuda:1, where the head uses the embedding's replica.
  const auto config = models::preset("gpt-tiny").config;
  StrategyConfig c;
  c.device = torch::Device(torch::kCUDA, 0);
  ManualSplit s("manual_split", c, ManualSplitOptions::parse({{"devices", "cuda:0,cuda:1"}, {"balance", "2,2"}}));
  s.attach(models::build_model(config, 0));
  const auto model = models::build_model(config, 0);
  int64_t expect0 = 0, expect1 = 0;
  for (const auto& p : model.parameters()) (p.owner_block < 2 ? expect0 : expect1) += p.tensor.nbytes();
  expect1 += model.parameters().front().tensor.nbytes();  // the replica of the tied embedding
  for (const auto& [where, dev] : s.placement()) {
    const auto block = std::stoll(where.substr(0, where.find(':')));
    EXPECT_EQ(dev, torch::Device(torch::kCUDA, block < 2 ? 0 : 1)) << where;
  }
  s.reset_stats();
  s.train_step(models::make_batch(config, 2, 1));
  s.optimizer_step();
  const auto stats = s.stats();
  ASSERT_EQ(stats.devices.size(), 2u);
  EXPECT_EQ(stats.devices.at("cuda:0").resident_param_bytes, expect0);
  EXPECT_EQ(stats.devices.at("cuda:1").resident_param_bytes, expect1);
  for (const auto& [d, mem] : stats.devices) EXPECT_GT(mem.peak_allocated, 0) << d;
  EXPECT_GT(stats.bytes_interconnect, 0);
  EXPECT_EQ(ManualSplitTestPeer(s).max_replica_drift(), 0.0);
}

TEST(MultiGpu, buffers_move_with_their_block) {
  // Blocks 0-2 (input, bn, table) on cuda:0, blocks 3-5 (bn, table, head) on cuda:1.
  const auto spec = correctness::ChainSpec::parse("chain(in=3 width=4 classes=3 blocks=bn,table,bn,table)");
  StrategyConfig c;
  c.device = torch::Device(torch::kCUDA, 0);
  ManualSplit s("manual_split", c, ManualSplitOptions::parse({{"devices", "cuda:0,cuda:1"}, {"balance", "3,3"}}));
  s.attach(spec.build(0));
  for (const auto& b : s.model().buffers())
    EXPECT_EQ(b.tensor.device(), torch::Device(torch::kCUDA, b.owner_block < 3 ? 0 : 1)) << b.name;
  correctness::ParityCase pc;
  pc.chain = spec;
  pc.batch_size = 4;
  pc.options = {{"devices", "cuda:0,cuda:1"}, {"balance", "3,3"}};
  const auto r = correctness::check_parity("manual_split", pc, c.device);
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(MultiGpu, a_buffer_shared_across_devices_is_refused_by_name) {
  struct Holder : models::Block {
    explicit Holder(torch::Tensor t) { table = register_buffer("table", std::move(t)); }
    torch::Tensor forward(const torch::Tensor& x) override { return x + table; }
    torch::Tensor table;
  };
  auto shared = torch::ones({4});
  models::BlockModel model(models::ModelConfig{}, {std::make_shared<Holder>(shared), std::make_shared<Holder>(shared)});
  auto s = make_split({{"devices", "cuda:0,cuda:1"}});
  EXPECT_THAT(error_of([&] { s->attach(std::move(model)); }), HasSubstr("buffer '0.table' is held by block 0"));
}

TEST(MultiGpu, bytes_across_devices_count_when_they_move) {
  // MLP with 3 blocks split {1,2} over two GPUs: one boundary. Forward moves the [batch, width]
  // activation over; backward moves its gradient back, and only then is it counted.
  const auto config = models::preset("mlp-tiny").config;
  auto s = make_split({{"balance", "1,2"}, {"devices", "cuda:0,cuda:1"}});
  s->attach(models::build_model(config, 0));
  const int64_t batch = 5, activation = batch * config.width * 4;
  const auto b = models::make_batch(config, batch, 1);
  s->reset_stats();
  s->forward(b.input);
  EXPECT_EQ(s->stats().bytes_interconnect, activation) << "forward only";
  s->reset_stats();
  s->train_step(b);
  EXPECT_EQ(s->stats().bytes_interconnect, 2 * activation) << "forward and backward";
}

TEST(MultiGpu, prop_split_over_two_devices_matches_the_baseline) {
  const bool ok = rc::check("manual_split over cuda:0 and cuda:1", [] {
    const auto c = *correctness::gen_parity_case("manual_split", {"cuda:0", "cuda:1"});
    const auto r = correctness::check_parity("manual_split", c, torch::Device(torch::kCUDA, 0));
    if (!r.ok) RC_FAIL(r.message);
  });
  EXPECT_TRUE(ok);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {
TEST(ManualSplit, weighing_memory_counts_activations) {
  // A GPT whose logits dwarf its parameters: by parameter bytes the tied embedding and head weigh
  // the same, by memory the head's logits put it in a stage of its own.
  auto c = models::preset("gpt-tiny").config;
  c.depth = 6;
  c.width = 4;
  c.heads = 1;
  c.vocab = 512;
  c.seq_len = 32;
  auto by = [&](const std::string& weigh) {
    auto s = make_split({{"stages", "2"}, {"weigh", weigh}});
    s->attach(models::build_model(c, 0));
    return s->balance();
  };
  EXPECT_EQ(by("memory").back(), 1) << "the head should stand alone";
  EXPECT_GT(by("params").back(), 1);
}
}  // namespace
}  // namespace strata
