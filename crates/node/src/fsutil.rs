//! Durable file writes: the one way the agent replaces a file on disk.
//!
//! [`write_atomic`] writes a temporary file in the target's directory (tempfile's, which removes
//! it on any error; given the requested mode), fsyncs it, renames it over the target and fsyncs
//! the directory, so a reader (a container
//! runtime reading a CDI spec, the agent reading its checkpoint after a crash) sees either the old
//! content or the new, never half a file, and the new content survives a power loss once the call
//! returns. [`remove_durable`] is the matching removal. Every error names the path it concerns.
//! A process killed mid-write leaves its temporary file behind (never read: the name is hidden
//! and does not end in `.json`); [`remove_stale_temps`] clears them at the next start.
//! Crash points `file.before-rename` and `file.after-rename` ([`crate::crashpoint`]) mark the
//! two steps a kill can split.
//!
//! [`overwrite_in_place`] rewrites an existing file with one fdatasync and no rename, for the
//! DRA checkpoint's slots, which a checksum and a second copy make safe to tear.
//!
//! [`write_atomic_unsynced`] and [`remove_unsynced`] are the same without the syncs: atomic for
//! every reader and across a killed process (the page cache survives it), but not across a
//! power loss. They are only for files the agent repairs at start: a claim's CDI spec, which
//! the DRA checkpoint records durably and which is swept after a reboot. A prepare then pays
//! for one durable write, not two.

use crate::crashpoint::{self, Step};
use gpuplane_model::report::chain;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Why a durable write or removal failed. Each variant names the file it was about.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The path has no file name (e.g. `/` or `..`), so there is nothing to replace.
    #[error("{path}: not a file path")]
    NotAFile { path: PathBuf },
    /// The temporary file next to the target could not be created.
    #[error("creating a temporary file in {dir} for {path}: {}", chain(.cause))]
    CreateTemp {
        path: PathBuf,
        dir: PathBuf,
        cause: io::Error,
    },
    /// Writing, setting the mode of or syncing the temporary file failed.
    #[error("writing {tmp} (new content for {path}): {}", chain(.cause))]
    Write {
        path: PathBuf,
        tmp: PathBuf,
        cause: io::Error,
    },
    /// The temporary file could not be renamed over the target.
    #[error("renaming {tmp} to {path}: {}", chain(.cause))]
    Rename {
        path: PathBuf,
        tmp: PathBuf,
        cause: io::Error,
    },
    /// Writing over or syncing an existing file in place failed.
    #[error("writing {path} in place: {}", chain(.cause))]
    Overwrite { path: PathBuf, cause: io::Error },
    /// The target could not be removed.
    #[error("removing {path}: {}", chain(.cause))]
    Remove { path: PathBuf, cause: io::Error },
    /// A directory could not be listed.
    #[error("listing directory {dir}: {}", chain(.cause))]
    ListDir { dir: PathBuf, cause: io::Error },
    /// The directory holding the target could not be synced after a rename or removal.
    #[error("syncing directory {dir} after updating {path}: {}", chain(.cause))]
    SyncDir {
        path: PathBuf,
        dir: PathBuf,
        cause: io::Error,
    },
}

/// The directory holding `path`; `.` for a bare file name.
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// How many random letters and digits end a temporary name (tempfile's choice of name).
const TEMP_RAND: usize = 8;

/// The start of every temporary name for a file named `file_name`: `.<file_name>.tmp-`. Hidden
/// and not ending in `.json`, so no reader of the directory takes it for a spec.
fn temp_prefix(file_name: &std::ffi::OsStr) -> std::ffi::OsString {
    let mut name = std::ffi::OsString::from(".");
    name.push(file_name);
    name.push(".tmp-");
    name
}

/// Whether `name` is a temporary name made for a file starting with `prefix`:
/// `.<prefix><rest>.tmp-` and [`TEMP_RAND`] letters and digits.
fn is_temp_for(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix('.').filter(|r| r.starts_with(prefix)) else {
        return false;
    };
    let Some((_, tail)) = rest.rsplit_once(".tmp-") else {
        return false;
    };
    tail.len() == TEMP_RAND && tail.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Removes the temporary files an earlier, killed writer left in `dir` for files whose names
/// start with `prefix`, and returns them. Call it before this process writes there: in a
/// container the agent's pid is the same on every restart, so the pid in the name cannot tell
/// an old writer from this one. A missing directory has none.
pub fn remove_stale_temps(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>, FsError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(FsError::ListDir {
                dir: dir.to_path_buf(),
                cause: source,
            })
        }
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| FsError::ListDir {
            dir: dir.to_path_buf(),
            cause: source,
        })?;
        if !is_temp_for(&entry.file_name().to_string_lossy(), prefix) {
            continue;
        }
        let path = entry.path();
        fs::remove_file(&path).map_err(|source| FsError::Remove {
            path: path.clone(),
            cause: source,
        })?;
        removed.push(path);
    }
    if !removed.is_empty() {
        sync_dir(dir, dir)?;
    }
    Ok(removed)
}

/// Replaces the content of `path` with `bytes`, atomically and durably, leaving the file with
/// exactly `mode` (e.g. `0o644`; the umask does not apply). The directory must exist.
///
/// On error the target is untouched and no temporary file is left behind.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FsError> {
    replace(path, bytes, mode, true)
}

/// [`write_atomic`] without fsyncing the file or the directory: readers and a restarted
/// process see the old content or the new, never half a file, but a power loss may lose the
/// new content (or leave the file empty). Only for files recreated at start from a durable
/// record.
pub fn write_atomic_unsynced(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FsError> {
    replace(path, bytes, mode, false)
}

fn replace(path: &Path, bytes: &[u8], mode: u32, durable: bool) -> Result<(), FsError> {
    let file_name = path.file_name().ok_or_else(|| FsError::NotAFile {
        path: path.to_path_buf(),
    })?;
    let dir = parent_dir(path);

    // Dropped on any error below, the temporary file removes itself.
    let mut tmp = tempfile::Builder::new()
        .prefix(&temp_prefix(file_name))
        .rand_bytes(TEMP_RAND)
        .tempfile_in(&dir)
        .map_err(|cause| FsError::CreateTemp {
            path: path.to_path_buf(),
            dir: dir.clone(),
            cause,
        })?;
    let written = tmp
        .as_file_mut()
        .write_all(bytes)
        .and_then(|()| tmp.as_file().set_permissions(Permissions::from_mode(mode)))
        .and_then(|()| {
            if durable {
                tmp.as_file().sync_all()
            } else {
                Ok(())
            }
        });
    if let Err(cause) = written {
        return Err(FsError::Write {
            path: path.to_path_buf(),
            tmp: tmp.path().to_path_buf(),
            cause,
        });
    }
    crashpoint::reached_at(Step::FileBeforeRename, &path.to_string_lossy());
    tmp.persist(path).map_err(|e| FsError::Rename {
        path: path.to_path_buf(),
        tmp: e.file.path().to_path_buf(),
        cause: e.error,
    })?;
    crashpoint::reached_at(Step::FileAfterRename, &path.to_string_lossy());
    if durable {
        sync_dir(path, &dir)?;
    }
    Ok(())
}

fn sync_dir(path: &Path, dir: &Path) -> Result<(), FsError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| FsError::SyncDir {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
            cause: source,
        })
}

/// Replaces the content of the existing file `path` in place and fdatasyncs it: one flush, no
/// rename, no directory sync. Not atomic: a crash midway leaves a mix of old and new bytes. Only
/// for a file read back through a checksum, beside another copy of the previous content (the
/// DRA checkpoint's two slots). A missing `path` is an error: create it with [`write_atomic`].
pub fn overwrite_in_place(path: &Path, bytes: &[u8]) -> Result<(), FsError> {
    overwrite(path, bytes, true)
}

/// [`overwrite_in_place`] without the fdatasync: a restarted process reads the new bytes, a
/// power loss may tear them. Only for content that matters only until the next boot.
pub fn overwrite_in_place_unsynced(path: &Path, bytes: &[u8]) -> Result<(), FsError> {
    overwrite(path, bytes, false)
}

fn overwrite(path: &Path, bytes: &[u8], durable: bool) -> Result<(), FsError> {
    use std::os::unix::fs::FileExt;
    let overwrite = |cause| FsError::Overwrite {
        path: path.to_path_buf(),
        cause,
    };
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(overwrite)?;
    file.write_all_at(bytes, 0)
        .and_then(|()| file.set_len(bytes.len() as u64))
        .map_err(overwrite)?;
    if !durable {
        return Ok(());
    }
    crashpoint::reached_at(Step::FileBeforeSync, &path.to_string_lossy());
    file.sync_data().map_err(overwrite)
}

/// Removes `path` without syncing its directory: a power loss may bring it back. A file that
/// is already gone is not an error.
pub fn remove_unsynced(path: &Path) -> Result<(), FsError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(FsError::Remove {
            path: path.to_path_buf(),
            cause: e,
        }),
        _ => Ok(()),
    }
}

/// Removes `path` and syncs its directory. A file that is already gone is not an error.
pub fn remove_durable(path: &Path) -> Result<(), FsError> {
    match fs::remove_file(path) {
        Ok(()) => sync_dir(path, &parent_dir(path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(FsError::Remove {
            path: path.to_path_buf(),
            cause: source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn replaces_content_and_leaves_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.json");
        write_atomic(&path, b"first", 0o644).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"first");
        write_atomic(&path, b"second, longer", 0o644).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second, longer");
        write_atomic(&path, b"", 0o644).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"");
        assert_eq!(entries(dir.path()), vec!["spec.json".to_string()]);
    }

    #[test]
    fn sets_the_mode_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        write_atomic(&path, b"x", 0o600).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // Replacing an existing file takes the new mode too; umask (usually 022) does not apply.
        write_atomic(&path, b"y", 0o666).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o666
        );
    }

    #[test]
    fn errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("spec.json");
        let err = write_atomic(&path, b"x", 0o644).unwrap_err();
        assert!(matches!(err, FsError::CreateTemp { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        // The OS's reason is in the message once, not also a source() (report.rs).
        assert!(
            err.to_string().contains("No such file or directory"),
            "{err}"
        );
        assert!(std::error::Error::source(&err).is_none());

        // Renaming over a non-empty directory fails; the temp file is cleaned up.
        let target = dir.path().join("occupied");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("inner"), b"").unwrap();
        let err = write_atomic(&target, b"x", 0o644).unwrap_err();
        assert!(matches!(err, FsError::Rename { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&target.display().to_string()),
            "{err}"
        );
        assert_eq!(entries(dir.path()), vec!["occupied".to_string()]);

        let err = write_atomic(Path::new("/"), b"x", 0o644).unwrap_err();
        assert!(err.to_string().starts_with("/:"), "{err}");
    }

    #[test]
    fn stale_temps_of_the_prefix_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let keep = [
            "spec.json",
            ".spec.json",
            ".other.json.tmp-1-2-3",
            ".spec.json.tmp-1-x-3",
        ];
        for n in keep {
            fs::write(dir.path().join(n), b"").unwrap();
        }
        let stale = dir.path().join(".spec.json.tmp-a1B2c3D4");
        fs::write(&stale, b"half").unwrap();
        assert_eq!(remove_stale_temps(dir.path(), "spec").unwrap(), vec![stale]);
        let mut want: Vec<String> = keep.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(entries(dir.path()), want);
        assert!(remove_stale_temps(&dir.path().join("none"), "spec")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_recreatable_write_replaces_content_with_the_mode_and_no_temp_files() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("claim.json");
        write_atomic_unsynced(&path, b"one", 0o644).unwrap();
        write_atomic_unsynced(&path, b"two", 0o644).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        assert_eq!(entries(dir.path()), vec!["claim.json".to_string()]);
    }

    #[test]
    fn an_in_place_overwrite_replaces_longer_and_shorter_content_and_needs_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slot");
        write_atomic(&path, b"0123456789", 0o600).unwrap();
        overwrite_in_place(&path, b"abc").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"abc");
        overwrite_in_place(&path, b"a longer content").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"a longer content");
        let err = overwrite_in_place(&dir.path().join("none"), b"x").unwrap_err();
        assert!(err.to_string().contains("none"), "{err}");
    }

    #[test]
    fn remove_is_durable_and_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.json");
        write_atomic(&path, b"x", 0o644).unwrap();
        remove_durable(&path).unwrap();
        assert!(!path.exists());
        remove_durable(&path).unwrap();
        write_atomic(&path, b"x", 0o644).unwrap();
        remove_unsynced(&path).unwrap();
        assert!(!path.exists());
        remove_unsynced(&path).unwrap();
        let sub = dir.path().join("sub");
        fs::create_dir(&sub).unwrap();
        fs::write(sub.join("f"), b"").unwrap();
        let err = remove_durable(&sub).unwrap_err();
        assert!(
            err.to_string().contains(&sub.display().to_string()),
            "{err}"
        );
    }
}
