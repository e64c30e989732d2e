//! Writing CDI spec files: `<cdi root>/<stem>.json`, 0644, replaced atomically through
//! [`crate::fsutil`] (durably, or recreatable when a durable record can rewrite the file at
//! start: [`Durability`]), and not rewritten when the bytes on disk are already the same (so a
//! runtime's directory watcher sees no churn).

use super::spec::Spec;
use crate::fsutil::{self, FsError};
use gpuplane_model::report::chain;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Mode of spec files: runtimes run as other users read them.
pub const SPEC_MODE: u32 = 0o644;

/// Why a spec could not be written or removed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("CDI spec file stem `{stem}`: {reason}")]
    BadStem { stem: String, reason: &'static str },
    #[error("creating CDI spec directory {dir}: {}", chain(.cause))]
    CreateDir { dir: PathBuf, cause: io::Error },
    #[error("serialising CDI spec {path}: {}", chain(.cause))]
    Serialise {
        path: PathBuf,
        cause: serde_json::Error,
    },
    #[error("writing CDI spec {path}: {}", chain(.cause))]
    Write { path: PathBuf, cause: FsError },
    #[error("removing CDI spec {path}: {}", chain(.cause))]
    Remove { path: PathBuf, cause: FsError },
}

/// How a spec write must survive a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Fsync'd: the new spec survives a power loss once the write returns (the node spec,
    /// which nothing else records).
    Durable,
    /// Atomic but not fsync'd ([`fsutil::write_atomic_unsynced`], [`fsutil::remove_unsynced`]):
    /// for a claim's spec, which the DRA checkpoint records durably (the agent rewrites it from
    /// there at start) and which the agent sweeps away after a reboot.
    Recoverable,
}

/// What [`write_spec`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written,
    /// The file already held exactly these bytes; nothing was touched.
    Unchanged,
}

fn check_stem(stem: &str) -> Result<(), WriteError> {
    let bad = |reason| {
        Err(WriteError::BadStem {
            stem: stem.to_string(),
            reason,
        })
    };
    if stem.is_empty() {
        return bad("empty");
    }
    if !stem
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '.' | '-'))
    {
        return bad("only a-z, 0-9, `_`, `.` and `-` are allowed");
    }
    if stem.starts_with('.') || stem.contains("..") {
        return bad("must not start with `.` or contain `..`");
    }
    Ok(())
}

/// `<cdi_root>/<file_stem>.json`, after validating the stem (`[a-z0-9_.-]`, not starting with
/// `.`, no `..`).
pub fn spec_path(cdi_root: &Path, file_stem: &str) -> Result<PathBuf, WriteError> {
    check_stem(file_stem)?;
    Ok(cdi_root.join(format!("{file_stem}.json")))
}

/// The bytes [`write_spec`] writes: pretty JSON and a final newline.
pub fn spec_bytes(spec: &Spec) -> Result<Vec<u8>, serde_json::Error> {
    let mut bytes = serde_json::to_vec_pretty(spec)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// Writes `spec` to `<cdi_root>/<file_stem>.json` (creating `cdi_root` if needed) unless the
/// file already holds the same bytes.
pub fn write_spec(
    cdi_root: &Path,
    file_stem: &str,
    spec: &Spec,
    durability: Durability,
) -> Result<WriteOutcome, WriteError> {
    let path = spec_path(cdi_root, file_stem)?;
    let bytes = spec_bytes(spec).map_err(|source| WriteError::Serialise {
        path: path.clone(),
        cause: source,
    })?;
    // Any read failure (absent, unreadable) just means: write.
    if fs::read(&path).is_ok_and(|old| old == bytes) {
        return Ok(WriteOutcome::Unchanged);
    }
    fs::create_dir_all(cdi_root).map_err(|source| WriteError::CreateDir {
        dir: cdi_root.to_path_buf(),
        cause: source,
    })?;
    let write = match durability {
        Durability::Durable => fsutil::write_atomic,
        Durability::Recoverable => fsutil::write_atomic_unsynced,
    };
    write(&path, &bytes, SPEC_MODE).map_err(|source| WriteError::Write {
        path,
        cause: source,
    })?;
    Ok(WriteOutcome::Written)
}

/// Removes `<cdi_root>/<file_stem>.json`; a spec that is not there is not an error.
pub fn remove_spec(
    cdi_root: &Path,
    file_stem: &str,
    durability: Durability,
) -> Result<(), WriteError> {
    let path = spec_path(cdi_root, file_stem)?;
    let remove = match durability {
        Durability::Durable => fsutil::remove_durable,
        Durability::Recoverable => fsutil::remove_unsynced,
    };
    remove(&path).map_err(|source| WriteError::Remove {
        path,
        cause: source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn spec(kind: &str) -> Spec {
        Spec {
            cdi_version: "0.3.0".into(),
            kind: kind.into(),
            ..Default::default()
        }
    }

    #[test]
    fn writes_once_then_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("run/cdi");
        let s = spec("nvidia.com/gpu");
        assert_eq!(
            write_spec(&root, "gpuplane-node", &s, Durability::Durable).unwrap(),
            WriteOutcome::Written
        );
        let path = root.join("gpuplane-node.json");
        let mtime = fs::metadata(&path).unwrap().modified().unwrap();
        assert_eq!(
            write_spec(&root, "gpuplane-node", &s, Durability::Durable).unwrap(),
            WriteOutcome::Unchanged
        );
        assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), mtime);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
        let back: Spec = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, s);

        assert_eq!(
            write_spec(
                &root,
                "gpuplane-node",
                &spec("example.com/gpu"),
                Durability::Durable
            )
            .unwrap(),
            WriteOutcome::Written
        );
        remove_spec(&root, "gpuplane-node", Durability::Durable).unwrap();
        assert!(!path.exists());
        remove_spec(&root, "gpuplane-node", Durability::Recoverable).unwrap();
        assert_eq!(fs::read_dir(&root).unwrap().count(), 0);
    }

    #[test]
    fn rejects_bad_stems() {
        let dir = tempfile::tempdir().unwrap();
        for bad in [
            "", "../x", "a/b", "..", ".hidden", "a..b", "Upper", "a b", "x.json/",
        ] {
            let err = write_spec(
                dir.path(),
                bad,
                &spec("nvidia.com/gpu"),
                Durability::Durable,
            )
            .unwrap_err();
            assert!(matches!(err, WriteError::BadStem { .. }), "{bad:?}: {err}");
            assert!(remove_spec(dir.path(), bad, Durability::Durable).is_err());
        }
        for ok in ["gpuplane", "gpuplane-claim-0a1b.2_c"] {
            assert!(spec_path(dir.path(), ok).is_ok());
        }
    }

    #[test]
    fn write_error_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        // The CDI root is a regular file: it cannot be created as a directory.
        let root = dir.path().join("not-a-dir");
        fs::write(&root, b"").unwrap();
        let err = write_spec(
            &root,
            "gpuplane",
            &spec("nvidia.com/gpu"),
            Durability::Durable,
        )
        .unwrap_err();
        assert!(err.to_string().contains("not-a-dir"), "{err}");
        // The OS's reason is in the message once, not also a source() (report.rs).
        assert!(err.to_string().contains("(os error"), "{err}");
        assert!(std::error::Error::source(&err).is_none());
    }
}
