//! `Config::validate`: every field a typo could break, named in the error.

use std::net::SocketAddr;

use super::*;

impl Config {
    /// Checks every field a typo could break; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("listen", &self.listen),
            ("metrics_listen", &self.metrics_listen),
        ] {
            value
                .parse::<SocketAddr>()
                .map_err(|e| invalid(field, format!("`{value}` is not IP:port ({e})")))?;
        }
        if let Some(t) = &self.tenants {
            t.validate()?;
        }
        if let Some(t) = &self.traces {
            t.validate()?;
        }
        if let Some(q) = &self.queue {
            if self.shed_in_flight.is_none() {
                return Err(invalid(
                    "queue",
                    "needs shed_in_flight: the in-flight bound requests wait for",
                ));
            }
            for (field, v, max) in [
                ("queue.max_waiting", q.max_waiting as u64, 1_000_000),
                ("queue.deadline_ms", q.deadline_ms, 3_600_000),
                ("queue.share_window_ms", q.share_window_ms, 3_600_000),
            ] {
                if v == 0 || v > max {
                    return Err(invalid(field, format!("must be 1 to {max}")));
                }
            }
        }
        if self.sample.above > 0 && self.sample.replicas < 2 {
            return Err(invalid(
                "sample.replicas",
                "must be at least 2 (sample.above: 0 turns sampling off)",
            ));
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be positive"));
        }
        if self.shed_in_flight == Some(0) {
            return Err(invalid(
                "shed_in_flight",
                "must be positive, or null for off",
            ));
        }
        if self.prefix_index.repair_on_miss_s == Some(0) {
            return Err(invalid(
                "prefix_index.repair_on_miss_s",
                "must be positive, or null for never",
            ));
        }
        let path = |field: &str, p: &str| {
            if p.starts_with('/') && p.parse::<http::uri::PathAndQuery>().is_ok() {
                Ok(())
            } else {
                Err(invalid(
                    field,
                    format!("`{p}` is not a path starting with /"),
                ))
            }
        };
        path("health_check.path", &self.health_check.path)?;
        if let Some(e) = &self.engine_load {
            path("engine_load.path", &e.path)?;
            if e.interval_ms < 50 {
                return Err(invalid("engine_load.interval_ms", "must be at least 50"));
            }
        }
        for (field, v) in [
            ("body_read_timeout_ms", self.body_read_timeout_ms),
            ("health_check.interval_ms", self.health_check.interval_ms),
            ("timeouts.connect_ms", self.timeouts.connect_ms),
            ("timeouts.read_ms", self.timeouts.read_ms),
            (
                "timeouts.response_header_ms",
                self.timeouts.response_header_ms,
            ),
            ("timeouts.write_ms", self.timeouts.write_ms),
            ("reload_interval_ms", self.reload_interval_ms),
            ("working_set_window_s", u64::from(self.working_set_window_s)),
            ("outlier.base_ejection_ms", self.outlier.base_ejection_ms),
            ("outlier.max_ejection_ms", self.outlier.max_ejection_ms),
            ("limits.max_requests", self.limits.max_requests as u64),
            (
                "limits.max_buffered_bytes",
                self.limits.max_buffered_bytes as u64,
            ),
            (
                "limits.max_prompt_bytes",
                self.limits.max_prompt_bytes as u64,
            ),
            (
                "client_timeouts.keepalive_idle_s",
                self.client_timeouts.keepalive_idle_s,
            ),
            ("client_timeouts.header_ms", self.client_timeouts.header_ms),
            ("client_timeouts.write_ms", self.client_timeouts.write_ms),
            (
                "limits.max_metrics_connections",
                self.limits.max_metrics_connections as u64,
            ),
            (
                "limits.max_streams_per_connection",
                u64::from(self.limits.max_streams_per_connection),
            ),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be positive"));
            }
        }
        if !(1..=65_535).contains(&self.prefix_index.block_bytes) {
            return Err(invalid("prefix_index.block_bytes", "must be 1..=65535"));
        }
        for (field, v) in [
            (
                "health_check.unhealthy_threshold",
                self.health_check.unhealthy_threshold,
            ),
            (
                "health_check.healthy_threshold",
                self.health_check.healthy_threshold,
            ),
        ] {
            if !(1..=100).contains(&v) {
                return Err(invalid(field, "must be 1..=100"));
            }
        }
        if self.prefix_index.max_entries == 0 {
            return Err(invalid("prefix_index.max_entries", "must be positive"));
        }
        if self.singles.min_prefix_percent > 100 {
            return Err(invalid("singles.min_prefix_percent", "must be 0..=100"));
        }
        if self.reload_max_removed_percent > 100 {
            return Err(invalid("reload_max_removed_percent", "must be 0..=100"));
        }
        if self.outlier.max_ejection_percent > 100 {
            return Err(invalid("outlier.max_ejection_percent", "must be 0..=100"));
        }
        if self.limits.max_buffered_bytes < self.max_body_bytes {
            return Err(invalid(
                "limits.max_buffered_bytes",
                "must be at least max_body_bytes (a body between the two could never pass)",
            ));
        }
        if self.threads == 0 {
            return Err(invalid("threads", "must be positive"));
        }
        if self.replica_tls.enabled && !cfg!(feature = "tls") {
            return Err(invalid(
                "replica_tls.enabled",
                "this build has no TLS support; build with `cargo build --features tls`",
            ));
        }
        if let Some(t) = &self.listen_tls {
            if !cfg!(feature = "tls") {
                return Err(invalid(
                    "listen_tls",
                    "this build has no TLS support; build with `cargo build --features tls`",
                ));
            }
            if t.addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(invalid("listen_tls.addr", "must be IP:port"));
            }
            if t.addr == self.listen || t.addr == self.metrics_listen {
                return Err(invalid("listen_tls.addr", "is another listener's address"));
            }
            for (field, file) in [
                ("listen_tls.cert_file", &t.cert_file),
                ("listen_tls.key_file", &t.key_file),
            ] {
                if !Path::new(file).is_file() {
                    return Err(invalid(field, format!("`{file}` is not a file")));
                }
            }
        }
        if let Some(ca) = &self.replica_tls.ca_file {
            if !Path::new(ca).is_file() {
                return Err(invalid(
                    "replica_tls.ca_file",
                    format!("`{ca}` is not a file"),
                ));
            }
        }
        if self.replicas.is_empty() && self.replicas_dns.is_empty() {
            // An emptied or truncated file must not take the whole fleet away.
            return Err(invalid(
                "replicas",
                "lists no replica (to take every replica out, stop the router)",
            ));
        }
        let f = &self.fleet;
        match (&f.mode, &f.redis_url) {
            (FleetMode::Redis, None) => {
                return Err(invalid("fleet.redis_url", "is needed by mode: redis"))
            }
            (_, Some(url)) => {
                let info = parse_redis_url(url).map_err(|why| invalid("fleet.redis_url", why))?;
                if f.redis_ca_file.is_some() && !redis_url::is_tls(&info) {
                    return Err(invalid("fleet.redis_ca_file", "is for a rediss:// URL"));
                }
            }
            _ => {}
        }
        if let Some(ca) = f.redis_ca_file.as_ref().filter(|f| !Path::new(f).is_file()) {
            return Err(invalid(
                "fleet.redis_ca_file",
                format!("`{ca}` is not a file"),
            ));
        }
        if f.redis_budget_ms == 0 || f.redis_ttl_s == 0 {
            return Err(invalid(
                "fleet",
                "redis_budget_ms and redis_ttl_s must be positive",
            ));
        }
        if self.dns_refresh_ms < 100 {
            return Err(invalid("dns_refresh_ms", "must be at least 100"));
        }
        for (model, dir) in &self.tokenizers {
            if !Path::new(dir).join("tokenizer.json").is_file() {
                return Err(invalid(
                    format!("tokenizers.{model}"),
                    format!("`{dir}` has no tokenizer.json"),
                ));
            }
        }
        let (mut names, mut addrs) = (HashSet::new(), HashSet::new());
        let lists = [
            ("replicas", &self.replicas),
            ("replicas_dns", &self.replicas_dns),
        ];
        for (list, replicas) in lists {
            for (i, r) in replicas.iter().enumerate() {
                let field = |f: &str| format!("{list}[{i}].{f}");
                r.validate(field, &mut names, &mut addrs)?;
            }
        }
        Ok(())
    }
}
