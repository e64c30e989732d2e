//! The DRA checkpoint: which claims this node prepared, so that a restarted agent answers a
//! repeated NodePrepareResources with the same devices and can undo a preparation on
//! NodeUnprepareResources.
//!
//! # File format
//!
//! Two slot files in the state directory, `dra-checkpoint.json` and `dra-checkpoint.2.json`,
//! mode 0600, each a whole checkpoint: a header line and a JSON body. Writes go to the two in
//! turn, each overwriting the older slot in place with one fdatasync
//! ([`fsutil::overwrite_in_place`]; a slot's first write creates it atomically). A crash in a
//! write tears at most that slot, which then fails its checksum, and the other slot holds the
//! content before the write. The newest slot that checks is the checkpoint (`sequence`, one
//! more on every write). One fdatasync per write rather than a replacement's two (file, then
//! directory) is what keeps a prepare near one durable write (benches/dra.rs). The one write
//! without it is a dynamic MIG instance's intent, which matters only until the next boot
//! ([`Checkpoint::update_until_reboot`]).
//!
//!
//! ```text
//! sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! {
//!   "version": 1,
//!   "sequence": 42,
//!   "bootId": "2b1c…",
//!   "claims": {
//!     "<claim uid>": {
//!       "namespace": "team-a",
//!       "name": "train-gpu",
//!       "state": "PrepareCompleted",
//!       "devices": [{"requests": ["gpu"], "pool": "node-1", "device": "gpu-3",
//!                    "cdiIds": ["k8s.gpu.gpuplane.dev/claim=<uid>-gpu-3"], "shareId": null}],
//!       "cdiSpecStem": "gpuplane-claim-<uid>",
//!       "units": {"gpu-3": "GPU-…"},
//!       "cdiSpec": {"cdiVersion": "0.5.0", "kind": "k8s.gpu.gpuplane.dev/claim", "devices": […]}
//!     }
//!   }
//! }
//! ```
//!
//! The checksum is the SHA-256 of exactly the body bytes as they are in the file, everything
//! after the first newline. It is never computed over a re-serialisation of the parsed data:
//! NVIDIA's driver did that, and a newer version serialising the same data differently (a new
//! field, another order) declared every old checkpoint corrupt on upgrade (#1080). For the same
//! reason unknown fields in a version-1 body are tolerated: only the version number says
//! whether this code understands the file.
//!
//! A claim's entry is the durable record of its preparation: written (fsync'd) before the
//! claim's CDI spec file exists, and holding that spec (`cdiSpec`), so the spec file is a copy
//! the agent rewrites from here at start ([`crate::dra::core::DraCore::new`]) and is itself written
//! without an fsync. Entries written by agents before `cdiSpec` existed lack it; such a claim
//! whose spec file is gone is prepared again when the kubelet retries.
//!
//! # Loading
//!
//! - temporary files of an interrupted first write of a slot (`.dra-checkpoint.json.tmp-…`)
//!   are removed first;
//! - no slot file: nothing prepared;
//! - a slot that cannot be read, lacks the header, fails the checksum, is not JSON of the
//!   expected shape or has another version is unusable. Beside a usable slot that is what an
//!   interrupted write leaves: it is ignored (one `warn!`) and overwritten by the next write.
//!   When no slot is usable, each unusable one is renamed to `<name>.corrupt-<unix seconds>`,
//!   one `error!` line says so, and loading goes on with nothing prepared. An agent that
//!   refused to start would crash-loop and leave every claim on the node unpreparable;
//! - a checkpoint of an agent before the slots is `dra-checkpoint.json` alone, read as
//!   sequence 0; an older agent started after this one reads only that slot, which may lack
//!   the last write;
//! - a file written under another boot id (`/proc/sys/kernel/random/boot_id`): the node
//!   rebooted, every container of its claims is gone, and the kubelet prepares them afresh.
//!   The claims are dropped from the checkpoint and handed back in [`Loaded::invalidated`], and
//!   [`Loaded::rebooted`] tells the caller to remove every claim's CDI spec file (`/etc/cdi`
//!   survives a reboot; so may a spec whose unsynced removal the power loss undid).

use super::PreparedDevice;
use crate::cdi::Spec;
use crate::fsutil::{self, FsError};
use crate::inventory::DeviceUuid;
use crate::sharing::{Enforcement, Share};
use crate::source::MigRequest;
use gpuplane_model::report::chain;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};
use tracing::{error, info, warn};

/// The first slot's file name in the state directory (the only one before the slots).
pub const FILE_NAME: &str = "dra-checkpoint.json";
/// The second slot's file name.
pub const SECOND_FILE_NAME: &str = "dra-checkpoint.2.json";
/// Both slots, by index.
pub const SLOTS: [&str; 2] = [FILE_NAME, SECOND_FILE_NAME];
/// The body version this code writes and reads.
pub const VERSION: u64 = 1;
/// Mode of the checkpoint file.
pub const FILE_MODE: u32 = 0o600;

const HEADER_PREFIX: &str = "sha256:";

/// How far a claim's preparation got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    /// Preparation began; the CDI spec may or may not be on disk. Only agents before `cdiSpec`
    /// wrote this state (one entry before the spec, another after it); it is still read.
    PrepareStarted,
    /// `devices` are what the kubelet gets, and `cdiSpec` (when present) is the claim's spec:
    /// written before the spec file, which may not exist yet after a crash.
    PrepareCompleted,
}

/// One prepared (or being prepared) claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    pub namespace: String,
    pub name: String,
    pub state: ClaimState,
    /// What the kubelet got (empty until PrepareCompleted).
    #[serde(default)]
    pub devices: Vec<PreparedDevice>,
    /// `<cdi root>/<stem>.json` holds the claim's CDI spec.
    pub cdi_spec_stem: String,
    /// DRA device name → unit UUID, for the allocation ledger.
    #[serde(default)]
    pub units: BTreeMap<String, DeviceUuid>,
    /// The claim's CDI spec, which the file `<stem>.json` copies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi_spec: Option<Spec>,
    /// The shares of shared units the claim holds (consumable capacity); their units are not
    /// in `units`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<ShareEntry>,
    /// Dynamic MIG instances the claim needs: recorded before each is created (`created`
    /// empty), and again once it exists, so a restart knows exactly which instances are ours.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<MigEntry>,
}

/// A dynamic MIG instance of a claim: the device the scheduler allocated, what creating it
/// means, and the instance once created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigEntry {
    /// DRA device name (`gpu-0-mig-3g40gb-at4`, or `gpu-0` for a whole dynamic GPU).
    pub device: String,
    pub request: MigRequest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<CreatedMig>,
}

/// An instance gpuplane created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedMig {
    pub gpu_instance_id: u32,
    pub uuid: DeviceUuid,
}

/// A share a prepared claim holds: enough to hold it again after a restart and to know
/// whether its unit needs an MPS control daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareEntry {
    /// DRA device name.
    pub device: String,
    pub unit: DeviceUuid,
    pub share_id: String,
    pub share: Share,
    /// The unit's whole capacity when it was prepared.
    pub capacity: Share,
    pub enforcement: Enforcement,
    /// Whether the driver holds the share's container to its memory (a memory-limit CDI hook,
    /// `gpuplane_model::cdi::memory_limit`); absent in checkpoints of earlier agents: false.
    #[serde(default)]
    pub memory_held: bool,
}

/// The checkpoint's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointData {
    pub version: u64,
    /// One more on every write: the newer of two usable slots is the checkpoint.
    #[serde(default)]
    pub sequence: u64,
    pub boot_id: String,
    /// By claim UID.
    pub claims: BTreeMap<String, ClaimEntry>,
}

impl CheckpointData {
    /// The dynamic MIG instances the entries own, created or intended.
    pub fn mig_owned(&self) -> std::collections::BTreeSet<MigRequest> {
        self.claims
            .values()
            .flat_map(|e| &e.instances)
            .map(|m| m.request.clone())
            .collect()
    }
}

impl CheckpointData {
    pub fn empty(boot_id: &str) -> Self {
        CheckpointData {
            version: VERSION,
            sequence: 0,
            boot_id: boot_id.to_string(),
            claims: BTreeMap::new(),
        }
    }
}

/// Why checkpoint bytes were not accepted.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("the first line is not `{HEADER_PREFIX}<64 hex digits>`")]
    NoHeader,
    #[error("checksum mismatch: the header says {expected}, the content hashes to {actual}")]
    Checksum { expected: String, actual: String },
    #[error("unsupported version {found} (this agent reads version {VERSION})")]
    Version { found: String },
    #[error("malformed content: {}", chain(.cause))]
    Json { cause: serde_json::Error },
}

/// Why the checkpoint could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("moving the unusable DRA checkpoint {path} aside to {to}: {}", chain(.cause))]
    SetAside {
        path: PathBuf,
        to: PathBuf,
        cause: io::Error,
    },
    #[error("creating the state directory {dir}: {}", chain(.cause))]
    CreateDir { dir: PathBuf, cause: io::Error },
    #[error("serialising the DRA checkpoint {path}: {}", chain(.cause))]
    Encode {
        path: PathBuf,
        cause: serde_json::Error,
    },
    #[error("saving the DRA checkpoint: {}", chain(.cause))]
    Write { cause: FsError },
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file's bytes for `data`: the header line, then the body the header's checksum covers.
pub fn encode(data: &CheckpointData) -> Result<Vec<u8>, serde_json::Error> {
    let mut body = serde_json::to_vec_pretty(data)?;
    body.push(b'\n');
    let mut out = format!("{HEADER_PREFIX}{}\n", sha256_hex(&body)).into_bytes();
    out.extend_from_slice(&body);
    Ok(out)
}

/// Checks and parses the file's bytes.
pub fn decode(bytes: &[u8]) -> Result<CheckpointData, DecodeError> {
    let newline = bytes
        .iter()
        .position(|b| *b == b'\n')
        .ok_or(DecodeError::NoHeader)?;
    let (header, body) = (&bytes[..newline], &bytes[newline + 1..]);
    let expected = std::str::from_utf8(header)
        .ok()
        .and_then(|h| h.strip_prefix(HEADER_PREFIX))
        .filter(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
        .ok_or(DecodeError::NoHeader)?;
    let actual = sha256_hex(body);
    if actual != expected {
        return Err(DecodeError::Checksum {
            expected: expected.to_string(),
            actual,
        });
    }
    #[derive(Deserialize)]
    struct Probe {
        version: serde_json::Value,
    }
    let probe: Probe =
        serde_json::from_slice(body).map_err(|source| DecodeError::Json { cause: source })?;
    if probe.version.as_u64() != Some(VERSION) {
        return Err(DecodeError::Version {
            found: probe.version.to_string(),
        });
    }
    serde_json::from_slice(body).map_err(|source| DecodeError::Json { cause: source })
}

/// This boot's id, or `None` (with a warning) when it cannot be read.
pub fn read_boot_id(path: &Path) -> Option<String> {
    match fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Ok(_) => {
            warn!(path = %path.display(), "boot id file is empty; reboots will not invalidate prepared claims");
            None
        }
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot read the boot id; reboots will not invalidate prepared claims");
            None
        }
    }
}

/// The checkpoint's slots and its content as last saved.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    state_dir: PathBuf,
    data: CheckpointData,
    /// The slot holding `data`; `None` before the first write.
    slot: Option<usize>,
}

/// What [`Checkpoint::load`] found.
#[derive(Debug)]
pub struct Loaded {
    pub checkpoint: Checkpoint,
    /// Claims of an earlier boot, dropped: remove their CDI specs.
    pub invalidated: BTreeMap<String, ClaimEntry>,
    /// The checkpoint was written under another (known) boot id: every claim spec on disk is of
    /// an earlier boot.
    pub rebooted: bool,
    /// Where unusable slots were moved (when no slot was usable).
    pub set_aside: Vec<PathBuf>,
    /// The content differs from the file (or there is no file worth keeping): save it.
    pub needs_save: bool,
}

impl Checkpoint {
    /// An empty checkpoint in `state_dir`, not yet saved.
    pub fn empty(state_dir: &Path, boot_id: &str) -> Self {
        Checkpoint {
            state_dir: state_dir.to_path_buf(),
            data: CheckpointData::empty(boot_id),
            slot: None,
        }
    }

    /// The slot file holding the content (the first slot before any write).
    pub fn path(&self) -> PathBuf {
        self.state_dir.join(SLOTS[self.slot.unwrap_or(0)])
    }

    pub fn data(&self) -> &CheckpointData {
        &self.data
    }

    pub fn get(&self, uid: &str) -> Option<&ClaimEntry> {
        self.data.claims.get(uid)
    }

    /// Loads the newest usable slot in `state_dir` for the boot `boot_id` (`None`: unknown,
    /// claims are kept whatever boot wrote them). Fails only when an unusable slot cannot be
    /// moved aside (it would be overwritten and its evidence lost).
    pub fn load(state_dir: &Path, boot_id: Option<&str>) -> Result<Loaded, CheckpointError> {
        // A first write of a slot the previous agent was killed in: the slot itself is absent
        // or whole (renames are atomic), the temporary file is garbage.
        match fsutil::remove_stale_temps(state_dir, "dra-checkpoint") {
            Ok(removed) => {
                for p in removed {
                    info!(path = %p.display(), "removed a temporary checkpoint file left by an interrupted write");
                }
            }
            Err(e) => warn!(error = %e, "clearing stale temporary checkpoint files failed"),
        }
        let current = boot_id.unwrap_or_default();
        let slots = read_slots(state_dir);
        let Some((slot, mut data)) = newest(&slots) else {
            let mut moved = Vec::new();
            for (i, read) in slots.iter().enumerate() {
                if let SlotRead::Unusable(reason) = read {
                    moved.push(set_aside(&state_dir.join(SLOTS[i]), reason)?);
                }
            }
            let needs_save = !moved.is_empty();
            return Ok(Loaded {
                checkpoint: Checkpoint::empty(state_dir, current),
                invalidated: BTreeMap::new(),
                rebooted: false,
                set_aside: moved,
                needs_save,
            });
        };
        if let SlotRead::Unusable(reason) = &slots[1 - slot] {
            warn!(path = %state_dir.join(SLOTS[1 - slot]).display(), reason = %reason,
                "ignoring an unusable DRA checkpoint slot (an interrupted write); the other slot holds the checkpoint");
        }
        let mut invalidated = BTreeMap::new();
        let mut needs_save = false;
        let rebooted = !current.is_empty() && !data.boot_id.is_empty() && data.boot_id != current;
        if !current.is_empty() && data.boot_id != current {
            if !data.boot_id.is_empty() && !data.claims.is_empty() {
                warn!(
                    path = %state_dir.join(SLOTS[slot]).display(), old_boot = %data.boot_id, boot = %current, claims = data.claims.len(),
                    "the node rebooted since the DRA checkpoint was written; its claims are no longer prepared"
                );
            }
            if !data.boot_id.is_empty() {
                invalidated = std::mem::take(&mut data.claims);
            }
            data.boot_id = current.to_string();
            needs_save = true;
        }
        Ok(Loaded {
            checkpoint: Checkpoint {
                state_dir: state_dir.to_path_buf(),
                data,
                slot: Some(slot),
            },
            invalidated,
            rebooted,
            set_aside: Vec::new(),
            needs_save,
        })
    }

    /// Writes the content as it is (into the other slot).
    pub fn save(&mut self) -> Result<(), CheckpointError> {
        let next = self.data.clone();
        self.write(next, Flush::Synced)
    }

    /// Applies `change` to a copy, saves the copy and only then adopts it: the content in
    /// memory is always what the newest slot holds.
    pub fn update(
        &mut self,
        change: impl FnOnce(&mut CheckpointData),
    ) -> Result<(), CheckpointError> {
        self.update_with(change, Flush::Synced)
    }

    /// [`Checkpoint::update`] without the fdatasync, for a record that matters only until the
    /// next boot: the intent to create a dynamic MIG instance. A process crash keeps the write
    /// (it is in the page cache); a power loss may tear the slot, and then the other slot,
    /// fsync'd, is read. After a power loss nothing such a record announces is left anyway: MIG
    /// GPU and compute instances do not survive a reboot (NVIDIA's MIG User Guide, "Getting
    /// Started with MIG": the instances are not persistent across reboots), and a checkpoint of
    /// another boot drops every claim (see Loading above). The next synced write goes to the
    /// slot this one left, so the content on disk is fsync'd again as soon as the prepare ends.
    pub fn update_until_reboot(
        &mut self,
        change: impl FnOnce(&mut CheckpointData),
    ) -> Result<(), CheckpointError> {
        self.update_with(change, Flush::Unsynced)
    }

    fn update_with(
        &mut self,
        change: impl FnOnce(&mut CheckpointData),
        flush: Flush,
    ) -> Result<(), CheckpointError> {
        let mut next = self.data.clone();
        change(&mut next);
        if next == self.data {
            return Ok(());
        }
        self.write(next, flush)
    }

    /// Writes `next`, one sequence on, into the slot not holding the current content, and
    /// adopts it.
    fn write(&mut self, mut next: CheckpointData, flush: Flush) -> Result<(), CheckpointError> {
        next.sequence = self.data.sequence + 1;
        let slot = self.slot.map_or(0, |s| 1 - s);
        write_slot(&self.state_dir, SLOTS[slot], &next, flush)?;
        self.data = next;
        self.slot = Some(slot);
        Ok(())
    }
}

/// One slot as read from disk.
#[derive(Debug)]
enum SlotRead {
    Absent,
    Unusable(String),
    Usable(CheckpointData),
}

fn read_slots(state_dir: &Path) -> [SlotRead; 2] {
    SLOTS.map(|name| match fs::read(state_dir.join(name)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => SlotRead::Absent,
        Err(e) => SlotRead::Unusable(format!("cannot be read: {e}")),
        Ok(bytes) => match decode(&bytes) {
            Ok(data) => SlotRead::Usable(data),
            Err(e) => SlotRead::Unusable(e.to_string()),
        },
    })
}

/// The usable slot with the higher sequence (the first on a tie), and its content.
fn newest(slots: &[SlotRead; 2]) -> Option<(usize, CheckpointData)> {
    slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            SlotRead::Usable(d) => Some((i, d)),
            _ => None,
        })
        .max_by_key(|(i, d)| (d.sequence, std::cmp::Reverse(*i)))
        .map(|(i, d)| (i, d.clone()))
}

/// The checkpoint as the newest usable slot in `state_dir` holds it, if any; reads only (for
/// tools and tests that look at what an agent left).
pub fn read(state_dir: &Path) -> Option<CheckpointData> {
    newest(&read_slots(state_dir)).map(|(_, d)| d)
}

/// Whether a slot write is fdatasync'd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flush {
    Synced,
    Unsynced,
}

fn write_slot(
    state_dir: &Path,
    name: &str,
    data: &CheckpointData,
    flush: Flush,
) -> Result<(), CheckpointError> {
    let path = state_dir.join(name);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .map_err(|source| CheckpointError::CreateDir {
            dir: state_dir.to_path_buf(),
            cause: source,
        })?;
    let bytes = encode(data).map_err(|source| CheckpointError::Encode {
        path: path.clone(),
        cause: source,
    })?;
    // An existing slot is overwritten in place (one fdatasync); the first write of a slot
    // creates it whole, so a slot file never exists half-made by a crash in its creation.
    let written = match fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_file() => match flush {
            Flush::Synced => fsutil::overwrite_in_place(&path, &bytes),
            Flush::Unsynced => fsutil::overwrite_in_place_unsynced(&path, &bytes),
        },
        _ => fsutil::write_atomic(&path, &bytes, FILE_MODE),
    };
    written.map_err(|source| CheckpointError::Write { cause: source })
}

/// Renames an unusable checkpoint to `<file>.corrupt-<unix seconds>[-n]` and logs it once.
fn set_aside(path: &Path, reason: &str) -> Result<PathBuf, CheckpointError> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let name = path.file_name().map_or_else(
        || FILE_NAME.to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let base = format!("{name}.corrupt-{secs}");
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut to = dir.join(&base);
    let mut n = 1;
    while fs::symlink_metadata(&to).is_ok() {
        to = dir.join(format!("{base}-{n}"));
        n += 1;
    }
    fs::rename(path, &to).map_err(|source| CheckpointError::SetAside {
        path: path.to_path_buf(),
        to: to.clone(),
        cause: source,
    })?;
    error!(
        path = %path.display(), moved_to = %to.display(), reason,
        "DRA checkpoint unusable; moved aside, starting with no prepared claims (claims are prepared again when the kubelet retries)"
    );
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(state: ClaimState) -> ClaimEntry {
        ClaimEntry {
            namespace: "ns".into(),
            name: "c".into(),
            state,
            devices: vec![PreparedDevice {
                requests: vec!["gpu".into()],
                pool: "node".into(),
                device: "gpu-3".into(),
                cdi_ids: vec!["k8s.gpu.gpuplane.dev/claim=abc-gpu-3".into()],
                share_id: None,
            }],
            cdi_spec_stem: "gpuplane-claim-abc".into(),
            units: [("gpu-3".to_string(), DeviceUuid::parse("GPU-x").unwrap())].into(),
            shares: Vec::new(),
            instances: Vec::new(),
            cdi_spec: Some(Spec {
                cdi_version: "0.3.0".into(),
                kind: "k8s.gpu.gpuplane.dev/claim".into(),
                ..Default::default()
            }),
        }
    }

    fn saved(dir: &Path, boot: &str) -> Checkpoint {
        let mut cp = Checkpoint::empty(dir, boot);
        cp.update(|d| {
            d.claims
                .insert("abc".into(), entry(ClaimState::PrepareCompleted));
        })
        .unwrap();
        cp
    }

    fn corrupt_files(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("dra-checkpoint.json.corrupt-"))
            .collect()
    }

    #[test]
    fn an_unsynced_write_is_read_back_and_the_next_synced_write_goes_to_the_other_slot() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let mut cp = saved(&state, "boot-1");
        cp.update(|d| {
            d.claims
                .insert("def".into(), entry(ClaimState::PrepareStarted));
        })
        .unwrap();
        // Both slots exist now; the intent overwrites the older one without a sync.
        cp.update_until_reboot(|d| {
            d.claims
                .insert("ghi".into(), entry(ClaimState::PrepareStarted));
        })
        .unwrap();
        let intent = read(&state).unwrap();
        assert_eq!(intent.sequence, 3);
        assert!(
            intent.claims.contains_key("ghi"),
            "a restart reads the intent"
        );
        cp.update(|d| {
            d.claims.get_mut("ghi").unwrap().state = ClaimState::PrepareCompleted;
        })
        .unwrap();
        let slots: Vec<u64> = SLOTS
            .iter()
            .map(|n| decode(&fs::read(state.join(n)).unwrap()).unwrap().sequence)
            .collect();
        let mut sorted = slots.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            [3, 4],
            "the synced write kept the intent's slot: {slots:?}"
        );
        assert_eq!(
            read(&state).unwrap().claims["ghi"].state,
            ClaimState::PrepareCompleted
        );
    }

    #[test]
    fn round_trips_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let cp = saved(&state, "boot-1");
        let mode = fs::metadata(cp.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let loaded = Checkpoint::load(&state, Some("boot-1")).unwrap();
        assert_eq!(loaded.checkpoint.data(), cp.data());
        assert!(loaded.invalidated.is_empty() && loaded.set_aside.is_empty() && !loaded.needs_save);
        let text = fs::read_to_string(cp.path()).unwrap();
        assert!(text.starts_with("sha256:"), "{text}");
        assert!(
            text.contains("\"PrepareCompleted\"")
                && text.contains("\"cdiSpecStem\"")
                && text.contains("\"cdiSpec\": {"),
            "{text}"
        );
    }

    #[test]
    fn missing_file_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert!(loaded.checkpoint.data().claims.is_empty());
        assert!(!loaded.needs_save && loaded.set_aside.is_empty());
    }

    #[test]
    fn the_checksum_covers_the_bytes_written() {
        let dir = tempfile::tempdir().unwrap();
        let cp = saved(dir.path(), "b");
        let good = fs::read(cp.path()).unwrap();
        // Any flipped byte of the body, even whitespace, is caught.
        for i in [good.len() - 1, good.len() / 2, 72] {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            assert!(decode(&bad).is_err(), "flip at {i} accepted");
        }
        let mut bad = good.clone();
        let i = good.len() / 2;
        bad[i] ^= 0x01;
        fs::write(cp.path(), &bad).unwrap();
        let loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert!(loaded.checkpoint.data().claims.is_empty());
        let aside = loaded.set_aside[0].clone();
        assert_eq!(fs::read(&aside).unwrap(), bad, "the evidence is kept");
        assert!(!cp.path().exists());
        assert_eq!(corrupt_files(dir.path()).len(), 1);
    }

    #[test]
    fn a_body_serialised_differently_still_loads() {
        // Compact JSON, another key order and an unknown field: what a newer writer might emit.
        let body = br#"{"claims":{},"extra":true,"bootId":"b","version":1}"#;
        let mut bytes = format!("sha256:{}\n", sha256_hex(body)).into_bytes();
        bytes.extend_from_slice(body);
        let data = decode(&bytes).unwrap();
        assert_eq!(data, CheckpointData::empty("b"));
    }

    #[test]
    fn an_entry_without_a_spec_from_an_older_agent_loads() {
        let body = br#"{"version":1,"bootId":"b","claims":{"abc":{"namespace":"ns","name":"c",
            "state":"PrepareStarted","cdiSpecStem":"gpuplane-claim-abc"}}}"#;
        let mut bytes = format!("sha256:{}\n", sha256_hex(body)).into_bytes();
        bytes.extend_from_slice(body);
        let entry = decode(&bytes).unwrap().claims["abc"].clone();
        assert_eq!(entry.state, ClaimState::PrepareStarted);
        assert!(entry.cdi_spec.is_none() && entry.devices.is_empty());
    }

    #[test]
    fn a_unit_that_is_not_a_device_uuid_is_refused_by_name() {
        // The ledger keys on checked UUIDs: a hand-edited unit must not slip into it.
        let body = br#"{"version":1,"bootId":"b","claims":{"abc":{"namespace":"ns","name":"c",
            "state":"PrepareCompleted","cdiSpecStem":"gpuplane-claim-abc",
            "units":{"gpu-0":"not a uuid"}}}}"#;
        let mut bytes = format!("sha256:{}\n", sha256_hex(body)).into_bytes();
        bytes.extend_from_slice(body);
        let e = decode(&bytes).unwrap_err().to_string();
        assert!(e.contains("not a uuid"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(FILE_NAME), &bytes).unwrap();
        let loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert!(!loaded.set_aside.is_empty() && loaded.checkpoint.data().claims.is_empty());
    }

    fn claim(n: u32) -> impl FnOnce(&mut CheckpointData) {
        move |d| {
            d.claims
                .insert(format!("c{n}"), entry(ClaimState::PrepareCompleted));
        }
    }

    #[test]
    fn writes_alternate_between_the_slots_and_the_newest_is_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::empty(dir.path(), "b");
        for n in 1..=3 {
            cp.update(claim(n)).unwrap();
            assert_eq!(cp.data().sequence, u64::from(n));
            let expected = if n % 2 == 1 {
                FILE_NAME
            } else {
                SECOND_FILE_NAME
            };
            assert_eq!(cp.path(), dir.path().join(expected));
        }
        let loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert_eq!(loaded.checkpoint.data(), cp.data());
        assert_eq!(read(dir.path()).as_ref(), Some(cp.data()));
        // The older slot holds the content before the last write.
        let older = decode(&fs::read(dir.path().join(SECOND_FILE_NAME)).unwrap()).unwrap();
        assert_eq!((older.sequence, older.claims.len()), (2, 2));
    }

    #[test]
    fn a_torn_slot_falls_back_to_the_other_and_is_overwritten_next() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::empty(dir.path(), "b");
        cp.update(claim(1)).unwrap();
        cp.update(claim(2)).unwrap();
        // What a crash in the middle of the second write leaves: half its bytes.
        let torn = dir.path().join(SECOND_FILE_NAME);
        let bytes = fs::read(&torn).unwrap();
        fs::write(&torn, &bytes[..bytes.len() / 2]).unwrap();
        let mut loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert!(loaded.set_aside.is_empty() && !loaded.needs_save);
        let data = loaded.checkpoint.data();
        assert_eq!((data.sequence, data.claims.len()), (1, 1));
        loaded.checkpoint.update(claim(3)).unwrap();
        assert_eq!(loaded.checkpoint.path(), torn);
        let again = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert_eq!(again.checkpoint.data().sequence, 2);
        assert_eq!(again.checkpoint.data().claims.len(), 2);
    }

    #[test]
    fn a_checkpoint_from_before_the_slots_is_read_and_continued() {
        let dir = tempfile::tempdir().unwrap();
        let body = br#"{"version":1,"bootId":"b","claims":{}}"#;
        let mut bytes = format!("sha256:{}\n", sha256_hex(body)).into_bytes();
        bytes.extend_from_slice(body);
        fs::write(dir.path().join(FILE_NAME), &bytes).unwrap();
        let mut loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert_eq!(loaded.checkpoint.data().sequence, 0);
        loaded.checkpoint.update(claim(1)).unwrap();
        assert_eq!(loaded.checkpoint.path(), dir.path().join(SECOND_FILE_NAME));
        let again = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert_eq!(again.checkpoint.data().claims.len(), 1);
        assert_eq!(fs::read(dir.path().join(FILE_NAME)).unwrap(), bytes);
    }

    #[test]
    fn unknown_version_and_garbage_are_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let mut data = CheckpointData::empty("b");
        data.version = 2;
        fs::write(dir.path().join(FILE_NAME), encode(&data).unwrap()).unwrap();
        let e = decode(&fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap_err();
        assert!(matches!(e, DecodeError::Version { .. }), "{e}");
        let loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
        assert!(!loaded.set_aside.is_empty() && loaded.needs_save);

        for garbage in [
            &b""[..],
            b"{\"version\":1}",
            b"sha256:00\n{}",
            b"\xff\xfe\n",
        ] {
            fs::write(dir.path().join(FILE_NAME), garbage).unwrap();
            let loaded = Checkpoint::load(dir.path(), Some("b")).unwrap();
            assert!(!loaded.set_aside.is_empty(), "{garbage:?}");
        }
        assert_eq!(
            corrupt_files(dir.path()).len(),
            5,
            "each one kept under its own name"
        );
    }

    #[test]
    fn a_reboot_invalidates_every_claim() {
        let dir = tempfile::tempdir().unwrap();
        saved(dir.path(), "boot-1");
        let loaded = Checkpoint::load(dir.path(), Some("boot-2")).unwrap();
        assert!(loaded.checkpoint.data().claims.is_empty());
        assert_eq!(loaded.checkpoint.data().boot_id, "boot-2");
        assert_eq!(loaded.invalidated.keys().collect::<Vec<_>>(), vec!["abc"]);
        assert!(loaded.needs_save && loaded.rebooted);
        // An unknown boot id keeps the claims.
        let loaded = Checkpoint::load(dir.path(), None).unwrap();
        assert_eq!(loaded.checkpoint.data().claims.len(), 1);
    }

    #[test]
    fn boot_id_is_read_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("boot_id");
        fs::write(&p, "5c1f-aa\n").unwrap();
        assert_eq!(read_boot_id(&p).as_deref(), Some("5c1f-aa"));
        assert_eq!(read_boot_id(&dir.path().join("none")), None);
    }

    #[test]
    fn a_failed_save_leaves_memory_as_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        fs::write(&blocker, b"").unwrap();
        // The state dir is below a regular file: it cannot be created.
        let mut cp = Checkpoint::empty(&blocker.join("state"), "b");
        let e = cp
            .update(|d| {
                d.claims
                    .insert("abc".into(), entry(ClaimState::PrepareStarted));
            })
            .unwrap_err();
        assert!(e.to_string().contains("state"), "{e}");
        assert!(cp.data().claims.is_empty());
    }
}
