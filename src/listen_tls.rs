//! The client-facing TLS listener (`listen_tls`, builds with `--features
//! tls`): HTTP/2 and HTTP/1.1 offered by ALPN, the certificate chain and key
//! supplied per handshake from files that are re-read when they change (a
//! renewal needs no restart). A changed pair is checked before use: a key
//! that does not match its certificate (a renewal half written) keeps the
//! last good pair in force, and is tried again a second later.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::listeners::tls::TlsSettings;
use pingora_core::listeners::TlsAccept;
use pingora_core::protocols::tls::TlsRef;
use pingora_core::tls::error::ErrorStack;
use pingora_core::tls::ext;
use pingora_core::tls::pkey::{PKey, Private};
use pingora_core::tls::x509::X509;

/// How often the files are looked at for changes.
const RECHECK: Duration = Duration::from_secs(1);

/// Why a certificate pair could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{0}: {1}")]
    Read(String, std::io::Error),
    #[error("{0}: not PEM the TLS library accepts: {1}")]
    Parse(String, ErrorStack),
    #[error("{0}: no certificate in the file")]
    Empty(String),
    #[error("key_file {0} does not match the certificate in cert_file")]
    Mismatch(String),
    #[error("TLS settings: {0}")]
    Settings(String),
}

/// What identifies a version of the two files.
type Stamp = [Option<(std::time::SystemTime, u64, u64)>; 2];

struct Pair {
    chain: Vec<X509>,
    key: PKey<Private>,
}

struct State {
    checked_at: Instant,
    /// The files' stamp last judged (loaded, or refused and logged).
    stamp: Stamp,
    pair: Arc<Pair>,
}

/// Supplies the current certificate pair to every handshake.
pub struct Certificates {
    cert: PathBuf,
    key: PathBuf,
    state: Mutex<State>,
}

fn stamp(cert: &Path, key: &Path) -> Stamp {
    let of = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len(), m.ino())))
    };
    [of(cert), of(key)]
}

fn load(cert: &Path, key: &Path) -> Result<Pair, CertError> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| CertError::Read(p.display().to_string(), e));
    let parse = |p: &Path, e| CertError::Parse(p.display().to_string(), e);
    let chain = X509::stack_from_pem(&read(cert)?).map_err(|e| parse(cert, e))?;
    let private = PKey::private_key_from_pem(&read(key)?).map_err(|e| parse(key, e))?;
    let leaf = chain
        .first()
        .ok_or_else(|| CertError::Empty(cert.display().to_string()))?;
    let matches = leaf
        .public_key()
        .map(|public| public.public_eq(&private))
        .unwrap_or(false);
    if !matches {
        return Err(CertError::Mismatch(key.display().to_string()));
    }
    Ok(Pair {
        chain,
        key: private,
    })
}

impl Certificates {
    /// Loads the pair now: a bad pair stops the start, naming the file.
    pub fn new(cert: &str, key: &str) -> Result<Self, CertError> {
        let (cert, key) = (PathBuf::from(cert), PathBuf::from(key));
        let stamp = stamp(&cert, &key);
        let pair = Arc::new(load(&cert, &key)?);
        Ok(Self {
            state: Mutex::new(State {
                checked_at: Instant::now(),
                stamp,
                pair,
            }),
            cert,
            key,
        })
    }

    /// The pair in force, re-read first when the files changed.
    fn current(&self) -> Arc<Pair> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.checked_at.elapsed() < RECHECK {
            return Arc::clone(&state.pair);
        }
        state.checked_at = Instant::now();
        let now = stamp(&self.cert, &self.key);
        if now != state.stamp {
            match load(&self.cert, &self.key) {
                Ok(pair) => {
                    log::info!(
                        "listen_tls: certificate reloaded from {}",
                        self.cert.display()
                    );
                    state.pair = Arc::new(pair);
                    state.stamp = now;
                }
                // Logged once per version of the files; tried again each second
                // (the other file of a renewal may still be on its way).
                Err(e) if state.stamp != [None, None] => {
                    log::warn!("listen_tls: keeping the previous certificate: {e}");
                    state.stamp = [None, None];
                }
                Err(_) => {}
            }
        }
        Arc::clone(&state.pair)
    }
}

fn use_pair(ssl: &mut TlsRef, pair: &Pair) -> Result<(), ErrorStack> {
    let mut chain = pair.chain.iter();
    if let Some(leaf) = chain.next() {
        ext::ssl_use_certificate(ssl, leaf)?;
    }
    for intermediate in chain {
        ext::ssl_add_chain_cert(ssl, intermediate)?;
    }
    ext::ssl_use_private_key(ssl, &pair.key)
}

#[async_trait]
impl TlsAccept for Certificates {
    async fn certificate_callback(&self, ssl: &mut TlsRef) -> () {
        let pair = self.current();
        if let Err(e) = use_pair(ssl, &pair) {
            log::error!("listen_tls: could not use the certificate: {e}");
        }
    }
}

/// The listener's settings: Mozilla's intermediate profile, ALPN h2 then
/// http/1.1, certificates from `cert` and `key`.
pub fn settings(cert: &str, key: &str) -> Result<TlsSettings, CertError> {
    let certificates = Certificates::new(cert, key)?;
    let mut s = TlsSettings::with_callbacks(Box::new(certificates))
        .map_err(|e| CertError::Settings(e.to_string()))?;
    s.enable_h2();
    Ok(s)
}
