#include "bench/capacity.h"

#include <algorithm>

#include "models/check.h"

namespace strata::bench {

const char* to_string(ProbeOutcome outcome) {
  switch (outcome) {
    case ProbeOutcome::trains: return "trains";
    case ProbeOutcome::device_oom: return "device out of memory";
    case ProbeOutcome::host_oom: return "host out of memory";
    case ProbeOutcome::error: break;
  }
  return "error";
}

bool fits(ProbeOutcome outcome) { return outcome == ProbeOutcome::trains; }
bool is_out_of_memory(ProbeOutcome outcome) {
  return outcome == ProbeOutcome::device_oom || outcome == ProbeOutcome::host_oom;
}

const Probe* Frontier::at(int64_t size) const {
  for (auto it = probes.rbegin(); it != probes.rend(); ++it)
    if (it->size == size) return &*it;
  return nullptr;
}

namespace {
void check_range(int64_t lo, int64_t hi, int64_t resolution) {
  STRATA_CHECK(resolution >= 1, "capacity search: resolution " << resolution << " must be at least 1");
  STRATA_CHECK(lo >= 1 && lo <= hi, "capacity search: the range [" << lo << ", " << hi
                                                                   << "] must start at 1 or more and not be empty");
}

// One probe into `f`; false when the search must end (an error).
bool run_probe(Frontier& f, int64_t size, const std::function<Probe(int64_t)>& probe) {
  f.probes.push_back(probe(size));
  auto& p = f.probes.back();
  p.size = size;
  if (fits(p.outcome)) {
    f.largest = size;
  } else if (is_out_of_memory(p.outcome)) {
    f.failing = size;
  } else {
    f.stopped = "size " + std::to_string(size) + ": " + (p.message.empty() ? "error" : p.message);
    return false;
  }
  return true;
}

// Halves the interval between a size that fits and one that does not until `resolution` apart.
void halve(Frontier& f, int64_t resolution, const std::function<Probe(int64_t)>& probe) {
  while (f.largest > 0 && f.failing > 0 && f.failing - f.largest > resolution) {
    const int64_t mid = f.largest + (f.failing - f.largest) / 2;
    if (!run_probe(f, mid, probe)) return;
  }
}
}  // namespace

Frontier bisect_from(int64_t guess, int64_t lo, int64_t hi, int64_t resolution,
                     const std::function<Probe(int64_t)>& probe) {
  check_range(lo, hi, resolution);
  Frontier f;
  if (!run_probe(f, std::clamp(guess, lo, hi), probe)) return f;
  // Away from the guess, each step twice the last, until the answer is bracketed or an end reached.
  for (int64_t step = resolution;; step *= 2) {
    if (f.failing < 0) {  // all so far fit: up
      if (f.largest == hi || !run_probe(f, std::min(hi, f.largest + step), probe)) return f;
    } else if (f.largest < 0) {  // none so far fits: down
      if (f.failing == lo || !run_probe(f, std::max(lo, f.failing - step), probe)) return f;
    } else {
      break;
    }
  }
  halve(f, resolution, probe);
  return f;
}

Frontier bisect(int64_t lo, int64_t hi, int64_t resolution, const std::function<Probe(int64_t)>& probe) {
  check_range(lo, hi, resolution);
  Frontier f;
  auto run = [&](int64_t size) { return run_probe(f, size, probe); };
  if (!run(lo) || f.largest < 0) return f;  // nothing from lo fits, or lo errored
  if (hi == lo || !run(hi) || f.failing < 0) return f;
  halve(f, resolution, probe);
  return f;
}

void order_by_fit(std::vector<std::pair<std::string, Probe>>& results) {
  std::stable_sort(results.begin(), results.end(), [](const auto& x, const auto& y) {
    if (fits(x.second.outcome) != fits(y.second.outcome)) return fits(x.second.outcome);
    return fits(x.second.outcome) && x.second.step_ms < y.second.step_ms;
  });
}

models::ModelConfig Axis::at(const models::ModelConfig& base, int64_t size) const {
  auto c = base;
  if (name == "depth")
    c.depth = size;
  else if (name == "width")
    c.width = size;
  else
    c.classes = size;
  c.validate();
  return c;
}

int64_t Axis::of(const models::ModelConfig& c) const {
  return name == "depth" ? c.depth : name == "width" ? c.width : c.classes;
}

Axis axis_for(const std::string& name, const models::ModelConfig& base) {
  const bool transformer = base.kind == models::ModelKind::gpt || base.kind == models::ModelKind::bert;
  STRATA_CHECK(transformer, "--scale=" << name << ": capacity is searched on gpt and bert models, not "
                                       << base.to_string());
  if (name == "depth") return {"depth", 1};
  if (name == "width") return {"width", base.heads * 8};
  if (name == "classes") {
    STRATA_CHECK(base.kind == models::ModelKind::bert,
                 "--scale=classes scales a bert model's classifier; " << base.to_string() << " has none");
    return {"classes", 1, 2};
  }
  STRATA_FAIL("--scale=" << name << " is not an axis (depth, width, classes)");
}

}  // namespace strata::bench
