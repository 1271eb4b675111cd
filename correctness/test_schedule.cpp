// Pipeline schedules as data: rapidcheck properties over generated pipelines (p in [1,8], m in
// [1,16], v in [1,4]) for every generator (validity, text round trip, derived messages, the known
// bubble formulas, activation memory), the same formulas over every size in range, and broken
// schedules (hand-written, and generated ones with an action dropped, repeated or moved into a
// deadlock) that the validator must reject naming the rank and position.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "correctness/support/errors.h"
#include "strategies/pipeline/schedule.h"

namespace strata::pipeline {
namespace {

using test::error_of;
using ::testing::HasSubstr;

/// Uniform over [min, max) whatever the test size; shrinks towards min.
rc::Gen<int> uniform(int min, int max) { return rc::gen::resize(rc::kNominalSize, rc::gen::inRange(min, max)); }

enum class Kind { gpipe, one_f_one_b, interleaved, zero_bubble };
const char* name(Kind k) {
  return k == Kind::gpipe ? "gpipe" : k == Kind::one_f_one_b ? "1f1b" : k == Kind::interleaved ? "interleaved" : "zb-h1";
}

Schedule make(Kind kind, int p, int m, int v) {
  switch (kind) {
    case Kind::gpipe: return gpipe(p, m);
    case Kind::one_f_one_b: return one_f_one_b(p, m);
    case Kind::interleaved: return interleaved_1f1b(p, m, v);
    case Kind::zero_bubble: return zero_bubble_h1(p, m);
  }
  return {};
}

/// A generated pipeline: p in [1,8], m in [1,16] (a multiple of p for interleaved), v in [1,4]
/// (used by interleaved only).
struct Case {
  Kind kind;
  int p, m, v;
};
Case draw_case(std::vector<Kind> kinds = {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zero_bubble}) {
  Case c;
  c.kind = kinds[*uniform(0, static_cast<int>(kinds.size()))];
  c.p = *uniform(1, 9);
  c.m = c.kind == Kind::interleaved ? c.p * *uniform(1, 16 / c.p + 1) : *uniform(1, 17);
  c.v = c.kind == Kind::interleaved ? *uniform(1, 5) : 1;
  RC_TAG(name(c.kind));
  return c;
}

/// Unit costs: F=1, B=2; for the zero-bubble split I=1, W=1 (so I+W = B).
Costs unit_costs() { return Costs{{StageCosts{1, 2, 1, 1}}, 0}; }

bool near(double a, double b) { return std::abs(a - b) < 1e-12; }
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Bubble formulas: what each test below expects, with F=1, B=2 and, split, I=W=1 (so I+W = B) on
// every stage, zero latency. bubble = idle / (ranks * makespan); every rank has 3m of work (3vm
// interleaved), so bubble = 1 - 3m / makespan and each formula is a makespan.
//  - GPipe and 1F1B: the pipeline fills and drains over p-1 micro-batch slots of 3 each, so the
//    makespan is 3(m+p-1) and the bubble (p-1)/(m+p-1), exactly, for every m (m < p included).
//  - Interleaved 1F1B, v > 1, m % p == 0: each of a rank's v stages costs F=1, B=2 (a stage is 1/v
//    of the rank's layers, so the unit is a stage, not a rank). Fill and drain still take p-1 slots,
//    but of one stage (3) instead of one rank's v stages (3v): makespan 3(vm+p-1), bubble
//    (p-1)/(vm+p-1), exactly. The bubble fraction does not depend on the unit, so this is
//    Megatron-LM's reduction of the bubble by v at a fixed model (there written (p-1)/(vm) as idle
//    over useful time; idle over total time is ours).
//  - ZB-H1: the last rank cannot start before p-1 (micro-batch 0's forwards on the stages before it)
//    and has 3m of work; stage 0's first I cannot end before 2p (p forwards down, p input gradients
//    up) and 2m-1 units of I and W remain after it. So any schedule under these costs takes at least
//    max(3m+p-1, 2m+2p-1) = 3m+p-1 + max(0, p-m); the test asserts that the generator takes exactly
//    that, i.e. bubble (p-1)/(3m+p-1) for m >= p. There each rank idles p-1, exactly a third of 1F1B's 3(p-1) (the
//    paper's (p-1)(F+I-W) against (p-1)(F+B)); for m < p the idle time is 2p-1-m, still below 1F1B's.
double classic_bubble(int p, int m) { return double(p - 1) / (m + p - 1); }
double interleaved_bubble(int p, int m, int v) { return double(p - 1) / (v * m + p - 1); }
double zb_h1_makespan(int p, int m) { return 3.0 * m + p - 1 + std::max(0, p - m); }
double zb_h1_bubble(int p, int m) { return 1.0 - 3.0 * m / zb_h1_makespan(p, m); }

// ---------------------------------------------------------------------------------------------
// Properties

TEST(Schedule, prop_every_generated_schedule_validates_and_round_trips_through_text) {
  EXPECT_TRUE(rc::check("generated schedules validate and round-trip", [] {
    const Case c = draw_case();
    const Schedule s = make(c.kind, c.p, c.m, c.v);
    RC_ASSERT(s.ranks == c.p && s.micro_batches == c.m && s.virtual_stages == c.v);
    validate(s);  // throws (and so fails the property) on any problem
    const std::string text = to_text(s);
    const Schedule back = parse(text, c.p, c.v);
    RC_ASSERT(back.micro_batches == s.micro_batches);
    RC_ASSERT(back.actions == s.actions);
    RC_ASSERT(to_text(back) == text);
    // Written by hand: ranks and stages read off the text, in the option form too.
    const Schedule inferred = parse(text);
    RC_ASSERT(inferred.ranks == c.p && inferred.virtual_stages == c.v && inferred.actions == s.actions);
    std::string option_form = text;
    std::replace(option_form.begin(), option_form.end(), '\n', '/');
    std::replace(option_form.begin(), option_form.end(), ' ', ',');
    RC_ASSERT(parse(option_form).actions == s.actions);
  }));
}

TEST(Schedule, prop_bubbles_match_the_known_formulas) {
  EXPECT_TRUE(rc::check("bubble formulas under unit costs", [] {
    const Case c = draw_case();
    const Timeline t = simulate(make(c.kind, c.p, c.m, c.v), unit_costs());
    switch (c.kind) {
      case Kind::gpipe:
      case Kind::one_f_one_b:
        RC_ASSERT(near(t.makespan, 3.0 * (c.m + c.p - 1)));
        RC_ASSERT(near(t.bubble, classic_bubble(c.p, c.m)));
        break;
      case Kind::interleaved:
        RC_ASSERT(near(t.makespan, 3.0 * (c.v * c.m + c.p - 1)));
        RC_ASSERT(near(t.bubble, interleaved_bubble(c.p, c.m, c.v)));
        break;
      case Kind::zero_bubble: {
        RC_ASSERT(near(t.makespan, zb_h1_makespan(c.p, c.m)));
        RC_ASSERT(near(t.bubble, zb_h1_bubble(c.p, c.m)));
        // Idle time per rank against 1F1B's 3(p-1): a third when m >= p, less than all of it always.
        const double idle = t.makespan - 3.0 * c.m;
        if (c.m >= c.p) RC_ASSERT(near(3 * idle, 3.0 * (c.p - 1)));
        if (c.p > 1) RC_ASSERT(t.bubble < simulate(one_f_one_b(c.p, c.m), unit_costs()).bubble);
        break;
      }
    }
  }));
}

TEST(Schedule, prop_activation_memory_per_stage) {
  EXPECT_TRUE(rc::check("peak in-flight micro-batches", [] {
    const Case c = draw_case({Kind::gpipe, Kind::one_f_one_b, Kind::zero_bubble});
    const Timeline t = simulate(make(c.kind, c.p, c.m, c.v), unit_costs());
    RC_ASSERT(static_cast<int>(t.peak_in_flight.size()) == c.p);
    for (int r = 0; r < c.p; ++r) {
      const int peak = t.peak_in_flight[r];
      if (c.kind == Kind::gpipe) RC_ASSERT(peak == c.m);
      // 1F1B: stage r holds its p-1-r warm-up forwards plus one; stage 0 the most, min(p, m).
      if (c.kind == Kind::one_f_one_b) RC_ASSERT(peak == std::min(c.p - r, c.m));
      // ZB-H1: stage r defers up to r W's on top of 1F1B's p-r: 1F1B's peak, on every stage.
      if (c.kind == Kind::zero_bubble) RC_ASSERT(peak == std::min(c.p, c.m));
    }
  }));
}

TEST(Schedule, prop_messages_pair_up_and_respect_the_placement) {
  EXPECT_TRUE(rc::check("every send has its receive", [] {
    const Case c = draw_case();
    const Schedule s = make(c.kind, c.p, c.m, c.v);
    const auto comms = communication(s);
    RC_ASSERT(static_cast<int>(comms.size()) == c.p);
    // (op, stage, micro, from rank, to rank) of every message, as its sender and its receiver see it.
    std::map<std::tuple<bool, int, int, int, int>, int> sent, received;
    for (int r = 0; r < c.p; ++r) {
      for (const Comm& m : comms[r]) {
        const Action& at = s.actions[r][m.position];
        RC_ASSERT(at.stage == m.stage && at.micro == m.micro && m.peer != r);
        const bool grad = m.op == CommOp::send_grad || m.op == CommOp::recv_grad;
        switch (m.op) {
          case CommOp::send_activation:
            RC_ASSERT(at.op == Op::F && s.rank_of(m.stage + 1) == m.peer);
            ++sent[{grad, m.stage, m.micro, r, m.peer}];
            break;
          case CommOp::recv_activation:
            RC_ASSERT(at.op == Op::F && s.rank_of(m.stage - 1) == m.peer);
            ++received[{grad, m.stage - 1, m.micro, m.peer, r}];
            break;
          case CommOp::send_grad:
            RC_ASSERT((at.op == Op::B || at.op == Op::I) && s.rank_of(m.stage - 1) == m.peer);
            ++sent[{grad, m.stage, m.micro, r, m.peer}];
            break;
          case CommOp::recv_grad:
            RC_ASSERT((at.op == Op::B || at.op == Op::I) && s.rank_of(m.stage + 1) == m.peer);
            ++received[{grad, m.stage + 1, m.micro, m.peer, r}];
            break;
        }
      }
    }
    RC_ASSERT(sent == received);
    for (const auto& [key, count] : sent) RC_ASSERT(count == 1);
    // Every stage boundary carries m activations and m gradients, except on one rank (p == 1).
    const int boundaries = c.p > 1 ? s.num_stages() - 1 : 0;
    RC_ASSERT(static_cast<int>(sent.size()) == 2 * boundaries * c.m);
  }));
}

TEST(Schedule, prop_a_dropped_or_repeated_action_is_rejected) {
  EXPECT_TRUE(rc::check("drop or repeat one action", [] {
    const Case c = draw_case();
    Schedule s = make(c.kind, c.p, c.m, c.v);
    const int rank = *uniform(0, c.p);
    auto& list = s.actions[rank];
    const int pos = *uniform(0, static_cast<int>(list.size()));
    const Action a = list[pos];
    const std::string named = token(a, c.v > 1);
    const std::string on_stage = " of micro-batch " + std::to_string(a.micro) + " on stage " + std::to_string(a.stage);
    if (*rc::gen::arbitrary<bool>()) {
      list.erase(list.begin() + pos);
      const std::string what = a.op == Op::F   ? "no forward"
                               : a.op == Op::B ? "no backward (B, or I and W)"
                               : a.op == Op::I ? "no input-gradient backward (I) for its W"
                                               : "no weight-gradient backward (W) for its I";
      const auto msg = error_of([&] { validate(s); });
      RC_LOG() << "dropped " << named << " from rank " << rank << ": " << msg << "\n";
      RC_ASSERT(contains(msg, what + on_stage));
    } else {
      list.insert(list.begin() + *uniform(0, static_cast<int>(list.size()) + 1), a);
      const auto msg = error_of([&] { validate(s); });
      RC_LOG() << "repeated " << named << " on rank " << rank << ": " << msg << "\n";
      RC_ASSERT(contains(msg, named + " appears twice on rank " + std::to_string(rank)));
    }
  }));
}

TEST(Schedule, prop_waiting_for_a_gradient_before_sending_the_next_micro_batch_deadlocks) {
  EXPECT_TRUE(rc::check("GPipe with rank 0's B0 moved up to right after its F0", [] {
    const int p = *uniform(2, 9), m = *uniform(2, 17);
    Schedule s = gpipe(p, m);
    // Rank 0 now waits for micro-batch 0's gradient before sending micro-batch 1 forward, while
    // every later rank runs all its forwards before its first backward: each stops at its F1 or B0.
    auto& list = s.actions[0];
    std::rotate(list.begin() + 1, list.begin() + m, list.begin() + m + 1);
    RC_ASSERT(list[1] == (Action{Op::B, 0, 0}));
    const auto msg = error_of([&] { validate(s); });
    RC_LOG() << msg << "\n";
    RC_ASSERT(contains(msg, "schedule deadlocks"));
    for (int r = 0; r < p; ++r) RC_ASSERT(contains(msg, "rank " + std::to_string(r) + " position 1 ("));
  }));
}

// The formulas over every size in range, not only the drawn ones (the sweep is cheap).
TEST(Schedule, bubble_formulas_hold_for_every_size_in_range) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      const std::string at = "p=" + std::to_string(p) + " m=" + std::to_string(m);
      EXPECT_TRUE(near(simulate(gpipe(p, m), unit_costs()).bubble, classic_bubble(p, m))) << "gpipe " << at;
      const double f1b1 = simulate(one_f_one_b(p, m), unit_costs()).bubble;
      EXPECT_TRUE(near(f1b1, classic_bubble(p, m))) << "1f1b " << at;
      const double zb = simulate(zero_bubble_h1(p, m), unit_costs()).bubble;
      EXPECT_TRUE(near(zb, zb_h1_bubble(p, m))) << "zb-h1 " << at << ": " << zb;
      for (int v = 1; v <= 4 && m % p == 0; ++v)
        EXPECT_TRUE(near(simulate(interleaved_1f1b(p, m, v), unit_costs()).bubble, interleaved_bubble(p, m, v)))
            << "interleaved " << at << " v=" << v;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fixed cases

TEST(Schedule, text_form_and_grid_read_as_documented) {
  const Schedule s = one_f_one_b(2, 3);
  EXPECT_EQ(to_text(s), "F0 F1 B0 F2 B1 B2\nF0 B0 F1 B1 F2 B2\n");
  const Schedule il = interleaved_1f1b(2, 2, 2);
  EXPECT_EQ(to_text(il).substr(0, 24), "F0.s0 F1.s0 F0.s2 F1.s2 ");
  // Tokens may carry the stage when v == 1 too; it reads the same.
  EXPECT_EQ(parse("F0.s0 B0.s0\nF0.s1 B0.s1", 2, 1).actions, one_f_one_b(2, 1).actions);
  const Timeline t = simulate(s, unit_costs());
  EXPECT_EQ(grid(s, t),
            "r0 | F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2\n"
            "r1 | .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  . \n");
  EXPECT_EQ(t.spans[1][1].start, 2);  // B0 on the last stage right after its F0
  EXPECT_EQ(parse(to_text(s), 2, 1).actions, s.actions);
}

TEST(Schedule, simulate_takes_per_stage_costs_and_latency) {
  Costs c{{StageCosts{1, 2, 1, 1}, StageCosts{3, 4, 1, 1}}, 0.5};
  const Timeline t = simulate(gpipe(2, 1), c);
  // F0 on stage 0 [0,1]; message 0.5; F0 on stage 1 [1.5,4.5]; B0 [4.5,8.5]; message; B0 [9,11].
  EXPECT_DOUBLE_EQ(t.spans[1][0].start, 1.5);
  EXPECT_DOUBLE_EQ(t.spans[0][1].start, 9);
  EXPECT_DOUBLE_EQ(t.makespan, 11);
  EXPECT_DOUBLE_EQ(t.bubble, 1 - (3.0 + 7.0) / (2 * 11));
  EXPECT_THAT(error_of([] { simulate(gpipe(2, 1), Costs{{{}, {}, {}}, 0}); }), HasSubstr("costs for 3 stages"));
}

TEST(Schedule, communication_lists_receives_before_sends_in_action_order) {
  const auto comms = communication(one_f_one_b(2, 1));
  ASSERT_EQ(comms[0].size(), 2u);
  EXPECT_EQ(comms[0][0].op, CommOp::send_activation);
  EXPECT_EQ(comms[0][1].op, CommOp::recv_grad);
  EXPECT_EQ(comms[0][1].position, 1);
  ASSERT_EQ(comms[1].size(), 2u);
  EXPECT_EQ(comms[1][0].op, CommOp::recv_activation);
  EXPECT_EQ(comms[1][1].op, CommOp::send_grad);
  // One rank, two stages: the hand-off is local.
  EXPECT_TRUE(communication(interleaved_1f1b(1, 2, 2))[0].empty());
}

TEST(Schedule, fewer_micro_batches_than_ranks_still_validate) {
  for (int p = 2; p <= 8; ++p) {
    for (int m = 1; m < p; ++m) {
      validate(gpipe(p, m));
      validate(one_f_one_b(p, m));
      validate(zero_bubble_h1(p, m));
    }
  }
}

TEST(Schedule, interleaved_refuses_micro_batches_not_a_multiple_of_ranks) {
  const auto msg = error_of([] { interleaved_1f1b(4, 6, 2); });
  EXPECT_THAT(msg, HasSubstr("m=6"));
  EXPECT_THAT(msg, HasSubstr("p=4"));
  // Fewer micro-batches than ranks: refused, naming both, never a schedule that hangs.
  EXPECT_THAT(error_of([] { interleaved_1f1b(4, 2, 3); }),
              HasSubstr("m=2 micro-batches is not a multiple of p=4 ranks (fewer micro-batches than ranks)"));
  // v == 1 is plain 1F1B, which takes any m.
  EXPECT_EQ(interleaved_1f1b(4, 2, 1).actions, one_f_one_b(4, 2).actions);
  EXPECT_THAT(error_of([] { interleaved_1f1b(2, 2, 0); }), HasSubstr("v=0"));
  EXPECT_THAT(error_of([] { gpipe(0, 3); }), HasSubstr("p=0"));
  EXPECT_THAT(error_of([] { one_f_one_b(2, 0); }), HasSubstr("m=0"));
}

// ---------------------------------------------------------------------------------------------
// Hand-broken schedules

TEST(Schedule, a_backward_before_its_forward_is_rejected_with_rank_and_position) {
  Schedule s = one_f_one_b(2, 2);  // rank 1: F0 B0 F1 B1
  std::swap(s.actions[1][0], s.actions[1][1]);
  EXPECT_THAT(error_of([&] { validate(s); }),
              HasSubstr("rank 1 position 0 (B0): backward comes before its forward F0 at position 1"));
  Schedule z = zero_bubble_h1(2, 2);  // rank 0: F0 F1 I0 W0 I1 W1
  std::swap(z.actions[0][2], z.actions[0][3]);
  EXPECT_THAT(error_of([&] { validate(z); }), HasSubstr("rank 0 position 2 (W0): W comes before its I0"));
}

TEST(Schedule, missing_repeated_and_misplaced_actions_are_rejected) {
  Schedule dropped = one_f_one_b(2, 2);
  dropped.actions[0].erase(dropped.actions[0].begin() + 1);  // rank 0: F0 [F1] B0 B1
  EXPECT_THAT(error_of([&] { validate(dropped); }), HasSubstr("no forward of micro-batch 1 on stage 0 (rank 0)"));

  Schedule twice = gpipe(2, 2);
  twice.actions[1].push_back({Op::B, 1, 0});
  EXPECT_THAT(error_of([&] { validate(twice); }), HasSubstr("B0 appears twice on rank 1: positions 2 and 4"));

  Schedule misplaced = gpipe(2, 1);
  misplaced.actions[0][0].stage = 1;
  EXPECT_THAT(error_of([&] { validate(misplaced); }),
              HasSubstr("rank 0 position 0 (F0): stage 1 lives on rank 1, not 0"));

  Schedule mixed = parse("F0 I0 B0\nF0 B0", 2, 1);
  EXPECT_THAT(error_of([&] { validate(mixed); }), HasSubstr("both a full backward (B) and a split one (I/W)"));
  EXPECT_THAT(error_of([] { validate(parse("F0 I0\nF0 B0", 2, 1)); }),
              HasSubstr("no weight-gradient backward (W) for its I of micro-batch 0 on stage 0"));
  EXPECT_THAT(error_of([] { validate(parse("F0 F1 B0\nF0 B0", 2, 1)); }),
              HasSubstr("no backward (B, or I and W) of micro-batch 1 on stage 0"));
  EXPECT_EQ(error_of([] { validate(parse("F0 I0 W0\nF0 B0", 2, 1)); }), "<no error>") << "split on one stage only";
  // A header that claims more than the lists hold is refused before anything is sized by it.
  EXPECT_THAT(error_of([] { validate(parse("F999999999 B999999999", 1, 1)); }),
              HasSubstr("schedule has 2 actions but p=1 ranks x v=1 stages per rank x m=1000000000 micro-batches"));
  Schedule short_lists = gpipe(2, 2);
  short_lists.actions.pop_back();
  EXPECT_THAT(error_of([&] { validate(short_lists); }), HasSubstr("action lists for 1 ranks but ranks=2"));
}

TEST(Schedule, a_deadlock_names_where_each_rank_stops) {
  // Rank 0 waits for micro-batch 0's gradient before sending micro-batch 1 forward; rank 1 wants
  // micro-batch 1 first.
  const Schedule s = parse("F0 B0 F1 B1\nF1 B1 F0 B0\n", 2, 1);
  const auto msg = error_of([&] { validate(s); });
  EXPECT_THAT(msg, HasSubstr("schedule deadlocks"));
  EXPECT_THAT(msg, HasSubstr("rank 0 position 1 (B0) waits for B0 (rank 1 position 3)"));
  EXPECT_THAT(msg, HasSubstr("rank 1 position 0 (F1) waits for F1 (rank 0 position 2)"));
  EXPECT_THAT(error_of([&] { simulate(s); }), HasSubstr("schedule deadlocks"));
  // One rank, two stages out of order: it waits for itself.
  EXPECT_THAT(error_of([] { validate(parse("F0.s1 F0.s0 B0.s1 B0.s0", 1, 2)); }),
              HasSubstr("rank 0 position 0 (F0.s1) waits for F0.s0 (rank 0 position 1)"));
}

TEST(Schedule, malformed_text_names_the_rank_and_token) {
  EXPECT_THAT(error_of([] { parse("F0 B0\n", 2, 1); }), HasSubstr("1 lines but p=2"));
  EXPECT_THAT(error_of([] { parse("F0 X1\nF0 B0", 2, 1); }), HasSubstr("rank 0 token 1 'X1': unknown op"));
  EXPECT_THAT(error_of([] { parse("F0 B0\nF0 B", 2, 1); }), HasSubstr("rank 1 token 1 'B': no micro-batch number"));
  EXPECT_THAT(error_of([] { parse("F0 B0.s", 1, 1); }), HasSubstr("'B0.s': bad stage number"));
  EXPECT_THAT(error_of([] { parse("F0.s0 F0", 1, 2); }), HasSubstr("'F0': needs the stage"));
  EXPECT_THAT(error_of([] { parse("F0x", 1, 1); }), HasSubstr("unexpected characters"));
  EXPECT_THAT(error_of([] { parse("# nothing but a comment\n\n"); }), HasSubstr("no rank lines"));
  EXPECT_THAT(error_of([] { parse("F0.s0 F0.s2 B0.s2 B0.s0\nF0.s1 B0.s1"); }),
              HasSubstr("3 stages do not divide over 2 ranks"));
}

TEST(Schedule, hand_written_text_reads_its_ranks_stages_and_comments) {
  const Schedule s = parse("# rank 0/1 of 2, runs ahead\nF0 F1 F2 B0 B1 B2   # GPipe-like, see docs/a.md\n\nF0 B0 F1 B1 F2 B2\n");
  EXPECT_EQ(s.ranks, 2);
  EXPECT_EQ(s.virtual_stages, 1);
  EXPECT_EQ(s.micro_batches, 3);
  EXPECT_EQ(to_text(s), "F0 F1 F2 B0 B1 B2\nF0 B0 F1 B1 F2 B2\n");
  validate(s);
  const Schedule interleaved = parse("F0.s0,F0.s2,B0.s2,B0.s0/F0.s1,F0.s3,B0.s3,B0.s1");
  EXPECT_EQ(interleaved.ranks, 2);
  EXPECT_EQ(interleaved.virtual_stages, 2);
  validate(interleaved);
}

}  // namespace
}  // namespace strata::pipeline
