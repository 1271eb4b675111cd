// hook_offload's state classes on their own: the overlapped optimizer's queue (which update runs
// next, what happens when one throws) and the state a tied matrix and a unit's gradient parts
// carry. The strategy's own tests (test_hook_offload_*.cpp) show them at work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>
#include <stdexcept>
#include <thread>

#include "strategies/hook_offload/host_updates.h"
#include "strategies/hook_offload/unit.h"

namespace strata::hook_offload {
namespace {

using namespace std::chrono_literals;

// An event that has not passed until `gate` opens: recorded behind a hold on a side stream.
struct Pending {
  std::shared_ptr<device::Gate> gate = std::make_shared<device::Gate>();
  device::Stream stream = device::Stream::side(torch::Device(torch::kCPU));
  device::Event event;
  Pending() {
    stream.hold(gate);
    event = stream.record();
  }
  ~Pending() { gate->open(); }
};

HostUpdate update_of(Unit& unit, device::Event landed, HostUpdate::Part part = HostUpdate::Part::whole) {
  HostUpdate u;
  u.unit = &unit;
  u.landed = std::move(landed);
  u.part = part;
  return u;
}

const auto none_held = [](const HostUpdate&) { return false; };

TEST(HostUpdates, landed_updates_go_first_in_the_order_the_next_forward_needs) {
  Unit a, b, c;
  a.first_use = 5;
  b.first_use = 1;
  c.first_use = 3;
  Pending late;
  // c has not landed; a and b have: b's block comes first in the forward.
  std::vector<HostUpdate> queued{update_of(a, {}), update_of(c, late.event), update_of(b, {})};
  EXPECT_EQ(HostUpdates::choose(queued, none_held), 2);
  queued.erase(queued.begin() + 2);
  EXPECT_EQ(HostUpdates::choose(queued, none_held), 0);  // a, landed, before c, not landed
}

TEST(HostUpdates, with_none_landed_the_first_queued_goes) {
  Unit a, b;
  a.first_use = 7;
  b.first_use = 0;
  Pending late_a, late_b;
  const std::vector<HostUpdate> queued{update_of(a, late_a.event), update_of(b, late_b.event)};
  EXPECT_EQ(HostUpdates::choose(queued, none_held), 0);
}

TEST(HostUpdates, a_first_part_with_ranges_to_land_waits_behind_whole_ones) {
  Unit tied, block;
  tied.first_use = 0;
  block.first_use = 4;
  Pending last_range;
  auto first = update_of(tied, {}, HostUpdate::Part::first);  // its first range has landed
  first.landed_ranges = {device::Event(), last_range.event};
  const std::vector<HostUpdate> queued{first, update_of(block, {})};
  EXPECT_EQ(HostUpdates::choose(queued, none_held), 1);
  last_range.gate->open();
  last_range.event.synchronize();
  EXPECT_EQ(HostUpdates::choose(queued, none_held), 0);  // all landed: the earlier block first
}

TEST(HostUpdates, a_units_parts_run_in_the_order_they_were_queued) {
  Unit tied, other;
  tied.first_use = 0;
  other.first_use = 2;
  Pending first_late;
  // The rows part has landed, its first part has not: neither may pass the first part.
  const std::vector<HostUpdate> queued{update_of(tied, first_late.event, HostUpdate::Part::first),
                                       update_of(tied, {}, HostUpdate::Part::rows), update_of(other, {})};
  EXPECT_EQ(HostUpdates::choose(queued, none_held), 2);
}

TEST(HostUpdates, held_units_are_passed_over_and_only_held_ones_choose_none) {
  Unit a, b;
  a.first_use = 0;
  b.first_use = 1;
  const std::vector<HostUpdate> queued{update_of(a, {}), update_of(b, {})};
  auto a_held = [&](const HostUpdate& u) { return u.unit == &a; };
  EXPECT_EQ(HostUpdates::choose(queued, a_held), 1);
  EXPECT_EQ(HostUpdates::choose({queued[0]}, a_held), -1);
}

// Run on a host queue: each update's gate opens however it ends, the first error is kept until
// taken (once), and the order records units updated, not first parts.
TEST(HostUpdates, every_gate_opens_and_the_first_error_is_kept_until_taken) {
  device::HostQueue host;
  std::vector<int64_t> applied;
  HostUpdates updates(host, [&](HostUpdate& u) {
    applied.push_back(u.unit->first_use);
    if (u.unit->first_use == 2) throw std::runtime_error("update of block 2 failed");
  });
  Unit a, b, c;
  a.first_use = 1;
  b.first_use = 2;
  c.first_use = 3;
  std::vector<std::shared_ptr<device::Gate>> done;
  for (Unit* unit : {&a, &b, &c}) {
    auto u = update_of(*unit, {}, unit == &c ? HostUpdate::Part::first : HostUpdate::Part::whole);
    u.done = std::make_shared<device::Gate>();
    done.push_back(u.done);
    updates.push(std::move(u));
  }
  EXPECT_THROW(host.drain(), std::runtime_error);
  host.drain();  // the queue ran every task
  for (const auto& gate : done) EXPECT_TRUE(gate->is_open());
  EXPECT_EQ(applied, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(updates.pending(), 0);
  EXPECT_EQ(updates.take_order(), std::vector<int64_t>{1});  // 2 threw; 3 was a first part
  const auto error = updates.take_error();
  ASSERT_TRUE(error);
  EXPECT_THROW(std::rethrow_exception(error), std::runtime_error);
  EXPECT_FALSE(updates.error());
}

TEST(HostUpdates, a_held_unit_runs_once_its_gate_opens_and_the_others_meanwhile) {
  device::HostQueue host;
  std::mutex mutex;
  std::vector<int64_t> applied;
  HostUpdates updates(host, [&](HostUpdate& u) {
    std::lock_guard<std::mutex> lock(mutex);
    applied.push_back(u.unit->first_use);
  });
  auto gate = std::make_shared<device::Gate>();
  updates.hold_unit(0, gate);
  EXPECT_TRUE(updates.unit_held());
  Unit a, b;
  a.first_use = 0;
  b.first_use = 1;
  updates.push(update_of(a, {}));
  updates.push(update_of(b, {}));
  // The worker runs b's task, then waits in a's for its gate: b is done once one is pending.
  for (int i = 0; i < 20000 && updates.pending() > 1; ++i) std::this_thread::sleep_for(1ms);
  {
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_EQ(applied, std::vector<int64_t>{1});
  }
  gate->open();
  host.drain();
  EXPECT_EQ(applied, (std::vector<int64_t>{1, 0}));
}

TEST(TiedRows, the_spare_becomes_the_master_and_twice_is_no_change) {
  TiedRows tied;
  auto master = torch::zeros({3}), travel = torch::zeros({3}, torch::kBFloat16);
  tied.spare_param = torch::ones({3});
  tied.spare_travel = torch::ones({3}, torch::kBFloat16);
  int slot = 0;
  const auto old_master = master, old_spare = tied.spare_param;
  const auto old_travel = travel, old_spare_travel = tied.spare_travel;
  tied.promote_spare(master, travel, slot);
  EXPECT_TRUE(master.is_same(old_spare));
  EXPECT_TRUE(tied.spare_param.is_same(old_master));
  EXPECT_TRUE(travel.is_same(old_spare_travel));
  EXPECT_TRUE(tied.spare_travel.is_same(old_travel));
  EXPECT_EQ(slot, 1);
  tied.promote_spare(master, travel, slot);
  EXPECT_TRUE(master.is_same(old_master));
  EXPECT_TRUE(travel.is_same(old_travel));
  EXPECT_EQ(slot, 0);
}

TEST(TiedRows, a_failed_backward_drops_its_first_use_and_ranges_and_a_copy_sent_in_it_unlearns_sparsity) {
  TiedRows tied;
  tied.rows = 4;
  tied.first_use_sent = true;
  tied.landed_ranges = {device::Event()};
  tied.range_bounds = {0, 4};
  tied.early.sparse_seen = true;
  tied.early.wanted = true;
  tied.early.flat = torch::zeros({8});  // sent during backward: its rows part not queued
  EXPECT_TRUE(tied.reset_after_failed_backward());
  EXPECT_FALSE(tied.first_use_sent);
  EXPECT_TRUE(tied.landed_ranges.empty() && tied.range_bounds.empty());
  EXPECT_FALSE(tied.early.sparse_seen);
  EXPECT_FALSE(tied.early.wanted);
  EXPECT_FALSE(tied.reset_after_failed_backward());  // nothing of the step left to drop
  // A copy whose rows part was queued (sent at backward's end) keeps what was learnt.
  TiedRows later;
  later.early.sparse_seen = true;
  later.early.flat = torch::zeros({8});
  later.early.rows_gathered = std::make_shared<device::Gate>();
  later.reset_after_failed_backward();
  EXPECT_TRUE(later.early.sparse_seen);
}

TEST(EarlyCopy, is_sent_in_backward_until_its_rows_part_is_queued_and_drop_forgets_it_all) {
  EarlyCopy early;
  EXPECT_FALSE(early.sent_in_backward());
  EXPECT_FALSE(early.drop());  // no device buffer to count off
  early.flat = torch::zeros({8});
  EXPECT_TRUE(early.sent_in_backward());
  early.rows_gathered = std::make_shared<device::Gate>();
  early.touched = torch::zeros({2}, torch::kLong);
  early.staging = torch::zeros({2, 4});
  early.rows_next = true;
  EXPECT_FALSE(early.sent_in_backward());
  EXPECT_TRUE(early.drop());
  EXPECT_FALSE(early.flat.defined() || early.touched.defined() || early.staging.defined() || early.rows_gathered ||
               early.rows_next);
}

TEST(GradientParts, go_once_a_quarter_of_the_units_gradient_waits) {
  GradientParts parts;
  parts.add(torch::zeros({24}), 0);  // 96 bytes of a unit of 100 fp32 elements (400 bytes)
  EXPECT_FALSE(parts.quarter_of(100));
  parts.add(torch::zeros({1}), 24);
  EXPECT_TRUE(parts.quarter_of(100));
  EXPECT_EQ(parts.offsets, (std::vector<int64_t>{0, 24}));
  parts.clear();
  EXPECT_TRUE(parts.waiting.empty() && parts.offsets.empty() && parts.bytes == 0);
}

}  // namespace
}  // namespace strata::hook_offload
