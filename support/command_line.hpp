#pragma once
// Command lines of the demo and the benchmarks: "--name value", "--name=value"
// and bare switches. A development helper, not part of the library.

#include <initializer_list>
#include <string>

namespace lce_support {

struct flag {
  std::string name, value;
};

// Reads the flag at argv[i] into `out`, moving i past its value; `switches`
// are the flags that take none. False when a flag needing a value has none.
inline bool read_flag(int& i, int argc, char** argv, std::initializer_list<const char*> switches, flag& out) {
  out.name = argv[i], out.value.clear();
  for (const char* name : switches)
    if (out.name == name) return true;
  if (const auto eq = out.name.find('='); eq != std::string::npos) {
    out.value = out.name.substr(eq + 1), out.name.resize(eq);
    return true;
  }
  if (i + 1 >= argc) return false;
  out.value = argv[++i];
  return true;
}

}  // namespace lce_support
