#pragma once
// Pipeline schedules as data: for each rank, the ordered list of compute actions it runs (forward,
// full backward, or the zero-bubble split into input-gradient and weight-gradient backward). The
// generators (GPipe, 1F1B, interleaved 1F1B, ZB-H1) only write these lists; everything else is
// derived from them, so one executor runs every schedule and new schedules are text, not code:
//   - the sends and receives each rank needs, in the order it needs them (communication());
//   - whether the lists are complete, placed and ordered, and free of deadlock (validate());
//   - when each action runs under given costs, the bubble and the activation memory (simulate()).
//
// Placement: p ranks, v stages per rank, p*v stages; stage s lives on rank s % p (the standard
// interleaved placement; v = 1 puts stage s on rank s). Micro-batch i enters at stage 0 and leaves
// at stage p*v-1, where the loss is computed and the backward starts.
//
// Execution model (what validate() and simulate() assume, and what an executor must provide):
// each rank runs its list in order; an action waits until its inputs exist; sends never block
// (unbounded buffers), receives do. Dependencies: F(s,i) needs F(s-1,i); B or I (s,i) needs its own
// F(s,i) and B or I (s+1,i); W(s,i) needs I(s,i).
//
// Text form, one line per rank (line r is rank r), tokens separated by spaces:
//   <op><micro>[.s<stage>]      e.g. "F0 F1 B0 F2 B1"   or, interleaved, "F0.s0 F1.s0 F0.s2 B0.s2"
// op is F, B, I or W; micro the micro-batch index; stage the global stage index (0..p*v-1), not the
// chunk on the rank. to_text() writes ".s<stage>" exactly when v > 1; parse() accepts it always and
// requires it when v > 1 (without it the stage is the rank's only stage, which is the rank itself).
// For files and option values parse() also reads '/' as a line break and ',' as a space, cuts '#'
// comments and skips blank lines: "F0,F1,B0,B1/F0,B0,F1,B1" is a two-rank schedule.
#include <string>
#include <vector>

namespace strata::pipeline {

/// What a compute action does. I and W split a backward in two (zero-bubble schedules): I computes
/// the gradient of the stage's input (what the previous stage waits for), W the weight gradients.
enum class Op : char { F = 'F', B = 'B', I = 'I', W = 'W' };

/// One compute action: `op` of micro-batch `micro` on stage `stage`.
struct Action {
  Op op = Op::F;
  int stage = 0;
  int micro = 0;

  bool operator==(const Action& other) const {
    return op == other.op && stage == other.stage && micro == other.micro;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
};

/// A pipeline schedule: each rank's compute actions in execution order.
struct Schedule {
  int ranks = 1;           ///< p: ranks in the pipeline
  int virtual_stages = 1;  ///< v: stages per rank (1: not interleaved)
  int micro_batches = 1;   ///< m: micro-batches per step
  std::vector<std::vector<Action>> actions;  ///< rank -> its actions, in the order it runs them

  int num_stages() const { return ranks * virtual_stages; }
  /// The rank that owns stage `stage`: the one place the placement is written.
  int rank_of(int stage) const { return stage % ranks; }
};

// Generators. Each returns a schedule that validate() accepts, for any p >= 1 and m >= 1 (m < p
// included: the warm-up shrinks to the micro-batches there are); interleaved_1f1b with v > 1
// refuses an m that is not a multiple of p, naming both.

/// GPipe: every forward, then every backward (in micro-batch order). m micro-batches in flight.
Schedule gpipe(int p, int m);
/// 1F1B (PipeDream-flush): rank r runs min(p-1-r, m) warm-up forwards, then alternates one forward
/// and one backward, then drains its backwards. At most p-r micro-batches in flight on stage r.
Schedule one_f_one_b(int p, int m);
/// Megatron-style interleaved 1F1B over p*v stages, stage s on rank s % p: forwards go through the
/// rank's chunks p micro-batches at a time. With v > 1 needs m % p == 0 (micro-batches travel in
/// groups of p), which also refuses m < p. v == 1 is plain 1F1B, for any m.
Schedule interleaved_1f1b(int p, int m, int v);
/// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split into I and
/// W; stage r runs its W's up to r behind its I's, so the input gradients reach earlier stages
/// sooner and the deferred W's fill the drain. Every stage holds min(p, m) micro-batches at its peak
/// (until their W is done): 1F1B's peak, which 1F1B reaches on stage 0 only.
Schedule zero_bubble_h1(int p, int m);

// Text.

/// "F3", "I0" or, with the stage, "F3.s5".
std::string token(const Action& action, bool with_stage);
/// One line per rank; see the syntax above. parse(to_text(s), s.ranks, s.virtual_stages) == s.
std::string to_text(const Schedule& schedule);
/// Reads the text form for p ranks and v stages per rank; m is the largest micro-batch index + 1.
/// Throws Error naming the rank and token position of a malformed token. Does not validate.
Schedule parse(const std::string& text, int p, int v);
/// The same, with p the number of rank lines and v from the largest stage named (".s<stage>"; none:
/// v = 1): the form for a schedule written by hand. Throws Error when the stages do not divide over
/// the ranks.
Schedule parse(const std::string& text);

// Checking.

/// Throws Error naming the first problem found: a bad header; an action out of range or on a rank
/// that does not own its stage (rank and position); an action missing or repeated (every
/// (stage, micro-batch) needs one F, and one B or else one I and one W); a backward before its own
/// forward or a W before its I on the rank (rank and position); a deadlock, where executing the
/// lists in order stops: each stuck rank's position and action, and what it waits for.
void validate(const Schedule& schedule);

// Communication, derived from the actions and the placement.

enum class CommOp { send_activation, recv_activation, send_grad, recv_grad };
std::string to_string(CommOp op);

/// One message, seen from the rank that posts it. Neighbouring stages on one rank (p == 1) pass
/// tensors locally and have no message.
struct Comm {
  CommOp op = CommOp::send_activation;
  int peer = 0;      ///< the other rank
  int stage = 0;     ///< this rank's stage: it produced the tensor (send) or consumes it (recv)
  int micro = 0;     ///< the micro-batch
  int position = 0;  ///< the rank's action it serves: a recv completes before it starts, a send is
                     ///< posted after it ends
};
/// Validates, then lists rank -> its messages in the order they occur: for each action, its
/// receive, then its send.
/// A message is named by (op, stage, micro) on both sides: activation from stage s to s+1 is
/// send_activation at stage s, recv_activation at stage s+1; gradient from s+1 to s likewise.
std::vector<std::vector<Comm>> communication(const Schedule& schedule);

// Simulation.

/// The time one action takes on a stage.
struct StageCosts {
  double forward = 1;
  double backward = 2;  ///< a full backward (B)
  double input = 1;     ///< input-gradient backward (I)
  double weight = 1;    ///< weight-gradient backward (W)
};

struct Costs {
  std::vector<StageCosts> stages = {StageCosts{}};  ///< one per stage, or one for every stage
  double latency = 0;  ///< added to every dependency that crosses ranks (a message)
};

struct Span {
  double start = 0;
  double end = 0;
};

struct Timeline {
  std::vector<std::vector<Span>> spans;  ///< rank -> position -> when that action ran
  double makespan = 0;                   ///< the step time: the last action's end
  double bubble = 0;                     ///< idle time / (ranks * makespan); 0 when makespan is 0
  /// Stage -> the most micro-batches whose forward was done and whose backward (B, or W when
  /// split) was not: the activation memory the stage holds, in micro-batches.
  std::vector<int> peak_in_flight;
};

/// Validates, then runs the lists as soon as dependencies allow (each rank in order, one action at
/// a time). Throws Error as validate() does, or for costs of the wrong length or negative.
Timeline simulate(const Schedule& schedule, const Costs& costs = {});

/// Human-readable step-by-rank grid: one row per rank ("r0 |"), one column per `step` of simulated
/// time, each cell the action running at that column's middle or '.' when the rank is idle.
std::string grid(const Schedule& schedule, const Timeline& timeline, double step = 1);

}  // namespace strata::pipeline
