//! The client-facing TLS listener (`listen_tls`, builds with `--features
//! tls`): HTTP/2 and HTTP/1.1 offered by ALPN, the certificate chain and key
//! supplied per handshake from files that a thread of its own re-reads when
//! they change (a renewal needs no restart; a slow or hung filesystem never
//! stalls a handshake). A changed pair is checked before use: a key that does
//! not match its certificate (a renewal half written) keeps the last good
//! pair in force, logged once per version of the files, and is tried again a
//! second later.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
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

/// Supplies the current certificate pair to every handshake; the watch
/// thread holds a weak handle on the same pair.
pub struct Certificates {
    pair: Arc<ArcSwap<Pair>>,
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
    /// Loads the pair now (a bad pair stops the start, naming the file), and
    /// starts the thread that watches the files for as long as it is in use.
    pub fn new(cert: &str, key: &str) -> Result<Self, CertError> {
        let (cert, key) = (PathBuf::from(cert), PathBuf::from(key));
        let seen = stamp(&cert, &key);
        let pair = Arc::new(ArcSwap::from_pointee(load(&cert, &key)?));
        let weak = Arc::downgrade(&pair);
        std::thread::Builder::new()
            .name("listen_tls certificates".into())
            .spawn(move || watch(weak, cert, key, seen))
            .map_err(|e| CertError::Settings(e.to_string()))?;
        Ok(Self { pair })
    }
}

/// Re-reads the files every [`RECHECK`] while the pair is in use.
fn watch(current: Weak<ArcSwap<Pair>>, cert: PathBuf, key: PathBuf, mut loaded: Stamp) {
    let mut refused = None;
    loop {
        std::thread::sleep(RECHECK);
        let Some(current) = current.upgrade() else {
            return;
        };
        let now = stamp(&cert, &key);
        if now == loaded {
            continue;
        }
        match load(&cert, &key) {
            Ok(pair) => {
                current.store(Arc::new(pair));
                loaded = now;
                refused = None;
                log::info!("listen_tls: certificate reloaded from {}", cert.display());
            }
            Err(e) if refused != Some(now) => {
                log::warn!("listen_tls: keeping the previous certificate: {e}");
                refused = Some(now);
            }
            Err(_) => {}
        }
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
        if let Err(e) = use_pair(ssl, &self.pair.load()) {
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
