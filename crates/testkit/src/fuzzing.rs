//! The checks behind the fuzz targets in `fuzz/` and the corpus replay in
//! `tests/it/fuzz_corpus.rs`: one function per decoder of outside input, taking raw bytes.
//!
//! Each check feeds the bytes to the same function the agent or the webhook calls on that
//! input and then asserts what must hold of every accepted value (a round trip, file names
//! that stay inside their directory, a choice drawn from what was offered). A panic is a
//! finding: libFuzzer saves the input, and the replay test fails on it.
//!
//! It lives in the library, behind no feature, so that the fuzz targets are one line each, the
//! replay test runs exactly the same code on stable in every CI run, and both may call the
//! crate-private validation functions the gRPC handlers use. Nothing in the agent or the
//! controller calls it. Like the gRPC services, it knows protobuf types: request bytes are
//! decoded by prost, as they are when they arrive.

use gpuplane_cluster::webhook::review::{self, Verdict};
use gpuplane_model::config::{AgentConfig, DeviceListStrategy};
use gpuplane_model::health::HealthBook;
use gpuplane_model::inventory::Inventory;
use gpuplane_model::quota::{check, claim_charge, pod_charge, pod_template_names};
use gpuplane_model::quota::{CatalogSettings, DeviceCatalog, GpuQuota};
use gpuplane_model::source::DeviceMode;
use gpuplane_model::topology::TopologyModel;
use gpuplane_node::cdi::{self, DeviceName, Kind, QualifiedName};
use gpuplane_node::deviceplugin::allocate;
use gpuplane_node::deviceplugin::resources::{self, ResourcePlan};
use gpuplane_node::dra::checkpoint;
use gpuplane_node::dra::core::{cdi_device_name, spec_stem};
use gpuplane_node::dra::opaque::{self, GpuConfig, Sharing, TimeSliceInterval};
use gpuplane_node::dra::service::{validate, RawClaim};
use gpuplane_node::dra::{ClaimUid, ObjectName};
use gpuplane_node::proto::{deviceplugin_v1beta1 as dp, dra_v1, dra_v1beta1};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimSpec};
use prost::Message;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;

/// A check: panics when the input breaks a property.
pub type Check = fn(&[u8]);

/// Every check, by fuzz target name (the directory of its corpus under `fuzz/corpus/`).
pub const TARGETS: &[(&str, Check)] = &[
    ("sim_profile", sim_profile),
    ("agent_config", agent_config),
    ("opaque_config", opaque_config),
    ("checkpoint", checkpoint_file),
    ("admission_review", admission_review),
    ("deviceplugin_request", deviceplugin_request),
    ("dra_claims", dra_claims),
    ("cdi_names", cdi_names),
];

/// The check of fuzz target `name`.
pub fn target(name: &str) -> Option<Check> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

const DRIVER: &str = "gpu.gpuplane.dev";
const NODE: &str = "node-1";

fn bundled(name: &str) -> Inventory {
    let text = gpuplane_model::sim::bundled_text(name).unwrap_or_default();
    gpuplane_model::sim::from_str(name, name, text).expect("bundled profiles are valid")
}

fn config(text: &str) -> AgentConfig {
    AgentConfig::parse("fixture", text).expect("fixture configs are valid")
}

/// A simulation profile (`--simulate FILE`, and what the fake NVML serves). Accepted profiles
/// describe a consistent machine, load the same way twice, and the agent's derived views
/// (topology model, device plugin plan, ResourceSlices) are built without a panic.
pub fn sim_profile(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(inv) = gpuplane_model::sim::from_str("fuzz.yaml", "fuzz", text) else {
        return;
    };
    let again = gpuplane_model::sim::from_str("fuzz.yaml", "fuzz", text).expect("accepted once");
    assert_eq!(inv, again, "a profile must load the same way every time");
    let mut uuids = BTreeSet::new();
    for (i, g) in inv.gpus.iter().enumerate() {
        assert_eq!(g.index as usize, i, "GPU indices are positions");
        assert!(uuids.insert(g.uuid.as_str()), "duplicate UUID {}", g.uuid);
        for (a, m) in g.mig_devices.iter().enumerate() {
            assert_eq!(m.parent_uuid, g.uuid);
            assert!(uuids.insert(m.uuid.as_str()), "duplicate UUID {}", m.uuid);
            for other in &g.mig_devices[a + 1..] {
                assert!(
                    !m.placement.overlaps(&other.placement),
                    "MIG devices {} and {} overlap",
                    m.uuid,
                    other.uuid
                );
            }
        }
    }
    let n = inv.gpus.len() as u32;
    for pair in inv.topology.links.windows(2) {
        assert!((pair[0].from, pair[0].to) < (pair[1].from, pair[1].to));
    }
    for l in &inv.topology.links {
        assert!(l.from < l.to && l.to < n, "link {l:?} names no GPU pair");
    }
    let _ = TopologyModel::new(&inv);
    let _ = resources::plan(&inv, &AgentConfig::default());
    let mut health = HealthBook::default();
    health.set_inventory(&inv);
    let _ = gpuplane_node::slices::render::render(&inv, &health, DRIVER, NODE);
}

/// The agent config file. Accepted configs parse the same way twice and plan against every
/// bundled machine without a panic (a plan error such as mixed MIG profiles is an answer).
pub fn agent_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = AgentConfig::parse("fuzz.yaml", text) else {
        return;
    };
    assert_eq!(
        cfg,
        AgentConfig::parse("fuzz.yaml", text).expect("accepted once")
    );
    assert!(!cfg.device_list_strategy.is_empty());
    for r in &cfg.time_slicing {
        assert!(r.replicas >= 1, "{} has {} replicas", r.name, r.replicas);
    }
    static MACHINES: OnceLock<Vec<Inventory>> = OnceLock::new();
    let machines = MACHINES.get_or_init(|| {
        gpuplane_model::sim::bundled_names()
            .into_iter()
            .map(bundled)
            .collect()
    });
    for inv in machines {
        if let Ok(plan) = resources::plan(inv, &cfg) {
            for r in &plan.resources {
                assert!(r.replicas >= 1);
                let ids: BTreeSet<&str> = r.devices.iter().map(|d| d.id.as_str()).collect();
                assert_eq!(
                    ids.len(),
                    r.devices.len(),
                    "{}: duplicate device ids",
                    r.name
                );
            }
        }
    }
}

/// Writes a decoded config back as `opaque.parameters`, in the canonical spellings.
fn encode_opaque(c: &GpuConfig) -> Value {
    let mut out = json!({"apiVersion": opaque::API_VERSION, "kind": opaque::KIND});
    match &c.sharing {
        None => {}
        Some(Sharing::TimeSlicing(ts)) => {
            out["sharing"] = json!({"strategy": "TimeSlicing",
                "timeSlicingConfig": {"interval": ts.interval.as_str()}});
        }
        Some(Sharing::Mps(m)) => {
            let mut mps = Map::new();
            if let Some(p) = m.default_active_thread_percentage {
                mps.insert("defaultActiveThreadPercentage".into(), json!(p));
            }
            if let Some(l) = &m.default_pinned_device_memory_limit {
                mps.insert("defaultPinnedDeviceMemoryLimit".into(), json!(l.quantity));
            }
            if !m.default_per_device_pinned_memory_limit.is_empty() {
                let per: Map<String, Value> = m
                    .default_per_device_pinned_memory_limit
                    .iter()
                    .map(|(k, l)| (k.clone(), json!(l.quantity)))
                    .collect();
                mps.insert(
                    "defaultPerDevicePinnedMemoryLimit".into(),
                    Value::Object(per),
                );
            }
            out["sharing"] = json!({"strategy": "MPS", "mpsConfig": mps});
        }
    }
    out
}

/// A ResourceClaim's opaque `GpuConfig` parameters (JSON, as the API server stores them).
/// Decode → encode → decode gives the same config, and the environment it turns into has only
/// our variables, one `NAME=value` line each.
pub fn opaque_config(data: &[u8]) {
    let Ok(raw) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let Ok(cfg) = opaque::parse(&raw) else {
        return;
    };
    let again = opaque::parse(&encode_opaque(&cfg)).expect("an encoded config decodes");
    assert_eq!(cfg, again, "decode -> encode -> decode changed the config");
    if let Ok(env) = opaque::container_env(&cfg) {
        for line in env {
            let (name, value) = line.split_once('=').expect("NAME=value");
            assert_eq!(name, opaque::ENV_STRATEGY, "unexpected variable {name}");
            assert!(!value.contains(['\n', '\0']), "{line:?}");
        }
    }
    if let Some(Sharing::TimeSlicing(ts)) = &cfg.sharing {
        assert!(matches!(
            ts.interval,
            TimeSliceInterval::Default
                | TimeSliceInterval::Short
                | TimeSliceInterval::Medium
                | TimeSliceInterval::Long
        ));
    }
}

/// Asserts `stem` names a file directly inside `root`, or is refused.
fn assert_contained(root: &Path, stem: &str) {
    let Ok(path) = cdi::writer::spec_path(root, stem) else {
        return;
    };
    assert_eq!(
        path.parent(),
        Some(root),
        "{stem:?} leaves {}",
        root.display()
    );
    assert!(
        !stem.contains('/') && !stem.contains("..") && !stem.starts_with('.'),
        "{stem:?} accepted as a file stem"
    );
    assert_eq!(path.file_name(), Some(format!("{stem}.json").as_ref()));
}

/// The DRA checkpoint file, as read at start-up. The bytes are tried as they are and, so that
/// the fuzzer gets past the checksum, as a body under a correct header. An accepted file
/// re-encodes to a file that decodes to the same content, and the CDI spec stems it names can
/// only ever reach files inside the CDI root.
pub fn checkpoint_file(data: &[u8]) {
    let mut sealed = format!("sha256:{}\n", sha256_hex(data)).into_bytes();
    sealed.extend_from_slice(data);
    for bytes in [data, &sealed] {
        let Ok(cp) = checkpoint::decode(bytes) else {
            continue;
        };
        assert_eq!(cp.version, checkpoint::VERSION);
        let encoded = checkpoint::encode(&cp).expect("decoded content encodes");
        let again = checkpoint::decode(&encoded).expect("encoded content decodes");
        assert_eq!(
            cp, again,
            "decode -> encode -> decode changed the checkpoint"
        );
        for entry in cp.claims.values() {
            assert_contained(Path::new("/var/run/cdi"), &entry.cdi_spec_stem);
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What the webhook prices against: the ResourceSlices the agent renders for two bundled
/// machines, and a GPU and a MIG DeviceClass.
fn catalog() -> &'static DeviceCatalog {
    static CATALOG: OnceLock<DeviceCatalog> = OnceLock::new();
    CATALOG.get_or_init(|| {
        let mut slices = Vec::new();
        for (node, profile) in [("a", "a100-mig-mixed"), ("h", "dgx-h100")] {
            let inv = bundled(profile);
            let mut health = HealthBook::default();
            health.set_inventory(&inv);
            slices.extend(gpuplane_node::slices::render::render(&inv, &health, DRIVER, node));
        }
        let class = |name: &str, ty: &str| -> DeviceClass {
            serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": format!(
                    "device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{ty}'")}}]}
            }))
            .expect("fixture DeviceClass")
        };
        let classes = [class("gpu.gpuplane.dev", "gpu"), class("mig.gpuplane.dev", "mig")];
        DeviceCatalog::new(&slices, &classes, CatalogSettings::default())
    })
}

fn quota(hard: Value) -> GpuQuota {
    serde_json::from_value(json!({
        "apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "q", "namespace": "team-a"},
        "spec": {"hard": hard}
    }))
    .expect("fixture GpuQuota")
}

/// An AdmissionReview body as the webhook receives it, then the pricing and quota check the
/// admission decision runs on the decoded Pod or ResourceClaim. Answers carry the request's
/// uid; a charge that is empty fits any quota, and any charge fits a quota that limits nothing.
pub fn admission_review(data: &[u8]) {
    let Ok(req) = review::decode(data) else {
        return;
    };
    assert!(!req.uid.trim().is_empty());
    for v in [Verdict::allow(), Verdict::deny(403, "no")] {
        let answer = review::encode(&req, &v).expect("answers encode");
        assert_eq!(answer["response"]["uid"], json!(req.uid));
        assert_eq!(answer["response"]["allowed"], json!(v.allowed));
        let bytes = serde_json::to_vec(&answer).expect("answers serialise");
        assert!(serde_json::from_slice::<Value>(&bytes).is_ok());
    }
    let charge = match (req.kind.group.as_str(), req.kind.kind.as_str()) {
        ("", "Pod") => {
            let Some(Ok(pod)) = req.object.as_ref().map(Pod::deserialize) else {
                return;
            };
            // Every template the pod names exists and asks for one GPU, as the webhook's
            // cache would answer.
            let template: ResourceClaimSpec =
                serde_json::from_value(json!({"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}))
                .expect("fixture template");
            let templates: BTreeMap<String, ResourceClaimSpec> = pod_template_names(&pod)
                .into_iter()
                .map(|t| (t, template.clone()))
                .collect();
            pod_charge(&pod, &templates, catalog())
        }
        ("resource.k8s.io", "ResourceClaim") => {
            let Some(Ok(claim)) = req.object.as_ref().map(ResourceClaim::deserialize) else {
                return;
            };
            claim_charge(&claim.spec, catalog())
        }
        _ => return,
    };
    let Ok(charge) = charge else {
        return;
    };
    static QUOTAS: OnceLock<(GpuQuota, GpuQuota)> = OnceLock::new();
    let (unlimited, tight) = QUOTAS.get_or_init(|| {
        (
            quota(json!({})),
            quota(json!({"gpus": "1", "gpuMemory": "20Gi"})),
        )
    });
    assert!(check(unlimited, &[], None, &charge).is_ok());
    let verdict = check(tight, &[], None, &charge);
    if charge.is_empty() {
        assert!(verdict.is_ok(), "an empty charge was denied: {verdict:?}");
    }
    if let Err(denial) = verdict {
        assert!(!denial.reasons.is_empty(), "a denial gives its reasons");
    }
}

/// The resources the device plugin fuzz target is served: whole GPUs on an NVSwitch machine,
/// time-sliced GPUs, and mixed MIG.
fn plans() -> &'static Vec<(ResourcePlan, TopologyModel, AgentConfig)> {
    static PLANS: OnceLock<Vec<(ResourcePlan, TopologyModel, AgentConfig)>> = OnceLock::new();
    PLANS.get_or_init(|| {
        let sliced = "sharing:\n  timeSlicing:\n    failRequestsGreaterThanOne: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 3\n";
        let mut out = Vec::new();
        for (profile, cfg) in [
            ("dgx-a100", "flags:\n  plugin:\n    deviceListStrategy: [cdi-cri, envvar]\n"),
            ("pcie-l4x4", sliced),
            ("a100-mig-mixed", "flags:\n  migStrategy: mixed\n"),
        ] {
            let inv = bundled(profile);
            let cfg = config(cfg);
            let plan = resources::plan(&inv, &cfg).expect("fixture plans");
            let model = TopologyModel::new(&inv);
            for r in plan.resources {
                out.push((r, model.clone(), cfg.clone()));
            }
        }
        out
    })
}

/// Device plugin Allocate and GetPreferredAllocation requests: the first byte picks a
/// resource and the call, the rest is the protobuf request. A grant names only requested
/// devices' units; a preferred set has the requested size, is drawn from the available
/// devices and holds every must-include device.
pub fn deviceplugin_request(data: &[u8]) {
    let Some((&selector, wire)) = data.split_first() else {
        return;
    };
    let plans = plans();
    let (plan, model, cfg) = &plans[usize::from(selector >> 1) % plans.len()];
    let health = HealthBook::default();
    if selector & 1 == 0 {
        let Ok(req) = dp::AllocateRequest::decode(wire) else {
            return;
        };
        for c in &req.container_requests {
            // As the gRPC service does: the strings parsed once, then decided.
            let mode = DeviceMode::Hardware;
            let Ok(grant) = allocate::parse_ids(plan, &health, cfg, &c.devices_ids, mode)
                .and_then(|ids| allocate::allocate(plan, &health, cfg, &ids, mode))
            else {
                continue;
            };
            let units: BTreeSet<&str> = c
                .devices_ids
                .iter()
                .filter_map(|id| plan.devices.iter().find(|d| &d.id == id))
                .map(|d| d.unit.as_str())
                .collect();
            if cfg
                .device_list_strategy
                .contains(&DeviceListStrategy::CdiCri)
            {
                assert_eq!(
                    grant.cdi_devices.len(),
                    units.len(),
                    "one CDI device per unit"
                );
            }
            for name in &grant.cdi_devices {
                let q: QualifiedName = name.parse().expect("granted CDI names are valid");
                assert!(units.contains(q.name.as_str()), "{name} was not requested");
            }
        }
    } else {
        let Ok(req) = dp::PreferredAllocationRequest::decode(wire) else {
            return;
        };
        for c in &req.container_requests {
            let Ok(size) = usize::try_from(c.allocation_size) else {
                continue;
            };
            // As the service does: the strings parsed once, then the decision.
            let Ok(ids) = allocate::parse_preferred_ids(
                plan,
                &c.available_device_i_ds,
                &c.must_include_device_i_ds,
            )
            .and_then(|(available, must)| {
                allocate::preferred(plan, model, &available, &must, size, &BTreeSet::new())
            }) else {
                continue;
            };
            let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
            assert_eq!(ids.len(), size, "asked for {size}, got {ids:?}");
            for id in &ids {
                assert!(
                    c.available_device_i_ds.contains(id),
                    "{id} was not available"
                );
            }
            let offered: BTreeSet<&String> = c.available_device_i_ds.iter().collect();
            if offered.len() == c.available_device_i_ds.len() {
                let distinct: BTreeSet<&String> = ids.iter().collect();
                assert_eq!(distinct.len(), ids.len(), "{ids:?} repeats a device");
            }
            for m in &c.must_include_device_i_ds {
                assert!(ids.contains(m), "must-include {m} left out of {ids:?}");
            }
        }
    }
}

/// NodePrepareResources / NodeUnprepareResources claim lists, v1 or v1beta1 (first byte), as
/// the DRA service splits them into claims for the core and rejections. Every claim uid asked
/// about gets exactly one answer; what the core then accepts as a uid makes a spec file inside
/// the CDI root and a valid CDI device name, and accepted namespaces and names are single path
/// segments.
pub fn dra_claims(data: &[u8]) {
    let Some((&selector, wire)) = data.split_first() else {
        return;
    };
    let raw: Vec<RawClaim> = match selector % 4 {
        0 => dra_v1::NodePrepareResourcesRequest::decode(wire)
            .map(|r| r.claims.into_iter().map(RawClaim::from).collect()),
        1 => dra_v1::NodeUnprepareResourcesRequest::decode(wire)
            .map(|r| r.claims.into_iter().map(RawClaim::from).collect()),
        2 => dra_v1beta1::NodePrepareResourcesRequest::decode(wire)
            .map(|r| r.claims.into_iter().map(RawClaim::from).collect()),
        _ => dra_v1beta1::NodeUnprepareResourcesRequest::decode(wire)
            .map(|r| r.claims.into_iter().map(RawClaim::from).collect()),
    }
    .unwrap_or_default();
    let asked: BTreeSet<String> = raw.iter().map(|c| c.uid.clone()).collect();
    let checked = validate(raw);
    let mut answered = BTreeSet::new();
    for c in &checked.accepted {
        assert!(
            answered.insert(c.uid.to_string()),
            "uid {} passed twice",
            c.uid
        );
        claim_names(&c.uid, &c.namespace, &c.name);
    }
    for uid in checked.rejected.keys().chain(checked.invalid.keys()) {
        assert!(answered.insert(uid.clone()), "uid {uid} answered twice");
    }
    assert_eq!(asked, answered, "every uid asked about gets one answer");
}

/// What the DRA core derives from a claim's uid, namespace and name once the edge accepted
/// them: a spec file directly inside the CDI root, a valid CDI device name, and names that
/// are single path segments.
fn claim_names(uid: &ClaimUid, namespace: &ObjectName, name: &ObjectName) {
    uid_names(uid);
    for v in [namespace, name] {
        name_is_one_segment(v);
    }
}

fn uid_names(uid: &ClaimUid) {
    let root = Path::new("/var/run/cdi");
    let stem = spec_stem(uid);
    assert!(
        cdi::writer::spec_path(root, &stem).is_ok(),
        "{stem:?} refused"
    );
    assert_contained(root, &stem);
    let device = cdi_device_name(uid, "gpu-0");
    assert!(DeviceName::new(device.as_str()).is_ok(), "{device:?}");
}

fn name_is_one_segment(v: &ObjectName) {
    assert!(!v.is_empty() && !v.contains('/') && *v != "." && *v != ".." && !v.contains('\0'));
    assert!(v.len() <= 253);
}

/// CDI names (device names, kinds, qualified names) and spec file stems: accepted names print
/// back as they were given and never carry a path separator; an accepted stem names a file
/// directly inside the CDI root. The same bytes are also tried as a claim's uid, namespace and
/// name.
pub fn cdi_names(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(d) = DeviceName::new(s) {
        assert_eq!(d.to_string(), s);
        assert!(!s.contains(['/', '=', '\0']));
    }
    if let Ok(k) = s.parse::<Kind>() {
        assert_eq!(k.to_string(), s);
        assert!(!k.vendor().contains('/') && !k.class().contains('/'));
    }
    if let Ok(q) = s.parse::<QualifiedName>() {
        assert_eq!(q.to_string(), s);
        assert_eq!(q.to_string().parse::<QualifiedName>(), Ok(q));
    }
    assert_contained(Path::new("/var/run/cdi"), s);
    if let Ok(uid) = ClaimUid::parse(s) {
        assert_eq!(uid.as_str(), s);
        uid_names(&uid);
    }
    if let Ok(name) = ObjectName::parse("name", s) {
        assert_eq!(name.as_str(), s);
        name_is_one_segment(&name);
    }
}
