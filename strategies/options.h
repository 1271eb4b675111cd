#pragma once
// Reading a strategy's text options into its options struct: every key must be known, every value
// must parse, and the error names the strategy, the key and the value.
#include <map>
#include <set>
#include <string>
#include <vector>

#include "models/check.h"

namespace strata {

/// "a,b,c" -> {"a", "b", "c"}; the one list splitter of strata (options, command lines).
std::vector<std::string> split(const std::string& text, char separator = ',');

/// One option a strategy's parser asked for: its key and the value it takes when the user gives
/// none, as text.
struct AskedOption {
  std::string key;
  std::string fallback;
};

class OptionReader {
 public:
  /// While one is alive on this thread, every OptionReader on the thread records the options it is
  /// asked for, each key once with its default (Registry::options builds a strategy under one, so
  /// the list comes from the parsers themselves, not from a copy of them).
  class Recording {
   public:
    Recording();
    ~Recording();
    Recording(const Recording&) = delete;  // restores the previous recording once
    Recording& operator=(const Recording&) = delete;
    const std::vector<AskedOption>& asked() const { return asked_; }

   private:
    friend class OptionReader;
    std::vector<AskedOption> asked_;
    Recording* previous_;
  };

  OptionReader(std::string strategy, const std::map<std::string, std::string>& options)
      : strategy_(std::move(strategy)), options_(options) {}

  bool get_bool(const std::string& key, bool fallback);
  int64_t get_int(const std::string& key, int64_t fallback);
  std::string get_string(const std::string& key, const std::string& fallback);
  /// One of `choices` (the first is the default); any other value is an Error naming it and them.
  std::string get_choice(const std::string& key, const std::vector<std::string>& choices);
  /// Comma-separated integers, e.g. "3,2,1".
  std::vector<int64_t> get_ints(const std::string& key, const std::vector<int64_t>& fallback);
  /// Comma-separated strings, e.g. "cuda:0,cuda:1".
  std::vector<std::string> get_strings(const std::string& key, const std::vector<std::string>& fallback);
  /// Rejects keys nobody asked for (typos), listing the known ones. Call after the gets.
  void finish() const;

 private:
  const std::string* find(const std::string& key);
  void record(const std::string& key, const std::string& fallback) const;
  std::string strategy_;
  const std::map<std::string, std::string>& options_;
  std::set<std::string> known_;
};

}  // namespace strata
