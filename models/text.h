#pragma once
// The text form of configurations: "name(key=value key=value ...)", as ModelConfig::to_string()
// writes it and as failure records and command lines carry it back.
#include <cstdint>
#include <map>
#include <string>

namespace strata::models {

struct Call {
  std::string name;
  std::map<std::string, std::string> args;
};

/// "gpt(depth=2 width=8)" -> {"gpt", {{"depth","2"}, {"width","8"}}}; an Error names malformed text.
Call parse_call(const std::string& text);

/// args[key] as an integer; an Error names `what`, the key and the value when it is absent or malformed.
int64_t int_arg(const Call& call, const std::string& key);

/// Where the call starting at text[begin] ends: one past its closing parenthesis (std::string::npos
/// if it never closes).
size_t end_of_call(const std::string& text, size_t begin = 0);

}  // namespace strata::models
