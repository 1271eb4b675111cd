#include "strategies/training_state.h"

#include "models/check.h"
#include "strategies/optimizer_state_io.h"

namespace strata {

std::string piece_key(const std::string& name, int64_t offset) { return name + "@" + std::to_string(offset); }

void StateIndex::add(const NamedTensors& state) {
  for (const auto& [key, t] : state) {
    std::string name = key;
    int64_t offset = 0;
    const auto at = key.rfind('@');
    const bool piece = at != std::string::npos;
    if (piece) {
      name = key.substr(0, at);
      try {
        size_t used = 0;
        offset = std::stoll(key.substr(at + 1), &used);
        STRATA_CHECK(used == key.size() - at - 1 && offset >= 0, "");
      } catch (const std::exception&) {
        STRATA_FAIL("training state: '" << key << "' is neither a name nor name@offset");
      }
      STRATA_CHECK(t.dim() == 1, "training state: piece '" << key << "' is " << t.sizes() << ", not flat");
    }
    auto& pieces = pieces_[name];
    STRATA_CHECK(!shapes_.count(name), "training state: '" << name << "' twice (whole, and again as '" << key << "')");
    if (!piece) {
      STRATA_CHECK(pieces.empty(), "training state: '" << name << "' twice (in pieces, and again whole)");
      shapes_[name] = t.sizes().vec();
    }
    const auto flat = t.reshape({-1});
    // Neither the piece before nor the one after may reach into this one.
    auto next = pieces.lower_bound(offset);
    if (next != pieces.end())
      STRATA_CHECK(offset + flat.numel() <= next->first,
                   "training state: pieces of '" << name << "' at " << offset << " and " << next->first << " overlap");
    if (next != pieces.begin()) {
      auto prev = std::prev(next);
      STRATA_CHECK(prev->first + prev->second.numel() <= offset,
                   "training state: pieces of '" << name << "' at " << prev->first << " and " << offset << " overlap");
    }
    pieces.emplace(offset, flat);
  }
}

bool StateIndex::has(const std::string& name) const { return pieces_.count(name) > 0; }

std::vector<std::string> StateIndex::names() const {
  std::vector<std::string> out;
  for (const auto& [name, pieces] : pieces_) out.push_back(name);
  return out;
}

int64_t StateIndex::extent(const std::string& name) const {
  const auto it = pieces_.find(name);
  if (it == pieces_.end() || it->second.empty()) return 0;
  const auto& last = *it->second.rbegin();
  return last.first + last.second.numel();
}

std::vector<int64_t> StateIndex::whole_shape(const std::string& name) const {
  const auto it = shapes_.find(name);
  return it == shapes_.end() ? std::vector<int64_t>{} : it->second;
}

torch::Tensor StateIndex::range(const std::string& name, int64_t begin, int64_t end) const {
  const auto it = pieces_.find(name);
  STRATA_CHECK(it != pieces_.end(), "training state: no '" << name << "'");
  STRATA_CHECK(0 <= begin && begin <= end, "training state: range [" << begin << ", " << end << ") of '" << name << "'");
  const auto& pieces = it->second;
  STRATA_CHECK(!pieces.empty(), "training state: no '" << name << "'");
  auto out = torch::empty({end - begin}, pieces.begin()->second.options());
  int64_t at = begin;
  auto p = pieces.upper_bound(begin);
  if (p != pieces.begin()) --p;
  for (; at < end && p != pieces.end(); ++p) {
    const auto [offset, flat] = *p;
    if (offset + flat.numel() <= at) continue;
    STRATA_CHECK(offset <= at, "training state: '" << name << "' has no element " << at
                                                   << " (a missing shard?); its next piece starts at " << offset);
    const int64_t take = std::min(end, offset + flat.numel()) - at;
    out.narrow(0, at - begin, take).copy_(flat.narrow(0, at - offset, take));
    at += take;
  }
  STRATA_CHECK(at == end, "training state: '" << name << "' has no element " << at << " (a missing shard?); its pieces end at "
                                             << extent(name));
  return out;
}

torch::Tensor StateIndex::whole(const std::string& name, at::IntArrayRef shape) const {
  const auto saved = whole_shape(name);
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  if (!saved.empty())
    STRATA_CHECK(at::IntArrayRef(saved) == shape, "'" << name << "' is " << at::IntArrayRef(saved) << " in the state, "
                                                      << shape << " here (another model?)");
  else
    STRATA_CHECK(extent(name) == numel, "'" << name << "' has " << extent(name) << " elements in the state, " << numel
                                            << " here (another model?)");
  return range(name, 0, numel).view(shape);
}

torch::Tensor StateIndex::find(const std::string& name) const {
  if (!has(name)) return {};
  const auto shape = whole_shape(name);
  return shape.empty() && !shapes_.count(name) ? range(name, 0, extent(name)) : whole(name, shape);
}

void append_optimizer_state(NamedTensors& out, const std::string& name, const OptimizerState& st) {
  auto host = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU, false, /*copy=*/true); };
  if (st.exp_avg.defined()) out.emplace_back(name + "/exp_avg", host(st.exp_avg));
  if (st.exp_avg_sq.defined()) out.emplace_back(name + "/exp_avg_sq", host(st.exp_avg_sq));
  if (st.step > 0) out.emplace_back(name + "/step", torch::tensor({st.step}, torch::kLong));
}

OptimizerState optimizer_state_from(const StateIndex& state, const std::string& name, at::IntArrayRef shape,
                                    const torch::Device& device) {
  OptimizerState st;
  auto moment = [&](const std::string& key) { return state.whole(key, shape).to(device, torch::kFloat).clone(); };
  if (state.has(name + "/exp_avg")) st.exp_avg = moment(name + "/exp_avg");
  if (state.has(name + "/exp_avg_sq")) st.exp_avg_sq = moment(name + "/exp_avg_sq");
  if (auto n = state.find(name + "/step"); n.defined()) st.step = n.item<int64_t>();
  return st;
}

}  // namespace strata
