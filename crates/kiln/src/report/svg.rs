//! Small, dependency-free SVG charts for the HTML report: line charts with axes, ticks and a
//! legend, and bar charts. Written by hand rather than with a plotting crate: the report needs
//! two chart kinds, and every dependency is build time for every user.

use std::fmt::Write;

const W: f64 = 640.0;
const H: f64 = 300.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 32.0;
const BOTTOM: f64 = 44.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The opening `<svg>` tag of a chart `W` wide and `height` high, with its title.
fn open_svg(title: &str, height: f64) -> String {
    format!(
        r#"<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" width="{W}" height="{height}" role="img" aria-label="{t}"><title>{t}</title><text x="{cx}" y="18" text-anchor="middle" font-size="14" font-weight="bold">{t}</text>"#,
        t = escape(title),
        cx = W / 2.0
    )
}

/// "Nice" tick values covering `[lo, hi]` (1, 2 or 5 × a power of ten apart).
fn ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let span = (hi - lo).abs().max(1e-12);
    let raw = span / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() * step;
    let mut out = Vec::new();
    let mut v = first;
    while v <= hi + step * 1e-9 {
        out.push(v);
        v += step;
    }
    out
}

fn label(v: f64) -> String {
    let a = v.abs();
    if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// A line chart of named series of (x, y) points.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(&str, Vec<(f64, f64)>)],
) -> String {
    let points: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|(_, p)| p.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let mut svg = open_svg(title, H);
    if points.is_empty() {
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">no data</text></svg>"#,
            W / 2.0,
            H / 2.0
        );
        return svg;
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in &points {
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y0 = y0.min(*y);
        y1 = y1.max(*y);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + y0.abs().max(1.0) * 0.1;
        y0 -= y0.abs().max(1.0) * 0.1;
    }
    // Start the y axis at zero when the data is not far from it: honest bars of change.
    if y0 > 0.0 && y0 < 0.5 * y1 {
        y0 = 0.0;
    }
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;
    let _ = write!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>"
    );
    for t in ticks(y0, y1, 5) {
        let y = sy(t);
        let _ = write!(
            svg,
            "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#eee\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" font-size=\"11\">{}</text>",
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            label(t)
        );
    }
    for t in ticks(x0, x1, 6) {
        let x = sx(t);
        let _ = write!(
            svg,
            "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{}\" y2=\"{}\" stroke=\"#999\"/><text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\" font-size=\"11\">{}</text>",
            TOP + ph,
            TOP + ph + 4.0,
            TOP + ph + 16.0,
            label(t)
        );
    }
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="12">{}</text><text transform="translate(14,{}) rotate(-90)" text-anchor="middle" font-size="12">{}</text>"#,
        LEFT + pw / 2.0,
        H - 8.0,
        escape(x_label),
        TOP + ph / 2.0,
        escape(y_label)
    );
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
            .collect();
        if path.len() == 1 {
            let _ = write!(
                svg,
                "<circle class=\"series\" cx=\"{}\" r=\"3\" fill=\"{color}\"/>",
                path[0].replace(',', "\" cy=\"")
            );
        } else {
            let _ = write!(
                svg,
                "<polyline class=\"series\" fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
                path.join(" ")
            );
        }
        let ly = TOP + 14.0 + 14.0 * i as f64;
        let _ = write!(
            svg,
            "<rect x=\"{}\" y=\"{:.1}\" width=\"10\" height=\"3\" fill=\"{color}\"/><text x=\"{}\" y=\"{:.1}\" font-size=\"11\">{}</text>",
            LEFT + pw - 150.0,
            ly - 4.0,
            LEFT + pw - 136.0,
            ly,
            escape(name)
        );
    }
    svg.push_str("</svg>");
    svg
}

/// A horizontal bar chart: one bar per label.
pub fn bar_chart(title: &str, value_label: &str, bars: &[(String, f64, bool)]) -> String {
    let rows = bars.len().max(1) as f64;
    let h = TOP + 22.0 * rows + BOTTOM;
    let max = bars.iter().map(|b| b.1).fold(0.0, f64::max).max(1e-9);
    let (left, pw) = (260.0, W - 260.0 - RIGHT - 60.0);
    let mut svg = open_svg(title, h);
    for (i, (name, value, highlight)) in bars.iter().enumerate() {
        let y = TOP + 22.0 * i as f64;
        let w = (value / max * pw).max(1.0);
        let color = if *highlight { "#2ca02c" } else { "#1f77b4" };
        let _ = write!(
            svg,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" font-size=\"11\">{}</text><rect class=\"series\" x=\"{left}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"16\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">{}</text>",
            left - 6.0,
            y + 12.0,
            escape(name),
            y,
            left + w + 4.0,
            y + 12.0,
            label(*value)
        );
    }
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="12">{}</text></svg>"#,
        left + pw / 2.0,
        h - 10.0,
        escape(value_label)
    );
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(0.13, 0.97, 4);
        assert!(t.first().is_some_and(|v| *v >= 0.13) && t.last().is_some_and(|v| *v <= 0.97));
    }

    #[test]
    fn charts_are_well_formed_svg_with_escaped_text() {
        let svg = line_chart(
            "loss <train>",
            "step",
            "loss",
            &[("a&b", vec![(1.0, 2.0), (2.0, 1.0)])],
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert!(svg.contains("loss &lt;train&gt;") && svg.contains("a&amp;b"));
        assert!(svg.contains("<polyline"));
        let bars = bar_chart("t", "samples/s", &[("x".into(), 3.0, true)]);
        assert!(bars.contains("<rect class=\"series\""));
    }
}
