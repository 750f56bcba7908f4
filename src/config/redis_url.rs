//! `fleet.redis_url`: where the shared pins' Redis is, read by the `redis`
//! crate's own parser, with what the router does not support refused here.

/// A `redis://[[USER]:PASSWORD@]HOST:PORT[/DB]` URL, or `rediss://` for
/// TLS: the connection it names (user and password percent-decoded).
pub fn parse_url(url: &str) -> Result<redis::ConnectionInfo, String> {
    let parsed = redis::parse_redis_url(url).ok_or("is not a redis:// or rediss:// URL")?;
    if !matches!(parsed.scheme(), "redis" | "rediss") {
        return Err("must start with redis:// or rediss://".into());
    }
    if parsed.port().is_none_or(|p| p == 0) || parsed.host_str().is_none_or(str::is_empty) {
        return Err("must name HOST:PORT (a port above 0)".into());
    }
    if parsed.fragment().is_some() {
        return Err("`#insecure` is not supported: name a CA in fleet.redis_ca_file".into());
    }
    if parsed.query().is_some() {
        return Err("takes no query (`?protocol=resp3` is not supported)".into());
    }
    let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|e| e.to_string())?;
    let settings = info.redis_settings();
    if settings.db() < 0 {
        return Err("the database must be 0 or more".into());
    }
    if settings.username().is_some() && settings.password().is_none() {
        return Err("a user name needs its password (redis://USER:PASSWORD@HOST:PORT)".into());
    }
    Ok(info)
}

/// Whether the URL asks for TLS.
pub fn is_tls(info: &redis::ConnectionInfo) -> bool {
    matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_host_port_database_user_and_password() {
        let t = parse_url("redis://127.0.0.1:6379/2").unwrap();
        assert_eq!(t.addr().to_string(), "127.0.0.1:6379");
        assert_eq!(t.redis_settings().db(), 2);
        assert!(!is_tls(&t));
        let t = parse_url("redis://:s3cret@redis.fleet:6380").unwrap();
        let s = t.redis_settings();
        assert_eq!(
            (s.db(), s.username(), s.password()),
            (0, None, Some("s3cret"))
        );
        let t = parse_url("rediss://router:p%40ss@redis.fleet:6380/1").unwrap();
        let s = t.redis_settings();
        assert_eq!((s.username(), s.password()), (Some("router"), Some("p@ss")));
        assert!(is_tls(&t));
        for bad in [
            "http://x:1",
            "redis://nohost",
            "redis://h:0/1",
            "redis://h:1/x",
            "redis://h:1/-1",
            "rediss://h:1/#insecure",
            "redis://h:1/?protocol=resp3",
            "redis://user@h:1",
            "unix:///tmp/redis.sock",
            "valkey://h:1",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
