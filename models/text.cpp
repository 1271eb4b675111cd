#include "models/text.h"

#include <sstream>

#include "models/check.h"

namespace strata::models {

size_t end_of_call(const std::string& text, size_t begin) {
  int depth = 0;
  for (size_t i = begin; i < text.size(); ++i) {
    if (text[i] == '(') ++depth;
    if (text[i] == ')' && --depth == 0) return i + 1;
  }
  return std::string::npos;
}

Call parse_call(const std::string& text) {
  const auto open = text.find('(');
  STRATA_CHECK(open != std::string::npos && open > 0 && end_of_call(text) == text.size(),
               "'" << text << "' is not of the form name(key=value ...)");
  Call call;
  call.name = text.substr(0, open);
  std::istringstream in(text.substr(open + 1, text.size() - open - 2));
  std::string item;
  while (in >> item) {
    const auto eq = item.find('=');
    STRATA_CHECK(eq != std::string::npos && eq > 0, "'" << text << "': '" << item << "' is not key=value");
    const auto key = item.substr(0, eq);
    STRATA_CHECK(call.args.count(key) == 0, "'" << text << "' gives " << key << " twice");
    call.args[key] = item.substr(eq + 1);
  }
  return call;
}

int64_t int_arg(const Call& call, const std::string& key) {
  auto it = call.args.find(key);
  STRATA_CHECK(it != call.args.end(), call.name << "(...) needs " << key << "=<integer>");
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  STRATA_CHECK(used == it->second.size() && used > 0,
               call.name << "(...): " << key << "='" << it->second << "' is not an integer");
  return value;
}

}  // namespace strata::models
