//! The SVG plot of warm-turn TTFT per turn (`compare`'s agent-loop chart).

use std::fmt::Write;

/// A line chart (SVG) of TTFT per turn, one line per series.
pub fn svg(title: &str, series: &[(String, Vec<(usize, f64)>)]) -> String {
    let (w, h, left, bottom, top, right) = (640.0, 360.0, 60.0, 40.0, 40.0, 130.0);
    let max_turn = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(t, _)| *t))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let max_y = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
        .fold(0.1, f64::max)
        * 1.1;
    let x = |t: f64| left + t / max_turn * (w - left - right);
    let y = |v: f64| top + (1.0 - v / max_y) * (h - top - bottom);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"20\" font-size=\"14\">{title}</text>\n"
    );
    let _ = writeln!(
        out,
        "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        y(0.0),
        w - right,
        y(0.0)
    );
    let _ = writeln!(
        out,
        "<line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>",
        y(0.0)
    );
    for i in 0..=4 {
        let v = max_y * i as f64 / 4.0;
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.1} s</text>",
            left - 6.0,
            y(v) + 4.0
        );
    }
    for t in 0..=max_turn as usize {
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{t}</text>",
            x(t as f64),
            y(0.0) + 16.0
        );
    }
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">turn (0 = cold first turn)</text>",
        (left + w - right) / 2.0,
        h - 6.0
    );
    for (i, (name, points)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let pts: Vec<String> = points
            .iter()
            .map(|(t, v)| format!("{:.1},{:.1}", x(*t as f64), y(*v)))
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            pts.join(" ")
        );
        for (t, v) in points {
            let _ = writeln!(
                out,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{c}\"/>",
                x(*t as f64),
                y(*v)
            );
        }
        let ly = top + 20.0 * i as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{c}\" stroke-width=\"2\"/>",
            w - right + 10.0,
            w - right + 30.0
        );
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\">{name}</text>",
            w - right + 36.0,
            ly + 4.0
        );
    }
    out.push_str("</svg>\n");
    out
}
