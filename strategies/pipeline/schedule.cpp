#include "strategies/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <regex>
#include <sstream>

#include "models/check.h"

namespace strata::pipeline {
namespace {

void check_sizes(int p, int m, const char* what) {
  STRATA_CHECK(p >= 1, what << ": p=" << p << " ranks; need at least 1");
  STRATA_CHECK(m >= 1, what << ": m=" << m << " micro-batches; need at least 1");
}

Schedule empty_schedule(int p, int m, int v) {
  Schedule s;
  s.ranks = p;
  s.virtual_stages = v;
  s.micro_batches = m;
  s.actions.resize(p);
  return s;
}

/// Where each action of a schedule sits, by (op, stage, micro); -1 where absent. Filled only for a
/// schedule whose actions are in range.
struct Index {
  int m = 0;
  std::vector<std::pair<int, int>> where[4];  ///< op -> stage * m + micro -> (rank, position)

  explicit Index(const Schedule& s) : m(s.micro_batches) {
    for (auto& w : where) w.assign(static_cast<size_t>(s.num_stages()) * m, {-1, -1});
  }
  static int slot(Op op) { return op == Op::F ? 0 : op == Op::B ? 1 : op == Op::I ? 2 : 3; }
  std::pair<int, int>& at(Op op, int stage, int micro) { return where[slot(op)][stage * m + micro]; }
  const std::pair<int, int>& at(Op op, int stage, int micro) const { return where[slot(op)][stage * m + micro]; }
};

/// The actions `a` waits for on any rank (its own F comes first on the same rank; listed too).
std::vector<Action> dependencies(const Schedule& s, const Action& a, const Index& index) {
  std::vector<Action> deps;
  // A backward needs the next stage's backward, whichever form (B or I) it took there.
  auto backward_of = [&](int stage, int micro) {
    return Action{index.at(Op::B, stage, micro).first >= 0 ? Op::B : Op::I, stage, micro};
  };
  switch (a.op) {
    case Op::F:
      if (a.stage > 0) deps.push_back({Op::F, a.stage - 1, a.micro});
      break;
    case Op::B:
    case Op::I:
      deps.push_back({Op::F, a.stage, a.micro});
      if (a.stage + 1 < s.num_stages()) deps.push_back(backward_of(a.stage + 1, a.micro));
      break;
    case Op::W:
      deps.push_back({Op::I, a.stage, a.micro});
      break;
  }
  return deps;
}

std::string describe(const Schedule& s, int rank, int position) {
  std::ostringstream out;
  out << "rank " << rank << " position " << position << " ("
      << token(s.actions[rank][position], s.virtual_stages > 1) << ")";
  return out.str();
}

/// Header, ranges, placement, completeness and same-rank order; fills `index`.
void check_structure(const Schedule& s, Index& index) {
  const int p = s.ranks, m = s.micro_batches, stages = s.num_stages();
  const bool named = s.virtual_stages > 1;
  for (int rank = 0; rank < p; ++rank) {
    for (int pos = 0; pos < static_cast<int>(s.actions[rank].size()); ++pos) {
      const Action& a = s.actions[rank][pos];
      STRATA_CHECK(a.op == Op::F || a.op == Op::B || a.op == Op::I || a.op == Op::W,
                   "rank " << rank << " position " << pos << ": unknown op " << static_cast<int>(a.op));
      STRATA_CHECK(a.stage >= 0 && a.stage < stages, describe(s, rank, pos) << ": stage " << a.stage
                       << " is out of range; the pipeline has " << stages << " stages");
      STRATA_CHECK(a.micro >= 0 && a.micro < m, describe(s, rank, pos) << ": micro-batch " << a.micro
                       << " is out of range; the schedule has m=" << m);
      STRATA_CHECK(s.rank_of(a.stage) == rank, describe(s, rank, pos) << ": stage " << a.stage
                       << " lives on rank " << s.rank_of(a.stage) << ", not " << rank);
      auto& slot = index.at(a.op, a.stage, a.micro);
      STRATA_CHECK(slot.first < 0, token(a, named) << " appears twice on rank " << rank << ": positions "
                       << slot.second << " and " << pos);
      slot = {rank, pos};
    }
  }
  for (int stage = 0; stage < stages; ++stage) {
    const int rank = s.rank_of(stage);
    for (int i = 0; i < m; ++i) {
      auto f = index.at(Op::F, stage, i), b = index.at(Op::B, stage, i);
      auto in = index.at(Op::I, stage, i), w = index.at(Op::W, stage, i);
      const std::string where = " of micro-batch " + std::to_string(i) + " on stage " + std::to_string(stage) +
                                " (rank " + std::to_string(rank) + ")";
      STRATA_CHECK(f.first >= 0, "no forward" << where);
      STRATA_CHECK(!(b.first >= 0 && (in.first >= 0 || w.first >= 0)),
                   "both a full backward (B) and a split one (I/W)" << where);
      STRATA_CHECK(b.first >= 0 || in.first >= 0 || w.first >= 0, "no backward (B, or I and W)" << where);
      STRATA_CHECK(b.first >= 0 || in.first >= 0, "no input-gradient backward (I) for its W" << where);
      STRATA_CHECK(b.first >= 0 || w.first >= 0, "no weight-gradient backward (W) for its I" << where);
      const auto back = b.first >= 0 ? b : in;
      STRATA_CHECK(back.second > f.second, describe(s, rank, back.second) << ": backward comes before its forward "
                       << token({Op::F, stage, i}, named) << " at position " << f.second);
      STRATA_CHECK(w.first < 0 || w.second > in.second, describe(s, rank, w.second) << ": W comes before its "
                       << token({Op::I, stage, i}, named) << " at position " << in.second);
    }
  }
}

double cost_of(const Costs& costs, const Action& a) {
  const StageCosts& c = costs.stages.size() == 1 ? costs.stages[0] : costs.stages[a.stage];
  switch (a.op) {
    case Op::F: return c.forward;
    case Op::B: return c.backward;
    case Op::I: return c.input;
    case Op::W: return c.weight;
  }
  return 0;
}

/// Runs every rank's list in order, each action as soon as its dependencies are done; throws on a
/// deadlock. Structure must have been checked.
Timeline run(const Schedule& s, const Index& index, const Costs& costs) {
  const int p = s.ranks;
  const bool named = s.virtual_stages > 1;
  Timeline t;
  t.spans.resize(p);
  std::vector<double> free_at(p, 0.0);
  std::vector<size_t> next(p, 0);
  // The dependency's end time, or negative while it has not run.
  auto done_at = [&](const Action& d) -> double {
    const auto [rank, pos] = index.at(d.op, d.stage, d.micro);
    return pos < static_cast<int>(next[rank]) ? t.spans[rank][pos].end : -1.0;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int rank = 0; rank < p; ++rank) {
      while (next[rank] < s.actions[rank].size()) {
        const Action& a = s.actions[rank][next[rank]];
        double start = free_at[rank];
        bool ready = true;
        for (const Action& d : dependencies(s, a, index)) {
          const double end = done_at(d);
          if (end < 0) {
            ready = false;
            break;
          }
          const bool remote = s.rank_of(d.stage) != rank;
          start = std::max(start, end + (remote ? costs.latency : 0.0));
        }
        if (!ready) break;
        t.spans[rank].push_back({start, start + cost_of(costs, a)});
        free_at[rank] = t.spans[rank].back().end;
        ++next[rank];
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int rank = 0; rank < p; ++rank) {
    if (next[rank] == s.actions[rank].size()) continue;
    const int pos = static_cast<int>(next[rank]);
    stuck << (stuck.tellp() > 0 ? "; " : "") << describe(s, rank, pos) << " waits for";
    for (const Action& d : dependencies(s, s.actions[rank][pos], index)) {
      if (done_at(d) >= 0) continue;
      const auto [drank, dpos] = index.at(d.op, d.stage, d.micro);
      stuck << " " << token(d, named) << " (rank " << drank << " position " << dpos << ")";
    }
  }
  STRATA_CHECK(stuck.tellp() == 0, "schedule deadlocks: " << stuck.str());
  return t;
}

void check_header(const Schedule& s) {
  STRATA_CHECK(s.ranks >= 1, "schedule has ranks=" << s.ranks << "; need at least 1");
  STRATA_CHECK(s.virtual_stages >= 1, "schedule has virtual_stages=" << s.virtual_stages << "; need at least 1");
  STRATA_CHECK(s.micro_batches >= 1, "schedule has micro_batches=" << s.micro_batches << "; need at least 1");
  STRATA_CHECK(s.actions.size() == static_cast<size_t>(s.ranks),
               "schedule has action lists for " << s.actions.size() << " ranks but ranks=" << s.ranks);
  // Every (stage, micro-batch) needs at least its forward, so a header that claims more than the
  // lists can hold is wrong. Refusing it before anything else keeps the index (a slot per stage and
  // micro-batch) no larger than the lists, whatever the header says (parse("F999999999") included);
  // a schedule short of fewer actions gets the precise message from check_structure.
  size_t total = 0;
  for (const auto& list : s.actions) total += list.size();
  const long long stages = 1LL * s.ranks * s.virtual_stages;  // both ints: no overflow
  STRATA_CHECK(stages <= static_cast<long long>(total) && s.micro_batches <= static_cast<long long>(total) / stages,
               "schedule has " << total << " actions but p=" << s.ranks << " ranks x v=" << s.virtual_stages
                               << " stages per rank x m=" << s.micro_batches
                               << " micro-batches need more: a forward of every micro-batch on every stage");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Generators

Schedule gpipe(int p, int m) {
  check_sizes(p, m, "gpipe");
  Schedule s = empty_schedule(p, m, 1);
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < m; ++i) s.actions[r].push_back({Op::F, r, i});
    for (int i = 0; i < m; ++i) s.actions[r].push_back({Op::B, r, i});
  }
  return s;
}

Schedule one_f_one_b(int p, int m) {
  check_sizes(p, m, "one_f_one_b");
  Schedule s = empty_schedule(p, m, 1);
  for (int r = 0; r < p; ++r) {
    // Stage r's first backward can start only once micro-batch 0 has reached the last stage and
    // come back, which takes p-1-r more forwards here: run those first, then one-in one-out.
    const int warmup = std::min(p - 1 - r, m);
    auto& list = s.actions[r];
    for (int i = 0; i < warmup; ++i) list.push_back({Op::F, r, i});
    for (int i = 0; i + warmup < m; ++i) {
      list.push_back({Op::F, r, i + warmup});
      list.push_back({Op::B, r, i});
    }
    for (int i = m - warmup; i < m; ++i) list.push_back({Op::B, r, i});
  }
  return s;
}

Schedule interleaved_1f1b(int p, int m, int v) {
  check_sizes(p, m, "interleaved_1f1b");
  STRATA_CHECK(v >= 1, "interleaved_1f1b: v=" << v << " stages per rank; need at least 1");
  if (v == 1) return one_f_one_b(p, m);
  STRATA_CHECK(m % p == 0, "interleaved_1f1b: m=" << m << " micro-batches is not a multiple of p=" << p
                               << " ranks" << (m < p ? " (fewer micro-batches than ranks)" : "")
                               << "; with v=" << v << " the schedule moves micro-batches in groups of p");
  Schedule s = empty_schedule(p, m, v);
  const int total = m * v;  // actions of each kind per rank
  // The k-th forward of a rank: groups of p micro-batches go through chunk 0, then chunk 1, ...;
  // backwards visit the chunks in reverse.
  auto action = [&](int r, int k, Op op) {
    const int group = k / (p * v), within = k % (p * v);
    const int chunk = op == Op::F ? within / p : v - 1 - within / p;
    return Action{op, chunk * p + r, group * p + within % p};
  };
  for (int r = 0; r < p; ++r) {
    // Megatron's warm-up: the first backward on rank r (chunk v-1) needs micro-batch 0 to pass
    // (v-1)*p stages beyond rank r's first chunk and come back; with m == p there is no steady
    // state to speak of and everything warms up.
    const int warmup = m == p ? total : std::min((p - r - 1) * 2 + (v - 1) * p, total);
    auto& list = s.actions[r];
    for (int k = 0; k < warmup; ++k) list.push_back(action(r, k, Op::F));
    for (int k = 0; k + warmup < total; ++k) {
      list.push_back(action(r, k + warmup, Op::F));
      list.push_back(action(r, k, Op::B));
    }
    for (int k = total - warmup; k < total; ++k) list.push_back(action(r, k, Op::B));
  }
  return s;
}

Schedule zero_bubble_h1(int p, int m) {
  check_sizes(p, m, "zero_bubble_h1");
  Schedule s = empty_schedule(p, m, 1);
  for (int r = 0; r < p; ++r) {
    // 1F1B's forwards and input-gradient backwards; W's run up to r behind the I's. Stage r's I of
    // the last micro-batch arrives p-1-r steps after the last stage's, so the r+1 W's left at the
    // end fill that drain. In flight: (p-1-r) warm-up + 1 + r deferred = p at most.
    const int warmup = std::min(p - 1 - r, m);
    auto& list = s.actions[r];
    int next_f = 0, next_i = 0, next_w = 0;
    while (next_f < warmup) list.push_back({Op::F, r, next_f++});
    while (next_i < m) {
      if (next_f < m) list.push_back({Op::F, r, next_f++});
      list.push_back({Op::I, r, next_i++});
      if (next_i - next_w > r) list.push_back({Op::W, r, next_w++});
    }
    while (next_w < m) list.push_back({Op::W, r, next_w++});
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Text

std::string token(const Action& action, bool with_stage) {
  std::string out(1, static_cast<char>(action.op));
  out += std::to_string(action.micro);
  if (with_stage) out += ".s" + std::to_string(action.stage);
  return out;
}

std::string to_text(const Schedule& schedule) {
  std::string out;
  for (const auto& list : schedule.actions) {
    for (size_t k = 0; k < list.size(); ++k) out += (k ? " " : "") + token(list[k], schedule.virtual_stages > 1);
    out += "\n";
  }
  return out;
}

namespace {

/// The text's rank lines: '#' comments cut from each line of the text, then the rest split at '/',
/// commas read as spaces, blank lines dropped (so a comment may hold '/' or ',').
std::vector<std::string> rank_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string text_line; std::getline(in, text_line);) {
    if (const auto hash = text_line.find('#'); hash != std::string::npos) text_line.erase(hash);
    std::istringstream parts(text_line);
    for (std::string line; std::getline(parts, line, '/');) {
      std::replace(line.begin(), line.end(), ',', ' ');
      if (line.find_first_not_of(" \t\r") != std::string::npos) lines.push_back(line);
    }
  }
  return lines;
}

}  // namespace

Schedule parse(const std::string& text) {
  const auto lines = rank_lines(text);
  STRATA_CHECK(!lines.empty(), "schedule text has no rank lines (one line of actions per rank, e.g. 'F0 F1 B0 B1')");
  const int p = static_cast<int>(lines.size());
  // The largest ".s<stage>" gives the stage count; without any, one stage per rank.
  int stages = p;
  const std::regex stage_suffix(R"(\.s(\d{1,9})\b)");
  for (const auto& line : lines)
    for (std::sregex_iterator it(line.begin(), line.end(), stage_suffix), end; it != end; ++it)
      stages = std::max(stages, std::stoi((*it)[1].str()) + 1);
  STRATA_CHECK(stages % p == 0, "schedule text of " << p << " ranks names stages up to " << stages - 1 << ": "
                                                     << stages << " stages do not divide over " << p
                                                     << " ranks (stage s lives on rank s % ranks)");
  return parse(text, p, stages / p);
}

Schedule parse(const std::string& text, int p, int v) {
  STRATA_CHECK(p >= 1 && v >= 1, "parse: p=" << p << " v=" << v << "; both need to be at least 1");
  const std::vector<std::string> lines = rank_lines(text);
  STRATA_CHECK(static_cast<int>(lines.size()) == p,
               "schedule text has " << lines.size() << " lines but p=" << p << " ranks (one line per rank)");
  Schedule s = empty_schedule(p, 0, v);
  auto number = [](const std::string& t, size_t& k) {
    const size_t from = k;
    while (k < t.size() && std::isdigit(static_cast<unsigned char>(t[k]))) ++k;
    return k > from && k - from <= 9 ? std::stoi(t.substr(from, k - from)) : -1;
  };
  for (int r = 0; r < p; ++r) {
    std::istringstream words(lines[r]);
    int pos = 0;
    for (std::string t; words >> t; ++pos) {
      const auto bad = [&](const char* why) {
        STRATA_FAIL("rank " << r << " token " << pos << " '" << t << "': " << why
                            << "; tokens are <op><micro>[.s<stage>] with op F, B, I or W, e.g. F3 or B3.s5");
      };
      Action a;
      if (t.empty() || std::string("FBIW").find(t[0]) == std::string::npos) bad("unknown op");
      a.op = static_cast<Op>(t[0]);
      size_t k = 1;
      a.micro = number(t, k);
      if (a.micro < 0) bad("no micro-batch number");
      if (k == t.size()) {
        if (v > 1) bad("needs the stage (.s<stage>) when a rank has several stages");
        a.stage = r;
      } else {
        if (t.compare(k, 2, ".s") != 0) bad("unexpected characters after the micro-batch");
        k += 2;
        a.stage = number(t, k);
        if (a.stage < 0 || k != t.size()) bad("bad stage number");
      }
      s.micro_batches = std::max(s.micro_batches, a.micro + 1);
      s.actions[r].push_back(a);
    }
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Checking, communication, simulation

void validate(const Schedule& schedule) {
  check_header(schedule);
  Index index(schedule);
  check_structure(schedule, index);
  run(schedule, index, Costs{});
}

std::string to_string(CommOp op) {
  switch (op) {
    case CommOp::send_activation: return "send_activation";
    case CommOp::recv_activation: return "recv_activation";
    case CommOp::send_grad: return "send_grad";
    case CommOp::recv_grad: return "recv_grad";
  }
  return "?";
}

std::vector<std::vector<Comm>> communication(const Schedule& s) {
  validate(s);
  const int last = s.num_stages() - 1;
  std::vector<std::vector<Comm>> out(s.ranks);
  for (int r = 0; r < s.ranks; ++r) {
    for (int pos = 0; pos < static_cast<int>(s.actions[r].size()); ++pos) {
      const Action& a = s.actions[r][pos];
      // A neighbour stage on this rank (only with p == 1) is passed locally; so is nothing beyond
      // the first and last stage.
      auto add = [&](CommOp op, int neighbour) {
        if (neighbour < 0 || neighbour > last || s.rank_of(neighbour) == r) return;
        out[r].push_back({op, s.rank_of(neighbour), a.stage, a.micro, pos});
      };
      if (a.op == Op::F) {
        add(CommOp::recv_activation, a.stage - 1);
        add(CommOp::send_activation, a.stage + 1);
      } else if (a.op == Op::B || a.op == Op::I) {
        add(CommOp::recv_grad, a.stage + 1);
        add(CommOp::send_grad, a.stage - 1);
      }
    }
  }
  return out;
}

Timeline simulate(const Schedule& schedule, const Costs& costs) {
  check_header(schedule);
  const size_t stages = static_cast<size_t>(schedule.num_stages());
  STRATA_CHECK(costs.stages.size() == 1 || costs.stages.size() == stages,
               "costs for " << costs.stages.size() << " stages; the schedule has " << stages
                            << " (give one per stage, or one for all)");
  for (const auto& c : costs.stages)
    STRATA_CHECK(c.forward >= 0 && c.backward >= 0 && c.input >= 0 && c.weight >= 0,
                 "negative cost: forward=" << c.forward << " backward=" << c.backward << " input=" << c.input
                                           << " weight=" << c.weight);
  STRATA_CHECK(costs.latency >= 0, "negative latency " << costs.latency);
  Index index(schedule);
  check_structure(schedule, index);
  Timeline t = run(schedule, index, costs);

  double busy = 0;
  for (const auto& spans : t.spans) {
    for (const Span& span : spans) {
      busy += span.end - span.start;
      t.makespan = std::max(t.makespan, span.end);
    }
  }
  t.bubble = t.makespan > 0 ? 1.0 - busy / (schedule.ranks * t.makespan) : 0.0;
  // A rank runs its actions one after another in list order, so counting along the list gives the
  // in-flight count at every moment, whatever the costs.
  t.peak_in_flight.assign(stages, 0);
  std::vector<int> now(stages, 0);
  for (const auto& list : schedule.actions) {
    for (const Action& a : list) {
      if (a.op == Op::F) t.peak_in_flight[a.stage] = std::max(t.peak_in_flight[a.stage], ++now[a.stage]);
      if (a.op == Op::B || a.op == Op::W) --now[a.stage];
    }
  }
  return t;
}

std::string grid(const Schedule& schedule, const Timeline& timeline, double step) {
  STRATA_CHECK(step > 0, "grid: step=" << step << " must be positive");
  const bool named = schedule.virtual_stages > 1;
  size_t width = 1;
  for (const auto& list : schedule.actions)
    for (const Action& a : list) width = std::max(width, token(a, named).size());
  const int columns = static_cast<int>(std::ceil(timeline.makespan / step - 1e-9));
  const std::string label_width = std::to_string(schedule.ranks - 1);
  std::ostringstream out;
  for (int r = 0; r < schedule.ranks; ++r) {
    std::string label = "r" + std::to_string(r);
    label.resize(label_width.size() + 1, ' ');
    out << label << " |";
    size_t k = 0;
    const auto& spans = timeline.spans[r];
    for (int c = 0; c < columns; ++c) {
      const double middle = (c + 0.5) * step;
      while (k < spans.size() && spans[k].end <= middle) ++k;
      std::string cell = k < spans.size() && spans[k].start <= middle ? token(schedule.actions[r][k], named) : ".";
      cell.resize(width, ' ');
      out << " " << cell;
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace strata::pipeline
