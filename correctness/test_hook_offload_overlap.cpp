// hook_offload, the overlapped optimizer (overlap_optimizer=1): updates queued as gradients land, run in the
// order the next forward needs, each fetch waiting for its own, and their time and trace.
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
using offload_test::OpenLater;
using offload_test::OpenOnExit;
using offload_test::two_steps;
using offload_test::expect_same_steps;

// A profiler records through thread-local RecordFunction callbacks: the overlapped updates run on
// the host worker's thread, so their spans reach a trace only if the worker runs them in the
// state of the thread that queued them (strata_compare --profile-steps relies on it). A callback
// registered on this thread alone must see one span per unit update, each named by the unit's
// first block, none on this thread; once removed, the next step's updates record nothing.
std::mutex spans_mutex;
std::vector<std::pair<std::string, std::thread::id>> spans;
std::unique_ptr<at::ObserverContext> note_span(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  if (name.rfind("strata::host_update", 0) == 0) {
    std::lock_guard<std::mutex> lock(spans_mutex);
    spans.emplace_back(name, std::this_thread::get_id());
  }
  return nullptr;
}

TEST(HookOffload, overlapped_optimizer_refuses_gradient_accumulation) {
  auto s = make_offload({{"overlap_optimizer", "1"}});
  const auto config = gpt(1, 8);
  s->attach(models::build_model(config, 0));
  const auto batch = models::make_batch(config, 1, 1);
  s->train_step(batch);
  try {
    s->train_step(batch);
    ADD_FAILURE() << "a second train_step without optimizer_step was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr("overlap_optimizer=1"));
  }
}

// overlap_optimizer=1 returns from optimizer_step with host updates still to run: they finish
// while the next step's forward runs, and each block's fetch must wait for its own units. The
// first step's updates are held behind a gate until the second step has asked for a fetch behind
// one of them (queued behind it, or with fetch_order=ready, the default, left unqueued until it
// has run), so its forward surely reaches blocks whose updates have not run; its loss and the
// parameters after it must equal those of hook_offload with its optimizer after backward. A fetch
// that does not wait reads the weights from before the update (seen failing that way). gpt-tiny
// and mlp-tied-tiny are tied (the embedding's update is the last to become ready and the first
// needed); resident=0 keeps block 0 on the device, whose copy is refreshed behind its update
// instead of fetched (with a tied first block, the case where a GPU host ran into the next
// backward before the update that its gradients wait for). Both fetch orders: in_order holds the
// copy stream itself.
TEST(HookOffload, the_next_forward_waits_for_every_overlapped_update) {
  for (const auto* preset : {"gpt-tiny", "mlp-tiny", "mlp-tied-tiny"}) {
    for (const auto& extra : std::vector<std::map<std::string, std::string>>{
             {{"prefetch", "0"}}, {{"prefetch", "2"}}, {{"prefetch", "1"}, {"resident", "0"}},
             {{"prefetch", "2"}, {"fetch_order", "in_order"}},
             {{"prefetch", "1"}, {"resident", "0"}, {"fetch_order", "in_order"}}}) {
      auto options = extra;
      StrategyConfig base;
      base.optimizer.lr = 0.05;  // a step moves the loss well above rounding
      const auto config = models::preset(preset).config;
      const auto first = models::make_batch(config, 2, 1), second = models::make_batch(config, 2, 2);
      std::string where = preset;
      for (const auto& [k, v] : extra) where += " " + k + "=" + v;

      const auto expected = two_steps(options, base, config, first, second);  // the optimizer after backward
      options["overlap_optimizer"] = "1";

      auto s = make_offload(options, base);
      s->attach(models::build_model(config, 0));
      auto gate = std::make_shared<device::Gate>();
      OpenOnExit open_on_exit{gate};  // before s drains its updates on destruction
      HookOffloadTestPeer(*s).hold_updates(gate);
      s->train_step(first);
      s->optimizer_step();
      EXPECT_TRUE(s->updates_in_flight()) << where << ": optimizer_step waited for the held updates";
      double loss = 0;
      bool forced = false;
      {
        // Opened 50 ms after the first fetch queued behind a held update: time for a fetch that
        // does not wait to have read the old weights.
        std::optional<std::chrono::steady_clock::time_point> queued;
        OpenLater opener(gate, 30s, [&s, queued]() mutable {
          const auto now = std::chrono::steady_clock::now();
          if (!queued && HookOffloadTestPeer(*s).fetches_behind_host_updates() > 0) queued = now;
          return queued && now - *queued > 50ms;
        });
        loss = s->train_step(second);
        opener.join();
        forced = opener.forced();
      }
      EXPECT_FALSE(forced) << where << ": no fetch of the second step was queued behind a held update";
      s->optimizer_step();
      expect_same_steps(expected, loss, *s, where);
      EXPECT_FALSE(s->updates_in_flight()) << where << ": parameters() returned before the updates ran";
      EXPECT_GT(s->stats().fetches_behind_host_updates, 0) << where;  // what the benchmark reports
    }
  }
}

// fetch_order=ready: a fetch whose unit's host update is still running waits for it unqueued, so
// the fetches behind it, of units already updated, reach the link first (at a GPT's step boundary
// the tied embedding's update ends after block 1's). Block 0's update of the first step is held
// until block 1's copy has been queued for the second forward; in forward order (in_order) that
// copy is queued behind block 0's. Either way the second step reads only updated weights: its loss
// and the parameters after it equal those of hook_offload with its optimizer after backward. (Seen
// failing with the deferred copy queued before its update had run: the losses differed.)
TEST(HookOffload, a_fetch_waiting_for_its_update_lets_fetches_of_updated_units_go_first) {
  for (const auto* preset : {"mlp-tiny", "gpt-tiny"}) {
    for (const std::string order : {"ready", "in_order"}) {
      const std::string where = std::string(preset) + " fetch_order=" + order;
      StrategyConfig base;
      base.optimizer.lr = 0.05;
      const auto config = models::preset(preset).config;
      const auto first = models::make_batch(config, 2, 1), second = models::make_batch(config, 2, 2);
      const auto expected = two_steps({{"prefetch", "2"}}, base, config, first, second);

      auto s = make_offload({{"overlap_optimizer", "1"}, {"prefetch", "2"}, {"fetch_order", order}}, base);
      s->attach(models::build_model(config, 0));
      auto gate = std::make_shared<device::Gate>();
      OpenOnExit open_on_exit{gate};
      HookOffloadTestPeer(*s).hold_update_of(0, gate);
      s->train_step(first);
      s->optimizer_step();
      EXPECT_TRUE(s->updates_in_flight()) << where << ": block 0's update was not held";
      std::mutex mutex;
      std::vector<int64_t> queued;  // first blocks, in the order their copies were queued
      std::atomic<bool> block1_queued{false};
      HookOffloadTestPeer(*s).observe_fetches([&](int64_t first_use) {
        std::lock_guard<std::mutex> lock(mutex);
        queued.push_back(first_use);
        if (first_use == 1) block1_queued = true;
      });
      double loss = 0;
      bool forced = false;
      {
        OpenLater opener(gate, 30s, [&] { return block1_queued.load(); });
        loss = s->train_step(second);
        opener.join();
        forced = opener.forced();
      }
      HookOffloadTestPeer(*s).observe_fetches(nullptr);
      EXPECT_FALSE(forced) << where << ": block 1's copy was never queued while block 0's update was held";
      ASSERT_FALSE(queued.empty()) << where;
      const auto at = [&](int64_t b) { return std::find(queued.begin(), queued.end(), b) - queued.begin(); };
      if (order == "ready")
        EXPECT_LT(at(1), at(0)) << where << ": block 1's copy waited behind block 0's, whose update was held; queued "
                                << ::testing::PrintToString(queued);
      else
        EXPECT_LT(at(0), at(1)) << where << ": fetches left forward order; queued " << ::testing::PrintToString(queued);
      s->optimizer_step();
      expect_same_steps(expected, loss, *s, where);
    }
  }
}

// The updates still to run when backward ends are the ones the next forward needs first (the
// first blocks' gradients land last): they must run in block order, or the next forward waits
// for all of them. All of one step's updates are held until backward is over, so the host chooses
// among all of them at once. A first-queued-first-run host (the last block first) fails this.
TEST(HookOffload, updates_left_after_backward_run_in_the_order_the_next_forward_needs) {
  for (const auto* preset : {"gpt-tiny", "mlp-tied-tiny", "mlp-tiny"}) {
    auto s = make_offload({{"overlap_optimizer", "1"}});
    const auto config = models::preset(preset).config;
    s->attach(models::build_model(config, 0));
    auto gate = std::make_shared<device::Gate>();
    OpenOnExit open_on_exit{gate};
    HookOffloadTestPeer(*s).hold_updates(gate);
    s->train_step(models::make_batch(config, 2, 1));
    s->finish_backward();  // every gradient on the host
    s->optimizer_step();
    EXPECT_TRUE(HookOffloadTestPeer(*s).take_update_order().empty()) << preset << ": an update ran while held";
    gate->open();
    s->finish_step();
    const auto order = HookOffloadTestPeer(*s).take_update_order();
    EXPECT_GE(static_cast<int64_t>(order.size()), config.depth) << preset;  // a unit at least per hidden block
    EXPECT_TRUE(std::is_sorted(order.begin(), order.end())) << preset << ": " << ::testing::PrintToString(order);
  }
}

TEST(HookOffload, host_update_time_counts_the_updates_not_the_wait_for_their_gradients) {
  // Gradients held on their way to the host for 300 ms: an overlapped update waits for them, and
  // that wait is not the host optimizer's work. gpt-tiny's updates take far less than the hold.
  // (Without overlap, finish_backward has waited for the copies before any update starts: that
  // pass checks the counter is kept and reset; the overlapped pass is the one a misplaced clock fails.)
  const auto config = models::preset("gpt-tiny").config;
  for (const auto* overlap : {"0", "1"}) {
    SCOPED_TRACE(std::string("overlap_optimizer=") + overlap);
    auto s = make_offload({{"overlap_optimizer", overlap}});
    s->attach(models::build_model(config, 0));
    const auto batch = models::make_batch(config, 2, 1);
    s->train_step(batch);
    s->optimizer_step();
    s->finish_step();
    EXPECT_GT(s->stats().host_update_ms, 0.0) << "a step's host updates were not timed";
    s->reset_stats();
    EXPECT_EQ(s->stats().host_update_ms, 0.0) << "reset_stats kept the host time";
    auto gate = std::make_shared<device::Gate>();
    OpenOnExit open_on_exit{gate};
    HookOffloadTestPeer(*s).hold_gradient_copies(gate);
    const auto start = std::chrono::steady_clock::now();
    {
      OpenLater opener(gate, 300ms);
      s->train_step(batch);
      s->finish_backward();
    }
    s->optimizer_step();
    s->finish_step();
    const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const double host_ms = s->stats().host_update_ms;
    EXPECT_GT(host_ms, 0.0);
    EXPECT_LT(host_ms, 150.0) << "the wait for held gradients was counted as host work: " << host_ms << " of a " << wall_ms << " ms step";
  }
}

// defer_updates=0: optimizer_step itself waits for every update (held here until a thread opens
// the gate; an optimizer_step that returned at once would find them still held).
TEST(HookOffload, without_deferral_optimizer_step_waits_for_every_update) {
  auto s = make_offload({{"overlap_optimizer", "1"}, {"defer_updates", "0"}});
  const auto config = models::preset("gpt-tiny").config;
  s->attach(models::build_model(config, 0));
  auto gate = std::make_shared<device::Gate>();
  OpenOnExit open_on_exit{gate};
  HookOffloadTestPeer(*s).hold_updates(gate);
  s->train_step(models::make_batch(config, 2, 1));
  EXPECT_TRUE(s->updates_in_flight()) << "the updates were not held";
  bool in_flight = true;
  {
    OpenLater opener(gate, 100ms);
    s->optimizer_step();
    in_flight = s->updates_in_flight();
  }
  EXPECT_FALSE(in_flight) << "optimizer_step returned with updates still to run";
}

TEST(HookOffload, overlapped_updates_show_in_a_profile_of_the_thread_that_queued_them) {
  const auto config = models::preset("mlp-tiny").config;
  auto s = make_offload({{"overlap_optimizer", "1"}});
  s->attach(models::build_model(config, 0));
  const auto batch = models::make_batch(config, 2, 1);
  s->train_step(batch);  // a first step outside the recording: set-up
  s->optimizer_step();
  s->parameters();  // every update of it has run
  {
    std::lock_guard<std::mutex> lock(spans_mutex);
    spans.clear();
  }
  {
    struct Removed {  // also when the step throws: later tests on this thread must not record
      at::CallbackHandle handle;
      ~Removed() { at::removeCallback(handle); }
    } callback{at::addThreadLocalCallback(at::RecordFunctionCallback(note_span).scopes({at::RecordScope::USER_SCOPE}))};
    s->train_step(batch);
    s->optimizer_step();
    s->parameters();
  }
  std::vector<std::pair<std::string, std::thread::id>> seen;
  {
    std::lock_guard<std::mutex> lock(spans_mutex);
    seen = std::exchange(spans, {});
  }
  std::set<std::string> names;
  for (const auto& [name, thread] : seen) {
    names.insert(name);
    EXPECT_NE(thread, std::this_thread::get_id()) << name << " ran on the thread that queued it";
  }
  const int64_t blocks = models::build_model(config, 0).num_blocks();
  EXPECT_EQ(static_cast<int64_t>(seen.size()), blocks) << "one span per unit update (mlp-tiny: one unit a block)";
  for (int64_t b = 0; b < blocks; ++b)
    EXPECT_EQ(names.count("strata::host_update block " + std::to_string(b)), 1u) << "block " << b;
  s->train_step(batch);  // the callback is gone: nothing is recorded, nothing carried over
  s->optimizer_step();
  s->parameters();
  std::lock_guard<std::mutex> lock(spans_mutex);
  EXPECT_TRUE(spans.empty()) << spans.size() << " spans after the callback was removed";
}

}  // namespace
}  // namespace strata
