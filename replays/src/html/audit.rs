//! The audit's drift plot: for each audited turn, the reference's
//! log-probability of every token the upstream chose (upper panel) and its
//! rank under the reference (lower panel, log scale, rank 1 at the floor),
//! against the token's position in the answer. A faithful upstream stays
//! near 0 nats and rank 1; a broken turn drops away at its first improbable
//! token.

use plotters::prelude::*;

use super::HtmlError;

/// The drift plot's colours, its grey (the reference's line there) left out.
fn colour(i: usize) -> RGBColor {
    let p = &super::plot::PALETTE[1..];
    p[i % p.len()]
}

/// One audited turn's line.
#[derive(Debug, Clone)]
pub struct AuditSeries {
    pub label: String,
    /// Reference log-probability of each output token.
    pub logprob: Vec<f64>,
    /// Its rank under the reference (1 = the reference's choice).
    pub rank: Vec<f64>,
}

fn err(e: impl std::fmt::Display) -> HtmlError {
    HtmlError::Plot(e.to_string())
}

/// The two panels as SVG.
pub fn audit_svg(series: &[AuditSeries]) -> Result<String, HtmlError> {
    let (w, h) = (900u32, 520u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let n = series
            .iter()
            .map(|s| s.logprob.len())
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        let lo = series
            .iter()
            .flat_map(|s| s.logprob.iter().copied())
            .filter(|v| v.is_finite())
            .fold(-1.0f64, f64::min)
            .floor();
        let max_rank = series
            .iter()
            .flat_map(|s| s.rank.iter().copied())
            .fold(10.0f64, f64::max);
        let areas = root.split_evenly((2, 1));
        let mut top = ChartBuilder::on(&areas[0])
            .margin(8)
            .margin_right(16)
            .caption(
                "reference logprob of each upstream token (nats)",
                ("sans-serif", 14),
            )
            .x_label_area_size(36)
            .y_label_area_size(54)
            .build_cartesian_2d(0.0..n, lo..0.5)
            .map_err(err)?;
        top.configure_mesh()
            .light_line_style(TRANSPARENT)
            .x_desc("output token")
            .draw()
            .map_err(err)?;
        for (i, s) in series.iter().enumerate() {
            let c = colour(i);
            let pts: Vec<(f64, f64)> = s
                .logprob
                .iter()
                .enumerate()
                .map(|(x, &y)| (x as f64, if y.is_finite() { y } else { lo }))
                .collect();
            top.draw_series(LineSeries::new(pts, c.stroke_width(1)))
                .map_err(err)?
                .label(s.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                });
        }
        top.configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(err)?;
        let mut bottom = ChartBuilder::on(&areas[1])
            .margin(8)
            .margin_right(16)
            .caption(
                "rank under the reference (1 = its choice; 6+ = below its top-5)",
                ("sans-serif", 14),
            )
            .x_label_area_size(36)
            .y_label_area_size(54)
            .build_cartesian_2d(0.0..n, (1.0..max_rank * 1.5).log_scale())
            .map_err(err)?;
        bottom
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .x_desc("output token")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(err)?;
        bottom
            .draw_series(LineSeries::new(
                [(0.0, 5.5), (n, 5.5)],
                RED.mix(0.5).stroke_width(1),
            ))
            .map_err(err)?;
        for (i, s) in series.iter().enumerate() {
            let c = colour(i);
            let pts: Vec<(f64, f64)> = s
                .rank
                .iter()
                .enumerate()
                .map(|(x, &y)| (x as f64, y))
                .collect();
            bottom
                .draw_series(pts.iter().map(|&p| Circle::new(p, 2, c.filled())))
                .map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}
