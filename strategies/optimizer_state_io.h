#pragma once
// One parameter's optimizer state as Strategy::training_state() names it, and back: the strategies
// that keep a parameter's state whole share these.
#include <string>

#include "strategies/optim.h"
#include "strategies/training_state.h"

namespace strata {

/// Appends `st` under `name`: host copies of its moments as `<name>/exp_avg` and `<name>/exp_avg_sq`
/// where it has them, and `<name>/step` once it has stepped.
void append_optimizer_state(NamedTensors& out, const std::string& name, const OptimizerState& st);

/// `name`'s optimizer state from a checked state: its moments shaped `shape`, in fp32 on `device`
/// (none where the state holds none), and its step count (0 where none).
OptimizerState optimizer_state_from(const StateIndex& state, const std::string& name, at::IntArrayRef shape,
                                    const torch::Device& device);

}  // namespace strata
