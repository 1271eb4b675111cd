// hook_offload, steps that fail (a forward, a backward, a loss that throws): nothing stays held or stale, and
// the next step computes what it would have.
// Shared helpers: correctness/support/hook_offload_testing.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include "correctness/support/parity.h"
#include "correctness/support/errors.h"
#include "correctness/support/failing_block.h"
#include "models/check.h"
#include "correctness/support/test_device.h"
#include "strategies/checkpoint.h"
#include "strategies/device/device.h"
#include "strategies/hook_offload/hook_offload.h"
#include "correctness/support/hook_offload_peer.h"
#include "correctness/support/hook_offload_testing.h"

namespace strata {
namespace {

using namespace std::chrono_literals;
using offload_test::make_offload;
using offload_test::gpt;
using offload_test::adamw;
using offload_test::OpenLater;
using offload_test::OpenOnExit;
using offload_test::tied_early_bytes;
using offload_test::with_failing_block;

TEST(HookOffload, a_failed_step_leaves_nothing_held_and_the_next_step_works) {
  // A target of the wrong size makes the loss throw (a host-side check, so also safe on CUDA)
  // after every block's forward ran.
  for (const char* overlap : {"0", "1"}) {
    auto s = make_offload({{"overlap_optimizer", overlap}, {"activations", "keep"}});
    const auto config = gpt(2, 8);
    s->attach(models::build_model(config, 0));
    auto bad = models::make_batch(config, 2, 1);
    bad.target = torch::zeros({3}, torch::kLong);
    EXPECT_THROW(s->train_step(bad), std::exception);
    EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0) << "overlap=" << overlap;
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "overlap=" << overlap;
    const double loss = s->train_step(models::make_batch(config, 2, 1));
    EXPECT_TRUE(std::isfinite(loss));
    s->optimizer_step();
  }
}

// tied_early: a step that fails after its forward took the tied matrix's early copy (its buffer
// handed over, only the rows sent) leaves nothing held, and the steps after it see the same
// weights as without the early copy: their losses are equal to the bit. Vocab 64, so the
// embedding's last use is sparse and the early copy is taken.
TEST(HookOffload, a_failed_step_after_an_early_tied_copy_leaves_nothing_stale) {
  const auto config = gpt(2, 8, 64);
  const auto base = adamw();
  std::vector<double> losses[2];
  for (int early : {0, 1}) {
    const std::string where = "tied_early=" + std::to_string(early);
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}}, base);
    s->attach(models::build_model(config, 0));
    auto bad = models::make_batch(config, 2, 5);
    bad.target = torch::zeros({3}, torch::kLong);
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {  // after two good steps: the early copy of the second is on the device
        const auto matrix = tied_early_bytes(s->model(), bad).matrix;
        EXPECT_EQ(s->offloaded_bytes_on_device(), early ? matrix : 0) << where;
        EXPECT_THROW(s->train_step(bad), std::exception) << where;
        EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0) << where;
        EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << where << ": the early copy outlived the failed step";
      }
      losses[early].push_back(s->train_step(models::make_batch(config, 2, step + 1)));
      s->optimizer_step();
    }
  }
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i)
    EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i;
  EXPECT_NE(losses[1].front(), losses[1].back()) << "the steps moved nothing";
}

// fetch_order=ready: a forward that fails while a fetch waits, unqueued, for its unit's update lets
// it go with its window (release), so nothing stays held or listed, and the next step, once the
// update has run, computes what hook_offload with its optimizer after backward does. Block 3's
// update of the first step is held; the second forward asks for window 3 (prefetch 2) at block 1,
// which throws. (Seen failing, the process crashing, with release() leaving the fetch listed.)
TEST(HookOffload, a_forward_that_fails_drops_a_fetch_still_waiting_for_its_update) {
  // Blocks: the input layer, the failing one, two linear ones, the head.
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=lin,lin,lin)");
  const auto batch = spec.make_batch(3, 1);
  StrategyConfig base;
  base.optimizer.lr = 0.05;
  auto reference = make_offload({{"prefetch", "2"}}, base);
  reference->attach(with_failing_block(spec, 1, nullptr));
  reference->train_step(batch);
  reference->optimizer_step();
  const double expected = reference->train_step(batch);

  std::shared_ptr<test::FailingBlock> failing;
  auto s = make_offload({{"overlap_optimizer", "1"}, {"prefetch", "2"}}, base);
  s->attach(with_failing_block(spec, 1, &failing));
  auto gate = std::make_shared<device::Gate>();
  OpenOnExit open_on_exit{gate};
  HookOffloadTestPeer(*s).hold_update_of(3, gate);
  s->train_step(batch);
  s->optimizer_step();
  failing->fail_after = failing->calls;  // its next forward throws
  {
    // The failed step drains the host's updates: the held one may run once block 1 has thrown.
    const int before = failing->calls;
    OpenLater opener(gate, 30s, [&] { return failing->calls > before; });
    EXPECT_THROW(s->train_step(batch), std::exception);
  }
  EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0);
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  failing->fail_after = -1;
  const double loss = s->train_step(batch);
  s->optimizer_step();
  EXPECT_NEAR(loss, expected, 1e-6 * std::abs(expected)) << "the step after the failure read stale or missing weights";
}

// A backward that fails after a tied unit's first use was summed on the device (here the block
// between its two uses throws in its recompute) must not leave that partial sum to the next step:
// the next step's gradients of the blocks up to the failure, the shared weight's among them, equal
// the baseline's for the same batch. (The blocks whose gradients already went to the host in the
// failed step are not compared: plain mode keeps them, as an accumulated micro-batch.)
TEST(HookOffload, a_backward_that_fails_between_a_tied_units_uses_leaves_no_partial_sum) {
  // Blocks: the input layer, shared0, the failing one, shared0, the head.
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=shared0,lin,shared0)");
  auto build = [&](std::shared_ptr<test::FailingBlock>* failing) { return with_failing_block(spec, 2, failing); };
  const auto batch = spec.make_batch(3, 1);
  StrategyConfig c;
  c.device = test::device();
  auto base = Registry::create("baseline", c);
  base->attach(build(nullptr));
  base->train_step(batch);
  const auto expected = base->gradients();
  std::shared_ptr<test::FailingBlock> failing;
  auto s = make_offload({});
  s->attach(build(&failing));
  failing->calls = 0;
  failing->fail_after = 1;  // its forward runs; its recompute in backward throws
  EXPECT_THROW(s->train_step(batch), std::exception);
  EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0);
  failing->fail_after = -1;
  s->train_step(batch);
  const auto actual = s->gradients();
  ASSERT_EQ(actual.size(), expected.size());
  int compared = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const auto& name = actual[i].first;
    if (name.rfind("3.", 0) == 0 || name.rfind("4.", 0) == 0) continue;
    ++compared;
    EXPECT_TRUE(torch::allclose(actual[i].second.cpu(), expected[i].second.cpu(), 1e-5, 1e-6))
        << name << ": " << actual[i].second << " against the baseline's " << expected[i].second;
  }
  EXPECT_GE(compared, 4);  // the input layer's two, the shared weight and bias of block 1, the failing block's
}

// A forward that fails between a shared unit's two uses, while carry_tied keeps it on the device
// for the second (prefetch 0: the later window is not held yet), must return that reference too:
// in train_step and in forward(), nothing stays held and the next step runs. Without carry_tied
// nothing is carried, and the same holds.
TEST(HookOffload, a_forward_that_fails_between_a_shared_units_uses_keeps_nothing_held) {
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=shared0,lin,shared0)");
  for (const char* carry : {"1", "0"}) {
    auto model = spec.build(0);
    auto blocks = model.blocks();  // input layer, shared0, lin, shared0, head
    auto failing = std::make_shared<test::FailingBlock>(4);
    blocks[2] = failing;
    auto s = make_offload({{"prefetch", "0"}, {"carry_tied", carry}});
    s->attach(models::BlockModel(model.config(), blocks));
    const auto batch = spec.make_batch(3, 1);
    const std::string where = std::string("carry_tied=") + carry;
    failing->calls = 0;
    failing->fail_after = 0;  // the first forward call throws
    EXPECT_THROW(s->train_step(batch), std::exception) << where;
    EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0) << "train_step, " << where;
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "train_step, " << where;
    failing->calls = 0;
    EXPECT_THROW(s->forward(batch.input), std::exception) << where;
    EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0) << "forward, " << where;
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "forward, " << where;
    failing->fail_after = -1;
    EXPECT_TRUE(std::isfinite(s->train_step(batch))) << where;
    s->optimizer_step();
    EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0) << "after a good step, " << where;
  }
}

}  // namespace
}  // namespace strata
