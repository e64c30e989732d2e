//! Rendering CDI specs from the inventory and the discovered driver files: pure functions.
//!
//! The node spec names devices the way NVIDIA's `nvidia-ctk cdi generate` does, so pod specs and
//! runtime configurations written for NVIDIA's specs keep working: every GPU by index (`0`) and
//! UUID (`GPU-…`), every MIG device by `<gpu index>:<mig index>` (the MIG index is the position in
//! [`Gpu::mig_devices`](crate::inventory::Gpu::mig_devices), i.e. ordered by GPU then compute instance) and by UUID (`MIG-…`), and
//! `all`. [`render_spec`] is the building block for specs over any named device sets (the DRA
//! per-claim specs).
//!
//! Simulated devices ([`render_simulated_spec`], [`render_simulated_node_spec`]) have nothing on
//! the host to inject: no device nodes, no libraries, no hooks. Each CDI device instead sets one
//! environment variable per inventory device, [`device_env`]:
//! `GPUPLANE_DEVICE_<key>=index=<index>,uuid=<uuid>,profile=<MIG profile, empty for a GPU>`,
//! where `<key>` is the GPU's index (`0`) or `<gpu index>_MIG_<mig index>` (`0_MIG_1`) and
//! `<index>` is `0` or `0:1` as the node spec names them. The runtime applies the edits of
//! several devices in turn and a later value of a variable replaces an earlier one, so each
//! device needs a name of its own. `NVIDIA_VISIBLE_DEVICES` is left to whoever knows the whole
//! set a container gets: the device plugin's Allocate, or the spec-level edits of a DRA claim's
//! spec; so a simulated spec never sets `NVIDIA_VISIBLE_DEVICES=void`.

use super::files::{CapNode, DriverFiles, HostFile};
use super::name::{DeviceName, Kind};
use super::spec::{minimum_version, ContainerEdits, Device, DeviceNode, Hook, Mount, Spec};
pub use crate::inventory::DeviceRef;
use crate::inventory::Inventory;
use std::collections::BTreeSet;
use std::path::Path;
use tracing::warn;

/// The name of the device that holds every GPU and MIG device.
pub const ALL: &str = "all";

/// Options of every library and binary mount.
pub const MOUNT_OPTIONS: &[&str] = &["ro", "nosuid", "nodev", "bind"];

/// The environment NVIDIA's specs set: the container toolkit's legacy hook must not inject
/// devices on its own into a container whose devices came through CDI.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES=void";

/// A CDI device to render: its name and the inventory devices it injects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedDevices<'a> {
    pub name: DeviceName,
    pub devices: Vec<DeviceRef<'a>>,
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn device_node(f: &HostFile) -> DeviceNode {
    let host = path_str(&f.host_path);
    let path = path_str(&f.container_path);
    DeviceNode {
        host_path: (host != path).then_some(host),
        path,
        ..Default::default()
    }
}

fn cap_device_node(node: &CapNode) -> DeviceNode {
    match node {
        CapNode::ByNumber { major, minor } => DeviceNode {
            path: path_str(&CapNode::container_path(*minor)),
            node_type: Some("c".into()),
            major: i64::try_from(*major).ok(),
            minor: Some(i64::from(*minor)),
            ..Default::default()
        },
        CapNode::Host(f) => device_node(f),
    }
}

fn mount(f: &HostFile) -> Mount {
    Mount {
        host_path: path_str(&f.host_path),
        container_path: path_str(&f.container_path),
        options: MOUNT_OPTIONS.iter().map(|o| o.to_string()).collect(),
        mount_type: None,
    }
}

/// The device nodes one inventory device needs: its GPU's `/dev/nvidia<minor>`, plus, for a MIG
/// device, its GPU- and compute-instance access nodes (when their minors were discovered), by
/// number where the major is known ([`CapNode`]).
pub fn device_nodes(dev: DeviceRef<'_>, files: &DriverFiles) -> Vec<DeviceNode> {
    match dev {
        DeviceRef::Gpu(gpu) => vec![device_node(&files.gpu_node(gpu.minor))],
        DeviceRef::Mig { parent, mig } => {
            let mut nodes = vec![device_node(&files.gpu_node(parent.minor))];
            let key = (parent.minor, mig.gpu_instance_id, mig.compute_instance_id);
            if let Some(caps) = files.mig_cap_nodes.get(&key) {
                nodes.extend(caps.iter().map(cap_device_node));
            }
            nodes
        }
    }
}

/// The edits a CDI device over `devices` makes: their device nodes, deduplicated and sorted.
pub fn device_edits(devices: &[DeviceRef<'_>], files: &DriverFiles) -> ContainerEdits {
    let nodes: BTreeSet<DeviceNode> = devices
        .iter()
        .flat_map(|d| device_nodes(*d, files))
        .collect();
    ContainerEdits {
        device_nodes: nodes.into_iter().collect(),
        ..Default::default()
    }
}

/// Spec-level edits shared by all devices: control nodes, library and binary mounts, the
/// ldcache hook (when a hook binary and libraries were found) and `NVIDIA_VISIBLE_DEVICES=void`.
pub fn common_edits(files: &DriverFiles) -> ContainerEdits {
    let nodes: BTreeSet<DeviceNode> = files.control_nodes.iter().map(device_node).collect();
    let mut mounted: Vec<&HostFile> = files.libraries.iter().chain(&files.binaries).collect();
    mounted.sort_by(|a, b| a.container_path.cmp(&b.container_path));
    mounted.dedup_by(|a, b| a.container_path == b.container_path);
    ContainerEdits {
        env: vec![VISIBLE_DEVICES_ENV.to_string()],
        device_nodes: nodes.into_iter().collect(),
        hooks: ldcache_hook(files).into_iter().collect(),
        mounts: mounted.into_iter().map(mount).collect(),
        additional_gids: Vec::new(),
    }
}

/// `createContainer` hook running `update-ldcache --folder <dir>…` over the container
/// directories of the mounted libraries, as nvidia-container-toolkit writes it: argv starts
/// `nvidia-cdi-hook update-ldcache`, or `nvidia-ctk hook update-ldcache` for the older binary.
pub fn ldcache_hook(files: &DriverFiles) -> Option<Hook> {
    let hook = files.ldcache_hook.as_ref()?;
    let folders: BTreeSet<String> = files
        .libraries
        .iter()
        .filter_map(|l| l.container_path.parent().map(path_str))
        .collect();
    if folders.is_empty() {
        return None;
    }
    let exe = hook
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut args = vec![exe.clone()];
    if exe == "nvidia-ctk" {
        args.push("hook".to_string());
    }
    args.push("update-ldcache".to_string());
    for f in folders {
        args.push("--folder".to_string());
        args.push(f);
    }
    Some(Hook {
        hook_name: "createContainer".to_string(),
        path: path_str(hook),
        args,
        env: Vec::new(),
    })
}

/// A spec of `kind` with one CDI device per entry (sorted by name; a repeated name keeps its
/// first entry, with a warning), the [`common_edits`], and the lowest cdiVersion that fits.
pub fn render_spec(kind: &Kind, devices: &[NamedDevices<'_>], files: &DriverFiles) -> Spec {
    assemble(
        kind,
        devices,
        |d| device_edits(d, files),
        common_edits(files),
    )
}

/// Prefix of the per-device environment variables of simulated devices.
pub const DEVICE_ENV_PREFIX: &str = "GPUPLANE_DEVICE_";

/// `0` for GPU 0, `0_MIG_1` for its second MIG device: unique per device and valid in an
/// environment variable name (letters, digits, `_`).
pub fn device_env_key(dev: DeviceRef<'_>) -> String {
    match dev {
        DeviceRef::Gpu(gpu) => gpu.index.to_string(),
        DeviceRef::Mig { parent, mig } => match mig_position(dev) {
            Some(i) => format!("{}_MIG_{i}", parent.index),
            // Not reachable for a DeviceRef built from its parent; stays unique anyway.
            None => format!(
                "{}_MIG_GI{}_CI{}",
                parent.index, mig.gpu_instance_id, mig.compute_instance_id
            ),
        },
    }
}

/// The position of a MIG device among its GPU's (the `<mig>` of the node spec's `<gpu>:<mig>`).
fn mig_position(dev: DeviceRef<'_>) -> Option<usize> {
    match dev {
        DeviceRef::Gpu(_) => None,
        DeviceRef::Mig { parent, mig } => {
            parent.mig_devices.iter().position(|m| m.uuid == mig.uuid)
        }
    }
}

/// `GPUPLANE_DEVICE_<key>=index=<index>,uuid=<uuid>,profile=<profile>`: a simulated device's
/// identity, as a container sees it (see the module docs).
pub fn device_env(dev: DeviceRef<'_>) -> String {
    let (index, profile) = match dev {
        DeviceRef::Gpu(gpu) => (gpu.index.to_string(), ""),
        DeviceRef::Mig { parent, mig } => {
            let index = match mig_position(dev) {
                Some(i) => format!("{}:{i}", parent.index),
                None => parent.index.to_string(),
            };
            (index, mig.profile.as_str())
        }
    };
    format!(
        "{DEVICE_ENV_PREFIX}{}=index={index},uuid={},profile={profile}",
        device_env_key(dev),
        dev.uuid()
    )
}

/// `NVIDIA_VISIBLE_DEVICES=<uuid>,...` over `devices`, in their order, each once.
pub fn visible_devices_env(devices: &[DeviceRef<'_>]) -> String {
    let mut seen = BTreeSet::new();
    let uuids: Vec<&str> = devices
        .iter()
        .map(|d| d.uuid().as_str())
        .filter(|u| seen.insert(*u))
        .collect();
    format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(","))
}

/// The edits of a simulated CDI device over `devices`: one [`device_env`] each, sorted.
pub fn simulated_device_edits(devices: &[DeviceRef<'_>]) -> ContainerEdits {
    let env: BTreeSet<String> = devices.iter().map(|d| device_env(*d)).collect();
    ContainerEdits {
        env: env.into_iter().collect(),
        ..Default::default()
    }
}

/// [`render_spec`] for simulated devices: per-device [`simulated_device_edits`] and
/// `common` as the spec-level edits (nothing, or a claim's `NVIDIA_VISIBLE_DEVICES`).
pub fn render_simulated_spec(
    kind: &Kind,
    devices: &[NamedDevices<'_>],
    common: ContainerEdits,
) -> Spec {
    assemble(kind, devices, simulated_device_edits, common)
}

/// The node-wide spec of a simulated inventory: the names of [`render_node_spec`], identities
/// in the environment, no spec-level edits (Allocate sets `NVIDIA_VISIBLE_DEVICES`).
pub fn render_simulated_node_spec(inv: &Inventory, kind: &Kind) -> Spec {
    render_simulated_spec(kind, &node_devices(inv), ContainerEdits::default())
}

fn assemble(
    kind: &Kind,
    devices: &[NamedDevices<'_>],
    edits: impl Fn(&[DeviceRef<'_>]) -> ContainerEdits,
    common: ContainerEdits,
) -> Spec {
    let mut seen = BTreeSet::new();
    let mut out: Vec<Device> = Vec::new();
    for nd in devices {
        if !seen.insert(nd.name.as_str()) {
            warn!(name = %nd.name, kind = %kind, "duplicate CDI device name; keeping the first");
            continue;
        }
        out.push(Device {
            name: nd.name.to_string(),
            annotations: Default::default(),
            container_edits: edits(&nd.devices),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    let mut spec = Spec {
        cdi_version: String::new(),
        kind: kind.to_string(),
        annotations: Default::default(),
        devices: out,
        container_edits: common,
    };
    spec.cdi_version = minimum_version(&spec).to_string();
    spec
}

fn push_named<'a>(out: &mut Vec<NamedDevices<'a>>, name: String, dev: DeviceRef<'a>) {
    match DeviceName::new(name) {
        Ok(name) => out.push(NamedDevices {
            name,
            devices: vec![dev],
        }),
        Err(e) => warn!(error = %e, "skipping a device whose name CDI does not accept"),
    }
}

/// The node spec's devices: per GPU its index and UUID, per MIG device `<gpu>:<mig>` and its
/// UUID (not a dynamic GPU's instances), and `all`.
pub fn node_devices(inv: &Inventory) -> Vec<NamedDevices<'_>> {
    let mut out = Vec::new();
    let mut all = Vec::new();
    for gpu in &inv.gpus {
        let dev = DeviceRef::Gpu(gpu);
        all.push(dev);
        push_named(&mut out, gpu.index.to_string(), dev);
        push_named(&mut out, gpu.uuid.to_string(), dev);
        // A dynamic GPU's instances come and go with the claims they were made for, whose own
        // specs name them: listed here, each create and destroy would rewrite (and fsync) the
        // node spec and hold up every Allocate until it is written.
        if gpu.mig.dynamic {
            continue;
        }
        for (i, mig) in gpu.mig_devices.iter().enumerate() {
            let dev = DeviceRef::Mig { parent: gpu, mig };
            all.push(dev);
            push_named(&mut out, format!("{}:{i}", gpu.index), dev);
            push_named(&mut out, mig.uuid.to_string(), dev);
        }
    }
    if let Ok(name) = DeviceName::new(ALL) {
        out.push(NamedDevices { name, devices: all });
    }
    out
}

/// The node-wide spec (`nvidia.com/gpu` with [`Kind::default`]).
pub fn render_node_spec(inv: &Inventory, files: &DriverFiles, kind: &Kind) -> Spec {
    render_spec(kind, &node_devices(inv), files)
}
