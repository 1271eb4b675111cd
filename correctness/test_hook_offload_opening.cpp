// hook_offload, the windows optimizer_step fetches for the next forward (`opening`): auto, a count, and fit
// (sized by what backward used).
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
using offload_test::window_bytes;
using offload_test::opening_bytes;
using offload_test::EarlyBytes;
using offload_test::tied_early_bytes;
using offload_test::expect_auto_opening;

// The arithmetic of opening=fit: the floor always, then windows while their bytes, summed from
// window 0, fit in the budget; a window that adds nothing (its units held already) is free.
TEST(HookOffload, a_fitted_opening_takes_its_floor_then_the_windows_that_fit) {
  const std::vector<int64_t> ten{10, 10, 10, 10};
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows(ten, 2, 0), 2);
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows(ten, 2, -50), 2) << "a budget below zero keeps the floor";
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows(ten, 2, 29), 2);
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows(ten, 2, 30), 3);
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows(ten, 0, 25), 2);
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows(ten, 2, 1000), 4) << "no more than the model has";
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows(ten, 9, 0), 4) << "a floor above the model's windows";
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows({40, 0, 10, 10}, 1, 50), 3) << "window 1 adds nothing";
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows({40, 0, 10, 10}, 1, 39), 1)
      << "over budget from the floor on: nothing more, not even a window that adds nothing";
  EXPECT_EQ(HookOffloadOptions::fit_opening_windows({}, 3, 100), 0);
}

// opening=fit's budget, with the device memory read from a probe the test sets: backward's reading
// less what is in use when the step opens, less the largest window (a transformer block's). The
// expected counts come from the model's parameter bytes: windows 0 to k need opening_bytes(k),
// the tied matrix counted once, a resident window's bytes not at all.
TEST(HookOffload, a_fitted_opening_is_sized_by_backwards_reading_less_what_is_in_use_and_a_window) {
  const auto config = gpt(3, 16);
  const auto model = models::build_model(config, 0);
  const auto batch = models::make_batch(config, 2, 1);
  const int64_t n = model.num_blocks(), backward = int64_t{1} << 30;
  int64_t largest = 0;
  for (int64_t b = 0; b < n; ++b) largest = std::max(largest, window_bytes(model, b));
  ASSERT_EQ(n, 5);
  // The windows the step opens with when the budget left for them is `budget`.
  auto opened = [&](const std::map<std::string, std::string>& extra, int64_t budget) {
    auto options = extra;
    options["prefetch"] = "1";  // floor: 2 windows
    options["opening"] = "fit";
    auto s = make_offload(options);
    s->attach(models::build_model(config, 0));
    int64_t in_use = backward;
    HookOffloadTestPeer(*s).read_device_memory_with([&] { return in_use; });
    s->train_step(batch);
    in_use = backward - largest - budget;  // read once the step opens
    s->optimizer_step();
    return s->last_opening();
  };
  for (int64_t k : {2, 3}) {  // windows 0 to k
    EXPECT_EQ(opened({}, opening_bytes(model, k)), k + 1) << "budget of windows 0 to " << k;
    EXPECT_EQ(opened({}, opening_bytes(model, k) - 1), k) << "a byte short of windows 0 to " << k;
  }
  // The head's window shares the tied matrix with window 0: it adds only its own parameters.
  EXPECT_EQ(opened({}, opening_bytes(model, 4)), 5);
  EXPECT_EQ(opened({}, opening_bytes(model, 4) - 1), 4);
  // A resident window is on the device already: it costs the opening nothing.
  const int64_t resident = window_bytes(model, 1);
  EXPECT_EQ(opened({{"resident", "1"}}, opening_bytes(model, 3) - resident), 4);
  EXPECT_EQ(opened({{"resident", "1"}}, opening_bytes(model, 3) - resident - 1), 3);
  // Below the floor, the floor.
  EXPECT_EQ(opened({}, 0), 2);
}

// In plain mode optimizer_step fetches the windows the next forward opens with (0 to prefetch, or
// as many as `opening` says), each once its units are updated: it moves their bytes, and the next
// train_step moves that much less than a first step. Whether they hold the updated values is the
// parity properties' (they compare every step's loss and gradients). The overlapped optimizer, and
// prefetch=0 without an `opening`, fetch nothing there.
TEST(HookOffload, the_next_forwards_first_windows_are_fetched_in_the_optimizer_step) {
  const auto config = gpt(3, 16);
  const auto batch = models::make_batch(config, 2, 1);
  const auto model = models::build_model(config, 0);
  for (int prefetch : {0, 1, 2}) {
    for (const std::string mode : {"plain", "overlap", "overlap, tied_early=1"}) {
      const std::string where = "prefetch=" + std::to_string(prefetch) + " " + mode;
      const bool plain = mode == "plain", sent_early = mode == "overlap, tied_early=1";
      auto options = std::map<std::string, std::string>{{"prefetch", std::to_string(prefetch)},
                                                        {"overlap_optimizer", plain ? "0" : "1"}};
      if (sent_early) options["tied_early"] = "1";
      auto s = make_offload(options);
      s->attach(models::build_model(config, 0));
      s->reset_stats();
      s->train_step(batch);
      const auto first_step = s->stats().bytes_h2d;
      s->reset_stats();
      s->optimizer_step();
      s->finish_step();
      const int64_t expected = plain ? expect_auto_opening(*s, model, prefetch, where) : 0;
      // With tied_early the tied matrix went to the device during train_step.
      const auto early = sent_early ? tied_early_bytes(model, batch) : EarlyBytes{};
      if (!plain) {
        EXPECT_EQ(s->last_opening(), 0) << where;
      }
      if (sent_early) {
        EXPECT_GT(early.matrix, 0) << where << ": the GPT's tied matrix is not sparse in its last use";
      }
      EXPECT_EQ(s->stats().bytes_h2d, expected) << where;
      EXPECT_EQ(s->offloaded_bytes_on_device(), expected + early.matrix) << where;
      s->reset_stats();
      s->train_step(batch);
      EXPECT_EQ(s->stats().bytes_h2d, first_step - expected - early.matrix + early.rows) << where;
      s->optimizer_step();
    }
  }
  // `opening` sets how many, whatever prefetch is: none, two, or more than the model has (all).
  const int64_t windows = model.num_blocks();
  for (int64_t opening : {0, 2, 99}) {
    const std::string where = "prefetch=1 opening=" + std::to_string(opening);
    const int64_t expected = opening > 0 ? opening_bytes(model, std::min(opening, windows) - 1) : 0;
    auto s = make_offload({{"prefetch", "1"}, {"opening", std::to_string(opening)}});
    s->attach(models::build_model(config, 0));
    s->train_step(batch);
    s->reset_stats();
    s->optimizer_step();
    EXPECT_EQ(s->stats().bytes_h2d, expected) << where;
    EXPECT_EQ(s->offloaded_bytes_on_device(), expected) << where;
    s->forward(batch.input);  // uses them and lets them go
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << where;
  }
}

// opening=fit on an asynchronous device. A GPT whose wide head sets backward's peak (its logits):
// windows beyond prefetch + 1 fit in that memory, are fetched in the step, and the next step's
// peak allocated is no higher than with the opening at prefetch + 1. An MLP whose activations are
// tiny next to its windows: what it holds at the forward's start must not go past backward's peak
// either (an opening of every window would, by five windows).
TEST(CudaOnly, hook_offload_fitted_opening_fills_what_backward_used_and_no_more) {
  const auto dev = test::device();
  ASSERT_TRUE(dev.is_cuda()) << "CudaOnly tests need --device=cuda";
  struct Seen {
    int64_t opening = 0, peak = 0;
  };
  auto run = [&](const models::ModelConfig& c, int64_t batch_size, const std::string& opening) {
    const auto batch = models::make_batch(c, batch_size, 1);
    auto s = make_offload({{"prefetch", "1"}, {"opening", opening}});
    s->attach(models::build_model(c, 0));
    for (int step = 0; step < 2; ++step) {  // the second step's opening comes from a backward seen
      s->train_step(batch);
      s->optimizer_step();
    }
    device::synchronize(dev);
    s->reset_stats();
    s->train_step(batch);
    s->finish_backward();
    device::synchronize(dev);
    Seen seen{s->last_opening(), s->stats().devices.at(dev.str()).peak_allocated};
    s->optimizer_step();
    return seen;
  };
  const int64_t slack = 1 << 20;  // allocation rounding; a window here is 3 MiB or more
  auto g = models::preset("gpt-tiny").config;
  g.depth = 6;
  g.width = 256;
  g.vocab = 16384;
  g.seq_len = 128;
  const auto gpt_fixed = run(g, 8, "auto"), gpt_fit = run(g, 8, "fit");
  EXPECT_GT(gpt_fit.opening, 2) << "the GPT's head left room for more windows at the forward's start";
  EXPECT_LE(gpt_fit.peak, gpt_fixed.peak + slack)
      << "opening=" << gpt_fit.opening << " raised the GPT's peak from " << gpt_fixed.peak;
  models::ModelConfig m;
  m.kind = models::ModelKind::mlp;
  m.depth = 8;
  m.width = m.in_features = m.classes = 1024;
  m.tied = false;
  const auto mlp_fixed = run(m, 2, "auto"), mlp_fit = run(m, 2, "fit"), mlp_all = run(m, 2, "99");
  EXPECT_LT(mlp_fit.opening, mlp_all.opening) << "fit opened every window of the MLP";
  EXPECT_LE(mlp_fit.peak, mlp_fixed.peak + slack)
      << "opening=" << mlp_fit.opening << " raised the MLP's peak from " << mlp_fixed.peak;
  EXPECT_GT(mlp_all.peak, mlp_fixed.peak + slack) << "an opening of every window should show in the MLP's peak";
}

// A backward that fails (here in a block's recompute) sizes no opening: what it was seen using may
// be what ran out. The same probe after a step that completes opens every window.
TEST(HookOffload, a_failed_backward_sizes_no_fitted_opening) {
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=shared0,lin,shared0)");
  auto model = spec.build(0);
  auto blocks = model.blocks();  // input layer, shared0, lin, shared0, head
  auto failing = std::make_shared<test::FailingBlock>(4);
  blocks[2] = failing;
  auto s = make_offload({{"prefetch", "1"}, {"opening", "fit"}});
  s->attach(models::BlockModel(model.config(), blocks));
  int64_t in_use = int64_t{1} << 30;
  HookOffloadTestPeer(*s).read_device_memory_with([&] { return in_use; });
  const auto batch = spec.make_batch(3, 1);
  failing->calls = 0;
  failing->fail_after = 1;  // its forward runs; its recompute in backward throws
  EXPECT_THROW(s->train_step(batch), std::exception);
  in_use = 0;
  s->optimizer_step();
  EXPECT_EQ(s->last_opening(), 2) << "the failed backward's reading sized the opening";
  failing->fail_after = -1;
  s->forward(batch.input);  // lets the opening go
  in_use = int64_t{1} << 30;
  s->train_step(batch);
  in_use = 0;
  s->optimizer_step();
  EXPECT_EQ(s->last_opening(), 5) << "after a backward that completed";
}

}  // namespace
}  // namespace strata
