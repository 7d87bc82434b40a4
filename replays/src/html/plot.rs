//! Drift plots: max |Δlogit| and KL on log scales, top-1 agreement on a
//! linear one, one line per series, the divergence step marked — drawn with
//! plotters' SVG backend (no font files: its text becomes SVG `<text>`).
//!
//! Log scales cannot show 0 (bit-identical rows); such points are drawn on
//! the panel's floor, and the caption says so. Each panel's pixel and data
//! ranges are returned with the SVG so the page's hover script can map the
//! pointer back to a step.

use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use super::{Drift, DriftPoint, HtmlError};

/// Width of the standalone `--svg` plot (pastes into an issue).
pub const SVG_WIDTH: u32 = 720;
/// Width of the page's plot.
pub const PAGE_WIDTH: u32 = 1100;
const PANEL_H: u32 = 170;

pub(crate) const PALETTE: [RGBColor; 7] = [
    RGBColor(90, 90, 90),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

/// Where one panel sits, for the hover script.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Panel {
    pub metric: &'static str,
    pub log: bool,
    /// Plotting area in SVG pixels.
    pub px: (i32, i32),
    pub py: (i32, i32),
    /// Data ranges (x: steps; y: values, log10 applied by the script when `log`).
    pub x: (f64, f64),
    pub y: (f64, f64),
}

/// A drawn plot.
#[derive(Debug, Clone)]
pub struct PlotSvg {
    pub svg: String,
    pub panels: Vec<Panel>,
    pub width: u32,
    pub height: u32,
}

fn err(e: impl std::fmt::Display) -> HtmlError {
    HtmlError::Plot(e.to_string())
}

/// Whether any point moved at all.
pub fn has_drift(d: &Drift) -> bool {
    d.series
        .iter()
        .flat_map(|s| &s.points)
        .any(|p| p.max_abs_dlogit > 0.0 || p.kl > 0.0 || p.top1_agreement < 1.0)
}

/// The three panels; without drift data (or with none that moved), one line
/// of text saying why.
pub fn drift_svg(d: Option<&Drift>, width: u32) -> Result<PlotSvg, HtmlError> {
    let note = match d {
        None => Some(
            "no drift data: the replay ran no second engine (same patch set as the \
             recording, or the oracle, which compares digests)",
        ),
        Some(d) if !has_drift(d) => Some("no drift: every compared logits row is bit-identical"),
        Some(_) => None,
    };
    let mut svg = String::new();
    let mut panels = Vec::new();
    let height = if note.is_some() { 40 } else { PANEL_H * 3 };
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        match (d, note) {
            (Some(d), None) => {
                let areas = root.split_evenly((3, 1));
                panels.push(panel(&areas[0], d, Metric::MaxAbs, true)?);
                panels.push(panel(&areas[1], d, Metric::Kl, false)?);
                panels.push(panel(&areas[2], d, Metric::Top1, false)?);
            }
            (_, note) => {
                root.draw(&Text::new(
                    note.unwrap_or_default().to_string(),
                    (10, 14),
                    ("sans-serif", 14).into_font(),
                ))
                .map_err(err)?;
            }
        }
        root.present().map_err(err)?;
    }
    Ok(PlotSvg {
        svg,
        panels,
        width,
        height,
    })
}

#[derive(Clone, Copy)]
enum Metric {
    MaxAbs,
    Kl,
    Top1,
}

impl Metric {
    fn value(self, p: &DriftPoint) -> f64 {
        match self {
            Metric::MaxAbs => p.max_abs_dlogit as f64,
            Metric::Kl => p.kl,
            Metric::Top1 => p.top1_agreement,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Metric::MaxAbs => "max |Δlogit|",
            Metric::Kl => "KL(expected ‖ actual)",
            Metric::Top1 => "top-1 agreement",
        }
    }
    fn key(self) -> &'static str {
        match self {
            Metric::MaxAbs => "max_abs_dlogit",
            Metric::Kl => "kl",
            Metric::Top1 => "top1_agreement",
        }
    }
}

fn panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    d: &Drift,
    metric: Metric,
    legend: bool,
) -> Result<Panel, HtmlError> {
    let x = (d.first_step as f64, d.last_step as f64 + 1.0);
    let bucket = if d.bucket > 1 {
        format!(", max per {} steps", d.bucket)
    } else {
        String::new()
    };
    let values = || {
        d.series
            .iter()
            .flat_map(|s| s.points.iter().map(move |p| metric.value(p)))
    };
    let mut builder = ChartBuilder::on(area);
    builder
        .margin(6)
        .margin_right(16)
        .x_label_area_size(22)
        .y_label_area_size(64);
    let style = |i: usize| PALETTE[i % PALETTE.len()].stroke_width(if i == 0 { 2 } else { 1 });
    let few = d.series.first().map_or(0, |s| s.points.len()) <= 60;
    let geometry;
    let y;
    let log;
    match metric {
        Metric::Top1 => {
            y = (0.0, 1.05);
            log = false;
            let mut c = builder
                .caption(format!("{}{bucket}", metric.name()), ("sans-serif", 14))
                .build_cartesian_2d(x.0..x.1, y.0..y.1)
                .map_err(err)?;
            c.configure_mesh()
                .light_line_style(TRANSPARENT)
                .x_desc("step")
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| format!("{:.0}%", v * 100.0))
                .draw()
                .map_err(err)?;
            for (i, s) in d.series.iter().enumerate() {
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|p| (p.step as f64, metric.value(p)))
                    .collect();
                c.draw_series(LineSeries::new(pts.clone(), style(i)))
                    .map_err(err)?;
                if few {
                    c.draw_series(pts.iter().map(|&p| Circle::new(p, 2, style(i).filled())))
                        .map_err(err)?;
                }
            }
            if let Some(m) = d.marker {
                c.draw_series(LineSeries::new(
                    [(m as f64, y.0), (m as f64, y.1)],
                    RED.stroke_width(2),
                ))
                .map_err(err)?;
            }
            geometry = c.plotting_area().get_pixel_range();
        }
        Metric::MaxAbs | Metric::Kl => {
            log = true;
            let max = values().fold(0.0f64, f64::max);
            let min_pos = values().filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
            let floor = if min_pos.is_finite() {
                10f64.powf((min_pos / 2.0).log10().floor())
            } else {
                1e-9
            };
            let top = if max > 0.0 {
                10f64.powf((max * 1.5).log10().ceil())
            } else {
                floor * 100.0
            };
            y = (floor, top);
            let mut c = builder
                .caption(
                    format!(
                        "{}{bucket} · log scale, 0 drawn on the floor",
                        metric.name()
                    ),
                    ("sans-serif", 14),
                )
                .build_cartesian_2d(x.0..x.1, (y.0..y.1).log_scale())
                .map_err(err)?;
            c.configure_mesh()
                .light_line_style(TRANSPARENT)
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| format!("{v:.0e}"))
                .draw()
                .map_err(err)?;
            for (i, s) in d.series.iter().enumerate() {
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|p| (p.step as f64, metric.value(p).max(floor)))
                    .collect();
                let drawn = c
                    .draw_series(LineSeries::new(pts.clone(), style(i)))
                    .map_err(err)?;
                if legend {
                    let col = PALETTE[i % PALETTE.len()];
                    drawn.label(s.name.clone()).legend(move |(lx, ly)| {
                        PathElement::new([(lx, ly), (lx + 16, ly)], col.stroke_width(2))
                    });
                }
                if few {
                    c.draw_series(pts.iter().map(|&p| Circle::new(p, 2, style(i).filled())))
                        .map_err(err)?;
                }
            }
            if let Some(m) = d.marker {
                c.draw_series(LineSeries::new(
                    [(m as f64, y.0), (m as f64, y.1)],
                    RED.stroke_width(2),
                ))
                .map_err(err)?
                .label(format!("first divergence (step {m})"))
                .legend(|(lx, ly)| {
                    PathElement::new([(lx, ly), (lx + 16, ly)], RED.stroke_width(2))
                });
            }
            if legend {
                c.configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK.mix(0.3))
                    .label_font(("sans-serif", 12))
                    .draw()
                    .map_err(err)?;
            }
            geometry = c.plotting_area().get_pixel_range();
        }
    }
    Ok(Panel {
        metric: metric.key(),
        log,
        px: (geometry.0.start, geometry.0.end),
        py: (geometry.1.start, geometry.1.end),
        x,
        y,
    })
}
