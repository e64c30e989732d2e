//! Crash points: named steps of the agent's durable work (start-up, prepare, unprepare, file
//! writes, slice publication) where a test can stop the agent so that it SIGKILLs it at
//! exactly that step (tests/it/crash.rs). The kill is real; this only chooses where it lands.
//!
//! `GPUPLANE_CRASHPOINT=<step>[@<detail>][#<n>]` arms one [`Step`] by its name: the `n`-th time
//! (default: the first) the agent reaches it with a detail containing `<detail>` (the file
//! name for `file.*` steps, the slice name for `slices.*`), it writes the step's name to the
//! file `GPUPLANE_CRASHPOINT_MARKER` (when set), logs it and blocks that thread for good,
//! leaving the caller to kill the process. Unset, a step costs one initialised-once load.
//! A value naming no step is logged once and arms nothing.
//!
//! Only a build with the cargo feature `crashpoints` (the test suite's, `hack/test.sh`) can
//! stop there: without it, the shipped binary's, every step is an empty inline function and
//! `GPUPLANE_CRASHPOINT` means nothing.

#[cfg(feature = "crashpoints")]
use std::sync::atomic::{AtomicU32, Ordering};
#[cfg(feature = "crashpoints")]
use std::sync::OnceLock;

/// The variable that arms a crash point.
pub const ENV: &str = "GPUPLANE_CRASHPOINT";
/// The variable naming the file written when the armed step is reached.
pub const MARKER_ENV: &str = "GPUPLANE_CRASHPOINT_MARKER";

/// Every step a crash point can be armed at; [`Step::ALL`] lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Start-up: the DRA checkpoint not loaded yet, so its holds are not in the ledger.
    StartupBeforeDraHolds,
    /// Prepare: devices held in the ledger, nothing written yet.
    PrepareBeforeCheckpoint,
    /// Prepare of an MPS share: its unit's control daemon started, nothing written yet.
    PrepareAfterMpsStart,
    /// Prepare: the checkpoint records the claim and its spec, no spec file written yet.
    PrepareAfterCheckpoint,
    /// Prepare of a dynamic MIG device: the checkpoint records the intent, no instance yet.
    PrepareAfterMigIntent,
    /// Prepare of a dynamic MIG device: the instance exists, the checkpoint does not say so.
    PrepareAfterMigCreate,
    /// Prepare: the claim's CDI spec file is written, the answer not yet sent.
    PrepareAfterCdiSpec,
    /// Unprepare: nothing removed yet.
    UnprepareBeforeSpecRemoval,
    /// Unprepare: the CDI spec is removed, the checkpoint still lists the claim.
    UnprepareAfterSpecRemoval,
    /// Unprepare: the checkpoint no longer lists the claim, the ledger still holds its units.
    UnprepareAfterCheckpoint,
    /// Unprepare of a unit's last MPS share: released, its control daemon not yet stopped.
    UnprepareBeforeMpsStop,
    /// Unprepare of a dynamic MIG device: the instance is destroyed, the checkpoint still
    /// lists it.
    UnprepareAfterMigDestroy,
    /// File write: the temporary file is written (and fsynced, when durable), not yet renamed.
    FileBeforeRename,
    /// Durable write: renamed over the target, the directory not yet fsynced.
    FileAfterRename,
    /// In-place overwrite: the new bytes are written, not yet fdatasynced.
    FileBeforeSync,
    /// Slice publication: one create, update or delete done, the rest of the sync not.
    SlicesAfterWrite,
}

impl Step {
    pub const ALL: [Step; 16] = [
        Step::StartupBeforeDraHolds,
        Step::PrepareBeforeCheckpoint,
        Step::PrepareAfterMpsStart,
        Step::PrepareAfterCheckpoint,
        Step::PrepareAfterMigIntent,
        Step::PrepareAfterMigCreate,
        Step::PrepareAfterCdiSpec,
        Step::UnprepareBeforeSpecRemoval,
        Step::UnprepareAfterSpecRemoval,
        Step::UnprepareAfterCheckpoint,
        Step::UnprepareBeforeMpsStop,
        Step::UnprepareAfterMigDestroy,
        Step::FileBeforeRename,
        Step::FileAfterRename,
        Step::FileBeforeSync,
        Step::SlicesAfterWrite,
    ];

    /// The name `GPUPLANE_CRASHPOINT` uses.
    pub fn name(self) -> &'static str {
        match self {
            Step::StartupBeforeDraHolds => "startup.before-dra-holds",
            Step::PrepareBeforeCheckpoint => "prepare.before-checkpoint",
            Step::PrepareAfterMpsStart => "prepare.after-mps-start",
            Step::PrepareAfterCheckpoint => "prepare.after-checkpoint",
            Step::PrepareAfterMigIntent => "prepare.after-mig-intent",
            Step::PrepareAfterMigCreate => "prepare.after-mig-create",
            Step::PrepareAfterCdiSpec => "prepare.after-cdi-spec",
            Step::UnprepareBeforeSpecRemoval => "unprepare.before-spec-removal",
            Step::UnprepareAfterSpecRemoval => "unprepare.after-spec-removal",
            Step::UnprepareAfterCheckpoint => "unprepare.after-checkpoint",
            Step::UnprepareBeforeMpsStop => "unprepare.before-mps-stop",
            Step::UnprepareAfterMigDestroy => "unprepare.after-mig-destroy",
            Step::FileBeforeRename => "file.before-rename",
            Step::FileAfterRename => "file.after-rename",
            Step::FileBeforeSync => "file.before-sync",
            Step::SlicesAfterWrite => "slices.after-write",
        }
    }
}

/// The armed step, parsed from the environment once.
#[cfg(feature = "crashpoints")]
#[derive(Debug)]
struct Armed {
    step: Step,
    detail: String,
    nth: u32,
    seen: AtomicU32,
    spec: String,
}

/// `<step>[@<detail>][#<n>]`; `None` when it names no step or `n` is not a positive number.
#[cfg(feature = "crashpoints")]
fn parse(spec: &str) -> Option<Armed> {
    let (rest, nth) = match spec.rsplit_once('#') {
        Some((rest, n)) => (rest, n.parse::<u32>().ok().filter(|n| *n > 0)?),
        None => (spec, 1),
    };
    let (name, detail) = rest.split_once('@').unwrap_or((rest, ""));
    let step = Step::ALL.into_iter().find(|s| s.name() == name)?;
    Some(Armed {
        step,
        detail: detail.to_string(),
        nth,
        seen: AtomicU32::new(0),
        spec: spec.to_string(),
    })
}

#[cfg(feature = "crashpoints")]
fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var(ENV).ok()?;
            let armed = parse(&spec);
            if armed.is_none() {
                let known: Vec<&str> = Step::ALL.iter().map(|s| s.name()).collect();
                tracing::error!(
                    value = %spec,
                    known = %known.join(", "),
                    "{ENV} is not `<step>[@<detail>][#<n>]` with a known step; no crash point armed"
                );
            }
            armed
        })
        .as_ref()
}

/// Logs the armed crash point, if any, so a run under test says so at start-up.
#[cfg(feature = "crashpoints")]
pub fn announce() {
    if let Some(a) = armed() {
        tracing::warn!(crashpoint = %a.spec, "crash point armed: the agent stops there for good");
    }
}

/// The agent reached `step`.
pub fn reached(step: Step) {
    reached_at(step, "");
}

/// The agent reached `step` about `detail` (a file or slice name).
#[cfg(feature = "crashpoints")]
pub fn reached_at(step: Step, detail: &str) {
    let Some(a) = armed() else { return };
    if a.step != step || !detail.contains(a.detail.as_str()) {
        return;
    }
    if a.seen.fetch_add(1, Ordering::SeqCst) + 1 != a.nth {
        return;
    }
    tracing::warn!(crashpoint = %a.spec, detail, "crash point reached; stopping here");
    if let Some(marker) = std::env::var_os(MARKER_ENV) {
        if let Err(e) = std::fs::write(&marker, step.name()) {
            tracing::error!(error = %e, "writing the crash point marker failed");
        }
    }
    loop {
        std::thread::park();
    }
}

/// Without the `crashpoints` feature: nothing is armed, nothing is said.
#[cfg(not(feature = "crashpoints"))]
#[inline(always)]
pub fn announce() {}

/// Without the `crashpoints` feature: a step is nothing.
#[cfg(not(feature = "crashpoints"))]
#[inline(always)]
pub fn reached_at(_step: Step, _detail: &str) {}

#[cfg(all(test, feature = "crashpoints"))]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_parse_back() {
        for s in Step::ALL {
            let a = parse(s.name()).unwrap();
            assert_eq!((a.step, a.detail.as_str(), a.nth), (s, "", 1));
            assert_eq!(Step::ALL.iter().filter(|t| t.name() == s.name()).count(), 1);
        }
        let a = parse("file.before-rename@dra-checkpoint#2").unwrap();
        assert_eq!(
            (a.step, a.detail.as_str(), a.nth),
            (Step::FileBeforeRename, "dra-checkpoint", 2)
        );
        for bad in [
            "",
            "prepare",
            "file.before-rename#0",
            "file.before-rename#x",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }
}
