//! Client API keys at the edge: a file of SHA-256 digests (hex, one per line,
//! `#` comments), reloaded when it changes, checked before any body is read.
//! A presented key is hashed and compared with every digest in constant time;
//! no key or digest is ever logged. A line may name the key's tenant and
//! class after its digest (`<digest> tenant=acme class=priority`), or mark
//! a gateway's key, whose requests name their tenant in a header
//! (`<digest> gateway`).
//!
//! Make a line with: `printf %s "$KEY" | sha256sum | cut -d' ' -f1`

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::config::{valid_tenant_name, Class, MAX_TENANT_NAME};

/// Why a keys file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("line {line}: not a SHA-256 hex digest (64 hex characters)")]
    Digest { line: usize },
    #[error("line {line}: {what}")]
    Field { line: usize, what: String },
    #[error("lists no key: every client would be refused")]
    Empty,
}

/// A set of accepted keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeys(Vec<Key>);

/// One accepted key: its digest and who it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    digest: [u8; 32],
    /// Its tenant: the line's `tenant=`, else `key-` and its digest (each
    /// unnamed key its own tenant; never shown: see `named`).
    pub tenant: Arc<str>,
    /// The line named the tenant.
    pub named: bool,
    /// `gateway`: a gateway's key, whose requests' tenant header names
    /// their tenant.
    pub gateway: bool,
    pub class: Option<Class>,
}

impl ApiKeys {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Self, KeysError> {
        let mut keys: Vec<Key> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let key = parse_line(line, i + 1)?;
            if !seen.insert(key.digest) {
                return Err(KeysError::Field {
                    line: i + 1,
                    what: "this digest is listed already".into(),
                });
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(KeysError::Empty);
        }
        Ok(Self(keys))
    }

    /// The entry of `key` when it is accepted. Every digest is compared, in
    /// constant time.
    pub fn find(&self, key: &[u8]) -> Option<&Key> {
        let presented: [u8; 32] = Sha256::digest(key).into();
        let (mut found, mut at) = (subtle::Choice::from(0), 0u32);
        for (i, k) in self.0.iter().enumerate() {
            let eq = k.digest.ct_eq(&presented);
            at.conditional_assign(&(i as u32), eq);
            found |= eq;
        }
        bool::from(found).then(|| &self.0[at as usize])
    }

    /// Whether `key` is accepted.
    pub fn accepts(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    /// The tenants the lines name.
    pub fn tenants(&self) -> impl Iterator<Item = &Key> {
        self.0.iter()
    }
}

fn parse_line(line: &str, n: usize) -> Result<Key, KeysError> {
    let mut words = line.split_ascii_whitespace();
    let digest = words
        .next()
        .and_then(parse_digest)
        .ok_or(KeysError::Digest { line: n })?;
    let field = |what: String| KeysError::Field { line: n, what };
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut key = Key {
        digest,
        tenant: Arc::from(format!("key-{hex}")),
        named: false,
        gateway: false,
        class: None,
    };
    for word in words {
        if word == "gateway" {
            key.gateway = true;
            continue;
        }
        match word.split_once('=') {
            Some(("tenant", t)) if valid_tenant_name(t) && t != crate::config::OTHER => {
                key.tenant = Arc::from(t);
                key.named = true;
            }
            Some(("tenant", _)) => {
                return Err(field(format!(
                    "a tenant name is 1 to {MAX_TENANT_NAME} of A-Z a-z 0-9 . _ - (not `other`)"
                )))
            }
            Some(("class", c)) => {
                key.class = Some(
                    Class::parse(c).ok_or_else(|| field("class is priority or standard".into()))?,
                )
            }
            _ => {
                return Err(field(
                    "after the digest: tenant=NAME, class=CLASS and gateway only".into(),
                ))
            }
        }
    }
    Ok(key)
}

/// Reads the keys file's text.
pub fn read(path: &Path) -> Result<String, KeysError> {
    std::fs::read_to_string(path).map_err(|source| KeysError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(bytes.chunks(2)) {
        let s = std::str::from_utf8(pair).ok()?;
        *o = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// The key the client presented: `Authorization: Bearer <key>` (OpenAI) or
/// `x-api-key: <key>` (Anthropic).
pub fn presented<'a>(
    authorization: Option<&'a [u8]>,
    x_api_key: Option<&'a [u8]>,
) -> Option<&'a [u8]> {
    let bearer = authorization.and_then(|v| {
        let (scheme, rest) = v.split_at(v.iter().position(|b| *b == b' ')?);
        scheme
            .eq_ignore_ascii_case(b"bearer")
            .then(|| rest.trim_ascii())
    });
    bearer
        .or(x_api_key.map(<[u8]>::trim_ascii))
        .filter(|k| !k.is_empty())
}

/// The keys in force, swapped whole when the file changes.
#[derive(Debug)]
pub struct KeyFile {
    pub path: PathBuf,
    /// The keys, and the text they were judged from (applied or rejected).
    keys: RwLock<(Arc<ApiKeys>, String)>,
}

impl KeyFile {
    /// Loads the file; it must be valid at start.
    pub fn open(path: PathBuf) -> Result<Self, KeysError> {
        let text = read(&path)?;
        let keys = ApiKeys::parse(&text)?;
        Ok(Self {
            path,
            keys: RwLock::new((Arc::new(keys), text)),
        })
    }

    /// The keys now.
    pub fn keys(&self) -> Arc<ApiKeys> {
        Arc::clone(&self.keys.read().unwrap_or_else(|p| p.into_inner()).0)
    }

    /// Whether `text` differs from the text last judged.
    pub fn changed(&self, text: &str) -> bool {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).1 != text
    }

    /// Judges new file text once: valid keys replace the old, invalid ones
    /// keep them (an emptied file too: it would refuse every client).
    pub fn apply(&self, text: String) -> Result<(), KeysError> {
        let mut cur = self.keys.write().unwrap_or_else(|p| p.into_inner());
        let parsed = ApiKeys::parse(&text);
        cur.1 = text;
        cur.0 = Arc::new(parsed?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(key: &str) -> String {
        Sha256::digest(key.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn only_listed_keys_are_accepted() {
        let keys =
            ApiKeys::parse(&format!("# team a\n{}\n\n{}\n", digest("k1"), digest("k2"))).unwrap();
        assert!(keys.accepts(b"k1") && keys.accepts(b"k2"));
        assert!(!keys.accepts(b"k3") && !keys.accepts(b""));
    }

    #[test]
    fn a_line_names_its_tenant_and_class_and_an_unnamed_key_is_its_own_tenant() {
        let text = format!(
            "{} tenant=acme class=priority\n{}\n{}  tenant=acme\n",
            digest("k1"),
            digest("k2"),
            digest("k3")
        );
        let keys = ApiKeys::parse(&text).unwrap();
        let k1 = keys.find(b"k1").unwrap();
        assert_eq!(
            (&*k1.tenant, k1.named, k1.class),
            ("acme", true, Some(Class::Priority))
        );
        let k2 = keys.find(b"k2").unwrap();
        assert_eq!(&*k2.tenant, format!("key-{}", digest("k2")));
        assert!(!k2.named && !k2.gateway && k2.class.is_none());
        assert_eq!(&*keys.find(b"k3").unwrap().tenant, "acme");
        assert!(keys.find(b"k4").is_none());
        let gateway = ApiKeys::parse(&format!("{} gateway\n", digest("g"))).unwrap();
        assert!(gateway.find(b"g").unwrap().gateway);
        for bad in [
            "tenant=a/b",
            "class=gold",
            "team=a",
            "tenant=other",
            "gateway=1",
        ] {
            let e = ApiKeys::parse(&format!("{} {bad}\n", digest("k"))).unwrap_err();
            assert!(e.to_string().contains("line 1"), "{bad}: {e}");
        }
        let twice = format!("{}\n{} tenant=b\n", digest("k"), digest("k"));
        let e = ApiKeys::parse(&twice).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }

    #[test]
    fn a_bad_line_or_an_empty_file_is_an_error_naming_the_line() {
        let e = ApiKeys::parse(&format!("{}\nsecret\n", digest("k"))).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        assert!(matches!(ApiKeys::parse("# none\n"), Err(KeysError::Empty)));
    }

    #[test]
    fn bearer_and_x_api_key_are_read() {
        assert_eq!(presented(Some(b"Bearer abc"), None), Some(&b"abc"[..]));
        assert_eq!(presented(Some(b"bearer  abc "), None), Some(&b"abc"[..]));
        assert_eq!(presented(None, Some(b"xyz")), Some(&b"xyz"[..]));
        assert_eq!(presented(Some(b"Basic abc"), None), None);
        assert_eq!(presented(Some(b"Bearer "), None), None);
    }
}
