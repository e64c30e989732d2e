//! Shares of a GPU (DRA consumable capacity): what a claim for a share is charged.

use super::*;

/// A device allocated in shares: memory in steps of 1Gi up to the largest multiple not above
/// `mem_gi`, compute in steps of 10 percent.
fn shared_device(name: &str, ty: &str, profile: Option<&str>, mem: &str, max_gi: u64) -> Value {
    let mut attrs =
        json!({"type": {"string": ty}, "productName": {"string": "NVIDIA H100 80GB HBM3"}});
    if let Some(p) = profile {
        attrs["profile"] = json!({"string": p});
    }
    let max = format!("{max_gi}Gi");
    json!({"name": name, "allowMultipleAllocations": true, "attributes": attrs, "capacity": {
        "memory": {"value": mem, "requestPolicy": {"default": max,
            "validRange": {"min": "1Gi", "max": max, "step": "1Gi"}}},
        "compute": {"value": "100", "requestPolicy": {"default": "100",
            "validRange": {"min": "10", "max": "100", "step": "10"}}}
    }})
}

fn slice_of(node: &str, devices: Vec<Value>) -> ResourceSlice {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{D}")},
        "spec": {"driver": D, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}
    }))
    .unwrap()
}

/// Node s: a whole H100 shared (80Gi) and a shared MIG 3g.40gb (39.5Gi, so at most 39Gi a
/// share); with `whole`, node w: an H200 (141Gi) allocated whole, no `compute` capacity.
fn share_catalog(whole: bool) -> DeviceCatalog {
    let mut slices = vec![slice_of(
        "s",
        vec![
            shared_device("gpu-0", "gpu", None, "80Gi", 80),
            shared_device("gpu-1-mig-0", "mig", Some("3g.40gb"), "40448Mi", 39),
        ],
    )];
    if whole {
        slices.push(slice(
            "w",
            &[("gpu-0", "gpu", None, "NVIDIA H200", "141Gi")],
        ));
    }
    DeviceCatalog::new(&slices, &shipped_classes(), CatalogSettings::default())
}

/// A claim of one request of `class` asking `capacity` (`null`: none).
fn share_claim(class: &str, capacity: Value) -> ResourceClaimSpec {
    let mut exactly = json!({"deviceClassName": class});
    if !capacity.is_null() {
        exactly["capacity"] = json!({"requests": capacity});
    }
    claim_spec(json!([{"name": "s", "exactly": exactly}]))
}

fn charged(c: &DeviceCatalog, class: &str, capacity: Value) -> Charge {
    claim_charge(&share_claim(class, capacity), c).unwrap()
}

fn claim_reservation(name: &str, charge: &Charge) -> Reservation {
    Reservation {
        kind: ObjectKind::ResourceClaim,
        ..reservation(name, charge)
    }
}

#[test]
fn the_catalog_knows_shared_devices_and_their_policies() {
    let c = share_catalog(true);
    let d = c.device(D, "s", "gpu-0").unwrap();
    assert!(d.multi_allocatable);
    let m = d.memory_capacity.as_ref().unwrap();
    let q = |s: &str| crate::quantity::Quantity::parse(s).unwrap();
    assert_eq!(m.value, q("80Gi"));
    let policy = m.policy.as_ref().unwrap();
    assert_eq!(policy.default, Some(q("80Gi")));
    assert_eq!(
        policy.valid_range,
        Some(ValidRange {
            min: q("1Gi"),
            max: Some(q("80Gi")),
            step: Some(q("1Gi"))
        })
    );
    assert_eq!(d.compute_capacity.as_ref().unwrap().value, q("100"));
    let w = c.device(D, "w", "gpu-0").unwrap();
    assert!(!w.multi_allocatable && w.compute_capacity.is_none());
    assert_eq!(w.memory_capacity.as_ref().unwrap().policy, None);
}

#[test]
fn the_card_a_share_is_charged_its_memory_and_compute_and_denials_keep_their_numbers() {
    let c = share_catalog(false);
    let mut q = quota(
        "team-a",
        "default",
        json!({"hard": {"gpuMemory": "20Gi", "gpus": 1}}),
        json!({}),
    );
    let first = charged(
        &c,
        "gpu.gpuplane.dev",
        json!({"memory": "15Gi", "compute": "80"}),
    );
    assert_eq!(first.usage.gpu_memory, Memory(15 * GI));
    assert_eq!(first.usage.gpus, gpus("0.8"));
    assert_eq!(first.usage.devices["gpu.gpuplane.dev"], 1);
    assert!(first.unknown.is_empty());
    try_reserve(&mut q, &[], claim_reservation("a", &first), &first).unwrap();
    let second = charged(
        &c,
        "gpu.gpuplane.dev",
        json!({"memory": "10Gi", "compute": "50"}),
    );
    assert_eq!(second.usage.gpus, gpus("1/2"));
    let d = try_reserve(&mut q, &[], claim_reservation("b", &second), &second).unwrap_err();
    let text = d.to_string();
    assert!(
        text.contains("gpuMemory: requested 10Gi, used 15Gi of 20Gi"),
        "{text}"
    );
    assert_eq!(
        text,
        "gpus: requested 1/2, used 4/5 of 1 in GpuQuota team-a/default; \
         gpuMemory: requested 10Gi, used 15Gi of 20Gi in GpuQuota team-a/default"
    );
    assert!(check(&q, &[], None, &second).is_err());
}

#[test]
fn a_request_is_rounded_up_to_the_next_valid_share() {
    let c = share_catalog(false);
    let share = |mem: &str, compute: &str| {
        let ch = charged(
            &c,
            "gpu.gpuplane.dev",
            json!({"memory": mem, "compute": compute}),
        );
        (ch.usage.gpu_memory, ch.usage.gpus)
    };
    // Up to the next step; below `min` to `min`; a fraction of a percent to the next step.
    assert_eq!(share("15.5Gi", "75"), (Memory(16 * GI), gpus("4/5")));
    assert_eq!(share("500Mi", "5"), (Memory(GI), gpus("1/10")));
    assert_eq!(share("1", "72.5"), (Memory(GI), gpus("4/5")));
    assert_eq!(share("80Gi", "100"), (Memory(80 * GI), Gpus::ONE));
    // On a MIG 3g.40gb a share's compute is a share of its 3/7.
    let ch = charged(
        &c,
        "mig.gpuplane.dev",
        json!({"memory": "20Gi", "compute": "50"}),
    );
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(20 * GI), gpus("3/14"))
    );
    // Count multiplies the share.
    let spec = claim_spec(
        json!([{"name": "s", "exactly": {"deviceClassName": "gpu.gpuplane.dev",
        "count": 2, "capacity": {"requests": {"memory": "15Gi", "compute": "80"}}}}]),
    );
    let ch = claim_charge(&spec, &c).unwrap();
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(30 * GI), gpus("8/5"))
    );
}

#[test]
fn a_request_above_max_matches_no_shared_device() {
    // The H100's shares stop at 80Gi: 81Gi fits only the whole H200, charged whole.
    let c = share_catalog(true);
    let ch = charged(&c, "gpu.gpuplane.dev", json!({"memory": "81Gi"}));
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(141 * GI), Gpus::ONE)
    );
    // The MIG's shares stop at 39Gi (its 39.5Gi is no whole step): 40Gi matches nothing, so
    // neither dimension can be priced and a quota limiting them denies.
    let ch = charged(&c, "mig.gpuplane.dev", json!({"memory": "40Gi"}));
    assert_eq!(ch.unknown.len(), 2, "{:?}", ch.unknown);
    assert!(ch.unknown[0].why.starts_with(
        "no published device matches DeviceClass mig.gpuplane.dev with the capacities"
    ));
    // Compute above 100 percent, or a capacity no device publishes: no device either.
    assert_eq!(
        charged(&c, "mig.gpuplane.dev", json!({"compute": "110"}))
            .unknown
            .len(),
        2
    );
    assert_eq!(
        charged(&c, "mig.gpuplane.dev", json!({"bandwidth": "1"}))
            .unknown
            .len(),
        2
    );
    // A request for 15Gi + 80% skips the H200, which publishes no `compute`.
    let ch = charged(
        &c,
        "gpu.gpuplane.dev",
        json!({"memory": "15Gi", "compute": "80"}),
    );
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(15 * GI), gpus("4/5"))
    );
    // A policy may cap a share below the device's value: at most 40Gi of 80Gi.
    let halves = DeviceCatalog::new(
        &[slice_of(
            "h",
            vec![shared_device("gpu-0", "gpu", None, "80Gi", 40)],
        )],
        &shipped_classes(),
        CatalogSettings::default(),
    );
    let ch = charged(&halves, "gpu.gpuplane.dev", json!({"memory": "50Gi"}));
    assert_eq!(ch.unknown.len(), 2, "{:?}", ch.unknown);
    let ch = charged(&halves, "gpu.gpuplane.dev", Value::Null);
    assert_eq!(ch.usage.gpu_memory, Memory(40 * GI));
    // A value that is not a quantity is an error.
    let spec = share_claim("gpu.gpuplane.dev", json!({"memory": "lots"}));
    assert!(matches!(
        claim_charge(&spec, &c),
        Err(ChargeError::BadCapacity { .. })
    ));
}

#[test]
fn an_omitted_capacity_is_consumed_at_its_default() {
    let c = share_catalog(true);
    // Only memory: compute is consumed at its default, 100 percent, a whole GPU.
    let s = share_catalog(false);
    let ch = charged(&s, "gpu.gpuplane.dev", json!({"memory": "10Gi"}));
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(10 * GI), Gpus::ONE)
    );
    // Only compute: memory at its default, the whole 80Gi.
    let ch = charged(&s, "gpu.gpuplane.dev", json!({"compute": "30"}));
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(80 * GI), gpus("3/10"))
    );
    // No capacity requests: a share of the defaults (the whole unit) on a shared device, the
    // whole device on the others, the worst of them charged as before.
    let ch = charged(&c, "gpu.gpuplane.dev", Value::Null);
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(141 * GI), Gpus::ONE)
    );
    let ch = charged(&c, "mig.gpuplane.dev", Value::Null);
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(39 * GI), gpus("3/7"))
    );
}

#[test]
fn all_mode_and_first_available_price_shares_too() {
    let c = share_catalog(true);
    // All: pool s, one 1Gi share of its shared GPU at the default compute (1 GPU); pool w, the
    // whole H200; the costlier pool is charged.
    let spec = claim_spec(
        json!([{"name": "s", "exactly": {"deviceClassName": "gpu.gpuplane.dev",
        "allocationMode": "All", "capacity": {"requests": {"memory": "1Gi"}}}}]),
    );
    let ch = claim_charge(&spec, &c).unwrap();
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(141 * GI), Gpus::ONE)
    );
    let spec = claim_spec(
        json!([{"name": "s", "exactly": {"deviceClassName": "mig.gpuplane.dev",
        "allocationMode": "All", "capacity": {"requests": {"memory": "2Gi", "compute": "10"}}}}]),
    );
    let ch = claim_charge(&spec, &c).unwrap();
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(2 * GI), gpus("3/70"))
    );
    let spec = claim_spec(json!([{"name": "r", "firstAvailable": [
        {"name": "share", "deviceClassName": "mig.gpuplane.dev",
         "capacity": {"requests": {"memory": "4Gi", "compute": "20"}}},
        {"name": "small", "deviceClassName": "gpu.gpuplane.dev",
         "capacity": {"requests": {"memory": "2Gi", "compute": "50"}}}
    ]}]));
    let ch = claim_charge(&spec, &c).unwrap();
    // max(4Gi, 2Gi); max(3/7 x 1/5, 1/2).
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(4 * GI), gpus("1/2"))
    );
}

fn allocated(results: Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": [{"name": "s", "exactly": {"deviceClassName": "gpu.gpuplane.dev",
            "capacity": {"requests": {"memory": "15Gi", "compute": "80"}}}}]}},
        "status": {"allocation": {"devices": {"results": results}}}
    }))
    .unwrap()
}

fn result(device: &str, consumed: Value) -> Value {
    json!({"request": "s", "driver": D, "pool": "s", "device": device,
        "shareID": "4f6f2a4e-0000-4000-8000-000000000001", "consumedCapacity": consumed})
}

#[test]
fn a_settled_share_is_charged_its_consumed_capacity() {
    let c = share_catalog(true);
    let claim = allocated(json!([
        result("gpu-0", json!({"memory": "15Gi", "compute": "80"})),
        result("gpu-1-mig-0", json!({"memory": "20Gi", "compute": "50"})),
    ]));
    let ch = settled_claim_charge(&claim, &c).unwrap().unwrap();
    // 15Gi + 20Gi; 4/5 + 3/7 x 1/2 = 4/5 + 3/14 = 71/70; one device per result.
    assert_eq!(ch.usage.gpu_memory, Memory(35 * GI));
    assert_eq!(ch.usage.gpus, gpus("71/70"));
    assert_eq!(ch.usage.devices["gpu.gpuplane.dev"], 2);
    assert!(ch.unknown.is_empty());
    // A device no longer published: compute read as a percent of one GPU.
    let gone = allocated(json!([result(
        "gpu-9",
        json!({"memory": "8Gi", "compute": "30"})
    )]));
    let ch = settled_claim_charge(&gone, &c).unwrap().unwrap();
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(8 * GI), gpus("3/10"))
    );
    assert!(ch.unknown.is_empty());
    // ... and what it did not record is unknown (the controller keeps the worst case).
    let gone = allocated(json!([result("gpu-9", json!({"memory": "8Gi"}))]));
    let ch = settled_claim_charge(&gone, &c).unwrap().unwrap();
    assert_eq!(ch.unknown.len(), 1);
    assert_eq!(ch.unknown[0].dimension, Dimension::Gpus);
    // A published device whose result omits compute: the whole unit's.
    let partial = allocated(json!([result("gpu-1-mig-0", json!({"memory": "20Gi"}))]));
    let ch = settled_claim_charge(&partial, &c).unwrap().unwrap();
    assert_eq!(
        (ch.usage.gpu_memory, ch.usage.gpus),
        (Memory(20 * GI), gpus("3/7"))
    );
}
