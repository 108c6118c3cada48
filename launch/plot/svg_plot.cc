#include "launch/plot/svg_plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace moerun::plot {

namespace {

// Colors that stay apart for the color-blind (Okabe-Ito), in the series' order.
constexpr const char* kColors[] = {"#E69F00", "#0072B2", "#009E73", "#CC79A7",
                                   "#D55E00", "#56B4E9", "#F0E442", "#000000"};
constexpr int kNumColors = sizeof(kColors) / sizeof(kColors[0]);
const char* Color(size_t i) { return kColors[i % kNumColors]; }

constexpr const char* kFont = "font-family=\"DejaVu Sans, Arial, Helvetica, sans-serif\"";

// Coordinates: one decimal, "-0.0" never.
std::string C(double v) {
  if (std::fabs(v) < 0.05) v = 0;
  return fmt::format("{:.1f}", v);
}

// A value as data-value keeps: shortest round trip.
std::string V(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{}", v);
}

double Drawn(double v) { return std::isfinite(v) && v > 0 ? v : 0.0; }

// An axis from lo to top in steps of step (nice numbers: 1, 2, 2.5, 5 times a power of 10), at
// most about `ticks` steps, covering [lo, hi].
struct Axis {
  double lo = 0, top = 1, step = 0.2;
};

double NiceStep(double raw) {
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * p >= raw * (1 - 1e-9)) return m * p;
  }
  return 10 * p;
}

Axis NiceAxis(double lo, double hi, int ticks) {
  Axis a;
  if (!std::isfinite(lo) || !std::isfinite(hi) || hi < lo) lo = 0, hi = 0;
  if (hi - lo <= 0) {
    if (hi == 0) return a;  // 0..1
    lo = std::min(lo, 0.0);
    hi = std::max(hi, 0.0);
    if (hi - lo <= 0) return a;
  }
  a.step = NiceStep((hi - lo) / ticks);
  a.lo = std::floor(lo / a.step + 1e-9) * a.step;
  a.top = std::ceil(hi / a.step - 1e-9) * a.step;
  if (a.top <= a.lo) a.top = a.lo + a.step;
  return a;
}

// The ticks of an axis (the values, computed from integers so that they print cleanly).
std::vector<double> Ticks(const Axis& a) {
  std::vector<double> t;
  const long n = std::lround((a.top - a.lo) / a.step);
  for (long i = 0; i <= n && i <= 100; ++i) t.push_back(a.lo + static_cast<double>(i) * a.step);
  return t;
}

void Text(std::string* out, double x, double y, const std::string& text, int size,
          const char* anchor, const std::string& extra = "") {
  *out += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"{}\" text-anchor=\"{}\"{}>{}</text>\n",
                      C(x), C(y), size, anchor, extra, XmlEscape(text));
}

void Line(std::string* out, double x1, double y1, double x2, double y2, const char* stroke,
          double width = 1) {
  *out += fmt::format(
      "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"{}\"/>\n", C(x1),
      C(y1), C(x2), C(y2), stroke, C(width));
}

// The legend, left to right from (x, y): a swatch and the name per series. Returns its width.
double Legend(std::string* out, double x, double y, const std::vector<std::string>& names,
              bool lines, const std::vector<bool>& dashed = {}) {
  const double x0 = x;
  for (size_t i = 0; i < names.size(); ++i) {
    if (lines && i < dashed.size() && dashed[i]) {
      *out += fmt::format(
          "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2.5\" "
          "stroke-dasharray=\"6 4\"/>\n",
          C(x), C(y - 4), C(x + 18), C(y - 4), Color(i));
    } else if (lines) {
      Line(out, x, y - 4, x + 18, y - 4, Color(i), 2.5);
    } else {
      *out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"11\" fill=\"{}\"/>\n",
                          C(x + 2), C(y - 10), Color(i));
    }
    Text(out, x + 23, y, names[i], 12, "start", " class=\"legend\"");
    x += 23 + 7.5 * static_cast<double>(names[i].size()) + 18;
  }
  return x - x0;
}

std::string Header(double w, double h) {
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "{}>\n<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n",
      C(w), C(h), C(w), C(h), kFont, C(w), C(h));
}

// Bar panel geometry.
constexpr double kLeft = 58, kRight = 14, kTop = 26, kBottom = 44, kPlotH = 150;

}  // namespace

std::string XmlEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 (but tab and newline are).
        if (static_cast<unsigned char>(ch) < 0x20 && ch != '\t' && ch != '\n') {
          out += ' ';
        } else {
          out += ch;
        }
    }
  }
  return out;
}

std::string TickLabel(double v) {
  if (!std::isfinite(v)) return V(v);
  const double a = std::fabs(v);
  auto trim = [](std::string s) {
    if (s.find('.') != std::string::npos) {
      while (s.back() == '0') s.pop_back();
      if (s.back() == '.') s.pop_back();
    }
    return s == "-0" ? std::string("0") : s;
  };
  if (a >= 1e9) return trim(fmt::format("{:.2f}", v / 1e9)) + "G";
  if (a >= 1e6) return trim(fmt::format("{:.2f}", v / 1e6)) + "M";
  if (a >= 1e4) return trim(fmt::format("{:.2f}", v / 1e3)) + "k";
  if (a >= 100 || a == 0) return trim(fmt::format("{:.0f}", v));
  if (a >= 1) return trim(fmt::format("{:.2f}", v));
  return trim(fmt::format("{:.4f}", v));
}

std::string BarGridSvg(const BarGrid& g) {
  size_t most_categories = 1;
  for (const BarPanel& p : g.panels)
    most_categories = std::max(most_categories, p.categories.size());
  const size_t nseries = std::max<size_t>(1, g.series_names.size());
  // Each category gets a group of bars (at least 3 px each) and a gap.
  // Many panels: narrower bars, so that more panels fit side by side.
  const double group_w = g.panels.size() > 4 ? 3.5 * static_cast<double>(nseries) + 1
                                             : 5.0 * static_cast<double>(nseries) + 4;
  const double plot_w = std::clamp(group_w * static_cast<double>(most_categories), 200.0, 1000.0);
  const double panel_w = kLeft + plot_w + kRight;
  const double panel_h = kTop + kPlotH + kBottom;
  const size_t n = std::max<size_t>(1, g.panels.size());
  size_t cols = g.columns > 0 ? static_cast<size_t>(g.columns)
                              : static_cast<size_t>(std::ceil(std::sqrt(static_cast<double>(n))));
  // The title's width (bold 17 px: about 10 px a character; UTF-8 bytes overcount a little),
  // the subtitle's (13 px: about 7.5).
  const double title_w = std::max(10.0 * static_cast<double>(g.title.size()),
                                  7.5 * static_cast<double>(g.subtitle.size())) +
                         40;
  if (g.columns <= 0) {
    cols = std::max<size_t>(1, std::min(cols, static_cast<size_t>(1800 / panel_w)));
  }
  cols = std::min(cols, n);
  const size_t rows = (n + cols - 1) / cols;
  const double head = g.subtitle.empty() ? 74 : 92;  // the title(s) and the legend
  const double width = std::max({panel_w * static_cast<double>(cols) + 20, title_w, 420.0});
  const double height = head + panel_h * static_cast<double>(rows) + 10;

  std::string out = Header(width, height);
  Text(&out, width / 2, 26, g.title, 17, "middle", " font-weight=\"bold\" class=\"title\"");
  if (!g.subtitle.empty()) {
    Text(&out, width / 2, 46, g.subtitle, 13, "middle", " class=\"subtitle\"");
  }
  {
    // The legend centred under the title (its width estimated as Legend lays it out).
    double w = 0;
    for (const std::string& s : g.series_names) w += 23 + 7.5 * static_cast<double>(s.size()) + 18;
    Legend(&out, std::max(10.0, (width - w) / 2), g.subtitle.empty() ? 52 : 70, g.series_names,
           false);
  }
  for (size_t pi = 0; pi < g.panels.size(); ++pi) {
    const BarPanel& p = g.panels[pi];
    const double ox = (width - panel_w * static_cast<double>(cols)) / 2 +
                      panel_w * static_cast<double>(pi % cols);
    const double oy = head + panel_h * static_cast<double>(pi / cols);
    const double x0 = ox + kLeft, y0 = oy + kTop, y1 = y0 + kPlotH;
    double hi = 0;
    for (const auto& s : p.values) {
      for (double v : s) hi = std::max(hi, Drawn(v));
    }
    const Axis ax = NiceAxis(0, hi, 4);
    auto ypos = [&](double v) { return y1 - (Drawn(v) - ax.lo) / (ax.top - ax.lo) * kPlotH; };
    out += fmt::format("<g class=\"panel\" data-panel=\"{}\">\n", pi);
    Text(&out, x0 + plot_w / 2, oy + 17, p.title, 13, "middle", " class=\"panel-title\"");
    for (double t : Ticks(ax)) {
      const double y = ypos(t);
      Line(&out, x0, y, x0 + plot_w, y, "#e0e0e0");
      Line(&out, x0 - 4, y, x0, y, "#333333");
      Text(&out, x0 - 6, y + 4, TickLabel(t), 10, "end");
    }
    const size_t ncat = p.categories.size();
    const double slot = ncat > 0 ? plot_w / static_cast<double>(ncat) : plot_w;
    const double bar_w = slot * 0.8 / static_cast<double>(nseries);
    // Category labels: as many as fit (about 26 px each), evenly thinned, the last one kept.
    const size_t fit = std::max<size_t>(1, static_cast<size_t>(plot_w / 26));
    const size_t stride = std::max<size_t>(1, (ncat + fit - 1) / fit);
    for (size_t c = 0; c < ncat; ++c) {
      const double cx = x0 + slot * static_cast<double>(c);
      for (size_t s = 0; s < nseries; ++s) {
        const double v = s < p.values.size() && c < p.values[s].size() ? p.values[s][c] : 0.0;
        const double y = ypos(v);
        out += fmt::format(
            "<rect class=\"bar\" data-series=\"{}\" data-category=\"{}\" data-value=\"{}\" "
            "x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>\n",
            s, c, V(v), C(cx + slot * 0.1 + bar_w * static_cast<double>(s)), C(y),
            fmt::format("{:.2f}", bar_w), C(y1 - y), Color(s));
      }
      if (c % stride == 0 || (c + 1 == ncat && c % stride >= stride / 2 + 1)) {
        Line(&out, cx + slot / 2, y1, cx + slot / 2, y1 + 3, "#333333");
        Text(&out, cx + slot / 2, y1 + 14, p.categories[c], 10, "middle");
      }
    }
    Line(&out, x0, y0, x0, y1, "#333333");
    Line(&out, x0, y1, x0 + plot_w, y1, "#333333");
    Text(&out, x0 + plot_w / 2, y1 + 32, g.x_label, 11, "middle", " class=\"x-label\"");
    Text(&out, ox + 14, y0 + kPlotH / 2, g.y_label, 11, "middle",
         fmt::format(" class=\"y-label\" transform=\"rotate(-90 {} {})\"", C(ox + 14),
                     C(y0 + kPlotH / 2)));
    out += "</g>\n";
  }
  out += "</svg>\n";
  return out;
}

std::string LineFigureSvg(const LineFigure& f) {
  constexpr double left = 74, right = 24, top = 30, plot_h = 240, bottom = 50, legend_h = 24;
  constexpr double plot_w = 820;
  const double chart_h = top + legend_h + plot_h + bottom;
  const double width = left + plot_w + right + 20;
  const double head = 40;
  const double height =
      head + chart_h * static_cast<double>(std::max<size_t>(1, f.charts.size())) + 10;
  std::string out = Header(width, height);
  Text(&out, width / 2, 26, f.title, 17, "middle", " font-weight=\"bold\" class=\"title\"");
  for (size_t ci = 0; ci < f.charts.size(); ++ci) {
    const LineChart& ch = f.charts[ci];
    const double oy = head + chart_h * static_cast<double>(ci);
    const double x0 = 10 + left, y0 = oy + top + legend_h, y1 = y0 + plot_h;
    // Where a point's x lands on the axis (log10 with log_x), and whether it is drawn.
    auto xv = [&](double x) { return ch.log_x ? std::log10(x) : x; };
    auto drawn = [&](double x, double y) {
      return std::isfinite(x) && std::isfinite(y) && (!ch.log_x || x > 0);
    };
    double xlo = INFINITY, xhi = -INFINITY, yhi = 0, ylo = 0;
    for (const LineSeries& s : ch.series) {
      for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
        if (!drawn(s.x[i], s.y[i])) continue;
        xlo = std::min(xlo, xv(s.x[i])), xhi = std::max(xhi, xv(s.x[i]));
        yhi = std::max(yhi, s.y[i]), ylo = std::min(ylo, s.y[i]);
      }
    }
    if (!(xlo <= xhi)) xlo = 0, xhi = 1;
    if (xhi == xlo) xlo -= 0.5, xhi += 0.5;
    Axis xa = NiceAxis(xlo, xhi, 8);
    if (ch.log_x) xa = {std::floor(xlo), std::max(std::ceil(xhi), std::floor(xlo) + 1), 1.0};
    const Axis ya = NiceAxis(ylo, yhi, 5);
    auto xpos = [&](double v) { return x0 + (xv(v) - xa.lo) / (xa.top - xa.lo) * plot_w; };
    auto ypos = [&](double v) { return y1 - (v - ya.lo) / (ya.top - ya.lo) * plot_h; };
    out += fmt::format("<g class=\"chart\" data-chart=\"{}\">\n", ci);
    Text(&out, x0 + plot_w / 2, oy + top - 6, ch.title, 14, "middle", " class=\"chart-title\"");
    std::vector<std::string> names;
    std::vector<bool> dashed;
    for (const LineSeries& s : ch.series) names.push_back(s.name), dashed.push_back(s.dashed);
    Legend(&out, x0 + 4, oy + top + 14, names, true, dashed);
    for (double t : Ticks(ya)) {
      const double y = ypos(t);
      Line(&out, x0, y, x0 + plot_w, y, "#e0e0e0");
      Line(&out, x0 - 4, y, x0, y, "#333333");
      Text(&out, x0 - 7, y + 4, TickLabel(t), 11, "end");
    }
    for (double t : Ticks(xa)) {
      const double v = ch.log_x ? std::pow(10.0, t) : t;
      const double x = xpos(v);
      Line(&out, x, y1, x, y1 + 4, "#333333");
      Text(&out, x, y1 + 17, TickLabel(v), 11, "middle");
    }
    Line(&out, x0, y0, x0, y1, "#333333");
    Line(&out, x0, y1, x0 + plot_w, y1, "#333333");
    for (size_t n = ch.series.size(); n-- > 0;) {
      const size_t si = n;
      const LineSeries& s = ch.series[si];
      std::string pts;
      size_t npts = 0;
      for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
        if (!drawn(s.x[i], s.y[i])) continue;
        if (!pts.empty()) pts += ' ';
        pts += C(xpos(s.x[i])) + "," + C(ypos(s.y[i]));
        ++npts;
      }
      out += fmt::format(
          "<polyline class=\"line\" data-series=\"{}\" data-points=\"{}\" points=\"{}\" "
          "fill=\"none\" stroke=\"{}\" stroke-width=\"2\" stroke-linejoin=\"round\"{}/>\n",
          si, npts, pts, Color(si), s.dashed ? " stroke-dasharray=\"6 4\"" : "");
      if (npts <= 40) {  // few points: each one marked
        for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
          if (!drawn(s.x[i], s.y[i])) continue;
          out += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"{}\"/>\n", C(xpos(s.x[i])),
                             C(ypos(s.y[i])), Color(si));
        }
      }
    }
    Text(&out, x0 + plot_w / 2, y1 + 38, ch.x_label, 12, "middle", " class=\"x-label\"");
    Text(&out, 24, y0 + plot_h / 2, ch.y_label, 12, "middle",
         fmt::format(" class=\"y-label\" transform=\"rotate(-90 24 {})\"", C(y0 + plot_h / 2)));
    out += "</g>\n";
  }
  out += "</svg>\n";
  return out;
}

Status CheckSvgPath(const std::string& flag, const std::string& path) {
  std::error_code ec;
  if (path.empty()) return Status::InvalidArgument(flag + " needs a file name");
  if (std::filesystem::is_directory(path, ec)) {
    return Status::InvalidArgument(flag + " " + path + " is a folder, not a file");
  }
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
    return Status::NotFound(flag + " " + path + ": no such folder " + dir.string());
  }
  return Status::Ok();
}

Status WriteSvg(const std::string& path, const std::string& svg) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::IoError(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
  out << svg;
  out.close();
  if (!out) return Status::IoError(fmt::format("cannot write {}", path));
  return Status::Ok();
}

}  // namespace moerun::plot
