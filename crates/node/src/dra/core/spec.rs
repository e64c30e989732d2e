//! A claim's CDI spec: planned against the current inventory and health, rendered with its
//! device nodes checked (or simulated), the devices the kubelet gets back, the ledger units and
//! the claim's `status.devices` entries; the one removal of a claim's spec file, its restore
//! from the checkpoint at start, and the sweep of every claim spec after a reboot.

use super::shares::Daemons;
use super::spec_names::{cdi_device_name, is_claim_spec_stem};
use super::PrepareError;
use crate::cdi::{self, ContainerEdits, DeviceName, DriverFiles, InstallCache, Kind};
use crate::cdi::{MemoryLimitHook, NamedDevices, WriteError};
use crate::dra::checkpoint::{ClaimEntry, ClaimState, ShareEntry};
use crate::dra::claims::{plan_claim, ClaimPlan};
use crate::dra::{status, ClaimRef, ClaimUid, PreparedDevice};
use crate::inventory::{DeviceRef, DeviceUuid, Inventory};
use crate::ledger::dra_view;
use crate::paths::HostPaths;
use crate::sharing::{self, Enforcement};
use crate::source::DeviceMode;
use crate::state::NodeState;
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tracing::{error, info, warn};

/// Removes a claim's spec; a stem that is not a claim spec's (a damaged or hand-edited
/// checkpoint) is left alone with a warning, so the node spec can never be removed here.
pub(super) fn remove_claim_spec(
    cdi_root: &Path,
    stem: &str,
    durability: cdi::Durability,
) -> Result<(), WriteError> {
    if !is_claim_spec_stem(stem) {
        warn!(
            stem,
            "the checkpoint names a CDI spec that is not a claim spec; leaving it"
        );
        return Ok(());
    }
    cdi::remove_spec(cdi_root, stem, durability)
}

/// Makes a checkpointed claim's spec file hold the spec its entry records (start-up): a
/// crash between the checkpoint write and the spec file, or a power loss that took the
/// unsynced file, leaves it missing or short. A failure is logged; the kubelet's retry
/// finds the spec missing and prepares the claim again.
pub(super) fn restore_spec(cdi_root: &Path, uid: &str, entry: &ClaimEntry) {
    let Some(spec) = entry
        .cdi_spec
        .as_ref()
        .filter(|_| entry.state == ClaimState::PrepareCompleted)
    else {
        return;
    };
    let claim = format!("{}/{}", entry.namespace, entry.name);
    if !is_claim_spec_stem(&entry.cdi_spec_stem) {
        warn!(claim = %claim, uid, stem = %entry.cdi_spec_stem,
            "the checkpoint names a CDI spec that is not a claim spec; not restoring it");
        return;
    }
    match cdi::write_spec(
        cdi_root,
        &entry.cdi_spec_stem,
        spec,
        cdi::Durability::Durable,
    ) {
        Ok(cdi::WriteOutcome::Unchanged) => {}
        Ok(cdi::WriteOutcome::Written) => {
            info!(claim = %claim, uid, "restored the CDI spec of a prepared claim from the checkpoint")
        }
        Err(e) => error!(claim = %claim, uid, error = %e,
            "restoring the CDI spec of a prepared claim failed; it is prepared again when the kubelet retries"),
    }
}

/// After a reboot every claim spec in `cdi_root` is of a claim no longer prepared (its
/// containers are gone; the kubelet prepares it again): removes them all, durably, and returns
/// their stems. This also takes the specs whose unsynced removal a power loss undid, which no
/// checkpoint entry names any more. A directory that cannot be listed is logged.
pub(super) fn sweep_claim_specs(cdi_root: &Path) -> Vec<String> {
    let entries = match std::fs::read_dir(cdi_root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            warn!(dir = %cdi_root.display(), error = %e, "listing the CDI specs of claims prepared before the reboot failed");
            return Vec::new();
        }
    };
    let mut removed = Vec::new();
    for name in entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
    {
        let Some(stem) = name.strip_suffix(".json").filter(|s| is_claim_spec_stem(s)) else {
            continue;
        };
        match remove_claim_spec(cdi_root, stem, cdi::Durability::Durable) {
            Ok(()) => removed.push(stem.to_string()),
            Err(e) => {
                warn!(stem, error = %e, "removing the CDI spec of a claim prepared before the reboot failed")
            }
        }
    }
    removed
}

/// The claims' CDI specs: what they are made of (the driver's files or simulated devices, the
/// share hooks) and where they are written.
pub(super) struct Specs {
    /// The driver and pool the claims' results and statuses name.
    pub(super) driver: String,
    pub(super) pool: String,
    /// The CDI kind of the claim specs (`k8s.<driver>/claim`).
    pub(super) kind: Kind,
    /// The CDI root the specs go to, and where the driver's files are found.
    paths: HostPaths,
    device_mode: DeviceMode,
    /// The driver's libraries, scanned once per driver version rather than per prepare.
    pub(super) installs: InstallCache,
    /// What holds a share's container to its memory, where the driver can.
    memory_limits: Option<MemoryLimitHook>,
}

/// A rendered preparation, not yet written.
pub(super) struct Rendered {
    pub(super) spec: cdi::Spec,
    pub(super) devices: Vec<PreparedDevice>,
    /// Devices held whole: DRA name -> unit.
    pub(super) units: BTreeMap<String, DeviceUuid>,
    /// Shares of shared units.
    pub(super) shares: Vec<ShareEntry>,
    /// The claim's `status.devices` entries once prepared.
    pub(super) status: Vec<serde_json::Value>,
}

/// The claim's devices as its spec and its status name them, and the device nodes they need.
struct Claimed<'a> {
    /// One CDI device per DRA device, `<claim uid>-<DRA device name>`.
    named: Vec<NamedDevices<'a>>,
    /// Each device by its DRA name, for the simulated environment and the status entries.
    by_name: Vec<(String, DeviceRef<'a>)>,
    /// Host paths of the device nodes the spec names, control nodes included (none when
    /// simulated): each must be right before the spec is written.
    needed: BTreeSet<PathBuf>,
}

impl Specs {
    pub(super) fn new(
        driver: String,
        pool: String,
        kind: Kind,
        paths: HostPaths,
        device_mode: DeviceMode,
        memory_limits: Option<MemoryLimitHook>,
    ) -> Specs {
        Specs {
            driver,
            pool,
            kind,
            paths,
            device_mode,
            installs: InstallCache::default(),
            memory_limits,
        }
    }

    /// Whether the spec file of `stem` is there.
    pub(super) fn present(&self, stem: &str) -> bool {
        cdi::writer::spec_path(&self.paths.cdi_root, stem).is_ok_and(|p| p.exists())
    }

    /// Writes the claim spec of `stem`.
    pub(super) fn write(
        &self,
        stem: &str,
        spec: &cdi::Spec,
        durability: cdi::Durability,
    ) -> Result<cdi::WriteOutcome, WriteError> {
        cdi::write_spec(&self.paths.cdi_root, stem, spec, durability)
    }

    /// Removes the claim spec of `stem` ([`remove_claim_spec`]).
    pub(super) fn remove(&self, stem: &str, durability: cdi::Durability) -> Result<(), WriteError> {
        remove_claim_spec(&self.paths.cdi_root, stem, durability)
    }

    /// Rewrites a checkpointed claim's spec from its entry ([`restore_spec`]).
    pub(super) fn restore(&self, uid: &str, entry: &ClaimEntry) {
        restore_spec(&self.paths.cdi_root, uid, entry);
    }

    /// Plans the claim against the current inventory and health of `state` (its shared units
    /// as `daemons` can run them) and renders its spec.
    pub(super) fn render(
        &self,
        state: &NodeState,
        daemons: &Daemons,
        claim: &k8s_openapi::api::resource::v1::ResourceClaim,
        c: &ClaimRef,
    ) -> Result<Rendered, PrepareError> {
        let (inv, health, shares) = {
            let snap = state.read();
            let inv = dra_view(&snap.inventory, &snap.config.allocation);
            let shares = daemons.shared_units(&inv, snap.config.shares.as_ref());
            (inv, snap.health.clone(), shares)
        };
        let plan = plan_claim(claim, c, &self.driver, &self.pool, &inv, &health, &shares)
            .map_err(|source| PrepareError::Plan { cause: source })?;
        let generation = claim.metadata.generation;
        match self.device_mode {
            // Nothing on the host to discover: no driver files, no device nodes.
            DeviceMode::Simulated => self.render_plan(&plan, c, generation, &inv, daemons, None),
            DeviceMode::Hardware => {
                let files = self.installs.discover(&self.paths, &inv);
                self.render_plan(&plan, c, generation, &inv, daemons, Some(&files))
            }
        }
    }

    /// Renders the claim's spec (over `files` on real hardware, simulated without them) and its
    /// `status.devices` entries (for the claim's `generation`).
    fn render_plan(
        &self,
        plan: &ClaimPlan,
        c: &ClaimRef,
        generation: Option<i64>,
        inv: &Inventory,
        daemons: &Daemons,
        files: Option<&DriverFiles>,
    ) -> Result<Rendered, PrepareError> {
        let claimed = claimed_devices(plan, &c.uid, inv, files)?;
        let mut spec = self.spec_over(&claimed, files)?;
        add_config_env(&mut spec, plan, &c.uid);
        self.add_share_edits(&mut spec, plan, &c.uid, inv, daemons);
        spec.cdi_version = cdi::minimum_version(&spec).to_string();
        let units = plan
            .devices
            .iter()
            .filter(|p| p.share.is_none())
            .map(|p| (p.device.clone(), p.uuid.clone()))
            .collect();
        let shares: Vec<ShareEntry> = plan
            .devices
            .iter()
            .filter_map(|p| {
                let (share, unit) = p.share?;
                Some(ShareEntry {
                    device: p.device.clone(),
                    unit: p.uuid.clone(),
                    share_id: p.share_id.clone().unwrap_or_default(),
                    share,
                    capacity: unit.whole(),
                    enforcement: unit.enforcement,
                    memory_held: self.memory_hook(&p.uuid, unit.enforcement, inv).is_some(),
                })
            })
            .collect();
        let now = Timestamp::from_second(Timestamp::now().as_second())
            .map(|t| t.to_string())
            .unwrap_or_default();
        let mut status =
            status::device_statuses(&self.driver, &self.pool, &claimed.by_name, generation, &now);
        for (entry, s) in status.iter_mut().zip(&claimed.by_name) {
            if let Some(share) = shares.iter().find(|x| x.device == s.0) {
                status::add_share(
                    entry,
                    &share.share_id,
                    &share.share,
                    share.enforcement,
                    share.memory_held,
                    &now,
                );
            }
        }
        Ok(Rendered {
            spec,
            devices: self.prepared_devices(plan, &c.uid),
            units,
            shares,
            status,
        })
    }

    /// The hook holding a share of `unit` to its memory, where this node can: MPS shares of a
    /// whole GPU on a driver with per-cgroup memory limits (none on MIG devices: NVIDIA's
    /// memory partitioning leaves them out).
    fn memory_hook(
        &self,
        unit: &DeviceUuid,
        enforcement: Enforcement,
        inv: &Inventory,
    ) -> Option<&MemoryLimitHook> {
        let whole_gpu = inv.gpus.iter().any(|g| &g.uuid == unit);
        (enforcement == Enforcement::Mps && whole_gpu)
            .then_some(self.memory_limits.as_ref())
            .flatten()
    }

    /// A share's container edits: what it is and, under MPS, its daemon's pipe directory
    /// (mounted at the same path), CUDA's MPS client limits and, where the driver can, the hook
    /// that holds the container to its memory.
    fn add_share_edits(
        &self,
        spec: &mut cdi::Spec,
        plan: &ClaimPlan,
        uid: &ClaimUid,
        inv: &Inventory,
        daemons: &Daemons,
    ) {
        for d in &mut spec.devices {
            let Some((share, unit, p)) = plan.devices.iter().find_map(|p| {
                let (share, unit) = p.share?;
                (cdi_device_name(uid, &p.device) == d.name).then_some((share, unit, p))
            }) else {
                continue;
            };
            let dirs = daemons.dirs(&p.uuid);
            let pipe = dirs.pipe.display().to_string();
            let mps = unit.enforcement == Enforcement::Mps;
            let edits = &mut d.container_edits;
            if let Some(h) = self.memory_hook(&p.uuid, unit.enforcement, inv) {
                edits.hooks.push(h.hook(p.uuid.as_str(), share.memory));
            }
            edits.env.extend(sharing::share_env(
                &share,
                unit.enforcement,
                mps.then_some(pipe.as_str()),
            ));
            if mps {
                edits.mounts.push(cdi::Mount {
                    host_path: pipe.clone(),
                    container_path: pipe,
                    options: vec!["rbind".into(), "rw".into()],
                    mount_type: None,
                });
                // MPS clients need their server's /dev/shm (NVIDIA's DRA driver mounts its
                // daemon's shm the same way, cmd/gpu-kubelet-plugin/sharing.go).
                if daemons.shares_shm() {
                    edits.mounts.push(cdi::Mount {
                        host_path: dirs.shm.display().to_string(),
                        container_path: "/dev/shm".into(),
                        options: vec!["rbind".into(), "rw".into()],
                        mount_type: None,
                    });
                }
            }
        }
    }

    /// The spec of `claimed`: over the driver's files once every needed device node is right,
    /// or simulated (each device's identity, and the claim's UUIDs spec-level).
    fn spec_over(
        &self,
        claimed: &Claimed<'_>,
        files: Option<&DriverFiles>,
    ) -> Result<cdi::Spec, PrepareError> {
        match files {
            Some(files) => {
                files
                    .check_needed(|p| claimed.needed.contains(p))
                    .map_err(PrepareError::MissingDeviceNodes)?;
                Ok(cdi::render_spec(&self.kind, &claimed.named, files))
            }
            None => {
                let common = ContainerEdits {
                    env: vec![cdi::render::visible_devices_env(
                        &claimed.by_name.iter().map(|(_, d)| *d).collect::<Vec<_>>(),
                    )],
                    ..Default::default()
                };
                Ok(cdi::render_simulated_spec(
                    &self.kind,
                    &claimed.named,
                    common,
                ))
            }
        }
    }

    /// What the kubelet gets back: per device its requests, share and CDI ID.
    fn prepared_devices(&self, plan: &ClaimPlan, uid: &ClaimUid) -> Vec<PreparedDevice> {
        plan.devices
            .iter()
            .map(|p| PreparedDevice {
                requests: p.requests.clone(),
                pool: self.pool.clone(),
                device: p.device.clone(),
                cdi_ids: vec![format!("{}={}", self.kind, cdi_device_name(uid, &p.device))],
                share_id: p.share_id.clone(),
            })
            .collect()
    }
}

/// Looks up the plan's devices in `inv` (where `plan_claim` found them) and names them.
fn claimed_devices<'a>(
    plan: &ClaimPlan,
    uid: &ClaimUid,
    inv: &'a Inventory,
    files: Option<&DriverFiles>,
) -> Result<Claimed<'a>, PrepareError> {
    let mut claimed = Claimed {
        named: Vec::new(),
        by_name: Vec::new(),
        needed: files
            .iter()
            .flat_map(|f| f.control_nodes.iter().map(|n| n.host_path.clone()))
            .collect(),
    };
    for name in plan.device_names() {
        let Some(dev) = inv.dra_device(name) else {
            // plan_claim looked every device up in this same inventory.
            continue;
        };
        claimed.by_name.push((name.to_string(), dev));
        for node in files.iter().flat_map(|f| cdi::render::device_nodes(dev, f)) {
            claimed
                .needed
                .insert(PathBuf::from(node.host_path.unwrap_or(node.path)));
        }
        let cdi_name = DeviceName::new(cdi_device_name(uid, name)).map_err(|source| {
            PrepareError::CdiName {
                device: name.to_string(),
                cause: source,
            }
        })?;
        claimed.named.push(NamedDevices {
            name: cdi_name,
            devices: vec![dev],
        });
    }
    Ok(claimed)
}

/// Adds each device's config environment after the device's own (its identity, in simulation).
fn add_config_env(spec: &mut cdi::Spec, plan: &ClaimPlan, uid: &ClaimUid) {
    for d in &mut spec.devices {
        if let Some(p) = plan
            .devices
            .iter()
            .find(|p| cdi_device_name(uid, &p.device) == d.name)
        {
            d.container_edits.env.extend(p.env.iter().cloned());
        }
    }
}
