//! `prefix_router_log_lines_dropped_total`: the log writer's count of lines
//! it dropped because its queue was full (see `access_log`), read at each
//! scrape once the writer is watched.

use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use tracing_appender::non_blocking::ErrorCounter;

use super::family::counter_name;

const NAME: &str = "prefix_router_log_lines_dropped_total";
const HELP: &str = "Log lines dropped because the log writer's queue was full (stderr slower than the lines logged)";

/// The collector over the log writer's counter.
pub struct LogDrops(pub Arc<OnceLock<ErrorCounter>>);

impl std::fmt::Debug for LogDrops {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("LogDrops")
    }
}

impl Collector for LogDrops {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(dropped) = self.0.get() else {
            return Ok(());
        };
        let counter = ConstCounter::new(dropped.dropped_lines() as u64);
        let help = format!("{HELP}.");
        let series =
            encoder.encode_descriptor(counter_name(NAME), &help, None, counter.metric_type())?;
        counter.encode(series)
    }
}
