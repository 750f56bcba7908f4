//! The Unix socket over which a running router hands its listening sockets
//! to a new one started with `-u` (Pingora's zero-downtime upgrade). Whoever
//! can create that path receives the listeners on SIGQUIT, so it must lie in
//! a directory only this user can write: `upgrade_sock` if set, else
//! `upgrade-<listen>.sock` in systemd's `$RUNTIME_DIRECTORY`, else in
//! `/tmp/prefix-router-<uid>/` (created 0700). A directory others can write
//! disables the hand-over: SIGQUIT then only stops the router.

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::config::Config;

/// Where a socket goes when the upgrade is disabled: connecting fails.
const DISABLED: &str = "/nonexistent/prefix-router-upgrade-disabled.sock";

/// Why the upgrade socket cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("{0}: {1}")]
    Dir(String, std::io::Error),
    #[error("{0} is not private to this user (owner uid {1}, mode {2:o}): another user could receive the listening sockets")]
    NotPrivate(String, u32, u32),
    #[error("{0} has no parent directory")]
    NoParent(String),
}

/// The socket path the configuration asks for.
pub fn socket(cfg: &Config) -> PathBuf {
    if let Some(path) = &cfg.upgrade_sock {
        return PathBuf::from(path);
    }
    let name: String = cfg
        .listen
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let dir = std::env::var_os("RUNTIME_DIRECTORY")
        .and_then(|d| {
            d.to_str()
                .and_then(|d| d.split(':').next())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/prefix-router-{}", uid())));
    dir.join(format!("upgrade-{name}.sock"))
}

fn uid() -> u32 {
    std::fs::metadata("/proc/self").map_or(0, |m| m.uid())
}

/// Makes sure `sock`'s directory exists (created 0700 when missing) and that
/// no other user can write to it; returns the socket to give Pingora: `sock`,
/// or, when that is unsafe, a path no one can bind (logged), so SIGQUIT
/// never sends the listeners to someone else.
pub fn checked(sock: &Path) -> Result<PathBuf, UpgradeError> {
    let show = |p: &Path| p.display().to_string();
    let dir = sock
        .parent()
        .ok_or_else(|| UpgradeError::NoParent(show(sock)))?;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| UpgradeError::Dir(show(dir), e))?;
    }
    let meta = std::fs::metadata(dir).map_err(|e| UpgradeError::Dir(show(dir), e))?;
    let mode = meta.mode() & 0o7777;
    if meta.uid() != uid() || mode & 0o022 != 0 {
        return Err(UpgradeError::NotPrivate(show(dir), meta.uid(), mode));
    }
    Ok(sock.to_owned())
}

/// [`checked`], or the disabled path with the reason logged.
pub fn socket_or_disabled(sock: &Path) -> PathBuf {
    checked(sock).unwrap_or_else(|e| {
        log::warn!("zero-downtime upgrade disabled (SIGQUIT only stops the router): {e}");
        PathBuf::from(DISABLED)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_socket_is_named_after_listen_in_a_private_directory() {
        let dir =
            std::env::temp_dir().join(format!("prefix-router-upgrade-test-{}", std::process::id()));
        let sock = dir.join("private").join("u.sock");
        assert_eq!(checked(&sock).unwrap(), sock);
        let mode = std::fs::metadata(sock.parent().unwrap()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // A directory others can write to is refused, and disables the hand-over.
        let open = dir.join("open");
        std::fs::create_dir_all(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
            .unwrap();
        let e = checked(&open.join("u.sock")).unwrap_err().to_string();
        assert!(e.contains("not private"), "{e}");
        assert_eq!(
            socket_or_disabled(&open.join("u.sock")),
            PathBuf::from(DISABLED)
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let cfg = Config {
            listen: "0.0.0.0:8080".into(),
            ..Config::default()
        };
        assert!(socket(&cfg).ends_with("upgrade-0_0_0_0_8080.sock"));
    }
}
