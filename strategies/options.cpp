#include "strategies/options.h"

#include <algorithm>
#include <sstream>

namespace strata {

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, separator)) out.push_back(item);
  return out;
}

namespace {
thread_local OptionReader::Recording* recording = nullptr;

template <typename T>
std::string joined(const std::vector<T>& items) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? "," : "") << items[i];
  return out.str();
}
}  // namespace

OptionReader::Recording::Recording() : previous_(recording) { recording = this; }
OptionReader::Recording::~Recording() { recording = previous_; }

void OptionReader::record(const std::string& key, const std::string& fallback) const {
  if (!recording) return;
  for (const auto& a : recording->asked_)
    if (a.key == key) return;  // asked twice (e.g. a list that may also be "auto"): the first default
  // Under a recording the options given are the variant's own presets and the examples of required
  // ones (Registry::options): what the strategy runs with when the user gives nothing.
  const auto given = options_.find(key);
  recording->asked_.push_back({key, given != options_.end() ? given->second : fallback});
}

const std::string* OptionReader::find(const std::string& key) {
  known_.insert(key);
  auto it = options_.find(key);
  return it == options_.end() ? nullptr : &it->second;
}

bool OptionReader::get_bool(const std::string& key, bool fallback) {
  record(key, fallback ? "1" : "0");
  const auto* v = find(key);
  if (!v) return fallback;
  if (*v == "1" || *v == "true" || *v == "on") return true;
  if (*v == "0" || *v == "false" || *v == "off") return false;
  STRATA_FAIL(strategy_ << ": option " << key << "='" << *v << "' is not a boolean (use 1/0, true/false, on/off)");
}

int64_t OptionReader::get_int(const std::string& key, int64_t fallback) {
  record(key, std::to_string(fallback));
  const auto* v = find(key);
  if (!v) return fallback;
  size_t used = 0;
  int64_t out = 0;
  try {
    out = std::stoll(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  STRATA_CHECK(used == v->size() && !v->empty(), strategy_ << ": option " << key << "='" << *v << "' is not an integer");
  return out;
}

std::string OptionReader::get_string(const std::string& key, const std::string& fallback) {
  record(key, fallback);
  const auto* v = find(key);
  return v ? *v : fallback;
}

std::string OptionReader::get_choice(const std::string& key, const std::vector<std::string>& choices) {
  const auto value = get_string(key, choices.front());
  if (std::find(choices.begin(), choices.end(), value) != choices.end()) return value;
  std::string listed;
  for (size_t i = 0; i < choices.size(); ++i)
    listed += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  STRATA_FAIL(strategy_ << ": option " << key << "='" << value << "' is not valid; use " << listed);
}

std::vector<int64_t> OptionReader::get_ints(const std::string& key, const std::vector<int64_t>& fallback) {
  record(key, joined(fallback));
  const auto* v = find(key);
  if (!v) return fallback;
  std::vector<int64_t> out;
  for (const auto& item : split(*v)) {
    size_t used = 0;
    int64_t x = 0;
    try {
      x = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    STRATA_CHECK(used == item.size() && !item.empty(),
                 strategy_ << ": option " << key << "='" << *v << "' is not a comma-separated list of integers");
    out.push_back(x);
  }
  return out;
}

std::vector<std::string> OptionReader::get_strings(const std::string& key, const std::vector<std::string>& fallback) {
  record(key, joined(fallback));
  const auto* v = find(key);
  return v ? split(*v) : fallback;
}

void OptionReader::finish() const {
  for (const auto& [key, value] : options_) {
    if (known_.count(key)) continue;
    std::string known;
    for (const auto& k : known_) known += (known.empty() ? "" : ", ") + k;
    STRATA_FAIL(strategy_ << ": unknown option '" << key << "'; known options: "
                                  << (known.empty() ? "(none)" : known));
  }
}

}  // namespace strata
