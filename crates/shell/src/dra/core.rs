//! The DRA core: prepares and unprepares ResourceClaims for the kubelet ([`DraDriver`]).
//!
//! Preparing a claim (NodePrepareResources):
//!
//! 1. a claim whose checkpoint entry is `PrepareCompleted` (and whose CDI spec file is still
//!    there) gets the recorded devices back and nothing is written: a repeated prepare never
//!    moves a claim backwards (NVIDIA's driver set it back to PrepareStarted, after which
//!    unprepare failed for ever, #727/#729);
//! 2. otherwise the claim is read from the API server and [`plan_claim`] decides its devices
//!    and their config;
//! 3. the checkpoint records `PrepareStarted` (with the spec's file stem), so a crash after
//!    the next step leaves a trace unprepare can clean up;
//! 4. one CDI spec per claim is written, `<cdi root>/gpuplane-claim-<uid>.json`, kind
//!    `k8s.<driver>/claim` (`k8s.gpu.gpuplane.dev/claim` by default), one CDI device per DRA
//!    device named `<claim uid>-<DRA device name>`, carrying the config's environment;
//! 5. the checkpoint records `PrepareCompleted` with the devices returned to the kubelet.
//!
//! A claim left `PrepareStarted` by a crash is simply prepared again (its spec rewritten) when
//! the kubelet retries, which it always does until prepare or unprepare succeeds.
//!
//! Each claim succeeds or fails on its own; a failure is an error string naming the claim
//! (`claim <namespace>/<name> (<uid>): <reason>`), logged once.
//!
//! Names coming from the kubelet are validated before use: the UID must be lower-case hex and
//! dashes (it is the only input that reaches a file name), namespace and name must be DNS
//! subdomains (they become API paths).
//!
//! A spec is only written once the device nodes its devices need exist and are what they must
//! be (a spec made before the driver created `/dev/nvidia*` gave NVIDIA users containers
//! without GPUs, #1380): until then the prepare fails naming them ([`DeviceNodesError`], the
//! refusal the device plugin's Allocate gives too) and the kubelet retries.
//!
//! Simulated devices ([`DeviceMode::Simulated`]) have no nodes to wait for: their spec carries
//! each device's `GPUPLANE_DEVICE_<key>` identity and, spec-level, `NVIDIA_VISIBLE_DEVICES` with
//! the claim's UUIDs. The runtime applies spec-level edits once for any device of the spec, so a
//! container that references only some of a claim's requests still sees all of the claim's
//! UUIDs there, and one that references several claims sees one claim's value (the later
//! replaces the earlier); `GPUPLANE_DEVICE_*` are exact in both cases.
//!
//! Everything after the API read (the second checkpoint look, rendering with its device-node
//! checks, the ledger hold, both checkpoint writes and the spec write, each fsync'd) runs as one
//! job on tokio's blocking pool ([`off_runtime`]), never on a runtime worker, with the
//! checkpoint lock moved into the job: the steps keep their order, the answer waits for the
//! job, and a kubelet call cancelled meanwhile does not cut the job short. The state lock is
//! taken only for the short plan read and the hold, never across a file operation. The
//! driver's libraries are scanned once per driver version ([`InstallCache`]); device nodes are
//! checked on every prepare.

use super::checkpoint::{
    self, Checkpoint, CheckpointData, CheckpointError, ClaimEntry, ClaimState,
};
use super::claims::{plan_claim, ClaimError, ClaimPlan};
use super::fetch::{ClaimFetcher, FetchError};
use super::status;
use super::{
    ClaimRef, DeviceHealthReport, DeviceHealthState, DraDriver, PrepareResult, PreparedDevice,
};
use crate::cdi::{
    self, ContainerEdits, DeviceName, DeviceNodesError, DriverFiles, InstallCache, Kind, NameError,
    NamedDevices, ProcCaps, WriteError,
};
use crate::config::AllocationMode;
use crate::health::Health;
use crate::inventory::{DeviceRef, Inventory};
use crate::ledger::{
    dra_view, Held, Holder, LEDGER_HANDOUTS, LEDGER_HANDOUTS_HELP, LEDGER_REFUSALS,
    LEDGER_REFUSALS_HELP, LEDGER_RELEASES, LEDGER_RELEASES_HELP,
};
use crate::metrics;
use crate::node::state::NodeState;
use crate::source::DeviceMode;
use gpuplane_model::report::chain;
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{watch, Mutex, OwnedMutexGuard};
use tracing::{error, info, warn};

/// CDI class of the per-claim specs; the vendor is `k8s.<driver>`.
pub const CDI_CLASS: &str = "claim";
/// File stem prefix of the per-claim specs: `gpuplane-claim-<uid>`.
pub const SPEC_STEM_PREFIX: &str = "gpuplane-claim-";

/// Where the core reads and writes, and under which names.
#[derive(Debug, Clone)]
pub struct DraCoreConfig {
    /// The DRA driver name (`gpu.gpuplane.dev`).
    pub driver: String,
    /// This node's name: the pool the node's ResourceSlices publish.
    pub node_name: String,
    /// Where CDI specs go (`/var/run/cdi`).
    pub cdi_root: PathBuf,
    /// Root of the NVIDIA driver's user-space files as the host sees them (`/`).
    pub driver_root: PathBuf,
    /// Where the agent finds `driver_root` when it is mounted elsewhere (see `NodePaths`).
    pub driver_root_mount: Option<PathBuf>,
    /// Where device nodes live (`/dev`).
    pub dev_root: PathBuf,
    /// Where the kernel's `/proc` is: MIG access-capability minors are read from
    /// `<proc_root>/driver/nvidia-caps/`.
    pub proc_root: PathBuf,
    /// The agent's state directory; the checkpoint is `dra-checkpoint.json` in it.
    pub state_dir: PathBuf,
    /// This boot's id (`/proc/sys/kernel/random/boot_id`); injectable for tests.
    pub boot_id_path: PathBuf,
    /// Real GPUs (specs with device nodes and driver files) or simulated ones.
    pub device_mode: DeviceMode,
}

impl DraCoreConfig {
    /// The standard host paths for `driver` on `node_name` with state in `state_dir`.
    pub fn new(driver: &str, node_name: &str, state_dir: &Path) -> Self {
        DraCoreConfig {
            driver: driver.to_string(),
            node_name: node_name.to_string(),
            cdi_root: PathBuf::from("/var/run/cdi"),
            driver_root: PathBuf::from("/"),
            driver_root_mount: None,
            dev_root: PathBuf::from("/dev"),
            proc_root: PathBuf::from("/proc"),
            state_dir: state_dir.to_path_buf(),
            boot_id_path: PathBuf::from(checkpoint::DEFAULT_BOOT_ID_PATH),
            device_mode: DeviceMode::Hardware,
        }
    }
}

/// Why the core could not start.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("driver name `{driver}` does not make a CDI vendor `k8s.{driver}`: {}", chain(.cause))]
    Kind { driver: String, cause: NameError },
    #[error("loading the DRA checkpoint: {}", chain(.cause))]
    Checkpoint { cause: CheckpointError },
}

/// Why one claim could not be prepared or unprepared (the claim is named by the caller).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("claim UID `{uid}` is not lower-case hex digits and dashes")]
    BadUid { uid: String },
    #[error("claim {what} `{value}` is not a DNS subdomain")]
    BadName { what: &'static str, value: String },
    #[error("{}", chain(.cause))]
    Fetch { cause: Box<FetchError> },
    #[error("{}", chain(.cause))]
    Plan { cause: ClaimError },
    #[error(transparent)]
    MissingDeviceNodes(DeviceNodesError),
    #[error("CDI device name for {device}: {}", chain(.cause))]
    CdiName { device: String, cause: NameError },
    #[error("{}", chain(.cause))]
    Checkpoint { cause: CheckpointError },
    #[error("{}", chain(.cause))]
    Spec { cause: WriteError },
    /// The blocking-pool job that writes the claim's files panicked (a bug).
    #[error("the file-writing job failed: {0}")]
    Worker(String),
    /// Another consumer (a device-plugin container, another claim) holds a device of the claim.
    #[error("device {device}: {}; it cannot be given out twice", chain(.cause))]
    Held { device: String, cause: Box<Held> },
}

/// What a user must see of a failed prepare: an Event on the ResourceClaim with a reason
/// (PascalCase, for `kubectl get events --field-selector reason=...`) and a note naming what to
/// do. The kubelet's `FailedPrepareDynamicResources` on the pod carries the error text, but not
/// on the claim (which a shared claim's owner watches) and not what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserEvent {
    pub reason: &'static str,
    pub note: String,
}

impl PrepareError {
    /// The Event a user must see for this failure; None for failures the kubelet's retry
    /// resolves or only the node's operator can act on (those are logged).
    pub fn user_event(&self) -> Option<UserEvent> {
        let (reason, advice) = match self {
            PrepareError::Held { .. } => (
                "DeviceInUse",
                "another consumer (a device-plugin container or another claim) holds it; \
                 delete this claim's pod so the scheduler allocates another device, or wait \
                 until the holder ends",
            ),
            PrepareError::Plan {
                cause: ClaimError::Unhealthy { .. },
            } => (
                "DeviceUnhealthy",
                "delete this claim's pod (and the claim, if it is not from a template) so the \
                 scheduler allocates a healthy device; the device carries a health taint in its \
                 ResourceSlice",
            ),
            PrepareError::Plan {
                cause:
                    ClaimError::BadConfig { .. }
                    | ClaimError::NotApplicable { .. }
                    | ClaimError::UnknownSource { .. }
                    | ClaimError::ConflictingConfigs { .. },
            } => (
                "InvalidDeviceConfig",
                "fix the opaque device config (spec.devices.config of the claim or its \
                 DeviceClass) and create the claim again",
            ),
            PrepareError::Plan {
                cause: ClaimError::UnknownDevice { .. } | ClaimError::OtherPool { .. },
            } => (
                "DeviceNotOnNode",
                "the allocation names a device this node does not publish (a stale \
                 ResourceSlice?); delete the pod and its claim to get a fresh allocation",
            ),
            PrepareError::MissingDeviceNodes(_) => (
                "DeviceNodesMissing",
                "the NVIDIA driver has not created its device nodes (or something else is in \
                 their place) on this node; preparing is retried, and if this persists the \
                 node's driver installation needs a look",
            ),
            _ => return None,
        };
        Some(UserEvent {
            reason,
            note: truncate(format!("{self}: {advice}."), MAX_NOTE_BYTES),
        })
    }
}

/// The API server refuses an Event note over 1 kB.
const MAX_NOTE_BYTES: usize = 1024;

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max - '…'.len_utf8();
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// The per-claim error the kubelet gets: `claim <namespace>/<name> (<uid>): <reason>`.
pub fn kubelet_error(c: &ClaimRef, e: &PrepareError) -> String {
    format!("claim {} ({}): {e}", claim_label(c), c.uid)
}

impl From<CheckpointError> for PrepareError {
    fn from(source: CheckpointError) -> Self {
        PrepareError::Checkpoint { cause: source }
    }
}

impl From<WriteError> for PrepareError {
    fn from(source: WriteError) -> Self {
        PrepareError::Spec { cause: source }
    }
}

/// Kubernetes UIDs are UUIDs; accept lower-case hex and dashes, starting and ending with a
/// digit, at most 64 characters. Nothing else may reach a file name.
pub fn validate_uid(uid: &str) -> Result<(), PrepareError> {
    let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    let ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| hex(b) || b == b'-')
        && uid.bytes().next().is_some_and(hex)
        && uid.bytes().last().is_some_and(hex);
    if ok {
        Ok(())
    } else {
        Err(PrepareError::BadUid {
            uid: uid.to_string(),
        })
    }
}

pub fn validate_name(what: &'static str, value: &str) -> Result<(), PrepareError> {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let ok = !value.is_empty()
        && value.len() <= 253
        && value.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
        && value.bytes().next().is_some_and(alnum)
        && value.bytes().last().is_some_and(alnum);
    if ok {
        Ok(())
    } else {
        Err(PrepareError::BadName {
            what,
            value: value.to_string(),
        })
    }
}

/// `gpuplane-claim-<uid>`: the spec file stem of a (validated) claim UID.
pub fn spec_stem(uid: &str) -> String {
    format!("{SPEC_STEM_PREFIX}{uid}")
}

/// `<uid>-<DRA device name>`: the CDI device name of a claim's device.
pub fn cdi_device_name(uid: &str, device: &str) -> String {
    format!("{uid}-{device}")
}

/// Removes a claim's spec; a stem that is not a claim spec's (a damaged or hand-edited
/// checkpoint) is left alone with a warning, so the node spec can never be removed here.
fn remove_claim_spec(cdi_root: &Path, stem: &str) -> Result<(), WriteError> {
    if !stem.starts_with(SPEC_STEM_PREFIX) {
        warn!(
            stem,
            "the checkpoint names a CDI spec that is not a claim spec; leaving it"
        );
        return Ok(());
    }
    cdi::remove_spec(cdi_root, stem)
}

/// A rendered preparation, not yet written.
struct Rendered {
    spec: cdi::Spec,
    devices: Vec<PreparedDevice>,
    units: BTreeMap<String, String>,
    /// The claim's `status.devices` entries once prepared.
    status: Vec<serde_json::Value>,
}

/// The DRA core. See the module docs.
pub struct DraCore {
    shared: Arc<Shared>,
    /// Every checkpoint change, and the CDI spec write between PrepareStarted and
    /// PrepareCompleted, happens under this lock, so prepares and unprepares serialise on it:
    /// the checkpoint is one file rewritten whole, and concurrent read-modify-writes would lose
    /// entries; and the kubelet may retry a prepare (after its 45 s timeout) while the first
    /// call still runs, and the two must not interleave their steps on one claim. The API read
    /// happens before taking it, so a slow API server does not hold up other claims; the
    /// claim's state is checked again once the lock is held. Its guard moves into the
    /// blocking-pool job that writes the files ([`off_runtime`]); no runtime task holds it
    /// across an await other than the wait for that job.
    checkpoint: Arc<Mutex<Checkpoint>>,
}

/// What the core knows besides the checkpoint: fixed at start, shared with the blocking-pool
/// jobs.
struct Shared {
    driver: String,
    pool: String,
    kind: Kind,
    state: Arc<NodeState>,
    claims: Arc<dyn ClaimFetcher>,
    cdi_root: PathBuf,
    driver_root: PathBuf,
    driver_root_mount: Option<PathBuf>,
    dev_root: PathBuf,
    proc_root: PathBuf,
    device_mode: DeviceMode,
    /// The driver's libraries, scanned once per driver version rather than per prepare.
    installs: InstallCache,
}

/// Runs `job` on tokio's blocking pool (file writes with fsync, device-node checks) and waits
/// for it; a runtime worker never blocks on the disk.
async fn off_runtime<T: Send + 'static>(
    job: impl FnOnce() -> Result<T, PrepareError> + Send + 'static,
) -> Result<T, PrepareError> {
    tokio::task::spawn_blocking(job)
        .await
        .map_err(|e| PrepareError::Worker(e.to_string()))?
}

impl DraCore {
    /// Loads the checkpoint (setting an unusable one aside, dropping claims of an earlier boot
    /// and removing their CDI specs). Claims left `PrepareStarted` stay until the kubelet
    /// retries them.
    pub fn new(
        config: DraCoreConfig,
        state: Arc<NodeState>,
        claims: Arc<dyn ClaimFetcher>,
    ) -> Result<DraCore, CoreError> {
        let kind = Kind::new(&format!("k8s.{}", config.driver), CDI_CLASS).map_err(|source| {
            CoreError::Kind {
                driver: config.driver.clone(),
                cause: source,
            }
        })?;
        let boot_id = checkpoint::read_boot_id(&config.boot_id_path);
        let loaded = Checkpoint::load(&config.state_dir, boot_id.as_deref())
            .map_err(|source| CoreError::Checkpoint { cause: source })?;
        // Specs first, then the checkpoint: a crash in between invalidates them again.
        for (uid, entry) in &loaded.invalidated {
            let claim = format!("{}/{}", entry.namespace, entry.name);
            match remove_claim_spec(&config.cdi_root, &entry.cdi_spec_stem) {
                Ok(()) => info!(claim = %claim, uid = %uid,
                    "removed the CDI spec of a claim prepared before the reboot"),
                Err(e) => error!(claim = %claim, uid = %uid, error = %e,
                    "removing the CDI spec of a claim prepared before the reboot failed"),
            }
        }
        if loaded.needs_save {
            if let Err(e) = loaded.checkpoint.save() {
                warn!(error = %e, "saving the DRA checkpoint failed; retried on the next prepare");
            }
        }
        for (uid, entry) in &loaded.checkpoint.data().claims {
            if entry.state == ClaimState::PrepareStarted {
                info!(claim = %format!("{}/{}", entry.namespace, entry.name), uid = %uid,
                    "claim was being prepared when the agent stopped; it is prepared again or cleaned up when the kubelet retries");
            }
        }
        Ok(DraCore {
            shared: Arc::new(Shared {
                driver: config.driver,
                pool: config.node_name,
                kind,
                state,
                claims,
                cdi_root: config.cdi_root,
                driver_root: config.driver_root,
                driver_root_mount: config.driver_root_mount,
                dev_root: config.dev_root,
                proc_root: config.proc_root,
                device_mode: config.device_mode,
                installs: InstallCache::default(),
            }),
            checkpoint: Arc::new(Mutex::new(loaded.checkpoint)),
        })
    }

    /// The CDI kind of the per-claim specs (`k8s.<driver>/claim`).
    pub fn cdi_kind(&self) -> &Kind {
        &self.shared.kind
    }

    pub fn driver(&self) -> &str {
        &self.shared.driver
    }

    /// The pool (node name) of this node's devices.
    pub fn pool(&self) -> &str {
        &self.shared.pool
    }

    /// How often the driver's libraries were scanned (once per driver version).
    pub fn install_scans(&self) -> u64 {
        self.shared.installs.scans()
    }

    /// Unit UUID (GPU or MIG) → UID of the claim it is prepared (or being prepared) for.
    pub async fn prepared_units(&self) -> BTreeMap<String, String> {
        let cp = self.checkpoint.lock().await;
        cp.data()
            .claims
            .iter()
            .flat_map(|(uid, e)| {
                e.units
                    .values()
                    .map(move |unit| (unit.clone(), uid.clone()))
            })
            .collect()
    }

    /// A copy of the checkpoint's content.
    pub async fn checkpoint(&self) -> CheckpointData {
        self.checkpoint.lock().await.data().clone()
    }

    async fn prepare_one(&self, c: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        validate_uid(&c.uid)?;
        validate_name("namespace", &c.namespace)?;
        validate_name("name", &c.name)?;
        let done = self
            .shared
            .completed(&*self.checkpoint.lock().await, &c.uid, true);
        if let Some(devices) = done {
            return Ok(devices);
        }
        let claim = self
            .shared
            .claims
            .get(&c.namespace, &c.name)
            .await
            .map_err(|source| PrepareError::Fetch {
                cause: Box::new(source),
            })?;
        let cp = self.checkpoint.clone().lock_owned().await;
        let (shared, c) = (self.shared.clone(), c.clone());
        off_runtime(move || shared.prepare_locked(cp, &claim, &c)).await
    }

    async fn unprepare_one(&self, c: &ClaimRef) -> Result<(), PrepareError> {
        let cp = self.checkpoint.clone().lock_owned().await;
        let (shared, c) = (self.shared.clone(), c.clone());
        off_runtime(move || shared.unprepare_locked(cp, &c)).await
    }

    /// Puts every checkpointed claim's units back into the ledger (agent start-up).
    pub async fn restore_holds(&self) {
        let cp = self.checkpoint.lock().await;
        for (uid, entry) in &cp.data().claims {
            let c = ClaimRef {
                namespace: entry.namespace.clone(),
                uid: uid.clone(),
                name: entry.name.clone(),
            };
            if let Err(e) = self.shared.hold(&c, &entry.units) {
                error!(claim = %claim_label(&c), error = %e, "checkpointed claim overlaps another holder");
            }
        }
    }
}

impl Shared {
    /// The recorded devices of a completed claim whose spec is still on disk.
    fn completed(&self, cp: &Checkpoint, uid: &str, log: bool) -> Option<Vec<PreparedDevice>> {
        let entry = cp
            .get(uid)
            .filter(|e| e.state == ClaimState::PrepareCompleted)?;
        let spec_present =
            cdi::writer::spec_path(&self.cdi_root, &entry.cdi_spec_stem).is_ok_and(|p| p.exists());
        if !spec_present {
            if log {
                warn!(claim = %format!("{}/{}", entry.namespace, entry.name), uid = %uid,
                    "the CDI spec of a prepared claim is gone; preparing it again");
            }
            return None;
        }
        Some(entry.devices.clone())
    }

    /// Steps 1 (again, under the lock) to 5 of the module docs, on the blocking pool with the
    /// checkpoint lock held.
    fn prepare_locked(
        &self,
        mut cp: OwnedMutexGuard<Checkpoint>,
        claim: &k8s_openapi::api::resource::v1::ResourceClaim,
        c: &ClaimRef,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        if let Some(devices) = self.completed(&cp, &c.uid, false) {
            return Ok(devices);
        }
        let rendered = self.render(claim, c)?;
        self.hold(c, &rendered.units)?;
        let stem = spec_stem(&c.uid);
        let started = ClaimEntry {
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            state: ClaimState::PrepareStarted,
            devices: Vec::new(),
            cdi_spec_stem: stem.clone(),
            units: rendered.units.clone(),
        };
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareBeforeCheckpointStarted);
        cp.update(|d| {
            d.claims.insert(c.uid.clone(), started.clone());
        })?;
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterCheckpointStarted);
        cdi::write_spec(&self.cdi_root, &stem, &rendered.spec)?;
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterCdiSpec);
        cp.update(|d| {
            d.claims.insert(
                c.uid.clone(),
                ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    devices: rendered.devices.clone(),
                    ..started
                },
            );
        })?;
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterCheckpointCompleted);
        self.write_device_status(c, rendered.status);
        Ok(rendered.devices)
    }

    /// Records the claim's units in the allocation ledger (shared mode), refusing units another
    /// consumer holds. Under the checkpoint lock, so two prepares cannot race for a unit; the
    /// device plugin's Allocate holds under the state's write lock, which `update` takes too.
    fn hold(&self, c: &ClaimRef, units: &BTreeMap<String, String>) -> Result<(), PrepareError> {
        let who = Holder::Claim {
            uid: c.uid.clone(),
            name: claim_label(c),
        };
        self.state.update(|s| {
            if s.config.allocation != AllocationMode::Shared {
                return (Ok(()), false);
            }
            let list: Vec<String> = units.values().cloned().collect();
            match s.ledger.hold_all(&list, &who, Instant::now()) {
                Ok(()) => {
                    metrics::global().inc(LEDGER_HANDOUTS, LEDGER_HANDOUTS_HELP, &[("api", "dra")]);
                    info!(claim = %claim_label(c), units = ?list, "handed out to claim");
                    (Ok(()), true)
                }
                Err(held) => {
                    metrics::global().inc(LEDGER_REFUSALS, LEDGER_REFUSALS_HELP, &[("api", "dra")]);
                    let device = units
                        .iter()
                        .find(|(_, u)| **u == held.unit)
                        .map_or(held.unit.clone(), |(d, _)| d.clone());
                    (
                        Err(PrepareError::Held {
                            device,
                            cause: Box::new(held),
                        }),
                        false,
                    )
                }
            }
        })
    }

    /// Plans the claim against the current inventory and health and renders its spec.
    fn render(
        &self,
        claim: &k8s_openapi::api::resource::v1::ResourceClaim,
        c: &ClaimRef,
    ) -> Result<Rendered, PrepareError> {
        let (inv, health) = {
            let snap = self.state.read();
            (
                dra_view(&snap.inventory, &snap.config.allocation),
                snap.health.clone(),
            )
        };
        let plan = plan_claim(claim, c, &self.driver, &self.pool, &inv, &health)
            .map_err(|source| PrepareError::Plan { cause: source })?;
        let generation = claim.metadata.generation;
        match self.device_mode {
            // Nothing on the host to discover: no driver files, no device nodes.
            DeviceMode::Simulated => self.render_plan(&plan, c, generation, &inv, None),
            DeviceMode::Hardware => {
                let proc = ProcCaps::new(&self.proc_root);
                let mount = self.driver_root_mount.as_deref();
                let install = self
                    .installs
                    .get(mount.unwrap_or(&self.driver_root), &inv.driver_version);
                let files = crate::cdi::driver::discover_nodes_with(
                    &self.driver_root,
                    mount,
                    &self.dev_root,
                    &inv,
                    &proc,
                    &install,
                );
                self.render_plan(&plan, c, generation, &inv, Some(&files))
            }
        }
    }

    /// Writes (or, with no entries, removes) our `status.devices` entries of a claim, in the
    /// background: a failed status write never fails a prepare or an unprepare. Called on the
    /// blocking pool, whose threads run inside the runtime, so `tokio::spawn` works there.
    fn write_device_status(&self, c: &ClaimRef, entries: Vec<serde_json::Value>) {
        let (claims, c) = (self.claims.clone(), c.clone());
        tokio::spawn(async move {
            let clearing = entries.is_empty();
            match claims
                .set_device_status(&c.namespace, &c.name, entries)
                .await
            {
                Ok(()) => {}
                // Unprepared after the claim was deleted: nothing left to clear.
                Err(FetchError::NotFound { .. }) if clearing => {}
                Err(e) => warn!(claim = %claim_label(&c), error = %e, "status.devices not written"),
            }
        });
    }

    /// Renders the claim's spec (over `files` on real hardware, simulated without them) and its
    /// `status.devices` entries (for the claim's `generation`).
    fn render_plan(
        &self,
        plan: &ClaimPlan,
        c: &ClaimRef,
        generation: Option<i64>,
        inv: &Inventory,
        files: Option<&DriverFiles>,
    ) -> Result<Rendered, PrepareError> {
        let mut named: Vec<NamedDevices<'_>> = Vec::new();
        let mut needed: BTreeSet<PathBuf> = files
            .iter()
            .flat_map(|f| f.control_nodes.iter().map(|n| n.host_path.clone()))
            .collect();
        // Each device by its DRA name, for the simulated environment and the status entries.
        let mut claimed: Vec<(String, DeviceRef<'_>)> = Vec::new();
        for name in plan.device_names() {
            let Some(dev) = inv.dra_device(name) else {
                // plan_claim looked every device up in this same inventory.
                continue;
            };
            claimed.push((name.to_string(), dev));
            for node in files.iter().flat_map(|f| cdi::render::device_nodes(dev, f)) {
                needed.insert(PathBuf::from(node.host_path.unwrap_or(node.path)));
            }
            let cdi_name = DeviceName::new(cdi_device_name(&c.uid, name)).map_err(|source| {
                PrepareError::CdiName {
                    device: name.to_string(),
                    cause: source,
                }
            })?;
            named.push(NamedDevices {
                name: cdi_name,
                devices: vec![dev],
            });
        }
        let mut spec = match files {
            Some(files) => {
                files
                    .check_needed(|p| needed.contains(p))
                    .map_err(PrepareError::MissingDeviceNodes)?;
                cdi::render_spec(&self.kind, &named, files)
            }
            None => {
                let common = ContainerEdits {
                    env: vec![cdi::render::visible_devices_env(
                        &claimed.iter().map(|(_, d)| *d).collect::<Vec<_>>(),
                    )],
                    ..Default::default()
                };
                cdi::render_simulated_spec(&self.kind, &named, common)
            }
        };
        for d in &mut spec.devices {
            if let Some(p) = plan
                .devices
                .iter()
                .find(|p| cdi_device_name(&c.uid, &p.device) == d.name)
            {
                // The config's environment after the device's own (identity, in simulation).
                d.container_edits.env.extend(p.env.iter().cloned());
            }
        }
        spec.cdi_version = cdi::minimum_version(&spec).to_string();
        let devices = plan
            .devices
            .iter()
            .map(|p| PreparedDevice {
                requests: p.requests.clone(),
                pool: self.pool.clone(),
                device: p.device.clone(),
                cdi_ids: vec![format!(
                    "{}={}",
                    self.kind,
                    cdi_device_name(&c.uid, &p.device)
                )],
                share_id: p.share_id.clone(),
            })
            .collect();
        let units = plan
            .devices
            .iter()
            .map(|p| (p.device.clone(), p.uuid.clone()))
            .collect();
        let now = Timestamp::from_second(Timestamp::now().as_second())
            .map(|t| t.to_string())
            .unwrap_or_default();
        let status = status::device_statuses(&self.driver, &self.pool, &claimed, generation, &now);
        Ok(Rendered {
            spec,
            devices,
            units,
            status,
        })
    }

    /// Unprepare on the blocking pool with the checkpoint lock held: specs first, then the
    /// checkpoint, then the ledger.
    fn unprepare_locked(
        &self,
        mut cp: OwnedMutexGuard<Checkpoint>,
        c: &ClaimRef,
    ) -> Result<(), PrepareError> {
        let was_prepared = cp.get(&c.uid).is_some();
        let mut stems: Vec<String> = cp
            .get(&c.uid)
            .map(|e| e.cdi_spec_stem.clone())
            .into_iter()
            .collect();
        // Also the stem the UID implies: a spec may outlive its entry (a checkpoint set aside).
        if validate_uid(&c.uid).is_ok() {
            let derived = spec_stem(&c.uid);
            if !stems.contains(&derived) {
                stems.push(derived);
            }
        }
        crate::crashpoint::reached(crate::crashpoint::Step::UnprepareBeforeSpecRemoval);
        for stem in &stems {
            remove_claim_spec(&self.cdi_root, stem)?;
        }
        crate::crashpoint::reached(crate::crashpoint::Step::UnprepareAfterSpecRemoval);
        cp.update(|d| {
            d.claims.remove(&c.uid);
        })?;
        crate::crashpoint::reached(crate::crashpoint::Step::UnprepareAfterCheckpoint);
        let released = self.state.update(|s| {
            let r = s.ledger.release_claim(&c.uid);
            let changed = !r.is_empty();
            (r, changed)
        });
        if !released.is_empty() {
            metrics::global().inc(LEDGER_RELEASES, LEDGER_RELEASES_HELP, &[("api", "dra")]);
            info!(claim = %claim_label(c), units = ?released, "released by claim");
        }
        if was_prepared {
            self.write_device_status(c, Vec::new());
        }
        Ok(())
    }
}

fn claim_label(c: &ClaimRef) -> String {
    format!("{}/{}", c.namespace, c.name)
}

/// One claim's prepare outcome with its typed error.
pub type PrepareOutcome = (ClaimRef, Result<Vec<PreparedDevice>, PrepareError>);

impl DraCore {
    /// Prepares each claim on its own (logged, counted), returning the typed errors, so the
    /// agent can tell users about the failures they must see; [`DraDriver::prepare`] turns them
    /// into the kubelet's strings.
    pub async fn prepare_each(&self, claims: Vec<ClaimRef>) -> Vec<PrepareOutcome> {
        let mut out = Vec::with_capacity(claims.len());
        for c in claims {
            let started = Instant::now();
            let result = self.prepare_one(&c).await;
            match &result {
                Ok(devices) => {
                    info!(claim = %claim_label(&c), uid = %c.uid, devices = devices.len(), "claim prepared");
                }
                Err(e) => {
                    warn!(claim = %claim_label(&c), uid = %c.uid, error = %e, "preparing claim failed");
                }
            }
            let m = metrics::global();
            let outcome = if result.is_ok() { "prepared" } else { "failed" };
            m.inc(
                "gpuplane_prepares_total",
                "NodePrepareResources claims by outcome.",
                &[("outcome", outcome)],
            );
            m.observe(
                "gpuplane_prepare_seconds",
                "Time to prepare one claim.",
                &[],
                started.elapsed().as_secs_f64(),
            );
            out.push((c, result));
        }
        out
    }
}

#[async_trait::async_trait]
impl DraDriver for DraCore {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult> {
        self.prepare_each(claims)
            .await
            .into_iter()
            .map(|(c, r)| {
                let r = r.map_err(|e| kubelet_error(&c, &e));
                (c.uid, r)
            })
            .collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>> {
        let mut out = BTreeMap::new();
        for c in claims {
            let result = match self.unprepare_one(&c).await {
                Ok(()) => {
                    info!(claim = %claim_label(&c), uid = %c.uid, "claim unprepared");
                    Ok(())
                }
                Err(e) => {
                    warn!(claim = %claim_label(&c), uid = %c.uid, error = %e, "unpreparing claim failed");
                    Err(kubelet_error(&c, &e))
                }
            };
            out.insert(c.uid, result);
        }
        out
    }

    fn device_health(&self) -> Vec<DeviceHealthReport> {
        let snap = self.shared.state.read();
        dra_view(&snap.inventory, &snap.config.allocation)
            .dra_devices()
            .iter()
            .map(|d| {
                let (health, message) = match snap.health.health(d.uuid()) {
                    Health::Healthy => (DeviceHealthState::Healthy, String::new()),
                    Health::Unhealthy(cause) => (DeviceHealthState::Unhealthy, cause.to_string()),
                };
                DeviceHealthReport {
                    pool: self.shared.pool.clone(),
                    device: d.dra_name(),
                    health,
                    message,
                }
            })
            .collect()
    }

    fn health_changes(&self) -> watch::Receiver<u64> {
        self.shared.state.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_and_names() {
        for ok in ["0b5c3f2e-1111-4222-8333-444455556666", "a", "0"] {
            assert!(validate_uid(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "../x",
            "A0",
            "0b5c/..",
            "g",
            &"a".repeat(65),
        ] {
            assert!(validate_uid(bad).is_err(), "{bad}");
        }
        for ok in ["default", "a.b-c", "x"] {
            assert!(validate_name("name", ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b", "..", "-a", "A", "a b"] {
            assert!(validate_name("name", bad).is_err(), "{bad}");
        }
        assert_eq!(spec_stem("ab-12"), "gpuplane-claim-ab-12");
        assert!(cdi::writer::spec_path(Path::new("/x"), &spec_stem("ab-12")).is_ok());
    }

    #[test]
    fn failures_a_user_can_act_on_become_events_naming_what_to_do() {
        let unhealthy = PrepareError::Plan {
            cause: ClaimError::Unhealthy {
                device: "gpu-0".into(),
                uuid: "GPU-0".into(),
                cause: "critical Xid 48".into(),
            },
        };
        let ev = unhealthy.user_event().unwrap();
        assert_eq!(ev.reason, "DeviceUnhealthy");
        assert!(
            ev.note.contains("gpu-0") && ev.note.contains("Xid 48"),
            "{}",
            ev.note
        );
        assert!(ev.note.contains("delete this claim's pod"), "{}", ev.note);
        let missing = PrepareError::MissingDeviceNodes(DeviceNodesError {
            problems: vec![cdi::NodeProblem {
                path: "/dev/nvidia0".into(),
                fault: cdi::NodeFault::Missing,
            }],
        });
        assert_eq!(missing.user_event().unwrap().reason, "DeviceNodesMissing");
        // The kubelet's own input, and node-local I/O: logged, not shown to users.
        let bad = PrepareError::BadUid { uid: "X".into() };
        assert_eq!(bad.user_event(), None);
        let c = ClaimRef {
            namespace: "a".into(),
            uid: "0".into(),
            name: "c".into(),
        };
        assert_eq!(
            kubelet_error(&c, &bad),
            "claim a/c (0): claim UID `X` is not lower-case hex digits and dashes"
        );
    }

    #[test]
    fn long_notes_are_cut_at_a_character_boundary_under_the_api_limit() {
        let cut = truncate("é".repeat(600), MAX_NOTE_BYTES);
        assert!(cut.len() <= MAX_NOTE_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert_eq!(truncate("short".into(), MAX_NOTE_BYTES), "short");
    }
}
