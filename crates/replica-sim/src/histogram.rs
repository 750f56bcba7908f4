//! A Prometheus histogram in vLLM's TTFT buckets, rendered as text.

/// Cumulative buckets in vLLM's bounds.
#[derive(Default)]
pub struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

const TTFT_BOUNDS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

impl Histogram {
    pub fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; TTFT_BOUNDS.len()];
        }
        for (i, b) in TTFT_BOUNDS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn render(&self, name: &str, labels: &str) -> String {
        let mut out = format!("# TYPE {name} histogram\n");
        for (i, b) in TTFT_BOUNDS.iter().enumerate() {
            let c = self.counts.get(i).copied().unwrap_or(0);
            out.push_str(&format!("{name}_bucket{{{labels},le=\"{b}\"}} {c}\n"));
        }
        out.push_str(&format!(
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}\n",
            self.count
        ));
        out.push_str(&format!(
            "{name}_sum{{{labels}}} {}\n{name}_count{{{labels}}} {}\n",
            self.sum, self.count
        ));
        out
    }
}
