#include "bench/memory_model.h"

#include <algorithm>
#include <set>
#include <sstream>

#include <c10/core/ScalarType.h>

#include "models/check.h"
#include "models/sizes.h"
#include "strategies/strategy.h"

namespace strata::bench {
namespace {

const std::set<std::string> kHookOffload = {"hook_offload", "hook_offload_overlap", "hook_offload_sync"};
const std::set<std::string> kSharded = {"sharded", "sharded_offload"};
const std::set<std::string> kBaseline = {"baseline", "baseline_checkpoint"};
// On one device these hold what baseline holds: every parameter, its gradient and optimizer state,
// and (an upper bound for schedules that keep fewer micro-batches in flight) every block's saved
// activations for the whole batch.
const std::set<std::string> kWholeOnOneDevice = {"manual_split", "pipeline_1f1b", "pipeline_gpipe",
                                                 "pipeline_interleaved", "pipeline_zero_bubble", "pipeline_custom"};

// An option's value as the strategy takes it: the one given, else the default it registers
// (Registry::options, read once per strategy), so no default is written down twice.
std::string option_value(const MemoryQuestion& q, const std::string& key) {
  if (const auto it = q.options.find(key); it != q.options.end()) return it->second;
  static std::map<std::string, std::map<std::string, std::string>> defaults;
  auto& known = defaults[q.strategy];
  if (known.empty())
    for (const auto& o : Registry::options(q.strategy)) known[o.key] = o.fallback;
  const auto it = known.find(key);
  return it == known.end() ? "" : it->second;
}

int64_t option_int(const MemoryQuestion& q, const std::string& key) {
  const auto text = option_value(q, key);
  try {
    size_t used = 0;
    const auto v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  STRATA_FAIL("memory model: option " << key << "=" << text << " is not a whole number");
}

bool option_is(const MemoryQuestion& q, const std::string& key, const std::string& value) {
  return option_value(q, key) == value;
}

// Units as strategies/windowed.h plans them: each block's own parameters, and the tied matrix.
struct Units {
  std::vector<int64_t> numel;                ///< unit -> parameters
  std::vector<std::vector<int64_t>> window;  ///< block -> units
};

Units units_of(const models::ModelSizes& sizes) {
  Units u;
  int64_t shared = -1;
  if (sizes.shared_params > 0) {
    shared = 0;
    u.numel.push_back(sizes.shared_params);
  }
  for (const auto& b : sizes.blocks) {
    std::vector<int64_t> w;
    if (b.own_params > 0) {
      w.push_back(static_cast<int64_t>(u.numel.size()));
      u.numel.push_back(b.own_params);
    }
    if (b.uses_shared && shared >= 0) w.push_back(shared);
    u.window.push_back(std::move(w));
  }
  return u;
}

// Bytes of the units in windows [first, last] (each unit once), at `element` bytes a parameter,
// and of `extra` (a unit, or -1) if not among them.
int64_t windows_bytes(const Units& u, int64_t first, int64_t last, int64_t element,
                      const std::vector<int64_t>& padded, int64_t extra = -1) {
  std::set<int64_t> seen;
  const int64_t n = static_cast<int64_t>(u.window.size());
  for (int64_t b = std::max<int64_t>(first, 0); b <= std::min(last, n - 1); ++b)
    for (auto unit : u.window[b]) seen.insert(unit);
  if (extra >= 0) seen.insert(extra);
  int64_t bytes = 0;
  for (auto unit : seen) bytes += padded[unit] * element;
  return bytes;
}

// The widest span of `span` consecutive windows; with `carried` (a unit, or -1), that unit too
// wherever the span starts between its first and last use (it stays on the device between them).
int64_t widest_span(const Units& u, int64_t span, int64_t element, const std::vector<int64_t>& padded,
                    int64_t carried = -1) {
  int64_t first = -1, last = -1;
  for (int64_t b = 0; b < static_cast<int64_t>(u.window.size()); ++b)
    for (auto unit : u.window[b])
      if (unit == carried) {
        if (first < 0) first = b;
        last = b;
      }
  int64_t widest = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(u.window.size()); ++b)
    widest = std::max(widest, windows_bytes(u, b, b + span - 1, element, padded, b > first && b < last ? carried : -1));
  return widest;
}

// Saved activations at the peak: every block's (kept), or every block's input and the widest
// block's own while it is recomputed, the last block's kept (recompute).
int64_t activation_bytes(const models::ModelSizes& sizes, int64_t batch, int64_t compute, bool recompute) {
  const auto scaled = [&](const models::BlockSizes& b) { return b.activation_bytes * batch * compute / 4; };
  int64_t total = 0;
  if (!recompute) {
    for (const auto& b : sizes.blocks) total += scaled(b);
    return total;
  }
  int64_t widest = 0;
  for (size_t i = 0; i + 1 < sizes.blocks.size(); ++i) {
    const auto& b = sizes.blocks[i];
    total += b.input_elements * batch * (b.integer_input ? 8 : compute);
    widest = std::max(widest, scaled(b));
  }
  return total + widest + scaled(sizes.blocks.back());
}

}  // namespace

int64_t MemoryPrediction::device_bytes() const {
  int64_t n = 0;
  for (const auto& p : device) n += p.bytes;
  return n;
}

int64_t MemoryPrediction::host_bytes() const {
  int64_t n = 0;
  for (const auto& p : host) n += p.bytes;
  return n;
}

std::string MemoryPrediction::summary() const {
  std::ostringstream out;
  out.precision(3);
  const auto list = [&](const char* where, const std::vector<MemoryPart>& parts, int64_t total) {
    out << where << " " << static_cast<double>(total) / (1 << 30) << " GiB";
    std::string sep = " (";
    for (const auto& p : parts)
      if (p.bytes > 0) out << sep << p.what << " " << static_cast<double>(p.bytes) / (1 << 30), sep = ", ";
    if (sep == ", ") out << ")";
  };
  list("device", device, device_bytes());
  out << "; ";
  list("host", host, host_bytes());
  return out.str();
}

bool memory_model_covers(const std::string& strategy) {
  return kHookOffload.count(strategy) || kSharded.count(strategy) || kBaseline.count(strategy) ||
         kWholeOnOneDevice.count(strategy);
}

MemoryPrediction predict_memory(const MemoryQuestion& q) {
  STRATA_CHECK(memory_model_covers(q.strategy),
               "memory model: strategy '" << q.strategy << "' is not modelled");
  STRATA_CHECK(q.batch >= 1, "memory model: batch=" << q.batch << " must be at least 1");
  const auto sizes = models::model_sizes(q.model);
  const auto units = units_of(sizes);
  const int64_t P = sizes.parameters();
  const int64_t compute = static_cast<int64_t>(c10::elementSize(q.precision.compute));
  const int64_t transfer = static_cast<int64_t>(c10::elementSize(q.precision.transfer));
  const int64_t state = q.optimizer.kind == OptimizerKind::adamw ? 8 : q.optimizer.momentum != 0.0 ? 4 : 0;
  const auto& o = q.options;
  MemoryPrediction out;
  const std::vector<int64_t>& numel = units.numel;
  const int64_t widest_unit = *std::max_element(numel.begin(), numel.end());

  // Every strategy's model is built in host memory first (fp32), whatever it keeps there later.
  const MemoryPart built{"model as built", 4 * P};
  // AdamW's update of one tensor takes temporaries about twice its size.
  const auto step_temporaries = [&](int64_t widest) { return state > 0 ? 2 * 4 * widest : 0; };

  if (kWholeOnOneDevice.count(q.strategy)) {
    const auto devices = o.find("devices");
    STRATA_CHECK(devices == o.end() || devices->second.find(',') == std::string::npos,
                 "memory model: " << q.strategy << " over several devices (devices=" << devices->second
                                  << ") is not modelled, only on one device");
    STRATA_CHECK(!o.count("classifier_shards") || o.at("classifier_shards") == "1",
                 "memory model: " << q.strategy << " with classifier_shards is not modelled");
  }
  if (kBaseline.count(q.strategy) || kWholeOnOneDevice.count(q.strategy)) {
    const bool recompute = option_is(q, "checkpoint", "1");
    // manual_split keeps a replica of a tied matrix for the stage that does not own it, on one device too.
    const int64_t replica = q.strategy == "manual_split" ? 4 * sizes.shared_params : 0;
    out.resident_param_bytes = out.peak_param_bytes = 4 * P + replica;
    // Backward frees activations as it fills gradients: the peak holds about the larger of the two.
    out.device = {{"params", 4 * P},
                  {"optimizer", state * P},
                  {"compute copies", compute < 4 ? compute * P : 0},
                  {"grads or activations", std::max(4 * P, activation_bytes(sizes, q.batch, compute, recompute))},
                  {"step temporaries", step_temporaries(sizes.largest_tensor)},
                  {"tied replica and its gradient", 2 * replica}};
    out.host = {built};
    return out;
  }

  if (kHookOffload.count(q.strategy)) {
    const int64_t prefetch = option_int(q, "prefetch");
    const bool recompute = option_is(q, "activations", "recompute");
    const bool overlap = option_is(q, "overlap_optimizer", "1");
    const bool carried = option_is(q, "carry_tied", "1");
    STRATA_CHECK(!o.count("resident"), "memory model: hook_offload with resident blocks is not modelled");
    // At rest: the windows optimizer_step fetched for the next forward (opening: prefetch + 1);
    // none with overlap_optimizer, whose updates run as gradients land.
    const int64_t opening = prefetch > 0 && !overlap ? prefetch + 1 : 0;
    out.resident_param_bytes = opening > 0 ? windows_bytes(units, 0, opening - 1, transfer, numel) : 0;
    // At the peak: the computing window and those prefetched, the tied matrix carried between uses.
    const int64_t shared = sizes.shared_params > 0 && carried ? 0 : -1;  // units_of puts it first
    out.peak_param_bytes = std::max(out.resident_param_bytes, widest_span(units, prefetch + 1, transfer, numel, shared));
    out.device = {{"windows", out.peak_param_bytes},
                  {"gradient", 4 * widest_unit},
                  {"activations", activation_bytes(sizes, q.batch, compute, recompute)}};
    out.host = {built,
                {"masters", 4 * P},
                {"grads", 4 * P},
                {"optimizer", state * P},
                {"travel copies", transfer < 4 ? transfer * P : 0},
                {"tied spares", overlap && sizes.shared_params > 0 ? (4 + state + (transfer < 4 ? transfer : 0)) * sizes.shared_params : 0}};
    return out;
  }

  // sharded in a world of one: each unit's shard is the whole unit.
  const bool offload = option_is(q, "offload", "1");
  const bool recompute = option_is(q, "activations", "recompute");
  const bool reshard = option_is(q, "reshard_after_forward", "1");
  const int64_t prefetch = option_int(q, "prefetch");
  const bool aliased = !offload && q.precision.transfer == torch::kFloat;  // fp32 units are their shards
  const int64_t shards = 4 * P;
  out.resident_param_bytes = offload ? 0 : shards;
  int64_t gathered = 0;
  if (!aliased)
    gathered = reshard ? widest_span(units, prefetch + 1, transfer, numel)
                       : windows_bytes(units, 0, static_cast<int64_t>(units.window.size()) - 1, transfer, numel);
  out.peak_param_bytes = out.resident_param_bytes + gathered;
  int64_t widest_window = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(units.window.size()); ++b)
    widest_window = std::max(widest_window, windows_bytes(units, b, b, 4, numel));
  const int64_t activations = activation_bytes(sizes, q.batch, compute, recompute);
  out.device = {{"shards", offload ? 0 : shards},
                {"optimizer", offload ? 0 : state * P},
                {offload ? "activations" : "grads or activations", offload ? activations : std::max(4 * P, activations)},
                {"gathered", gathered},
                {"gradient", widest_window},
                {"step temporaries", offload ? 0 : step_temporaries(widest_unit)}};
  out.host = {built};
  if (offload)
    out.host.insert(out.host.end(), {{"shards", shards}, {"grads", 4 * P}, {"optimizer", state * P},
                                     {"travel copies", transfer < 4 ? transfer * P : 0}});
  return out;
}

}  // namespace strata::bench
