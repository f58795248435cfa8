#pragma once
// A minimal JSON writer for the benchmarks' --json files (no dependency).
//
//   lce_bench::json_writer j;
//   j.begin_object();
//   j.field("program", "lce_bench"); j.field("threads", 2);
//   j.key("rows"); j.begin_array(); j.begin_object(); j.field("ms", 1.5); j.end_object(); j.end_array();
//   j.end_object();
//   j.save("results.json");
//
// Numbers are written with 17 significant digits (%.17g): what is read back is
// what was measured; NaN and infinities become null.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace lce_bench {

class json_writer {
 public:
  void begin_object() { open('{'); }
  void end_object() { close('}'); }
  void begin_array() { open('['); }
  void end_array() { close(']'); }
  void key(const std::string& name) {
    comma();
    out_ += quote(name) + ": ";
    after_key_ = true;
  }
  template <class V>
  void field(const std::string& name, const V& v) {
    key(name);
    value(v);
  }
  void value(const std::string& s) { item(quote(s)); }
  void value(const char* s) { item(quote(s)); }
  void value(bool b) { item(b ? "true" : "false"); }
  void value(double d) {
    char buf[40];
    if (std::isfinite(d)) std::snprintf(buf, sizeof buf, "%.17g", d);
    else std::snprintf(buf, sizeof buf, "null");
    item(buf);
  }
  void value(float f) { value(static_cast<double>(f)); }
  void value(int v) { value(static_cast<long long>(v)); }
  void value(long v) { value(static_cast<long long>(v)); }
  void value(long long v) { item(std::to_string(v)); }
  void value(unsigned long v) { item(std::to_string(v)); }
  void value(unsigned long long v) { item(std::to_string(v)); }
  template <class V>
  void value(const std::vector<V>& list) {
    begin_array();
    for (const V& v : list) value(v);
    end_array();
  }

  const std::string& str() const { return out_; }
  bool save(const std::string& path) const {
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return false;
    const bool ok = std::fwrite(out_.data(), 1, out_.size(), f) == out_.size() && std::fputc('\n', f) != EOF;
    return std::fclose(f) == 0 && ok;
  }

 private:
  std::string out_;
  std::vector<bool> first_;  // per open container: nothing written in it yet
  bool after_key_ = false;

  void comma() {
    if (after_key_) return;
    if (!first_.empty()) {
      if (!first_.back()) out_ += ",";
      first_.back() = false;
      out_ += "\n" + std::string(2 * first_.size(), ' ');
    }
  }
  void item(const std::string& text) {
    comma();
    after_key_ = false;
    out_ += text;
  }
  void open(char c) {
    comma();
    after_key_ = false;
    out_ += c;
    first_.push_back(true);
  }
  void close(char c) {
    const bool empty = first_.back();
    first_.pop_back();
    if (!empty) out_ += "\n" + std::string(2 * first_.size(), ' ');
    out_ += c;
  }
  static std::string quote(const std::string& s) {
    std::string q = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') q += '\\', q += c;
      else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        q += buf;
      } else q += c;
    }
    return q + "\"";
  }
};

}  // namespace lce_bench
