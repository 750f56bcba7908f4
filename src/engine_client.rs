//! The router's own requests to replicas: the peer settings and `Host`
//! its health checks use, and [`OwnGet`], the pooled GET behind model lists
//! and engine metrics.

use std::time::Duration;

use pingora_core::connectors::http::Connector as HttpConnector;
use pingora_core::connectors::ConnectorOptions;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{ErrorType, Result};
use pingora_http::RequestHeader;

use crate::config::{ReplicaTls, Secret};

/// A GET the router sends replicas itself (engine metrics, model lists):
/// replica TLS and `Host` as the health checks, a pooled connection, the
/// answer's body capped.
pub struct OwnGet {
    connector: HttpConnector,
    peer: HttpPeer,
    request: RequestHeader,
    /// A pooled connection is kept this long between requests.
    idle: Duration,
    max_bytes: usize,
}

impl OwnGet {
    pub fn new(
        path: &str,
        host: &str,
        (peer, connector): (HttpPeer, HttpConnector),
        idle: Duration,
        max_bytes: usize,
    ) -> Result<Self> {
        let mut request = RequestHeader::build("GET", path.as_bytes(), None)?;
        request.insert_header("Host", host)?;
        Ok(Self {
            connector,
            peer,
            request,
            idle,
            max_bytes,
        })
    }

    /// The body of a 200 answer from `addr`, sending `key` (the replica's
    /// `api_key_file`) as `Authorization: Bearer`; an error for any other
    /// status or a body over the cap (a cut body could end inside a figure).
    pub async fn get(&self, addr: std::net::SocketAddr, key: Option<&Secret>) -> Result<Vec<u8>> {
        let mut peer = self.peer.clone();
        peer._address = pingora_core::protocols::l4::socket::SocketAddr::Inet(addr);
        let (mut session, _) = self.connector.get_http_session(&peer).await?;
        let mut request = self.request.clone();
        if let Some(key) = key {
            request.insert_header("Authorization", key.bearer())?;
        }
        session.write_request_header(Box::new(request)).await?;
        session.finish_request_body().await?;
        session.read_response_header().await?;
        let status = session.response_header().map(|h| h.status.as_u16());
        if status != Some(200) {
            return pingora_core::Error::e_explain(
                ErrorType::HTTPStatus(status.unwrap_or(0)),
                "status",
            );
        }
        let mut body = Vec::new();
        while let Some(chunk) = session.read_response_body().await? {
            if body.len() + chunk.len() > self.max_bytes {
                return pingora_core::Error::e_explain(
                    ErrorType::InvalidHTTPHeader,
                    "body over the size cap",
                );
            }
            body.extend_from_slice(&chunk);
        }
        self.connector
            .release_http_session(session, &peer, Some(self.idle))
            .await;
        Ok(body)
    }
}

/// The peer settings (its address a placeholder) and connector of the
/// router's own requests to replicas, health checks and engine metrics:
/// replica TLS as configured, a 1 s connect timeout.
pub fn own_requests(tls: &ReplicaTls) -> (HttpPeer, HttpConnector) {
    let mut peer = HttpPeer::new("0.0.0.0:1", tls.enabled, tls.sni.clone());
    peer.options.connection_timeout = Some(Duration::from_secs(1));
    peer.options.read_timeout = Some(Duration::from_secs(2));
    let mut options = ConnectorOptions::new(IDLE_POOL);
    if tls.enabled {
        peer.options.verify_cert = tls.verify;
        peer.options.verify_hostname = tls.verify_hostname();
        options.ca_file = tls.ca_file.clone();
    }
    (peer, HttpConnector::new(Some(options)))
}

/// Idle connections kept to replicas, per connection pool (the proxy's, and
/// each kind of the router's own requests): one or more per replica, so a
/// fleet of thousands reuses its connections. Pingora's default, 128, made
/// a fleet of 1,000 open a connection for most requests, health checks and
/// engine reads. Each is an open descriptor while kept, at most
/// `timeouts.idle_ms` (own requests: [`KEEP_IDLE`]).
pub const IDLE_POOL: usize = 4096;

/// How long the router's own connections to an engine (health checks,
/// model lists, engine reads) are kept idle: under uvicorn's 5 s
/// keep-alive, so the engine does not close one first, and past the 4 s
/// between a live replica's checks under the probes' default budget at a
/// thousand replicas, so each check reuses its connection.
pub const KEEP_IDLE: Duration = Duration::from_millis(4_500);

/// The `Host` of the router's own requests to replicas: the TLS server
/// name when one is set.
pub fn own_host(tls: &ReplicaTls) -> &str {
    if tls.sni.is_empty() {
        "localhost"
    } else {
        &tls.sni
    }
}
