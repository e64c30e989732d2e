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
//! 3. the checkpoint records the claim as `PrepareCompleted` with the devices the kubelet gets,
//!    the ledger units and the claim's whole CDI spec, fsync'd: this one durable write is the
//!    preparation's record;
//! 4. the claim's spec file is written from it, `<cdi root>/gpuplane-claim-<uid>.json`, kind
//!    `k8s.<driver>/claim` (`k8s.gpu.gpuplane.dev/claim` by default), one CDI device per DRA
//!    device named `<claim uid>-<DRA device name>`, carrying the config's environment. The
//!    write is atomic but not fsync'd ([`cdi::Durability::Recoverable`]): at start the agent
//!    rewrites every recorded spec whose file is missing or differs ([`DraCore::new`]), so the
//!    checkpoint is the one record a crash must not lose, and a prepare costs one durable write.
//!
//! A crash before step 3 leaves nothing; after it, the claim is prepared and its devices held
//! once the agent is back, its spec restored. A claim left `PrepareStarted` by an older agent,
//! or a completed one whose spec file is gone, is prepared again (its spec rewritten) when the
//! kubelet retries, which it always does until prepare or unprepare succeeds.
//!
//! Unpreparing removes the claim's spec file (unsynced), then its checkpoint entry (the durable
//! write), then its ledger hold. A power loss can bring a removed spec file back; that is a
//! reboot, and the first start after one removes every claim spec in the CDI root.
//!
//! Each claim succeeds or fails on its own; a failure is a typed error ([`PrepareError`],
//! [`UnprepareError`]) that the gRPC edge turns into the kubelet's string naming the claim
//! (`claim <namespace>/<name> (<uid>): <reason>`) and logs once.
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
//! Simulated devices ([`DeviceMode::Simulated`](crate::source::DeviceMode::Simulated)) have
//! no nodes to wait for: their spec carries each device's `GPUPLANE_DEVICE_<key>` identity
//! and, spec-level, `NVIDIA_VISIBLE_DEVICES` with the claim's UUIDs. The runtime applies spec-level edits once for any device of the spec, so a
//! container that references only some of a claim's requests still sees all of the claim's
//! UUIDs there, and one that references several claims sees one claim's value (the later
//! replaces the earlier); `GPUPLANE_DEVICE_*` are exact in both cases.
//!
//! Everything after the API read (the second checkpoint look, rendering with its device-node
//! checks, the ledger hold, the checkpoint write and the spec write) runs as one
//! job on tokio's blocking pool (`off_runtime`), never on a runtime worker, with the
//! checkpoint lock moved into the job: the steps keep their order, the answer waits for the
//! job, and a kubelet call cancelled meanwhile does not cut the job short. The state lock is
//! taken only for the short plan read and the hold, never across a file operation. The
//! driver's libraries are scanned once per driver version ([`InstallCache`](crate::cdi::InstallCache)); device nodes are
//! checked on every prepare.
//!
//! [`plan_claim`]: crate::dra::claims::plan_claim
//! [`DeviceNodesError`]: crate::cdi::DeviceNodesError

mod config;
mod errors;
mod holds;
mod instances;
mod shares;
mod spec;
mod spec_names;

pub use config::DraCoreConfig;
pub use errors::{CoreError, PrepareError, UnprepareError, UserEvent};
pub use spec_names::{cdi_device_name, spec_stem, CDI_CLASS};

use super::checkpoint::{self, Checkpoint, CheckpointData, ClaimEntry, ClaimState};
use super::fetch::{ClaimFetcher, FetchError};
use super::{ClaimRef, ClaimUid, DeviceHealthReport, DeviceHealthState, DraDriver, PreparedDevice};
use crate::cdi::{self, Kind};
use crate::health::Health;
use crate::inventory::DeviceUuid;
use crate::ledger::dra_view;
use crate::metrics;
use crate::mps::process::MpsDaemons;
use crate::source::DeviceSource;
use crate::state::NodeState;
use gpuplane_model::dynamic_mig;
use holds::Holds;
use instances::Instances;
use shares::Daemons;
use spec::{sweep_claim_specs, Specs};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{watch, Mutex, OwnedMutexGuard};
use tracing::{error, info, warn, Instrument};

/// The DRA core. See the module docs.
pub struct DraCore {
    shared: Arc<Shared>,
    /// Every checkpoint change, and the CDI spec write after it, happens under this lock, so
    /// prepares and unprepares serialise on it: the checkpoint is rewritten whole, and
    /// concurrent read-modify-writes would lose entries; and the kubelet may retry a prepare
    /// (after its 45 s timeout) while the first call still runs, and the two must not
    /// interleave their steps on one claim. The API read
    /// happens before taking it, so a slow API server does not hold up other claims; the
    /// claim's state is checked again once the lock is held. Its guard moves into the
    /// blocking-pool job that writes the files ([`off_runtime`]); no runtime task holds it
    /// across an await other than the wait for that job.
    checkpoint: Arc<Mutex<Checkpoint>>,
}

/// What the core knows besides the checkpoint: fixed at start, shared with the blocking-pool
/// jobs. A prepare runs its parts in turn (module docs).
struct Shared {
    state: Arc<NodeState>,
    claims: Arc<dyn ClaimFetcher>,
    /// The claims' CDI specs: rendered, written, restored, removed (`core/spec.rs`).
    specs: Specs,
    /// The claims' units and shares in the ledger (`core/holds.rs`).
    holds: Holds,
    /// The MPS control daemons of shared units (`core/shares.rs`).
    daemons: Daemons,
    /// Dynamic MIG instances (`core/instances.rs`).
    instances: Instances,
}

/// Runs `job` on tokio's blocking pool (file writes with fsync, device-node checks) and waits
/// for it; a runtime worker never blocks on the disk. A panicking job is the error's `Worker`.
async fn off_runtime<T, E>(job: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, E>
where
    T: Send + 'static,
    E: From<tokio::task::JoinError> + Send + 'static,
{
    tokio::task::spawn_blocking(job).await?
}

/// How long a prepare waits for the device plugin's holds after a (re)start before it is
/// refused (and retried by the kubelet).
const HOLDS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl DraCore {
    /// Loads the checkpoint (setting an unusable one aside, dropping claims of an earlier boot
    /// and removing their CDI specs) and rewrites each recorded claim spec whose file is
    /// missing or differs. Claims left `PrepareStarted` stay until the kubelet retries them.
    pub fn new(
        config: DraCoreConfig,
        state: Arc<NodeState>,
        claims: Arc<dyn ClaimFetcher>,
        source: Arc<dyn DeviceSource>,
    ) -> Result<DraCore, CoreError> {
        let kind = Kind::new(&format!("k8s.{}", config.driver), CDI_CLASS).map_err(|source| {
            CoreError::Kind {
                driver: config.driver.clone(),
                cause: source,
            }
        })?;
        crate::crashpoint::reached(crate::crashpoint::Step::StartupBeforeDraHolds);
        let boot_id = checkpoint::read_boot_id(&config.paths.boot_id());
        let mut loaded = Checkpoint::load(&config.paths.state_dir, boot_id.as_deref())
            .map_err(|source| CoreError::Checkpoint { cause: source })?;
        // Specs first, then the checkpoint: a crash in between finds the old boot id again.
        if loaded.rebooted {
            for stem in sweep_claim_specs(&config.paths.cdi_root) {
                let claim = loaded
                    .invalidated
                    .iter()
                    .find(|(_, e)| e.cdi_spec_stem == stem)
                    .map(|(uid, e)| format!("{}/{} ({uid})", e.namespace, e.name));
                info!(stem = %stem, claim = claim.as_deref().unwrap_or("none in the checkpoint"),
                    "removed the CDI spec of a claim prepared before the reboot");
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
        let mps = (config.mps.clone()).unwrap_or_else(|| Arc::new(MpsDaemons::new(&config.paths)));
        let mut checkpoint = loaded.checkpoint;
        let instances = Instances::new(&config.driver, &config.node_name, state.clone(), source);
        let shared = Arc::new(Shared {
            holds: Holds::new(state.clone()),
            daemons: Daemons::new(state.clone(), mps),
            instances,
            specs: Specs::new(
                config.driver,
                config.node_name,
                kind,
                config.paths,
                config.device_mode,
                config.memory_limits,
            ),
            state,
            claims,
        });
        // Before any claim spec is restored: a prepared claim whose instance is gone is not
        // prepared any more.
        shared.instances.reconcile_instances(&mut checkpoint);
        for (uid, entry) in &checkpoint.data().claims {
            shared.specs.restore(uid, entry);
        }
        Ok(DraCore {
            shared,
            checkpoint: Arc::new(Mutex::new(checkpoint)),
        })
    }

    /// The CDI kind of the per-claim specs (`k8s.<driver>/claim`).
    pub fn cdi_kind(&self) -> &Kind {
        &self.shared.specs.kind
    }

    pub fn driver(&self) -> &str {
        &self.shared.specs.driver
    }

    /// The pool (node name) of this node's devices.
    pub fn pool(&self) -> &str {
        &self.shared.specs.pool
    }

    /// How often the driver's libraries were scanned (once per driver version). For the tests'
    /// assertions.
    #[doc(hidden)]
    pub fn install_scans(&self) -> u64 {
        self.shared.specs.installs.scans()
    }

    /// Unit UUID (GPU or MIG) → UID of the claim it is prepared (or being prepared) for. For
    /// the tests' assertions.
    #[doc(hidden)]
    pub async fn prepared_units(&self) -> BTreeMap<DeviceUuid, String> {
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

    /// The Event a prepared claim's user must see when a share of it is time-sliced, its
    /// limits not enforced.
    pub async fn share_notice(&self, uid: &str) -> Option<UserEvent> {
        let cp = self.checkpoint.lock().await;
        shares::notice(cp.get(uid)?)
    }

    /// A copy of the checkpoint's content.
    pub async fn checkpoint(&self) -> CheckpointData {
        self.checkpoint.lock().await.data().clone()
    }

    async fn prepare_one(&self, c: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        let done = {
            let cp = self.checkpoint.lock().await;
            let shares = cp.get(&c.uid).map(|e| e.shares.clone()).unwrap_or_default();
            self.shared
                .completed(&cp, &c.uid, true)
                .map(|devices| (devices, shares))
        };
        if let Some((devices, shares)) = done {
            // A daemon that died since: the share gets one again before the answer.
            if !shares.is_empty() {
                let shared = self.shared.clone();
                off_runtime(move || shared.daemons.start_daemons(&shares)).await?;
            }
            return Ok(devices);
        }
        // A prepare before the device plugin's holds are in the ledger could hand out a GPU a
        // device-plugin container has: wait for the first listing (it is usually there).
        let deadline = tokio::time::Instant::now() + HOLDS_WAIT;
        if !self
            .shared
            .state
            .device_plugin_holds_known(Some(deadline))
            .await
        {
            return Err(PrepareError::HoldsUnknown { waited: HOLDS_WAIT });
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

    async fn unprepare_one(&self, c: &ClaimRef) -> Result<(), UnprepareError> {
        let cp = self.checkpoint.clone().lock_owned().await;
        let (shared, c) = (self.shared.clone(), c.clone());
        off_runtime(move || shared.unprepare_locked(cp, &c)).await
    }

    /// Puts every checkpointed claim's units back into the ledger (agent start-up).
    pub async fn restore_holds(&self) {
        let cp = self.checkpoint.lock().await;
        for (uid, entry) in &cp.data().claims {
            // Only this agent writes the checkpoint, from claims checked at the edge; a
            // hand-edited entry that is not a claim's identity holds nothing.
            let c = match ClaimRef::parse(
                entry.namespace.as_str(),
                uid.as_str(),
                entry.name.as_str(),
            ) {
                Ok(c) => c,
                Err(e) => {
                    error!(uid = %uid, error = %e, "checkpointed claim is not a valid claim; its devices are not held");
                    continue;
                }
            };
            if let Err(e) = self.shared.holds.hold(&c, &entry.units, &entry.shares) {
                error!(claim = %claim_label(&c), error = %e, "checkpointed claim overlaps another holder");
            }
        }
        let wanted = shares::mps_daemons(cp.data(), &self.shared.state.read().inventory);
        drop(cp);
        let daemons = self.shared.daemons.clone();
        // Starting and stopping daemons runs programs: off the runtime.
        if let Err(e) = tokio::task::spawn_blocking(move || daemons.reconcile(&wanted)).await {
            error!(error = %e, "reconciling the MPS control daemons failed");
        }
    }
}

impl Shared {
    /// The recorded devices of a completed claim whose spec is still on disk.
    fn completed(&self, cp: &Checkpoint, uid: &str, log: bool) -> Option<Vec<PreparedDevice>> {
        let entry = cp
            .get(uid)
            .filter(|e| e.state == ClaimState::PrepareCompleted)?;
        if !self.specs.present(&entry.cdi_spec_stem) {
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
        let instances = self.instances.create_instances(&mut cp, claim, c)?;
        let rendered = self.specs.render(&self.state, &self.daemons, claim, c)?;
        self.holds.hold(c, &rendered.units, &rendered.shares)?;
        if let Err(e) = self.daemons.start_daemons(&rendered.shares) {
            self.holds.release(c);
            return Err(e);
        }
        let stem = spec_stem(&c.uid);
        let entry = ClaimEntry {
            namespace: c.namespace.to_string(),
            name: c.name.to_string(),
            state: ClaimState::PrepareCompleted,
            devices: rendered.devices.clone(),
            cdi_spec_stem: stem.clone(),
            units: rendered.units,
            cdi_spec: Some(rendered.spec.clone()),
            shares: rendered.shares,
            instances,
        };
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareBeforeCheckpoint);
        cp.update(|d| {
            d.claims.insert(c.uid.to_string(), entry);
        })?;
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterCheckpoint);
        // Not fsync'd: the entry just written is the durable record, and start-up rewrites
        // the file from it (restore_spec). A failed write leaves the entry; the kubelet's
        // retry finds the spec missing and prepares the claim again.
        self.specs
            .write(&stem, &rendered.spec, cdi::Durability::Recoverable)?;
        crate::crashpoint::reached(crate::crashpoint::Step::PrepareAfterCdiSpec);
        self.write_device_status(c, rendered.status);
        Ok(rendered.devices)
    }

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

    /// Unprepare on the blocking pool with the checkpoint lock held: specs first, then the
    /// checkpoint, then the ledger.
    fn unprepare_locked(
        &self,
        mut cp: OwnedMutexGuard<Checkpoint>,
        c: &ClaimRef,
    ) -> Result<(), UnprepareError> {
        let was_prepared = cp.get(&c.uid).is_some();
        let shares = cp.get(&c.uid).map(|e| e.shares.clone()).unwrap_or_default();
        let instances = cp
            .get(&c.uid)
            .map(|e| e.instances.clone())
            .unwrap_or_default();
        let mut stems: Vec<String> = cp
            .get(&c.uid)
            .map(|e| e.cdi_spec_stem.clone())
            .into_iter()
            .collect();
        // Also the stem the UID implies: a spec may outlive its entry (a checkpoint set aside).
        let derived = spec_stem(&c.uid);
        if !stems.contains(&derived) {
            stems.push(derived);
        }
        crate::crashpoint::reached(crate::crashpoint::Step::UnprepareBeforeSpecRemoval);
        // Not synced: a power loss that brings a spec back is a reboot, after which start-up
        // sweeps every claim spec away.
        for stem in &stems {
            self.specs.remove(stem, cdi::Durability::Recoverable)?;
        }
        crate::crashpoint::reached(crate::crashpoint::Step::UnprepareAfterSpecRemoval);
        // Before the entry goes: an instance no entry records is never ours.
        self.instances.destroy_instances(c, &instances)?;
        cp.update(|d| {
            d.claims.remove(c.uid.as_str());
        })?;
        crate::crashpoint::reached(crate::crashpoint::Step::UnprepareAfterCheckpoint);
        self.holds.release(c);
        self.instances.forget_instances(&instances);
        self.daemons.stop_unused_daemons(&shares);
        if was_prepared {
            self.write_device_status(c, Vec::new());
        }
        Ok(())
    }
}

fn claim_label(c: &ClaimRef) -> String {
    format!("{}/{}", c.namespace, c.name)
}

/// The span every line logged while preparing or unpreparing a claim carries.
fn claim_span(c: &ClaimRef) -> tracing::Span {
    tracing::info_span!("claim", namespace = %c.namespace, name = %c.name, uid = %c.uid)
}

#[async_trait::async_trait]
impl DraDriver for DraCore {
    /// Prepares each claim on its own (counted); the gRPC service logs each outcome once and
    /// turns the errors into the kubelet's strings.
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<Vec<PreparedDevice>, PrepareError>> {
        let mut out = BTreeMap::new();
        for c in claims {
            let started = Instant::now();
            // The outcome is logged once, by the gRPC service that was asked; lines logged on
            // the way carry the claim through this span.
            let result = self.prepare_one(&c).instrument(claim_span(&c)).await;
            let m = metrics::node();
            let outcome = if result.is_ok() {
                metrics::Prepare::Prepared
            } else {
                metrics::Prepare::Failed
            };
            m.prepares
                .get_or_create(&metrics::PrepareLabel { outcome })
                .inc();
            m.prepare_seconds.observe(started.elapsed().as_secs_f64());
            out.insert(c.uid, result);
        }
        out
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<(), UnprepareError>> {
        let mut out = BTreeMap::new();
        for c in claims {
            let result = self.unprepare_one(&c).instrument(claim_span(&c)).await;
            out.insert(c.uid, result);
        }
        out
    }

    async fn share_notice(&self, uid: &ClaimUid) -> Option<UserEvent> {
        DraCore::share_notice(self, uid).await
    }

    fn device_health(&self) -> Vec<DeviceHealthReport> {
        let snap = self.shared.state.read();
        let inv = dra_view(&snap.inventory, &snap.config.allocation);
        let fixed = inv
            .dra_devices()
            .into_iter()
            .map(|d| (d.dra_name(), d.uuid()));
        // A dynamic device's health is its instance's once it exists, its GPU's before.
        let dynamic = dynamic_mig::devices(&inv).into_iter().map(|d| {
            let name = d.dra_name();
            let unit = inv.dra_device(&name).map_or(&d.parent.uuid, |i| i.uuid());
            (name, unit)
        });
        fixed
            .chain(dynamic)
            .map(|(device, unit)| {
                let (health, message) = match snap.health.health(unit) {
                    Health::Healthy => (DeviceHealthState::Healthy, String::new()),
                    Health::Unhealthy(cause) => (DeviceHealthState::Unhealthy, cause.to_string()),
                };
                DeviceHealthReport {
                    pool: self.shared.specs.pool.clone(),
                    device,
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
