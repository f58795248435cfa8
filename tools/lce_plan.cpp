// lce_plan: the memory of the LM-head step per tensor-parallel rank, and the
// longest sequence that fits a budget, with materialised logits, with the
// origin's chunked scheme and with lce (lce::plan_step / lce::longest_sequence
// from <lce/plan.hpp>; lce's figure is its own workspace_bytes()).
//
//   lce_plan --model qwen2.5-7b --tp 1,2,4,8 --sp on --dtype bf16 --budget 80GiB [--tokens 131072]
//   lce_plan --hidden 4096 --vocab 128256 --tp 8
//   lce_plan --table [--budget 80GiB] [--markdown]     every preset at TP 1, 2, 4, 8
//   lce_plan ... --json plan.json
#include <lce/plan.hpp>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr double gib = 1024.0 * 1024.0 * 1024.0;

void usage(const char* argv0, std::FILE* to) {
  std::fprintf(to,
               "usage: %s [--model NAME | --hidden H --vocab V] [--tp 1,2,4,8] [--sp on|off]\n"
               "          [--dtype bf16|fp16|fp32] [--budget 80GiB] [--workspace 256MiB] [--origin-chunk 1024]\n"
               "          [--tokens S] [--table] [--markdown] [--json FILE]\n"
               "models:",
               argv0);
  for (const auto& m : lce::model_presets)
    std::fprintf(to, " %.*s (H %lld, V %lld)", int(m.name.size()), m.name.data(), (long long)m.hidden,
                 (long long)m.vocab);
  std::fprintf(to, "\n--budget/--workspace take a number with B, KiB, MiB, GiB, GB (1e9) or TB; a bare number of\n"
                   "--budget is GiB, of --workspace MiB. --table: every model at TP 1, 2, 4, 8.\n");
}

// A bad value: says which option and why, and exits 2 (the usage would not say).
[[noreturn]] void bad_value(const std::string& option, const std::string& text, const char* why) {
  std::fprintf(stderr, "lce_plan: %s %s: %s (--help for the usage)\n", option.c_str(), text.c_str(), why);
  std::exit(2);
}

// "80", "80GiB", "80GB", "256MiB"; a bare number is in `unit` bytes. At most 2^62 bytes.
std::size_t parse_bytes(const std::string& option, const std::string& s, double unit) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !(v >= 0)) bad_value(option, s, "not a number of bytes >= 0");
  const std::string suffix(end);
  double scale = unit;
  if (suffix == "B") scale = 1;
  else if (suffix == "KiB") scale = 1024.0;
  else if (suffix == "MiB") scale = 1024.0 * 1024;
  else if (suffix == "GiB") scale = gib;
  else if (suffix == "TiB") scale = gib * 1024;
  else if (suffix == "KB") scale = 1e3;
  else if (suffix == "MB") scale = 1e6;
  else if (suffix == "GB") scale = 1e9;
  else if (suffix == "TB") scale = 1e12;
  else if (!suffix.empty()) bad_value(option, s, "unit not one of B, KiB, MiB, GiB, TiB, KB, MB, GB, TB");
  const double bytes = v * scale;
  if (!(bytes <= 0x1p62)) bad_value(option, s, "more than 2^62 bytes (4 EiB)");
  return static_cast<std::size_t>(bytes);
}

// A whole decimal number in [least, most], nothing after it.
std::int64_t parse_int(const std::string& option, const std::string& s, std::int64_t least, std::int64_t most) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (end == s.c_str() || *end != '\0' || errno == ERANGE || v < least || v > most) {
    const std::string why = "not a whole number in [" + std::to_string(least) + ", " + std::to_string(most) + "]";
    bad_value(option, s, why.c_str());
  }
  return v;
}

std::vector<int> parse_ints(const std::string& option, const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    out.push_back(static_cast<int>(parse_int(option, item, 1, 1 << 20)));
  if (out.empty()) bad_value(option, s, "no value");
  return out;
}

std::string tokens_text(std::int64_t t) {
  char buf[64];
  if (t >= lce::plan_max_tokens) return ">= 2^31";
  if (t >= 1000000) std::snprintf(buf, sizeof buf, "%.2fM", double(t) / 1e6);
  else std::snprintf(buf, sizeof buf, "%lld", (long long)t);
  return buf;
}
// 131072 -> "128K" (in units of 1024, one decimal when needed)
std::string tokens_k(std::int64_t t) {
  char buf[64];
  if (t >= lce::plan_max_tokens) return ">= 2,097,152K";
  const double k = double(t) / 1024.0;
  if (k >= 1000) std::snprintf(buf, sizeof buf, "%.2fM", k / 1024.0);
  else if (k >= 100) std::snprintf(buf, sizeof buf, "%.0fK", std::floor(k));
  else std::snprintf(buf, sizeof buf, "%.1fK", std::floor(k * 10) / 10);
  return buf;
}
std::string gib_text(std::size_t bytes) {
  if (bytes == SIZE_MAX) return "> 2^64 B";  // the plan saturates rather than wrap
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", double(bytes) / gib);
  return buf;
}

const char* assumptions =
    "What is counted, per rank (the largest vocabulary shard V_r = ceil(V/P); S tokens; b bytes per element;\n"
    "rows = S/P under sequence parallelism, else S), for forward + backward of the LM head:\n"
    "  inputs       hidden rows x H x b, all S int64 targets, the weight shard V_r x H x b\n"
    "  gradients    dL/dhidden rows x H x b, dL/dweight V_r x H x b\n"
    "  per-token    fp32 log-probs, lse, dL/dlogp (3 x S x 4); materialised and origin: + row max, sum of exp,\n"
    "               target logit, and every rank's copy of them for the merge (3 (1 + P) x S x 4 when P > 1)\n"
    "  logits       materialised: S x V_r fp32 (+ its 2-byte GEMM output when b = 2);\n"
    "               origin: per chunk of C_o tokens fp32 logits, fp32 softmax/grad, int64 one-hot (16 B each)\n"
    "  collectives  materialised + SP: all-gathered [S, H] hidden and [S, H] dL/dhidden before reduce-scatter;\n"
    "               origin: the gathered [S, H] (SP) and its fp32 [S, H] gradient; lce: inside its workspace\n"
    "  workspace    lce: op.workspace_bytes(S, H, V_r) of an operator of P ranks (one chunk's logits, row\n"
    "               statistics, per-chunk gather/reduce-scatter buffers; b = 2: fp32 [V_r, H] dW accumulator)\n"
    "Not counted: the rest of the model, allocator slack, CUDA context, the collective library's own buffers.\n"
    "The budget is what the LM-head step may use: the device's memory minus everything else.\n";

struct row {
  std::string model;
  std::int64_t hidden, vocab;
  int tp;
  bool sp;
  lce::step_memory at[3];
  std::int64_t longest[3];
};

row plan_row(const lce::plan_request& r, const std::string& model, std::int64_t tokens) {
  row out{model, r.hidden, r.vocab, r.tensor_parallel, lce::detail::plan_sequence_parallel(r), {}, {}};
  const lce::plan_scheme schemes[3] = {lce::plan_scheme::materialised, lce::plan_scheme::origin, lce::plan_scheme::lce};
  std::int64_t s = tokens;
  if (out.sp) s = (s + r.tensor_parallel - 1) / r.tensor_parallel * r.tensor_parallel;
  for (int k = 0; k < 3; ++k) {
    out.at[k] = lce::plan_step(r, schemes[k], s);
    out.longest[k] = lce::longest_sequence(r, schemes[k]);
  }
  return out;
}

void print_breakdown(const row& x, std::size_t budget) {
  std::printf("\n%s  H %lld  V %lld  TP %d%s: per rank at S = %lld tokens (GiB)\n", x.model.c_str(),
              (long long)x.hidden, (long long)x.vocab, x.tp, x.sp ? " + SP" : "", (long long)x.at[0].tokens);
  std::printf("  %-26s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s | %s\n", "scheme", "hidden", "targets", "weight",
              "d hidden", "d weight", "per-tok", "logits", "collect.", "workspace", "total",
              "longest S in the budget");
  for (int k = 0; k < 3; ++k) {
    const lce::step_memory& m = x.at[k];
    const auto name = lce::plan_scheme_name(static_cast<lce::plan_scheme>(k));
    std::printf("  %-26.*s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s | %s\n", int(name.size()), name.data(),
                gib_text(m.hidden).c_str(), gib_text(m.targets).c_str(), gib_text(m.weight).c_str(),
                gib_text(m.grad_hidden).c_str(), gib_text(m.grad_weight).c_str(), gib_text(m.per_token).c_str(),
                gib_text(m.logits).c_str(), gib_text(m.collectives).c_str(), gib_text(m.workspace).c_str(),
                gib_text(m.total()).c_str(), tokens_text(x.longest[k]).c_str());
  }
  std::printf("  (lce's logit block: %lld rows per chunk; budget %.2f GiB)\n", (long long)x.at[2].chunk,
              double(budget) / gib);
}

void json_row(std::FILE* f, const row& x, bool last) {
  std::fprintf(f, "    {\"model\": \"%s\", \"hidden\": %lld, \"vocab\": %lld, \"tensor_parallel\": %d, "
                  "\"sequence_parallel\": %s,\n",
               x.model.c_str(), (long long)x.hidden, (long long)x.vocab, x.tp, x.sp ? "true" : "false");
  const char* keys[3] = {"materialised", "origin", "lce"};
  for (int k = 0; k < 3; ++k) {
    const lce::step_memory& m = x.at[k];
    std::fprintf(f,
                 "     \"%s\": {\"tokens\": %lld, \"hidden\": %zu, \"targets\": %zu, \"weight\": %zu, "
                 "\"grad_hidden\": %zu, \"grad_weight\": %zu, \"per_token\": %zu, \"logits\": %zu, "
                 "\"collectives\": %zu, \"workspace\": %zu, \"total\": %zu, \"chunk\": %lld, "
                 "\"longest_sequence\": %lld}%s\n",
                 keys[k], (long long)m.tokens, m.hidden, m.targets, m.weight, m.grad_hidden, m.grad_weight,
                 m.per_token, m.logits, m.collectives, m.workspace, m.total(), (long long)m.chunk,
                 (long long)x.longest[k], k < 2 ? "," : "");
  }
  std::fprintf(f, "    }%s\n", last ? "" : ",");
}

}  // namespace

int main(int argc, char** argv) {
  lce::plan_request base;
  std::string model = "qwen2.5-7b", json, dtype = "bf16";
  std::vector<int> tps{1, 2, 4, 8};
  bool table = false, markdown = false, custom = false, sp = true;
  // Sizes whose products the plan sums in 64 bits (it saturates past them).
  constexpr std::int64_t max_size = std::int64_t{1} << 40;
  std::int64_t tokens = 131072;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-h" || a == "--help") return usage(argv[0], stdout), 0;
    else if (a == "--table") table = true;
    else if (a == "--markdown") markdown = true;
    else if (a == "--model") model = value();
    else if (a == "--hidden") base.hidden = parse_int(a, value(), 1, max_size), custom = true;
    else if (a == "--vocab") base.vocab = parse_int(a, value(), 1, max_size), custom = true;
    else if (a == "--tp") tps = parse_ints(a, value());
    else if (a == "--sp") {
      const std::string v = value();
      if (v != "on" && v != "off") bad_value(a, v, "not on or off");
      sp = v == "on";
    } else if (a == "--dtype") {
      dtype = value();
      if (dtype != "bf16" && dtype != "fp16" && dtype != "fp32") bad_value(a, dtype, "not bf16, fp16 or fp32");
    } else if (a == "--budget") base.budget_bytes = parse_bytes(a, value(), gib);
    else if (a == "--workspace") base.workspace_limit_bytes = parse_bytes(a, value(), 1024.0 * 1024);
    else if (a == "--origin-chunk") base.origin_chunk_tokens = parse_int(a, value(), 1, max_size);
    else if (a == "--tokens") tokens = parse_int(a, value(), 1, lce::plan_max_tokens);
    else if (a == "--json") json = value();
    else return std::fprintf(stderr, "lce_plan: unknown option %s\n", a.c_str()), usage(argv[0], stderr), 2;
  }
  if (dtype == "bf16" || dtype == "fp16") base.element_bytes = 2;
  else if (dtype == "fp32") base.element_bytes = 4;
  else return usage(argv[0], stderr), 2;
  if (tps.empty() || tokens < 1) return usage(argv[0], stderr), 2;
  base.sequence_parallel = sp;

  std::vector<std::pair<std::string, lce::plan_request>> models;
  if (table) {
    for (const auto& m : lce::model_presets) {
      lce::plan_request r = base;
      r.hidden = m.hidden, r.vocab = m.vocab;
      models.emplace_back(std::string(m.name), r);
    }
  } else if (custom) {
    if (base.hidden <= 0 || base.vocab <= 0) return usage(argv[0], stderr), 2;
    models.emplace_back("H " + std::to_string(base.hidden) + ", V " + std::to_string(base.vocab), base);
  } else {
    bool found = false;
    for (const auto& m : lce::model_presets)
      if (m.name == model) {
        lce::plan_request r = base;
        r.hidden = m.hidden, r.vocab = m.vocab;
        models.emplace_back(model, r);
        found = true;
      }
    if (!found) return std::fprintf(stderr, "unknown model %s\n", model.c_str()), usage(argv[0], stderr), 2;
  }

  std::vector<row> rows;
  try {
    for (const auto& [name, r0] : models)
      for (int tp : tps) {
        lce::plan_request r = r0;
        r.tensor_parallel = tp;
        rows.push_back(plan_row(r, name, tokens));
      }
  } catch (const lce::error& e) {
    std::fprintf(stderr, "lce_plan: %s\n", e.what());
    return 2;
  }

  std::printf("lce_plan: LM-head step (forward + backward) per tensor-parallel rank; %s, sequence parallel %s, "
              "budget %.2f GiB, lce workspace limit %.0f MiB, origin chunk %lld tokens\n",
              dtype.c_str(), sp ? "on" : "off", double(base.budget_bytes) / gib,
              double(base.workspace_limit_bytes) / (1024.0 * 1024), (long long)base.origin_chunk_tokens);
  std::fputs(assumptions, stdout);
  if (markdown || table) {
    std::printf("\nLongest sequence per step in %.0f GiB (K = 1024 tokens), and GiB per rank at %s tokens:\n\n",
                double(base.budget_bytes) / gib, tokens_k(tokens).c_str());
    std::printf("| model | TP | materialised | origin | lce | GiB at %s: materialised / origin / lce |\n",
                tokens_k(tokens).c_str());
    std::printf("|---|---:|---:|---:|---:|---:|\n");
    for (const row& x : rows)
      std::printf("| %s | %d%s | %s | %s | %s | %s / %s / %s |\n", x.model.c_str(), x.tp, x.sp ? " + SP" : "",
                  tokens_k(x.longest[0]).c_str(), tokens_k(x.longest[1]).c_str(), tokens_k(x.longest[2]).c_str(),
                  gib_text(x.at[0].total()).c_str(), gib_text(x.at[1].total()).c_str(),
                  gib_text(x.at[2].total()).c_str());
  }
  if (!table)
    for (const row& x : rows) print_breakdown(x, base.budget_bytes);

  if (!json.empty()) {
    std::FILE* f = std::fopen(json.c_str(), "w");
    if (!f) return std::fprintf(stderr, "lce_plan: cannot write %s\n", json.c_str()), 1;
    std::fprintf(f, "{\n  \"program\": \"lce_plan\",\n  \"dtype\": \"%s\",\n  \"element_bytes\": %zu,\n"
                    "  \"sequence_parallel\": %s,\n  \"budget_bytes\": %zu,\n  \"workspace_limit_bytes\": %zu,\n"
                    "  \"origin_chunk_tokens\": %lld,\n  \"rows\": [\n",
                 dtype.c_str(), base.element_bytes, sp ? "true" : "false", base.budget_bytes,
                 base.workspace_limit_bytes, (long long)base.origin_chunk_tokens);
    for (std::size_t k = 0; k < rows.size(); ++k) json_row(f, rows[k], k + 1 == rows.size());
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
