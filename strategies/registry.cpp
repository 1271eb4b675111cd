#include <algorithm>
#include <map>
#include <mutex>

#include "models/check.h"
#include "strategies/options.h"
#include "strategies/strategy.h"

namespace strata {
namespace {
struct Entry {
  std::string description;
  StrategyFactory factory;
  std::map<std::string, std::string> required;
};
// Function-local, so registrars in other translation units may run in any order.
std::map<std::string, Entry>& entries() {
  static std::map<std::string, Entry> all;
  return all;
}
// Documentation by strategy name; kept apart from entries(), as the two register in any order.
std::map<std::string, std::vector<OptionDoc>>& docs() {
  static std::map<std::string, std::vector<OptionDoc>> all;
  return all;
}
std::string known_names() {
  std::string known;
  for (const auto& [name, entry] : entries()) known += (known.empty() ? "" : ", ") + name;
  return known;
}
}  // namespace

void Registry::add(const std::string& name, const std::string& description, StrategyFactory factory,
                   std::map<std::string, std::string> required) {
  STRATA_CHECK(!name.empty(), "a strategy needs a non-empty name");
  STRATA_CHECK(entries().count(name) == 0, "strategy '" << name << "' is registered twice");
  entries().emplace(name, Entry{description, std::move(factory), std::move(required)});
}

std::unique_ptr<Strategy> Registry::create(const std::string& name, const StrategyConfig& config) {
  auto found = entries().find(name);
  STRATA_CHECK(found != entries().end(),
               "unknown strategy '" << name << "'; registered strategies: " << known_names());
  config.optimizer.validate();
  config.precision.validate();
  check_precision_on(config.precision, config.device);
  for (const auto& d : config.devices) check_precision_on(config.precision, d);
  auto strategy = found->second.factory(config);
  STRATA_CHECK(strategy->supports(config.precision), "strategy '" << name << "' does not train in precision "
                                                                 << config.precision.to_string()
                                                                 << " (yet); docs/precision.md says what each supports");
  return strategy;
}

std::vector<std::string> Registry::names() {
  std::vector<std::string> out;
  for (const auto& [name, entry] : entries()) out.push_back(name);
  return out;
}

std::vector<std::string> Registry::default_names() {
  std::vector<std::string> out;
  for (const auto& [name, entry] : entries())
    if (entry.required.empty()) out.push_back(name);
  return out;
}

std::string Registry::description(const std::string& name) {
  auto found = entries().find(name);
  STRATA_CHECK(found != entries().end(),
               "unknown strategy '" << name << "'; registered strategies: " << known_names());
  return found->second.description;
}

std::map<std::string, std::string> Registry::required_options(const std::string& name) {
  auto found = entries().find(name);
  STRATA_CHECK(found != entries().end(),
               "unknown strategy '" << name << "'; registered strategies: " << known_names());
  return found->second.required;
}

void Registry::document(const std::vector<std::string>& names, std::vector<OptionDoc> options) {
  for (const auto& name : names) {
    auto& list = docs()[name];
    for (const auto& d : options) {
      for (const auto& known : list)
        STRATA_CHECK(known.key != d.key, "option '" << d.key << "' of strategy '" << name << "' is documented twice");
      list.push_back(d);
    }
  }
}

std::vector<OptionDoc> Registry::documented(const std::string& name) {
  required_options(name);  // an unknown name is an Error here
  const auto found = docs().find(name);
  return found == docs().end() ? std::vector<OptionDoc>{} : found->second;
}

std::vector<OptionInfo> Registry::options(const std::string& name) {
  const auto required = required_options(name);  // an unknown name is an Error here
  StrategyConfig config;
  for (const auto& [key, example] : required) config.options[key] = example;
  std::vector<AskedOption> asked;
  {
    OptionReader::Recording recording;
    entries().at(name).factory(config);
    asked = recording.asked();
  }
  const auto documented = docs().find(name);
  std::vector<OptionInfo> out;
  for (const auto& a : asked) {
    OptionInfo info;
    info.key = a.key;
    info.fallback = a.fallback;
    info.required = required.count(a.key) > 0;
    info.doc.key = a.key;
    if (documented != docs().end())
      for (const auto& d : documented->second)
        if (d.key == a.key) info.doc = d;
    out.push_back(info);
  }
  return out;
}

}  // namespace strata
