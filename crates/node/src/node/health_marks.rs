//! Xid health marks that outlive the agent: `<state dir>/health-marks.json`.
//!
//! A GPU marked unhealthy by a critical Xid stays out of service until its quiet period has
//! passed without another one. Without this file a restarted agent (an upgrade, an OOM kill)
//! would offer such a GPU as healthy at once, untaint its ResourceSlice and hand it out. The
//! state owner changes marks only in memory; [`keep`] writes them (off the runtime, atomically)
//! whenever they change, and [`read`] gives them back at start, where the health book ages each
//! by the wall clock ([`HealthBook::restore`](crate::health::HealthBook::restore)).
//!
//! Marks belong to one boot: a reboot resets the GPUs (as a GPU reset would, which NVIDIA's Xid
//! catalogue prescribes for most critical Xids), so marks of another boot id are dropped. Lost
//! GPUs are not kept: discovery finds one that still does not answer.

use crate::health::SavedMark;
use crate::node::http::now_ms;
use crate::state::NodeState;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;

/// The file, in the state directory.
pub const FILE: &str = "health-marks.json";

/// Two saved times closer than this are the same mark (a restored mark, aged again, comes back
/// a few milliseconds off).
const SAME_WITHIN_MS: u64 = 1_000;

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Saved {
    /// The boot the marks belong to; `None` where the boot id could not be read.
    boot_id: Option<String>,
    marks: Vec<SavedMark>,
}

/// The file's path under `state_dir`.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

/// The marks saved in this boot: none when the file is absent, of another boot, or unreadable
/// (then logged: a mark lost costs a GPU's quiet period, never a wrong allocation). Blocks.
pub fn read(state_dir: &Path, boot_id: Option<&str>) -> Vec<SavedMark> {
    let file = path(state_dir);
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %file.display(), error = %e, "cannot read the saved health marks; GPUs marked by an Xid before the restart are healthy again");
            return Vec::new();
        }
    };
    let saved: Saved = match serde_json::from_slice(&bytes) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(path = %file.display(), error = %e, "the saved health marks do not decode; ignoring them (the file is rewritten at the next change)");
            return Vec::new();
        }
    };
    if saved.boot_id.as_deref() != boot_id {
        if !saved.marks.is_empty() {
            tracing::info!(
                marks = saved.marks.len(),
                "the node rebooted since the Xid marks were saved: dropping them"
            );
        }
        return Vec::new();
    }
    saved.marks
}

/// Whether `a` and `b` record the same marks.
fn same(a: &[SavedMark], b: &[SavedMark]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.unit == y.unit
                && x.xid == y.xid
                && x.at_unix_ms.abs_diff(y.at_unix_ms) < SAME_WITHIN_MS
        })
}

/// Writes the marks whenever they change until `stop`; `written` is what the file holds now
/// (what [`read`] returned). A failed write is logged and tried again at the next change.
pub async fn keep(
    state: Arc<NodeState>,
    state_dir: PathBuf,
    boot_id: Option<String>,
    mut written: Vec<SavedMark>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = state.subscribe();
    let file = path(&state_dir);
    loop {
        let marks = state.read().health.saved_marks(Instant::now(), now_ms());
        if !same(&marks, &written) {
            let saved = Saved {
                boot_id: boot_id.clone(),
                marks: marks.clone(),
            };
            let target = file.clone();
            let wrote = tokio::task::spawn_blocking(move || {
                let bytes = serde_json::to_vec_pretty(&saved).map_err(|e| e.to_string())?;
                crate::fsutil::write_atomic(&target, &bytes, 0o644).map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r);
            match wrote {
                Ok(()) => written = marks,
                Err(e) => {
                    tracing::warn!(path = %file.display(), error = %e, "saving the health marks failed; a restart now would forget them")
                }
            }
        }
        tokio::select! {
            _ = stop.changed() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(unit: &str, at: u64) -> SavedMark {
        SavedMark {
            unit: unit.into(),
            xid: 48,
            at_unix_ms: at,
        }
    }

    #[test]
    fn marks_of_this_boot_come_back_and_others_do_not() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path(), Some("b1")).is_empty(), "no file yet");
        let saved = Saved {
            boot_id: Some("b1".into()),
            marks: vec![mark("GPU-1", 5)],
        };
        std::fs::write(path(dir.path()), serde_json::to_vec(&saved).unwrap()).unwrap();
        assert_eq!(read(dir.path(), Some("b1")), saved.marks);
        assert!(read(dir.path(), Some("b2")).is_empty(), "another boot");
        std::fs::write(path(dir.path()), b"{not json").unwrap();
        assert!(read(dir.path(), Some("b1")).is_empty(), "corrupt");
    }

    #[test]
    fn a_mark_aged_again_is_the_same_mark() {
        assert!(same(&[mark("GPU-1", 1_000)], &[mark("GPU-1", 1_400)]));
        assert!(!same(&[mark("GPU-1", 1_000)], &[mark("GPU-1", 3_000)]));
        assert!(!same(&[mark("GPU-1", 1_000)], &[mark("GPU-2", 1_000)]));
        assert!(!same(&[], &[mark("GPU-1", 1_000)]));
    }
}
