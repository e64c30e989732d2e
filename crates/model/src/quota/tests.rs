//! Quota arithmetic, pricing and decisions, without sockets.

use super::escrow::EscrowRound;
use super::selector::Selector;
use super::*;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimSpec, ResourceSlice,
};
use serde_json::{json, Value};
use std::collections::BTreeMap;

const D: &str = "gpu.gpuplane.dev";
const GI: u64 = 1 << 30;

/// One device: (name, type, profile, product, memory).
type Dev<'a> = (&'a str, &'a str, Option<&'a str>, &'a str, &'a str);

fn slice(node: &str, devices: &[Dev<'_>]) -> ResourceSlice {
    let devices: Vec<Value> = devices
        .iter()
        .map(|(name, ty, profile, product, mem)| {
            let mut attrs = json!({"type": {"string": ty}, "productName": {"string": product}});
            if let Some(p) = profile {
                attrs["profile"] = json!({"string": p});
            }
            json!({"name": name, "attributes": attrs, "capacity": {"memory": {"value": mem}}})
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{D}")},
        "spec": {"driver": D, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}
    }))
    .unwrap()
}

fn class(name: &str, expr: &str) -> DeviceClass {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expr}}]}
    }))
    .unwrap()
}

fn shipped_classes() -> Vec<DeviceClass> {
    let text = include_str!("../../../../daemonset/deviceclasses.yaml");
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| DeviceClass::deserialize_from(d))
        .collect()
}

trait FromYamlDoc: Sized {
    fn deserialize_from(d: serde_yaml_ng::Deserializer<'_>) -> Self;
}
impl FromYamlDoc for DeviceClass {
    fn deserialize_from(d: serde_yaml_ng::Deserializer<'_>) -> Self {
        serde::Deserialize::deserialize(d).unwrap()
    }
}

/// Node a: 2 H100 whole GPUs (80Gi); node b: an H100 in MIG (1g.10gb x3, 3g.40gb); node c:
/// an A30 in MIG (1g.6gb).
fn catalog_with(settings: CatalogSettings) -> DeviceCatalog {
    let slices = vec![
        slice(
            "a",
            &[
                ("gpu-0", "gpu", None, "NVIDIA H100 80GB HBM3", "80Gi"),
                ("gpu-1", "gpu", None, "NVIDIA H100 80GB HBM3", "80Gi"),
            ],
        ),
        slice(
            "b",
            &[
                (
                    "gpu-0-mig-0",
                    "mig",
                    Some("1g.10gb"),
                    "NVIDIA H100 80GB HBM3",
                    "9984Mi",
                ),
                (
                    "gpu-0-mig-1",
                    "mig",
                    Some("1g.10gb"),
                    "NVIDIA H100 80GB HBM3",
                    "9984Mi",
                ),
                (
                    "gpu-0-mig-2",
                    "mig",
                    Some("1g.10gb"),
                    "NVIDIA H100 80GB HBM3",
                    "9984Mi",
                ),
                (
                    "gpu-0-mig-3",
                    "mig",
                    Some("3g.40gb"),
                    "NVIDIA H100 80GB HBM3",
                    "40448Mi",
                ),
            ],
        ),
        slice(
            "c",
            &[("gpu-0-mig-0", "mig", Some("1g.6gb"), "NVIDIA A30", "5952Mi")],
        ),
    ];
    let mut classes = shipped_classes();
    classes.push(class(
        "nic.example.com",
        "device.driver == 'nic.example.com'",
    ));
    classes.push(class("big-gpu", "device.driver == 'gpu.gpuplane.dev' && device.capacity['gpu.gpuplane.dev'].memory.compareTo(quantity('48Gi')) >= 0"));
    DeviceCatalog::new(&slices, &classes, settings)
}

fn catalog() -> DeviceCatalog {
    catalog_with(CatalogSettings::default())
}

fn pod(v: Value) -> Pod {
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}, "spec": v})).unwrap()
}

fn ctr(name: &str, res: Value) -> Value {
    json!({"name": name, "image": "x", "resources": {"limits": res}})
}

fn claim_spec(v: Value) -> ResourceClaimSpec {
    serde_json::from_value(json!({"devices": {"requests": v}})).unwrap()
}

fn gpus(s: &str) -> Gpus {
    Gpus::parse(s).unwrap()
}

#[test]
fn the_shipped_device_classes_parse() {
    assert_eq!(shipped_classes().len(), 5);
}

#[test]
fn a_mig_1g_slice_on_an_h100_is_a_seventh_and_on_an_a30_a_quarter() {
    let c = catalog();
    let one = c
        .resource_charge("nvidia.com/mig-1g.10gb", 1)
        .unwrap()
        .unwrap();
    assert_eq!(one.usage.gpus, gpus("1/7"));
    assert_eq!(one.usage.gpu_memory, Memory(9984 << 20));
    let three = c
        .resource_charge("nvidia.com/mig-3g.40gb", 2)
        .unwrap()
        .unwrap();
    assert_eq!(three.usage.gpus, gpus("6/7"));
    let a30 = c
        .resource_charge("nvidia.com/mig-1g.6gb", 1)
        .unwrap()
        .unwrap();
    assert_eq!(a30.usage.gpus, gpus("1/4"));
    // Seven 1g slices make a whole GPU, exactly.
    let seven = c
        .resource_charge("nvidia.com/mig-1g.10gb", 7)
        .unwrap()
        .unwrap();
    assert_eq!(seven.usage.gpus, Gpus::ONE);
    assert!(seven.unknown.is_empty());
    assert_eq!(mig_share("7g.80gb", Some("NVIDIA H100")), Some(Gpus::ONE));
}

#[test]
fn a_time_sliced_replica_is_a_share_of_the_gpu_and_its_memory() {
    let settings = CatalogSettings {
        time_slicing: [
            ("nvidia.com/gpu".to_string(), 3),
            ("nvidia.com/mig-1g.10gb".to_string(), 2),
        ]
        .into(),
        ..CatalogSettings::default()
    };
    let c = catalog_with(settings);
    let r = c.resource_charge("nvidia.com/gpu", 1).unwrap().unwrap();
    assert_eq!(r.usage.gpus, gpus("1/3"));
    assert_eq!(r.usage.gpu_memory, Memory((80 * GI).div_ceil(3)));
    let r = c.resource_charge("nvidia.com/gpu", 3).unwrap().unwrap();
    assert_eq!(r.usage.gpus, Gpus::ONE);
    let m = c
        .resource_charge("nvidia.com/mig-1g.10gb", 1)
        .unwrap()
        .unwrap();
    assert_eq!(m.usage.gpus, gpus("1/14"));
    assert_eq!(m.usage.devices["nvidia.com/mig-1g.10gb"], 1);
}

#[test]
fn renamed_shared_resources_are_priced_like_their_base() {
    let settings = CatalogSettings {
        time_slicing: [("nvidia.com/gpu.shared".to_string(), 4)].into(),
        ..CatalogSettings::default()
    };
    let c = catalog_with(settings);
    let r = c
        .resource_charge("nvidia.com/gpu.shared", 2)
        .unwrap()
        .unwrap();
    assert_eq!(r.usage.gpus, gpus("1/2"));
    assert_eq!(r.usage.gpu_memory, Memory(40 * GI));
}

#[test]
fn unpublished_resources_have_unknown_memory_and_other_resources_are_free() {
    let c = catalog();
    let r = c
        .resource_charge("nvidia.com/mig-2g.20gb", 1)
        .unwrap()
        .unwrap();
    assert_eq!(r.unknown.len(), 2, "{r:?}");
    assert!(c.resource_charge("example.com/fpga", 1).is_none());
    assert!(c.resource_charge("cpu", 1).is_none());
    let empty = DeviceCatalog::new(&[], &[], CatalogSettings::default());
    let g = empty.resource_charge("nvidia.com/gpu", 1).unwrap().unwrap();
    assert_eq!(g.usage.gpus, Gpus::ONE);
    assert_eq!(g.unknown.len(), 1);
    assert_eq!(g.unknown[0].dimension, Dimension::GpuMemory);
}

#[test]
fn init_containers_count_as_kubernetes_counts_them() {
    let c = catalog();
    // max(max(init) = 3, sum(app) = 1 + 1) = 3
    let p = pod(json!({
        "initContainers": [ctr("i1", json!({"nvidia.com/gpu": "3"})), ctr("i2", json!({"nvidia.com/gpu": "1"}))],
        "containers": [ctr("a", json!({"nvidia.com/gpu": "1"})), ctr("b", json!({"nvidia.com/gpu": "1", "cpu": "2"}))]
    }));
    assert_eq!(
        pod_resource_counts(&p, &c).unwrap(),
        [("nvidia.com/gpu".to_string(), 3)].into()
    );
    // Sidecars (restartPolicy Always) add to the app sum and to every later init container:
    // app 1 + sidecar 1 = 2; init after the sidecar: 1 + 1 = 2; init before it: 1 -> 2.
    let p = pod(json!({
        "initContainers": [
            ctr("i0", json!({"nvidia.com/gpu": "1"})),
            {"name": "side", "image": "x", "restartPolicy": "Always", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            ctr("i1", json!({"nvidia.com/gpu": "2"}))
        ],
        "containers": [ctr("a", json!({"nvidia.com/gpu": "1"}))]
    }));
    // i1 runs beside the sidecar: 2 + 1 = 3 > app 2.
    assert_eq!(pod_resource_counts(&p, &c).unwrap()["nvidia.com/gpu"], 3);
    // Requests given without limits count; MIG resources are per resource name.
    let p = pod(json!({
        "containers": [
            {"name": "a", "image": "x", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "2"}}},
            ctr("b", json!({"nvidia.com/mig-1g.10gb": "1", "nvidia.com/gpu": "1"}))
        ]
    }));
    let charge = pod_charge(&p, &BTreeMap::new(), &c).unwrap();
    assert_eq!(charge.usage.gpus, gpus("10/7"));
    assert_eq!(charge.usage.gpu_memory, Memory(3 * (9984 << 20) + 80 * GI));
    // Not whole numbers: an error, not a guess.
    let p = pod(json!({"containers": [ctr("a", json!({"nvidia.com/gpu": "500m"}))]}));
    assert!(matches!(
        pod_resource_counts(&p, &c),
        Err(ChargeError::BadQuantity { .. })
    ));
    let p = pod(json!({"containers": [ctr("a", json!({"cpu": "1"}))]}));
    assert!(pod_charge(&p, &BTreeMap::new(), &c).unwrap().is_empty());
}

#[test]
fn claims_are_charged_by_class_with_the_worst_matching_device() {
    let c = catalog();
    let spec = claim_spec(
        json!([{"name": "g", "exactly": {"deviceClassName": "gpu.gpuplane.dev", "count": 2}}]),
    );
    let ch = claim_charge(&spec, &c).unwrap();
    assert_eq!(ch.usage.gpus, Gpus::whole(2));
    assert_eq!(ch.usage.gpu_memory, Memory(160 * GI));
    assert_eq!(ch.usage.devices["gpu.gpuplane.dev"], 2);
    // mig-1g matches 1g.10gb (H100, 1/7) and 1g.6gb (A30, 1/4): the worst of each.
    let spec =
        claim_spec(json!([{"name": "m", "exactly": {"deviceClassName": "mig-1g.gpuplane.dev"}}]));
    let ch = claim_charge(&spec, &c).unwrap();
    assert_eq!(ch.usage.gpus, gpus("1/4"));
    assert_eq!(ch.usage.gpu_memory, Memory(9984 << 20));
    // A request selector narrows the class.
    let spec = claim_spec(
        json!([{"name": "m", "exactly": {"deviceClassName": "mig.gpuplane.dev",
        "selectors": [{"cel": {"expression": "device.attributes['gpu.gpuplane.dev'].profile == '1g.10gb'"}}]}}]),
    );
    assert_eq!(claim_charge(&spec, &c).unwrap().usage.gpus, gpus("1/7"));
    // A class of another driver costs devices only.
    let spec =
        claim_spec(json!([{"name": "n", "exactly": {"deviceClassName": "nic.example.com"}}]));
    let ch = claim_charge(&spec, &c).unwrap();
    assert!(ch.unknown.is_empty() && ch.usage.gpus.is_zero());
    assert_eq!(ch.usage.devices["nic.example.com"], 1);
    // An unknown class: unknown GPUs and memory (a quota limiting them denies).
    let spec = claim_spec(json!([{"name": "x", "exactly": {"deviceClassName": "nope"}}]));
    assert_eq!(claim_charge(&spec, &c).unwrap().unknown.len(), 2);
    // Bad counts are errors.
    let spec = claim_spec(
        json!([{"name": "g", "exactly": {"deviceClassName": "gpu.gpuplane.dev", "count": 0}}]),
    );
    assert!(claim_charge(&spec, &c).is_err());
}

#[test]
fn all_mode_charges_32_devices_and_the_biggest_pool() {
    let c = catalog();
    let spec = claim_spec(
        json!([{"name": "all", "exactly": {"deviceClassName": "mig.gpuplane.dev", "allocationMode": "All"}}]),
    );
    let ch = claim_charge(&spec, &c).unwrap();
    assert_eq!(ch.usage.devices["mig.gpuplane.dev"], 32);
    // Pool b: 3/7 + 3/7 = 6/7 and 3 x 9984Mi + 40448Mi.
    assert_eq!(ch.usage.gpus, gpus("6/7"));
    assert_eq!(ch.usage.gpu_memory, Memory((3 * 9984 + 40448) << 20));
}

#[test]
fn first_available_is_charged_for_its_worst_alternative() {
    let c = catalog();
    let spec = claim_spec(json!([{"name": "r", "firstAvailable": [
        {"name": "small", "deviceClassName": "mig-1g.gpuplane.dev", "count": 2},
        {"name": "big", "deviceClassName": "gpu.gpuplane.dev"}
    ]}]));
    let ch = claim_charge(&spec, &c).unwrap();
    // gpus: max(2 x 1/4, 1) = 1; memory: max(2 x 9984Mi, 80Gi) = 80Gi; both classes counted.
    assert_eq!(ch.usage.gpus, Gpus::ONE);
    assert_eq!(ch.usage.gpu_memory, Memory(80 * GI));
    assert_eq!(ch.usage.devices["mig-1g.gpuplane.dev"], 2);
    assert_eq!(ch.usage.devices["gpu.gpuplane.dev"], 1);
}

#[test]
fn a_capacity_selector_class_is_priced_from_its_matches() {
    let c = catalog();
    let spec = claim_spec(json!([{"name": "b", "exactly": {"deviceClassName": "big-gpu"}}]));
    let ch = claim_charge(&spec, &c).unwrap();
    assert_eq!(
        (ch.usage.gpus, ch.usage.gpu_memory),
        (Gpus::ONE, Memory(80 * GI))
    );
}

#[test]
fn a_catalog_remembers_each_expressions_verdicts_apart() {
    // Verdicts are kept per expression: asking again, or another expression, on one catalog
    // (and on a clone of it) gives what a fresh catalog gives.
    let c = catalog();
    let names = |c: &DeviceCatalog, expr: &str| -> Vec<String> {
        match c.matching("mig.gpuplane.dev", &[Selector::parse(expr)]) {
            ClassMatch::Devices(d) => d.iter().map(|d| format!("{}/{}", d.pool, d.name)).collect(),
            _ => panic!("mig.gpuplane.dev matches devices"),
        }
    };
    let small = "device.attributes['gpu.gpuplane.dev'].profile == '1g.10gb'";
    let big = "device.attributes['gpu.gpuplane.dev'].profile == '3g.40gb'";
    let fresh = |expr: &str| names(&catalog(), expr);
    for _ in 0..2 {
        assert_eq!(names(&c, small), fresh(small));
        assert_eq!(names(&c, big), fresh(big));
        assert_eq!(names(&c.clone(), big), fresh(big));
    }
    assert_eq!(fresh(small).len(), 3);
    assert_eq!(fresh(big).len(), 1);
}

#[test]
fn a_catalog_from_slices_read_once_is_the_catalog_of_the_slices() {
    // The shared device store keeps each slice read once (SliceDevices) and assembles
    // catalogs from those: the same devices, facts and verdicts as reading the slices.
    let old = slice(
        "a",
        &[("gpu-0", "gpu", None, "NVIDIA H100 80GB HBM3", "80Gi")],
    );
    let mut new = slice(
        "a",
        &[("gpu-9", "gpu", None, "NVIDIA H100 80GB HBM3", "80Gi")],
    );
    new.metadata.name = Some("a-newer".into());
    new.spec.pool.generation = 2;
    let devices = new.spec.devices.iter_mut().flatten();
    for d in devices {
        let numa = serde_json::from_value(json!({"int": 1})).unwrap();
        d.attributes
            .get_or_insert_with(BTreeMap::new)
            .insert("resource.kubernetes.io/numaNode".into(), numa);
        d.taints = Some(vec![serde_json::from_value(
            json!({"key": "drain", "effect": "NoSchedule"}),
        )
        .unwrap()]);
    }
    let mut nic = slice("n", &[("nic-0", "nic", None, "ConnectX-7", "0")]);
    nic.spec.driver = "nic.example.com".into();
    let slices = [old, new, nic];
    let settings = CatalogSettings::default();
    let parts: Vec<SliceDevices> = slices
        .iter()
        .map(|s| SliceDevices::new(s, &settings))
        .collect();
    let classes = shipped_classes();
    let read = DeviceCatalog::new(&slices, &classes, settings.clone());
    let kept = DeviceCatalog::from_parts(&parts, &classes, settings);
    let show = |c: &DeviceCatalog| -> Vec<String> {
        let all = match c.matching("gpu.gpuplane.dev", &[]) {
            ClassMatch::Devices(d) => d.len(),
            other => panic!("gpu.gpuplane.dev matches devices, not {other:?}"),
        };
        let mut out = vec![format!("{all} of class gpu")];
        out.extend(
            c.devices()
                .iter()
                .map(|d| format!("{}/{} {:?}", d.pool, d.name, d.facts)),
        );
        out
    };
    assert_eq!(show(&read), show(&kept));
    // Only the newest generation of pool a, with what its slice says of the device; the NIC
    // driver publishes no GPU but its node is a node with slices.
    let d = &kept.devices()[0];
    assert_eq!((kept.devices().len(), d.name.as_str()), (1, "gpu-9"));
    assert_eq!(
        (d.facts.node.as_deref(), d.facts.numa),
        (Some("a"), Some(1))
    );
    assert_eq!(d.facts.taints[0].key, "drain");
    assert!(d.has_capacity("memory") && d.has_capacity("gpu.gpuplane.dev/memory"));
    assert!(!d.has_capacity("compute"));
    let sliced: Vec<&str> = kept.sliced().iter().map(String::as_str).collect();
    assert_eq!(sliced, ["a", "n"]);
}

#[test]
fn pods_are_charged_for_template_claims_but_not_for_named_claims() {
    let c = catalog();
    let p = pod(json!({
        "containers": [{"name": "a", "image": "x"}],
        "resourceClaims": [{"name": "t", "resourceClaimTemplateName": "one-mig"}, {"name": "n", "resourceClaimName": "shared"}]
    }));
    assert_eq!(pod_template_names(&p), vec!["one-mig".to_string()]);
    assert!(matches!(
        pod_charge(&p, &BTreeMap::new(), &c),
        Err(ChargeError::MissingTemplate(_))
    ));
    let templates = [("one-mig".to_string(), claim_spec(json!([{"name": "m", "exactly": {"deviceClassName": "mig.gpuplane.dev",
        "selectors": [{"cel": {"expression": "device.attributes['gpu.gpuplane.dev'].profile == '3g.40gb'"}}]}}])))].into();
    let ch = pod_charge(&p, &templates, &c).unwrap();
    assert_eq!(ch.usage.gpus, gpus("3/7"));
    assert_eq!(ch.usage.devices.len(), 1);
}

#[test]
fn an_allocated_claim_settles_to_its_actual_devices() {
    let c = catalog();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": [{"name": "r", "firstAvailable": [
            {"name": "small", "deviceClassName": "mig-1g.gpuplane.dev"},
            {"name": "big", "deviceClassName": "gpu.gpuplane.dev"}]}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "r/small", "driver": D, "pool": "b", "device": "gpu-0-mig-1"}]}}}
    }))
    .unwrap();
    let ch = settled_claim_charge(&claim, &c).unwrap().unwrap();
    assert_eq!(ch.usage.gpus, gpus("1/7"));
    assert_eq!(ch.usage.gpu_memory, Memory(9984 << 20));
    assert_eq!(
        ch.usage.devices,
        [("mig-1g.gpuplane.dev".to_string(), 1)].into()
    );
    let mut unallocated = claim.clone();
    unallocated.status = None;
    assert_eq!(settled_claim_charge(&unallocated, &c).unwrap(), None);
    let mut gone = claim;
    gone.status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap()
        .devices
        .as_mut()
        .unwrap()
        .results
        .as_mut()
        .unwrap()[0]
        .device = "gpu-9".into();
    assert_eq!(
        settled_claim_charge(&gone, &c)
            .unwrap()
            .unwrap()
            .unknown
            .len(),
        2
    );
}

fn quota(ns: &str, name: &str, spec: Value, status: Value) -> GpuQuota {
    serde_json::from_value(json!({
        "apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": name, "namespace": ns}, "spec": spec, "status": status
    }))
    .unwrap()
}

fn mem_charge(gi: u64) -> Charge {
    Charge {
        usage: Usage {
            gpu_memory: Memory(gi * GI),
            gpus: Gpus::ONE,
            ..Usage::default()
        },
        unknown: vec![],
    }
}

fn reservation(name: &str, charge: &Charge) -> Reservation {
    Reservation {
        kind: ObjectKind::Pod,
        namespace: "team-a".into(),
        name: name.into(),
        uid: Some(format!("uid-{name}")),
        state: ReservationState::Reserved,
        charge: charge.usage.clone(),
        unpriced: vec![],
        priority: None,
        since: now_rfc3339(),
    }
}

#[test]
fn a_charge_over_the_limit_is_denied_with_an_actionable_message() {
    let mut q = quota(
        "team-a",
        "default",
        json!({"hard": {"gpuMemory": "20Gi"}}),
        json!({}),
    );
    let (_, changed) = try_reserve(
        &mut q,
        &[],
        reservation("a", &mem_charge(15)),
        &mem_charge(15),
    )
    .unwrap();
    assert!(changed);
    let d = try_reserve(
        &mut q,
        &[],
        reservation("b", &mem_charge(10)),
        &mem_charge(10),
    )
    .unwrap_err();
    assert_eq!(
        d.to_string(),
        "gpuMemory: requested 10Gi, used 15Gi of 20Gi in GpuQuota team-a/default"
    );
    // Re-admitting "a" (a retried request) is not counted twice, and needs no write.
    let (_, changed) = try_reserve(
        &mut q,
        &[],
        reservation("a", &mem_charge(15)),
        &mem_charge(15),
    )
    .unwrap();
    assert!(!changed);
    let status = q.status.clone().unwrap();
    assert_eq!(status.reserved.gpu_memory, Memory(15 * GI));
    // A charge that does not touch gpuMemory is not checked against it.
    let mut free = Charge::default();
    free.usage.devices.insert("nic".into(), 1);
    assert!(check(&q, &[], None, &free).is_ok());
    // Unknown memory under a memory limit: denied, saying why.
    let mut unknown = Charge::default();
    unknown.unknown.push(UnknownCharge {
        dimension: Dimension::GpuMemory,
        why: "no ResourceSlice publishes the memory of a device of nvidia.com/gpu".into(),
    });
    let d = check(&q, &[], None, &unknown).unwrap_err();
    assert!(
        d.to_string()
            .starts_with("gpuMemory: cannot be charged (no ResourceSlice"),
        "{d}"
    );
}

#[test]
fn fractions_fill_a_gpu_quota_exactly() {
    let mut q = quota("ns", "q", json!({"hard": {"gpus": 1}}), json!({}));
    let c = catalog();
    let one = c
        .resource_charge("nvidia.com/mig-1g.10gb", 1)
        .unwrap()
        .unwrap();
    for i in 0..7 {
        try_reserve(&mut q, &[], reservation(&format!("p{i}"), &one), &one).unwrap();
    }
    let d = try_reserve(&mut q, &[], reservation("p7", &one), &one).unwrap_err();
    assert_eq!(
        d.to_string(),
        "gpus: requested 1/7, used 1 of 1 in GpuQuota ns/q"
    );
}

#[test]
fn a_cohort_lends_unused_quota_up_to_the_borrowing_limit() {
    let lender = quota(
        "b",
        "q",
        json!({"hard": {"gpus": 4}, "cohort": "research"}),
        json!({"used": {"gpus": "1", "gpuMemory": "0"}}),
    );
    let other_cohort = quota(
        "c",
        "q",
        json!({"hard": {"gpus": 100}, "cohort": "other"}),
        json!({}),
    );
    let borrower = quota(
        "a",
        "q",
        json!({"hard": {"gpus": 2}, "cohort": "research", "borrowingLimit": {"gpus": 2}}),
        json!({"used": {"gpus": "2", "gpuMemory": "0"}}),
    );
    let peers = vec![lender.clone(), other_cohort.clone(), borrower.clone()];
    let two = Charge {
        usage: Usage {
            gpus: Gpus::whole(2),
            ..Usage::default()
        },
        unknown: vec![],
    };
    let fit = check(&borrower, &peers, None, &two).unwrap();
    assert_eq!(
        fit.borrowed,
        vec![(Dimension::Gpus, Amount::Gpus(Gpus::whole(2)))]
    );
    // Over the borrowing limit.
    let three = Charge {
        usage: Usage {
            gpus: Gpus::whole(3),
            ..Usage::default()
        },
        unknown: vec![],
    };
    let d = check(&borrower, &peers, None, &three).unwrap_err();
    assert!(
        d.to_string().contains("exceeds its borrowing limit 2"),
        "{d}"
    );
    // Without a limit, bounded by what the cohort has unused (4 - 1 = 3).
    let unlimited = quota(
        "a",
        "q",
        json!({"hard": {"gpus": 2}, "cohort": "research"}),
        json!({"used": {"gpus": "2", "gpuMemory": "0"}}),
    );
    assert!(check(&unlimited, &peers, None, &three).is_ok());
    let four = Charge {
        usage: Usage {
            gpus: Gpus::whole(4),
            ..Usage::default()
        },
        unknown: vec![],
    };
    let d = check(&unlimited, &peers, None, &four).unwrap_err();
    assert!(
        d.to_string()
            .contains("cohort research has 3 unused to lend, 4 needed"),
        "{d}"
    );
    // No cohort: no borrowing.
    let alone = quota(
        "a",
        "q",
        json!({"hard": {"gpus": 2}}),
        json!({"used": {"gpus": "2", "gpuMemory": "0"}}),
    );
    assert!(check(&alone, &peers, None, &two).is_err());
}

#[test]
fn stale_reservations_are_those_without_their_object() {
    use k8s_openapi::jiff::Timestamp;
    let now: Timestamp = "2025-01-01T00:10:00Z".parse().unwrap();
    let mut status = GpuQuotaStatus::default();
    let mk = |name: &str, since: &str, uid: Option<&str>| Reservation {
        since: since.into(),
        uid: uid.map(String::from),
        ..reservation(name, &mem_charge(1))
    };
    for r in [
        mk("fresh-missing", "2025-01-01T00:09:30Z", Some("u1")),
        mk("old-missing", "2025-01-01T00:01:00Z", Some("u2")),
        mk("old-live", "2025-01-01T00:01:00Z", Some("u3")),
        mk("old-replaced", "2025-01-01T00:01:00Z", Some("u4")),
        mk("fresh-replaced", "2025-01-01T00:09:59Z", Some("u5")),
        mk("counted", "2025-01-01T00:09:59Z", Some("u6")),
        mk("garbled", "yesterday", None),
    ] {
        status.upsert(r).unwrap();
    }
    let live: BTreeMap<ReservationKey, LiveObject> = [
        ("old-live", "u3", false),
        ("old-replaced", "other", false),
        ("fresh-replaced", "other", false),
        ("counted", "u6", true),
    ]
    .into_iter()
    .map(|(n, uid, counted)| {
        (
            ReservationKey::pod("team-a", n),
            LiveObject {
                uid: Some(uid.into()),
                counted,
            },
        )
    })
    .collect();
    let stale: Vec<String> = stale_reservations(&status, &live, now, DEFAULT_RESERVATION_GRACE)
        .into_iter()
        .map(|k| k.name)
        .collect();
    assert_eq!(
        stale,
        vec!["old-missing", "old-replaced", "counted", "garbled"]
    );
}

#[test]
fn queued_reservations_do_not_count_until_admitted() {
    let mut q = quota(
        "team-a",
        "q",
        json!({"hard": {"gpuMemory": "20Gi"}, "mode": "Queue"}),
        json!({}),
    );
    assert!(record_queued(&mut q, reservation("a", &mem_charge(15))).unwrap());
    assert!(!record_queued(&mut q, reservation("a", &mem_charge(15))).unwrap());
    let mut low = reservation("b", &mem_charge(10));
    low.priority = Some(-1);
    record_queued(&mut q, low).unwrap();
    let s = q.status.clone().unwrap();
    assert_eq!(s.queued.gpu_memory, Memory(25 * GI));
    assert!(s.reserved.is_zero());
    assert_eq!(
        s.queue_order()
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>(),
        vec!["a", "b"]
    );
    let key = ReservationKey::pod("team-a", "a");
    assert!(check(&q, &[], Some(&key), &mem_charge(15)).is_ok());
    let mut s = s;
    assert!(s.admit_queued(&key, None).unwrap());
    assert_eq!(s.reserved.gpu_memory, Memory(15 * GI));
    q.status = Some(s);
    assert!(check(
        &q,
        &[],
        Some(&ReservationKey::pod("team-a", "b")),
        &mem_charge(10)
    )
    .is_err());
}

#[test]
fn the_status_round_trips_through_json() {
    let mut q = quota(
        "ns",
        "q",
        json!({"hard": {"gpus": "1/2", "gpuMemory": "1.5Gi", "devices": {"nvidia.com/gpu": 3}}, "mode": "Queue", "cohort": "c"}),
        json!({}),
    );
    try_reserve(
        &mut q,
        &[],
        reservation("a", &mem_charge(0)),
        &Charge {
            usage: Usage {
                gpus: gpus("1/7"),
                ..Usage::default()
            },
            unknown: vec![],
        },
    )
    .unwrap();
    let v = serde_json::to_value(&q).unwrap();
    assert_eq!(
        v["spec"]["hard"],
        json!({"gpus": "1/2", "gpuMemory": "1536Mi", "devices": {"nvidia.com/gpu": 3}})
    );
    assert_eq!(v["status"]["reserved"]["gpus"], json!("1/7"));
    let back: GpuQuota = serde_json::from_value(v).unwrap();
    assert_eq!(back, q);
    assert!(serde_json::from_value::<GpuQuota>(
        json!({"metadata": {}, "spec": {"hard": {"gpus": "-1"}}})
    )
    .is_err());
    assert!(serde_json::from_value::<GpuQuota>(
        json!({"metadata": {}, "spec": {"hard": {}, "mode": "Maybe"}})
    )
    .is_err());
}

/// `daemonset/controller/crd.yaml` is `GpuQuota::crd()`; regenerate with
/// `GPUPLANE_WRITE_CRD=1 cargo test --lib quota::tests::the_crd_manifest`.
#[test]
fn the_crd_manifest_matches_the_types() {
    use kube_core::CustomResourceExt;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../daemonset/controller/crd.yaml"
    );
    let generated = format!(
        "# Generated from crates/model/src/quota/crd.rs (GpuQuota::crd()); do not edit by hand.\n# Regenerate: GPUPLANE_WRITE_CRD=1 cargo test -p gpuplane-model --lib quota::tests::the_crd_manifest\n{}",
        serde_yaml_ng::to_string(&GpuQuota::crd()).unwrap()
    );
    if std::env::var_os("GPUPLANE_WRITE_CRD").is_some() {
        std::fs::write(path, &generated).unwrap();
    }
    let on_disk = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "{path} is out of date; regenerate it (see this test's doc)"
    );
}

fn reserve_op(name: &str, charge: &Charge) -> Op {
    Op::Reserve {
        reservation: reservation(name, charge),
        charge: charge.clone(),
        retreat: false,
    }
}

#[test]
fn a_batch_is_decided_in_order_on_one_state_as_one_by_one_would() {
    let spec = json!({"hard": {"gpuMemory": "50Gi"}});
    let ops: Vec<Op> = (0..7)
        .map(|i| reserve_op(&format!("p{i}"), &mem_charge(10)))
        .chain([
            Op::Release {
                key: ReservationKey::pod("team-a", "p1"),
            },
            reserve_op("late", &mem_charge(10)),
            Op::Check {
                key: ReservationKey::pod("team-a", "dry"),
                charge: mem_charge(10),
            },
        ])
        .collect();
    let mut q = quota(
        "team-a",
        "q",
        spec.clone(),
        json!({"used": {"gpuMemory": "10Gi"}}),
    );
    let d = decide_batch(&mut q, &[], &ops, None);
    assert!(d.changed);
    let fits: Vec<bool> = d
        .outcomes
        .iter()
        .map(|o| matches!(o, Outcome::Fits(_) | Outcome::Released))
        .collect();
    // 10Gi used: p0..p3 fit, p4..p6 do not, p1 gives back, "late" takes its place, and the
    // dry run finds the quota full.
    assert_eq!(
        fits,
        [true, true, true, true, false, false, false, true, true, false]
    );
    let Outcome::Denied(d4) = &d.outcomes[4] else {
        panic!("{:?}", d.outcomes[4])
    };
    assert_eq!(
        d4.to_string(),
        "gpuMemory: requested 10Gi, used 50Gi of 50Gi in GpuQuota team-a/q"
    );
    let s = q.status.clone().unwrap();
    let names: Vec<&str> = s.reservations.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["p0", "p2", "p3", "late"]);
    assert_eq!(s.reserved.gpu_memory.to_string(), "40Gi");

    // The same ops one by one through try_reserve/check/release give the same answers.
    let mut one = quota("team-a", "q", spec, json!({"used": {"gpuMemory": "10Gi"}}));
    let mut singles = Vec::new();
    for op in &ops {
        let ok = match op {
            Op::Reserve {
                reservation,
                charge,
                ..
            } => try_reserve(&mut one, &[], reservation.clone(), charge).is_ok(),
            Op::Check { key, charge } => check(&one, &[], Some(key), charge).is_ok(),
            Op::Release { key } => {
                let mut s = one.status_or_default();
                s.release(key).unwrap();
                one.status = Some(s);
                true
            }
            Op::Queue { .. } => unreachable!(),
        };
        singles.push(ok);
    }
    assert_eq!(singles, fits);
    assert_eq!(one.status, q.status);

    // Deciding the written state again changes nothing: a retried create is not charged twice.
    let retried = [
        ops[0].clone(),
        ops[2].clone(),
        ops[3].clone(),
        ops[8].clone(),
    ];
    let again = decide_batch(&mut q, &[], &retried, None);
    assert!(!again.changed);
    assert!(again.outcomes.iter().all(|o| matches!(o, Outcome::Fits(_))));
}

#[test]
fn a_retreating_borrower_that_no_longer_fits_gives_its_reservation_back() {
    let lender = quota(
        "lend",
        "l",
        json!({"hard": {"gpus": 2}, "cohort": "c"}),
        json!({}),
    );
    let spec = json!({"hard": {"gpus": 1}, "cohort": "c"});
    let one_gpu = Charge {
        usage: Usage {
            gpus: Gpus::ONE,
            ..Usage::default()
        },
        unknown: vec![],
    };
    let mut b = quota("team-a", "b", spec.clone(), json!({}));
    let d = decide_batch(
        &mut b,
        std::slice::from_ref(&lender),
        &[reserve_op("x", &one_gpu), reserve_op("y", &one_gpu)],
        None,
    );
    // x within hard, y borrows one of the lender's two.
    let borrowed: Vec<usize> = d
        .outcomes
        .iter()
        .map(|o| match o {
            Outcome::Fits(f) => f.borrowed.len(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(borrowed, [0, 1]);
    assert!(borrows(&d.outcomes));
    let ops = [reserve_op("x", &one_gpu), reserve_op("y", &one_gpu)];
    // Meanwhile another borrower took both of the lender's unused GPUs.
    let other = quota(
        "team-b",
        "o",
        json!({"hard": {"gpus": 0}, "cohort": "c"}),
        json!({"reservations": [
            {"kind": "Pod", "namespace": "team-b", "name": "z", "state": "Reserved", "charge": {"gpus": "2"}, "since": "2025-01-01T00:00:00Z"}
        ]}),
    );
    let fresh = [lender.clone(), other.clone()];
    let stale = stale_borrowers(&b, &fresh, &ops, &d.outcomes);
    assert_eq!(stale.len(), 1);
    assert_eq!(stale[0].0, 1);
    assert_eq!(
        stale[0].1.to_string(),
        "gpus: requested 1, used 1 of 1 in GpuQuota team-a/b; cohort c has 0 unused to lend, 1 needed"
    );
    // Decided again on the fresh cohort, y is denied and its reservation removed.
    let retry = Op::Reserve {
        reservation: reservation("y", &one_gpu),
        charge: one_gpu.clone(),
        retreat: true,
    };
    let d = decide_batch(&mut b, &fresh, &[retry], None);
    assert!(matches!(d.outcomes[0], Outcome::Denied(_)), "{d:?}");
    assert!(d.changed);
    let s = b.status.unwrap();
    assert_eq!(s.reservations.len(), 1);
    assert_eq!(s.reserved.gpus, Gpus::ONE);
}

fn escrow_round(holder: &str, flush: &[&str], unit: Option<&Charge>) -> EscrowRound {
    EscrowRound {
        holder: holder.into(),
        flush: flush
            .iter()
            .map(|n| reservation(n, &mem_charge(10)))
            .collect(),
        unit: unit.map(|c| c.usage.clone()),
        now: "2026-01-01T00:00:00Z".parse().unwrap(),
    }
}

#[test]
fn an_escrow_round_records_its_admissions_resizes_the_escrow_and_holds_what_others_hold() {
    let spec = json!({"hard": {"gpuMemory": "400Gi"}});
    let mut q = quota(
        "team-a",
        "q",
        spec.clone(),
        json!({"used": {"gpuMemory": "40Gi"}}),
    );
    // First admission on the slow path: recorded, and a quarter of what is left (320Gi)
    // in whole 10Gi charges is held: 80Gi.
    let ten = mem_charge(10);
    let d = decide_batch(
        &mut q,
        &[],
        &[reserve_op("p0", &ten)],
        Some(&escrow_round("a", &[], Some(&ten))),
    );
    assert!(matches!(d.outcomes[0], Outcome::Fits(_)));
    assert_eq!(d.escrow.gpu_memory.to_string(), "80Gi");
    let s = q.status.clone().unwrap();
    assert_eq!(s.escrows.len(), 1);
    assert_eq!(s.consumed(None).unwrap().gpu_memory.to_string(), "130Gi");

    // Three admissions made within it are flushed: reservations, escrow re-sized on the rest
    // (400 - 40 - 40 = 320 -> 80Gi again), nothing counted twice.
    let d = decide_batch(
        &mut q,
        &[],
        &[],
        Some(&escrow_round("a", &["p1", "p2", "p3"], Some(&ten))),
    );
    assert!(d.changed);
    let s = q.status.clone().unwrap();
    assert_eq!(s.reservations.len(), 4);
    assert_eq!(s.reserved.gpu_memory.to_string(), "40Gi");
    assert_eq!(d.escrow.gpu_memory.to_string(), "80Gi");
    assert_eq!(s.consumed(None).unwrap().gpu_memory.to_string(), "160Gi");

    // Another replica's request that fits only without a's escrow is held, not denied.
    let mut full = quota(
        "team-a",
        "q",
        spec.clone(),
        json!({"used": {"gpuMemory": "300Gi"},
               "escrows": [{"holder": "a", "amount": {"gpuMemory": "80Gi"},
                            "renewed": "2026-01-01T00:00:00Z"}]}),
    );
    let d = decide_batch(
        &mut full,
        &[],
        &[
            reserve_op("big", &mem_charge(50)),
            reserve_op("huge", &mem_charge(150)),
        ],
        Some(&escrow_round("b", &[], Some(&ten))),
    );
    let Outcome::Held(why) = &d.outcomes[0] else {
        panic!("{:?}", d.outcomes)
    };
    assert_eq!(
        why.to_string(),
        "gpuMemory: requested 50Gi, used 380Gi of 400Gi in GpuQuota team-a/q"
    );
    assert!(
        matches!(d.outcomes[1], Outcome::Denied(_)),
        "{:?}",
        d.outcomes
    );
    // b gets no escrow (20Gi left is less than four 10Gi charges) and writes nothing.
    assert!(d.escrow.is_zero());
    assert!(!d.changed);

    // a gives its escrow back: the entry goes, and so does the hold.
    let d = decide_batch(&mut full, &[], &[], Some(&escrow_round("a", &[], None)));
    assert!(d.changed && d.escrow.is_zero());
    assert!(full.status.clone().unwrap().escrows.is_empty());
    let d = decide_batch(&mut full, &[], &[reserve_op("big", &mem_charge(50))], None);
    assert!(
        matches!(d.outcomes[0], Outcome::Fits(_)),
        "{:?}",
        d.outcomes
    );

    // Queue mode and cohorts hold no escrow.
    let mut queue = quota(
        "team-a",
        "q",
        json!({"hard": {"gpuMemory": "400Gi"}, "mode": "Queue"}),
        json!({}),
    );
    let d = decide_batch(
        &mut queue,
        &[],
        &[],
        Some(&escrow_round("a", &[], Some(&ten))),
    );
    assert!(d.escrow.is_zero() && !d.changed);
}

mod shares;

#[path = "tests/bound.rs"]
mod bound;

#[path = "tests/temporary.rs"]
mod temporary;

#[path = "tests/owners.rs"]
mod owners;
