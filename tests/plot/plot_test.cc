// The SVG writer (launch/plot/svg_plot.h): the output is well-formed XML (checked by a small parser
// here: every tag closed in order, attributes quoted, entities only the five of XML), has one bar
// per (series, category) with the value it was given, bar heights that grow with the values,
// escaped text, identical bytes for identical input, and sane figures for 1 and 64 ranks, 1 and
// 61 layers, zero loads, empty series.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "launch/plot/svg_plot.h"

namespace moerun::plot {
namespace {

struct Element {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::string text;
};

// A strict little XML reader: fails the test on anything malformed; returns every element.
std::vector<Element> ParseXml(const std::string& s) {
  std::vector<Element> all;
  std::vector<std::string> open;
  size_t i = 0;
  auto check_entities = [&](const std::string& t) {
    for (size_t k = 0; k < t.size(); ++k) {
      if (t[k] == '<') ADD_FAILURE() << "raw < in text near " << k;
      if (t[k] == '&') {
        const size_t semi = t.find(';', k);
        EXPECT_NE(semi, std::string::npos);
        const std::string ent = t.substr(k, semi - k + 1);
        EXPECT_TRUE(ent == "&amp;" || ent == "&lt;" || ent == "&gt;" || ent == "&quot;" ||
                    ent == "&apos;")
            << ent;
      }
    }
  };
  if (s.rfind("<?xml", 0) == 0) i = s.find("?>") + 2;
  while (i < s.size()) {
    const size_t lt = s.find('<', i);
    if (lt == std::string::npos) {
      check_entities(s.substr(i));
      break;
    }
    const std::string text = s.substr(i, lt - i);
    check_entities(text);
    if (!all.empty() && !open.empty()) all.back().text += text;
    const size_t gt = s.find('>', lt);
    if (gt == std::string::npos) {
      ADD_FAILURE() << "unclosed tag at " << lt;
      return all;
    }
    std::string tag = s.substr(lt + 1, gt - lt - 1);
    i = gt + 1;
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) {
        ADD_FAILURE() << "</" << tag.substr(1) << "> closes " << (open.empty() ? "" : open.back());
        return all;
      }
      open.pop_back();
      continue;
    }
    const bool self_closing = tag.back() == '/';
    if (self_closing) tag.pop_back();
    Element e;
    size_t k = tag.find_first_of(" \n");
    e.name = tag.substr(0, k);
    while (k != std::string::npos && k < tag.size()) {
      k = tag.find_first_not_of(" \n", k);
      if (k == std::string::npos) break;
      const size_t eq = tag.find('=', k);
      if (eq == std::string::npos || eq + 1 >= tag.size() || tag[eq + 1] != '"') {
        ADD_FAILURE() << "bad attribute in <" << tag << ">";
        return all;
      }
      const size_t end = tag.find('"', eq + 2);
      if (end == std::string::npos) {
        ADD_FAILURE() << "unterminated attribute in <" << tag << ">";
        return all;
      }
      const std::string name = tag.substr(k, eq - k), value = tag.substr(eq + 2, end - eq - 2);
      check_entities(value);
      EXPECT_EQ(e.attrs.count(name), 0u) << "duplicate attribute " << name;
      e.attrs[name] = value;
      k = end + 1;
    }
    all.push_back(e);
    if (!self_closing) open.push_back(e.name);
  }
  EXPECT_TRUE(open.empty()) << "unclosed <" << (open.empty() ? "" : open.back()) << ">";
  EXPECT_FALSE(all.empty());
  if (!all.empty()) {
    EXPECT_EQ(all[0].name, "svg");
  }
  return all;
}

std::vector<Element> Named(const std::vector<Element>& all, const std::string& name,
                           const std::string& cls = "") {
  std::vector<Element> out;
  for (const Element& e : all) {
    if (e.name == name && (cls.empty() || (e.attrs.count("class") && e.attrs.at("class") == cls))) {
      out.push_back(e);
    }
  }
  return out;
}

BarGrid Grid(int layers, int ranks, double scale) {
  BarGrid g;
  g.title = "load <before> & after";
  g.x_label = "expert rank";
  g.y_label = "load";
  g.series_names = {"before", "after"};
  for (int l = 0; l < layers; ++l) {
    BarPanel p;
    p.title = "layer " + std::to_string(l);
    std::vector<double> before, after;
    for (int r = 0; r < ranks; ++r) {
      p.categories.push_back(std::to_string(r + 1));
      before.push_back(scale * (r + 1) * (l + 1));
      after.push_back(scale * 10);
    }
    p.values = {before, after};
    g.panels.push_back(p);
  }
  return g;
}

double Num(const Element& e, const std::string& a) { return std::stod(e.attrs.at(a)); }

TEST(PlotTest, BarsOnePerRankAndSeriesWithTheirValues) {
  for (auto [layers, ranks] : {std::pair{1, 1}, {3, 8}, {61, 8}, {2, 64}, {61, 64}}) {
    SCOPED_TRACE(std::to_string(layers) + " layers x " + std::to_string(ranks) + " ranks");
    const std::string svg = BarGridSvg(Grid(layers, ranks, 1.5));
    const auto all = ParseXml(svg);
    const auto bars = Named(all, "rect", "bar");
    ASSERT_EQ(bars.size(), static_cast<size_t>(layers * ranks * 2));
    EXPECT_EQ(Named(all, "g", "panel").size(), static_cast<size_t>(layers));
    // Layer 0's "before" bars: value (r+1)*1.5, heights growing with it; the bars inside the
    // figure.
    const double w = Num(all[0], "width"), h = Num(all[0], "height");
    double last_h = -1;
    for (int r = 0; r < ranks; ++r) {
      const Element& b = bars[static_cast<size_t>(2 * r)];
      EXPECT_EQ(b.attrs.at("data-series"), "0");
      EXPECT_EQ(b.attrs.at("data-category"), std::to_string(r));
      EXPECT_DOUBLE_EQ(Num(b, "data-value"), 1.5 * (r + 1));
      EXPECT_GT(Num(b, "height"), last_h);
      last_h = Num(b, "height");
    }
    for (const Element& b : bars) {
      EXPECT_GE(Num(b, "x"), 0);
      EXPECT_LE(Num(b, "x") + Num(b, "width"), w);
      EXPECT_GE(Num(b, "y"), 0);
      EXPECT_LE(Num(b, "y") + Num(b, "height"), h);
      EXPECT_GT(Num(b, "width"), 0.5);
    }
    // Tick labels of the x axis never more than fit: about one per 26 px of a panel.
    EXPECT_LE(Named(all, "text").size(), static_cast<size_t>(layers * (4 + 12 + 40) + 10));
  }
}

TEST(PlotTest, ProportionalHeightsWithinAPanel) {
  BarGrid g = Grid(1, 4, 1);
  g.panels[0].values = {{0, 25, 50, 100}, {100, 100, 100, 100}};
  const auto bars = Named(ParseXml(BarGridSvg(g)), "rect", "bar");
  ASSERT_EQ(bars.size(), 8u);
  const double full = Num(bars[6], "height");
  EXPECT_GT(full, 50);
  EXPECT_DOUBLE_EQ(Num(bars[0], "height"), 0);
  EXPECT_NEAR(Num(bars[2], "height"), full / 4, 0.2);
  EXPECT_NEAR(Num(bars[4], "height"), full / 2, 0.2);
  EXPECT_NEAR(Num(bars[7], "height"), full, 0.01);
}

TEST(PlotTest, ZeroAndMissingValuesDrawEmptyAxes) {
  BarGrid g = Grid(2, 3, 0);
  g.panels[1].values = {{}};  // missing: drawn as 0
  const auto all = ParseXml(BarGridSvg(g));
  const auto bars = Named(all, "rect", "bar");
  ASSERT_EQ(bars.size(), 12u);
  for (const Element& b : bars) EXPECT_DOUBLE_EQ(Num(b, "height"), 0);
  for (const Element& e : all) {
    for (const auto& [k, v] : e.attrs) {
      EXPECT_EQ(v.find("nan"), std::string::npos) << k;
      EXPECT_EQ(v.find("inf"), std::string::npos) << k;
    }
  }
  // No panel at all: still a well-formed figure.
  ParseXml(BarGridSvg(BarGrid{}));
}

TEST(PlotTest, TextIsEscapedAndOutputDeterministic) {
  BarGrid g = Grid(2, 2, 1);
  g.panels[0].categories[0] = "a<b>&\"c'";
  const std::string svg = BarGridSvg(g);
  ParseXml(svg);
  EXPECT_NE(svg.find("load &lt;before&gt; &amp; after"), std::string::npos);
  EXPECT_NE(svg.find("a&lt;b&gt;&amp;&quot;c&apos;"), std::string::npos);
  EXPECT_EQ(svg, BarGridSvg(g));
  EXPECT_EQ(XmlEscape("x\x01y"), "x y");
}

TEST(PlotTest, LinesOnePolylinePerSeriesSkippingGaps) {
  LineFigure f;
  f.title = "serve";
  LineChart lat{"latency",
                "t (s)",
                "ms",
                {{"p50", {0.5, 1.5, 2.5}, {1, 2, 3}}, {"p99", {0.5, 1.5, 2.5}, {2, NAN, 6}}}};
  LineChart thr{"throughput", "t (s)", "per second", {{"answers", {0.5, 1.5, 2.5}, {10, 0, 5}}}};
  f.charts = {lat, thr};
  const std::string svg = LineFigureSvg(f);
  const auto all = ParseXml(svg);
  const auto lines = Named(all, "polyline", "line");
  ASSERT_EQ(lines.size(), 3u);
  // Drawn last to first (the first series on top): p99, p50, then the throughput chart's.
  EXPECT_EQ(lines[0].attrs.at("data-series"), "1");
  EXPECT_EQ(lines[0].attrs.at("data-points"), "2");  // the NaN skipped
  EXPECT_EQ(lines[1].attrs.at("data-series"), "0");
  EXPECT_EQ(lines[1].attrs.at("data-points"), "3");
  EXPECT_EQ(lines[2].attrs.at("data-series"), "0");
  EXPECT_EQ(Named(all, "g", "chart").size(), 2u);
  // y grows upward: p50's points go up (smaller SVG y) from left to right.
  std::istringstream pts(lines[1].attrs.at("points"));
  double lx = -1, ly = 1e9, x, y;
  char comma;
  while (pts >> x >> comma >> y) {
    EXPECT_GT(x, lx);
    EXPECT_LT(y, ly);
    lx = x, ly = y;
  }
  EXPECT_EQ(svg, LineFigureSvg(f));
  // Empty charts and series: axes only.
  LineFigure empty;
  empty.charts = {LineChart{}, LineChart{"t", "x", "y", {{"none", {}, {}}}}};
  ParseXml(LineFigureSvg(empty));
  ParseXml(LineFigureSvg(LineFigure{}));
}

TEST(PlotTest, LogXSpacesDecadesEvenly) {
  LineFigure f;
  LineChart c{"t", "tokens", "us", {{"a", {1, 10, 100, 1000, 0}, {4, 3, 2, 1, 9}}}};
  c.log_x = true;
  f.charts = {c};
  const auto lines = Named(ParseXml(LineFigureSvg(f)), "polyline", "line");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].attrs.at("data-points"), "4");  // x = 0 has no place on a log axis
  std::istringstream pts(lines[0].attrs.at("points"));
  std::vector<double> xs;
  double x, y;
  char comma;
  while (pts >> x >> comma >> y) xs.push_back(x);
  ASSERT_EQ(xs.size(), 4u);
  EXPECT_NEAR(xs[1] - xs[0], xs[2] - xs[1], 0.11);
  EXPECT_NEAR(xs[2] - xs[1], xs[3] - xs[2], 0.11);
}

TEST(PlotTest, TickLabels) {
  EXPECT_EQ(TickLabel(0), "0");
  EXPECT_EQ(TickLabel(2.5), "2.5");
  EXPECT_EQ(TickLabel(40), "40");
  EXPECT_EQ(TickLabel(250), "250");
  EXPECT_EQ(TickLabel(12000), "12k");
  EXPECT_EQ(TickLabel(3e6), "3M");
  EXPECT_EQ(TickLabel(0.05), "0.05");
}

TEST(PlotTest, WritesAndReportsBadPaths) {
  char tmpl[] = "/tmp/moerun-plot-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::filesystem::path dir = tmpl;
  const std::string file = (dir / "x.svg").string();
  EXPECT_TRUE(CheckSvgPath("--plot", file).ok());
  ASSERT_TRUE(WriteSvg(file, "<svg/>").ok());
  std::ifstream in(file);
  std::string back;
  std::getline(in, back);
  EXPECT_EQ(back, "<svg/>");
  const Status folder = CheckSvgPath("--plot", dir.string());
  EXPECT_EQ(folder.code(), StatusCode::kInvalidArgument);
  const Status missing = CheckSvgPath("--plot", (dir / "no" / "x.svg").string());
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("no such folder"), std::string::npos);
  const Status unwritable = WriteSvg((dir / "no" / "x.svg").string(), "<svg/>");
  EXPECT_EQ(unwritable.code(), StatusCode::kIoError);
  EXPECT_NE(unwritable.message().find("x.svg"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moerun::plot
