//! Client API keys at the edge: a file of SHA-256 digests (hex, one per line,
//! `#` comments), reloaded when it changes, checked before any body is read.
//! A presented key is hashed and compared with every digest in constant time;
//! no key or digest is ever logged.
//!
//! Make a line with: `printf %s "$KEY" | sha256sum | cut -d' ' -f1`

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

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
    #[error("lists no key: every client would be refused")]
    Empty,
}

/// A set of accepted key digests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeys(Vec<[u8; 32]>);

impl ApiKeys {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Self, KeysError> {
        let mut digests = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            digests.push(parse_digest(line).ok_or(KeysError::Digest { line: i + 1 })?);
        }
        if digests.is_empty() {
            return Err(KeysError::Empty);
        }
        Ok(Self(digests))
    }

    /// Whether `key` is accepted. Every digest is compared, in constant time.
    pub fn accepts(&self, key: &[u8]) -> bool {
        let presented: [u8; 32] = Sha256::digest(key).into();
        self.0
            .iter()
            .fold(subtle::Choice::from(0), |ok, d| ok | d.ct_eq(&presented))
            .into()
    }
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
