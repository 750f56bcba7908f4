//! `prefix_router_log_lines_dropped_total`: the log writer's count of lines
//! it dropped because its queue was full (see `access_log`), read at each
//! scrape.

use prometheus::core::{Collector, Desc, Describer};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, Opts};
use tracing_appender::non_blocking::ErrorCounter;

const NAME: &str = "prefix_router_log_lines_dropped_total";
const HELP: &str = "Log lines dropped because the log writer's queue was full (stderr slower than the lines logged)";

/// The collector over the log writer's counter.
pub struct LogDrops {
    dropped: ErrorCounter,
    desc: Desc,
}

impl LogDrops {
    pub fn new(dropped: ErrorCounter) -> Result<Self, prometheus::Error> {
        let desc = Opts::new(NAME, HELP).describe()?;
        Ok(Self { dropped, desc })
    }
}

impl Collector for LogDrops {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        IntCounter::with_opts(Opts::new(NAME, HELP))
            .map(|c| {
                c.inc_by(self.dropped.dropped_lines() as u64);
                c.collect()
            })
            .unwrap_or_default()
    }
}
