//! The metric types the router's metrics are made of: `prometheus-client`'s
//! counters, gauges and histograms, grouped in families by label values,
//! with the calls the rest of the router makes (`with_label_values` gives
//! a series' handle, `remove_label_values` drops a series). A handle is an
//! atomic shared with the family: parts that count often resolve it once.
//!
//! Labels are written in name order, as Prometheus's own clients write
//! them, so a series reads the same whatever order a family declares.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::{counter, gauge, histogram};
use prometheus_client::registry::{Metric, Registry};

pub type IntCounter = counter::Counter<u64, AtomicU64>;
pub type IntGauge = gauge::Gauge<i64, AtomicI64>;
pub type Gauge = gauge::Gauge<f64, AtomicU64>;
pub type Histogram = histogram::Histogram;

/// A series' label values (escaped) and its family's label names, both in
/// name order.
#[derive(Clone, Debug)]
pub struct Labels {
    names: Arc<[&'static str]>,
    values: Box<[String]>,
}

// A family's names are the same for all its series: only values tell two apart.
impl PartialEq for Labels {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

impl Eq for Labels {}

impl Hash for Labels {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.values.hash(state);
    }
}

impl EncodeLabelSet for Labels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        for (name, value) in self.names.iter().zip(self.values.iter()) {
            (*name, value.as_str()).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

/// A label value as the text format writes it (the encoder writes values
/// as given): a model id an engine lists may hold a quote, a backslash or
/// a line break.
fn escaped(value: &str) -> String {
    if !value.contains(['\\', '"', '\n']) {
        return value.to_owned();
    }
    let mut out = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Makes a family's histograms, with its buckets.
#[derive(Clone, Debug)]
pub struct Buckets(&'static [f64]);

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
}

/// Makes a family's counters and gauges (their default: 0).
#[derive(Clone, Debug)]
pub struct Zero;

impl<M: Default> MetricConstructor<M> for Zero {
    fn new_metric(&self) -> M {
        M::default()
    }
}

/// A family of series of one metric, by the values of its labels.
#[derive(Clone, Debug)]
pub struct Labelled<M, C = Zero> {
    family: Family<Labels, M, C>,
    /// Its label names in name order, and where each declared label is in it.
    names: Arc<[&'static str]>,
    at: Box<[usize]>,
}

pub type IntCounterVec = Labelled<IntCounter>;
pub type IntGaugeVec = Labelled<IntGauge>;
pub type GaugeVec = Labelled<Gauge>;
pub type HistogramVec = Labelled<Histogram, Buckets>;

impl<M, C> Labelled<M, C>
where
    M: Clone + Metric,
    C: MetricConstructor<M> + Clone + Send + Sync + std::fmt::Debug + 'static,
{
    fn new(labels: &[&'static str], make: C) -> Self {
        let mut names: Vec<&'static str> = labels.to_vec();
        names.sort_unstable();
        let at = (labels.iter())
            .map(|l| names.iter().position(|n| n == l).unwrap_or(0))
            .collect();
        Self {
            family: Family::new_with_constructor(make),
            names: names.into(),
            at,
        }
    }

    fn labels(&self, values: &[&str]) -> Labels {
        debug_assert_eq!(values.len(), self.at.len(), "{:?}", self.names);
        let mut sorted = vec![String::new(); self.names.len()];
        for (value, &i) in values.iter().zip(self.at.iter()) {
            if let Some(slot) = sorted.get_mut(i) {
                *slot = escaped(value);
            }
        }
        Labels {
            names: Arc::clone(&self.names),
            values: sorted.into(),
        }
    }

    /// The series with these values (in the family's declared label order),
    /// created at 0 when new.
    pub fn with_label_values(&self, values: &[&str]) -> M {
        self.family.get_or_create_owned(&self.labels(values))
    }

    /// Drops the series with these values; `false` when there was none.
    pub fn remove_label_values(&self, values: &[&str]) -> bool {
        self.family.remove(&self.labels(values))
    }
}

/// What `Metrics::new` registers with: counters' names end in `_total` as
/// exported, which the OpenMetrics encoder adds itself.
pub struct Register<'a>(pub &'a mut Registry);

impl Register<'_> {
    pub fn counter(&mut self, name: &str, help: &str) -> IntCounter {
        let c = IntCounter::default();
        self.0.register(counter_name(name), help, c.clone());
        c
    }

    pub fn counter_vec(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&'static str],
    ) -> IntCounterVec {
        let v = Labelled::new(labels, Zero);
        self.0.register(counter_name(name), help, v.family.clone());
        v
    }

    pub fn gauge(&mut self, name: &str, help: &str) -> IntGauge {
        let g = IntGauge::default();
        self.0.register(name, help, g.clone());
        g
    }

    pub fn gauge_vec(&mut self, name: &str, help: &str, labels: &[&'static str]) -> IntGaugeVec {
        let v = Labelled::new(labels, Zero);
        self.0.register(name, help, v.family.clone());
        v
    }

    pub fn float_gauge_vec(&mut self, name: &str, help: &str, labels: &[&'static str]) -> GaugeVec {
        let v = Labelled::new(labels, Zero);
        self.0.register(name, help, v.family.clone());
        v
    }

    pub fn histogram(&mut self, name: &str, help: &str, buckets: &'static [f64]) -> Histogram {
        let h = Buckets(buckets).new_metric();
        self.0.register(name, help, h.clone());
        h
    }

    pub fn histogram_vec(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&'static str],
        buckets: &'static [f64],
    ) -> HistogramVec {
        let v = Labelled::new(labels, Buckets(buckets));
        self.0.register(name, help, v.family.clone());
        v
    }
}

/// A counter's name as registered: without the `_total` the encoder adds.
pub fn counter_name(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(registry: &Registry) -> String {
        let mut page = String::new();
        prometheus_client::encoding::text::encode(&mut page, registry).unwrap();
        page
    }

    #[test]
    fn series_are_written_with_labels_in_name_order_and_one_total() {
        let mut registry = Registry::default();
        let requests = Register(&mut registry).counter_vec(
            "x_requests_total",
            "Requests",
            &["shape", "decision"],
        );
        requests.with_label_values(&["single", "spread"]).inc_by(2);
        requests.with_label_values(&["single", "spread"]).inc();
        let page = page(&registry);
        assert!(page.contains("# TYPE x_requests counter\n"), "{page}");
        assert!(
            page.contains("\nx_requests_total{decision=\"spread\",shape=\"single\"} 3\n"),
            "{page}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let mut registry = Registry::default();
        let models = Register(&mut registry).counter_vec("x_total", "Models", &["model"]);
        models.with_label_values(&["a\"b\\c\nd"]).inc();
        let page = page(&registry);
        assert!(
            page.contains("\nx_total{model=\"a\\\"b\\\\c\\nd\"} 1\n"),
            "{page}"
        );
    }

    #[test]
    fn a_removed_series_is_gone_and_the_others_stay() {
        let mut registry = Registry::default();
        let up = Register(&mut registry).gauge_vec("x_up", "Up", &["replica"]);
        up.with_label_values(&["a"]).set(1);
        up.with_label_values(&["b"]).set(1);
        assert!(up.remove_label_values(&["a"]));
        assert!(!up.remove_label_values(&["a"]));
        let page = page(&registry);
        assert!(!page.contains("replica=\"a\""), "{page}");
        assert!(page.contains("x_up{replica=\"b\"} 1\n"), "{page}");
    }

    #[test]
    fn a_histogram_family_has_its_buckets() {
        let mut registry = Registry::default();
        let h =
            Register(&mut registry).histogram_vec("x_seconds", "Time", &["decision"], &[0.5, 2.0]);
        h.with_label_values(&["pin"]).observe(1.0);
        let page = page(&registry);
        // The encoder writes `le` first.
        assert!(
            page.contains("x_seconds_bucket{le=\"0.5\",decision=\"pin\"} 0\n"),
            "{page}"
        );
        assert!(
            page.contains("x_seconds_bucket{le=\"2.0\",decision=\"pin\"} 1\n"),
            "{page}"
        );
        assert!(
            page.contains("x_seconds_count{decision=\"pin\"} 1\n"),
            "{page}"
        );
    }
}
