#include <algorithm>
#include <map>
#include <mutex>

#include "models/check.h"
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
  return found->second.factory(config);
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

}  // namespace strata
