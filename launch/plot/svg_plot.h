// Charts as standalone SVG text, from our own small writer (no dependency): grouped bar charts
// (one small chart per panel, the panels in a grid: per-rank load before and after a rebalance,
// one panel per layer) and line charts (series over x, the charts stacked: latency and
// throughput over a benchmark's run). The output is deterministic (same input, same bytes), every
// text is XML-escaped, and it stays readable from 1 bar to 64 per series and from 1 panel to
// dozens (the grid grows; tick labels thin out). All-zero or empty data draws empty axes.
//
// Every bar is a <rect class="bar" data-series="S" data-category="C" data-value="V">, every line a
// <polyline class="line" data-series="S">, so that tests (and people) can read the numbers back.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace moerun::plot {

// One panel of a grouped bar chart: values[s][c] is series s's bar in category c (missing
// values are 0; NaN and negative values are drawn as 0 but kept in data-value).
struct BarPanel {
  std::string title;                    // e.g. "layer 3: 0.41 -> 0.97"
  std::vector<std::string> categories;  // x: e.g. "1", "2" (expert ranks)
  std::vector<std::vector<double>> values;
};

struct BarGrid {
  std::string title;                      // the whole figure's
  std::string subtitle;                   // a second line under it (optional)
  std::string x_label, y_label;           // the same for every panel
  std::vector<std::string> series_names;  // the legend, e.g. "before", "after"
  std::vector<BarPanel> panels;
  int columns = 0;  // panels per row; 0: chosen from the number of panels
};

struct LineSeries {
  std::string name;
  std::vector<double> x, y;  // same length; points with a non-finite value are skipped
  bool dashed = false;
};
// The series are drawn last to first: the first one is on top where lines overlap.

struct LineChart {
  std::string title, x_label, y_label;
  std::vector<LineSeries> series;
  bool log_x = false;  // x on a log10 scale (ticks at powers of 10); x <= 0 skipped
};

// The charts stacked top to bottom in one figure (each its own axes and legend).
struct LineFigure {
  std::string title;
  std::vector<LineChart> charts;
};

std::string BarGridSvg(const BarGrid& grid);
std::string LineFigureSvg(const LineFigure& figure);

// The text of a tick: "0", "2.5", "40", "1.2k", "3M" (short, for axes).
std::string TickLabel(double v);
// Text safe inside XML elements and attributes (& < > " ').
std::string XmlEscape(const std::string& text);

// Before a run that ends in writing path (flag: "--plot", for the message): InvalidArgument when
// it is a folder, NotFound when its folder does not exist (both exit 2: the user's to fix).
Status CheckSvgPath(const std::string& flag, const std::string& path);

// Writes svg to path (replacing it); IoError naming the path when it cannot.
Status WriteSvg(const std::string& path, const std::string& svg);

}  // namespace moerun::plot
