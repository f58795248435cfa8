#pragma once
// A small SVG line-plot writer for the benchmarks (no plotting dependency).
//
//   lce_bench::line_plot plot;
//   plot.title = "Peak memory, H = 1024, V = 32000";
//   plot.x_label = "tokens", plot.y_label = "MiB";
//   plot.x_log2 = true;                                    // optional: log2 x axis
//   plot.add("materialised", {{1024, 130}, {2048, 260}});
//   plot.add("lce", {{1024, 60}, {2048, 62}}, /*dashed*/ false);
//   plot.write("docs/plots/memory.svg");                  // false if the file cannot be written
//
// Axes start at 0 on y (or the data's minimum when it is negative), ticks are
// 1-2-5 steps; x ticks are the data's x values on a log2 axis. Colours are a
// fixed palette, so the same series keeps its colour across plots.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace lce_bench {

struct series {
  std::string name;
  std::vector<std::pair<double, double>> points;
  bool dashed = false;
  int colour = -1;  // index into the palette; -1: the series' own position
};

class line_plot {
 public:
  std::string title, subtitle, x_label, y_label;
  bool x_log2 = false;
  int width = 760, height = 440;

  // colour: a palette index, so that e.g. a measured and a planned series share one (-1: the next)
  void add(std::string name, std::vector<std::pair<double, double>> points, bool dashed = false, int colour = -1) {
    std::sort(points.begin(), points.end());
    lines_.push_back({std::move(name), std::move(points), dashed, colour});
  }
  bool empty() const { return lines_.empty(); }

  std::string svg() const {
    static const char* palette[] = {"#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"};
    const double left = 78, right = 200, top = subtitle.empty() ? 44 : 60, bottom = 56;
    const double pw = width - left - right, ph = height - top - bottom;
    double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = 0, y1 = -x0;
    std::vector<double> xs;
    for (const series& s : lines_)
      for (auto [x, y] : s.points) {
        if (x_log2 && !(x > 0)) continue;
        x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
        xs.push_back(x);
      }
    if (!(x1 >= x0)) x0 = 0, x1 = 1;
    if (!(y1 > y0)) y1 = y0 + 1;
    auto fx = [&](double x) { return x_log2 ? std::log2(x) : x; };
    const double fx0 = fx(x0), fx1 = fx(x1) > fx(x0) ? fx(x1) : fx(x0) + 1;
    const double ystep = nice_step((y1 - y0) / 5);
    y1 = std::ceil(y1 / ystep) * ystep, y0 = std::floor(y0 / ystep) * ystep;
    auto px = [&](double x) { return left + (fx(x) - fx0) / (fx1 - fx0) * pw; };
    auto py = [&](double y) { return top + ph - (y - y0) / (y1 - y0) * ph; };

    std::string out;
    out += fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n",
               width, height, width, height);
    out += fmt("<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", width, height);
    out += fmt("<text x=\"%g\" y=\"22\" font-size=\"15\" font-weight=\"bold\">%s</text>\n", left, esc(title).c_str());
    if (!subtitle.empty())
      out += fmt("<text x=\"%g\" y=\"40\" font-size=\"11\" fill=\"#555\">%s</text>\n", left, esc(subtitle).c_str());
    // grid and y ticks
    for (double y = y0; y <= y1 + ystep * 1e-9; y += ystep) {
      out += fmt("<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#e5e5e5\"/>\n", left, py(y), left + pw, py(y));
      out += fmt("<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", left - 6, py(y) + 4, num(y).c_str());
    }
    // x ticks: the data's x values on a log axis, else 1-2-5 steps
    std::vector<double> ticks;
    if (x_log2) {
      std::sort(xs.begin(), xs.end());
      xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
      ticks = xs;
    } else {
      const double xstep = nice_step((x1 - x0) / 6);
      for (double x = std::ceil(x0 / xstep) * xstep; x <= x1 + xstep * 1e-9; x += xstep) ticks.push_back(x);
    }
    for (double x : ticks) {
      out += fmt("<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#e5e5e5\"/>\n", px(x), top, px(x), top + ph);
      out += fmt("<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%s</text>\n", px(x), top + ph + 16, num(x).c_str());
    }
    out += fmt("<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"#333\"/>\n", left, top, pw, ph);
    out += fmt("<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%s</text>\n", left + pw / 2, top + ph + 38,
               esc(x_label).c_str());
    out += fmt("<text transform=\"translate(%g,%g) rotate(-90)\" text-anchor=\"middle\">%s</text>\n", 22.0,
               top + ph / 2, esc(y_label).c_str());
    // lines, markers, legend
    for (std::size_t k = 0; k < lines_.size(); ++k) {
      const series& s = lines_[k];
      const std::size_t index = s.colour >= 0 ? static_cast<std::size_t>(s.colour) : k;
      const char* colour = palette[index % (sizeof palette / sizeof *palette)];
      std::string path;
      for (auto [x, y] : s.points) {
        if (x_log2 && !(x > 0)) continue;
        path += fmt("%s%.1f,%.1f", path.empty() ? "" : " ", px(x), py(y));
      }
      out += fmt("<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s/>\n", path.c_str(), colour,
                 s.dashed ? " stroke-dasharray=\"6,4\"" : "");
      for (auto [x, y] : s.points)
        if (!x_log2 || x > 0)
          out += fmt("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", px(x), py(y), colour);
      const double ly = top + 10 + 20.0 * static_cast<double>(k);
      out += fmt("<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" stroke-width=\"2\"%s/>\n", left + pw + 12, ly,
                 left + pw + 36, ly, colour, s.dashed ? " stroke-dasharray=\"6,4\"" : "");
      out += fmt("<text x=\"%g\" y=\"%g\">%s</text>\n", left + pw + 42, ly + 4, esc(s.name).c_str());
    }
    out += "</svg>\n";
    return out;
  }

  bool write(const std::string& path) const {
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return false;
    const std::string text = svg();
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    return std::fclose(f) == 0 && ok;
  }

 private:
  std::vector<series> lines_;

  template <class... A>
  static std::string fmt(const char* format, A... args) {
    const int n = std::snprintf(nullptr, 0, format, args...);
    std::string s(static_cast<std::size_t>(n > 0 ? n : 0), '\0');
    std::snprintf(s.data(), s.size() + 1, format, args...);
    return s;
  }
  static double nice_step(double raw) {
    if (!(raw > 0)) return 1;
    const double p = std::pow(10.0, std::floor(std::log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }
  static std::string num(double v) {
    char buf[32];
    const double a = std::fabs(v);
    if (a >= 1e6 && std::fmod(a, 1024.0 * 1024) == 0) std::snprintf(buf, sizeof buf, "%gM", v / (1024.0 * 1024));
    else if (a >= 1e4 && std::fmod(a, 1024.0) == 0) std::snprintf(buf, sizeof buf, "%gK", v / 1024.0);
    else std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
  }
  static std::string esc(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '&') out += "&amp;";
      else if (c == '<') out += "&lt;";
      else if (c == '>') out += "&gt;";
      else if (c == '"') out += "&quot;";
      else out += c;
    }
    return out;
  }
};

}  // namespace lce_bench
