#pragma once
// strata_capacity's search: the largest size along one axis of a model that still trains, found by
// bisection over probes (each, in the tool, a process of its own), and the axes themselves.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/model.h"

namespace strata::bench {

/// How one probe ended. A device or host out-of-memory is an answer ("does not fit"); an error is
/// not, and stops the search.
enum class ProbeOutcome { trains, device_oom, host_oom, error };
const char* to_string(ProbeOutcome outcome);
bool fits(ProbeOutcome outcome);
bool is_out_of_memory(ProbeOutcome outcome);

struct Probe {
  int64_t size = 0;  ///< the axis' value (layers, width, classes)
  ProbeOutcome outcome = ProbeOutcome::error;
  std::string message;  ///< what ran out, or the error
  double step_ms = 0;   ///< median training step (train_step + optimizer_step), where it trains
  int64_t parameters = 0, peak_device = 0, peak_host = 0;
  double seconds = 0;  ///< the probe's wall time, its process's start-up and model building included
};

struct Frontier {
  std::vector<Probe> probes;  ///< in the order they ran
  int64_t largest = -1;       ///< the largest size that trained; -1 when the smallest did not
  int64_t failing = -1;       ///< the smallest size seen not to fit; -1 when the largest asked trained
  std::string stopped;        ///< non-empty: a probe errored (not out of memory) and the search ended
  /// The probe of `size` (the last one, if probed twice); nullptr if none.
  const Probe* at(int64_t size) const;
};

/// Bisection over [lo, hi] with `probe`: lo must fit (else nothing does), hi is tried next (if it
/// fits, it is the answer: the range was too small), then the midpoint of the interval between the
/// largest fitting and the smallest failing size, until they are `resolution` apart or closer.
/// `resolution` >= 1 and lo <= hi, else an Error naming the values.
Frontier bisect(int64_t lo, int64_t hi, int64_t resolution, const std::function<Probe(int64_t)>& probe);

/// The same answer, starting from a guess (the memory model's): `guess` (clamped to [lo, hi]) is
/// probed first, then sizes `resolution`, 2x, 4x... away from it in the direction the answer lies,
/// until one fits and one does not (or an end of [lo, hi] is reached), then the interval is halved.
/// A guess d away from the answer costs about 2 log2(d) + 2 probes: 2 when it is right.
Frontier bisect_from(int64_t guess, int64_t lo, int64_t hi, int64_t resolution,
                     const std::function<Probe(int64_t)>& probe);

/// --fit's answer: the strategies that trained, fastest first, then the others in the order given.
void order_by_fit(std::vector<std::pair<std::string, Probe>>& results);

/// An axis of a model: the config at a size, and the step between sizes it allows.
struct Axis {
  std::string name;  ///< depth, width or classes
  int64_t unit = 1;  ///< sizes are multiples of this (width: of the heads times 8)
  int64_t smallest = 1;  ///< the smallest size the model takes, in units (classes: 2)
  models::ModelConfig at(const models::ModelConfig& base, int64_t size) const;
  int64_t of(const models::ModelConfig& config) const;  ///< the base's own size
};
/// `name` for `base`: depth and width for gpt and bert, classes for bert; an Error naming what is
/// possible otherwise.
Axis axis_for(const std::string& name, const models::ModelConfig& base);

}  // namespace strata::bench
