//! `fleet.redis_url`: where the shared pins' Redis is.

/// Where Redis is and how it is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisTarget {
    /// `host:port`.
    pub addr: String,
    pub db: u32,
    pub password: Option<String>,
}

/// A `redis://[:PASSWORD@]HOST:PORT[/DB]` URL.
pub fn parse_url(url: &str) -> Result<RedisTarget, String> {
    let rest = url
        .strip_prefix("redis://")
        .ok_or("must start with redis://")?;
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => (Some(auth), rest),
        None => (None, rest),
    };
    let password = auth
        .map(|a| a.split_once(':').map_or(a, |(_, p)| p).to_owned())
        .filter(|p| !p.is_empty());
    let (addr, db) = match rest.split_once('/') {
        Some((addr, "")) => (addr, 0),
        Some((addr, db)) => (
            addr,
            db.parse()
                .map_err(|_| format!("database `{db}` is not a number"))?,
        ),
        None => (rest, 0),
    };
    let port_ok = addr
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if !port_ok {
        return Err(format!("`{addr}` is not HOST:PORT"));
    }
    Ok(RedisTarget {
        addr: addr.to_owned(),
        db,
        password,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_host_port_database_and_password() {
        assert_eq!(
            parse_url("redis://127.0.0.1:6379/2"),
            Ok(RedisTarget {
                addr: "127.0.0.1:6379".into(),
                db: 2,
                password: None
            })
        );
        let t = parse_url("redis://:s3cret@redis.fleet:6380").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.db, t.password.as_deref()),
            ("redis.fleet:6380", 0, Some("s3cret"))
        );
        for bad in [
            "http://x:1",
            "redis://nohost",
            "redis://h:0/1",
            "redis://h:1/x",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
