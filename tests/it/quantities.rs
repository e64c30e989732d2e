//! The three readers of a Kubernetes quantity agree on every string: the quota webhook's
//! `gpuMemory` (a GpuQuota spec), a ResourceSlice capacity (as validated before we write it
//! and as the webhook's catalog prices it), and an opaque DRA config's MPS memory limit.
//! Each accepts the same value or refuses with an error naming its field.

use gpuplane_model::quota::catalog::{CatalogSettings, DeviceCatalog, DEFAULT_DRIVER};
use gpuplane_model::quota::GpuQuotaSpec;
use gpuplane_node::dra::opaque::{self, Sharing};
use gpuplane_node::slices::validate::validate;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::json;

/// The quota's reading of `spec.hard.gpuMemory`, in bytes, or its error message.
fn webhook(s: &str) -> Result<u64, String> {
    serde_json::from_value::<GpuQuotaSpec>(json!({"hard": {"gpuMemory": s}}))
        .map_err(|e| e.to_string())
        .and_then(|spec| spec.hard.gpu_memory.ok_or_else(|| "absent".into()))
        .map(|m| m.bytes())
}

fn slice(s: &str) -> ResourceSlice {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu-gpuplane-dev-0"},
        "spec": {
            "driver": DEFAULT_DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [{
                "name": "gpu-0",
                "attributes": {"type": {"string": "gpu"}},
                "capacity": {"memory": {"value": s}},
            }],
        },
    }))
    .expect("the fixture is a ResourceSlice")
}

/// The slice validation's verdict on the capacity: `Ok` or the violations' fields and reasons.
fn slice_check(s: &str) -> Result<(), String> {
    validate(&slice(s)).map_err(|v| {
        v.iter()
            .map(|v| format!("{}: {}", v.field, v.problem))
            .collect::<Vec<_>>()
            .join("; ")
    })
}

/// What the webhook's catalog prices the device's memory at.
fn catalog_memory(s: &str) -> Option<u64> {
    let catalog = DeviceCatalog::new(&[slice(s)], &[], CatalogSettings::default());
    catalog.devices().first()?.memory.map(|m| m.bytes())
}

/// The opaque config's MPS pinned memory limit, in bytes, or its error message.
fn opaque_limit(s: &str) -> Result<u64, String> {
    let config = opaque::parse(&json!({
        "apiVersion": opaque::API_VERSION,
        "kind": opaque::KIND,
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": s}},
    }))
    .map_err(|e| e.to_string())?;
    match config.sharing {
        Some(Sharing::Mps(m)) => m
            .default_pinned_device_memory_limit
            .map(|l| l.bytes)
            .ok_or_else(|| "absent".into()),
        other => Err(format!("not MPS: {other:?}")),
    }
}

const GPU_MEMORY: &str = "gpuMemory";
const CAPACITY: &str = "spec.devices[0].capacity[memory].value";
const PINNED: &str = "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit";

#[test]
fn every_reader_gives_a_quantity_the_same_number_of_bytes() {
    const MI: u64 = 1 << 20;
    // string, bytes (rounded up, as Kubernetes' Value() rounds)
    for (s, bytes) in [
        ("1.5Gi", 1536 * MI),
        ("10Gi", 10 << 30),
        ("1Ei", 1 << 60),
        ("+5Mi", 5 * MI),
        ("2e6", 2_000_000),
        ("1048576500m", MI + 1),
    ] {
        assert_eq!(webhook(s), Ok(bytes), "{s}: gpuMemory");
        assert_eq!(slice_check(s), Ok(()), "{s}: ResourceSlice");
        assert_eq!(catalog_memory(s), Some(bytes), "{s}: catalog");
        assert_eq!(opaque_limit(s), Ok(bytes), "{s}: opaque config");
    }
}

#[test]
fn fractions_of_a_byte_round_up_and_small_limits_are_refused_by_the_mps_rule_alone() {
    for (s, bytes) in [("100m", 1), ("0.5", 1), ("1e3", 1000), ("0.1Ki", 103)] {
        assert_eq!(webhook(s), Ok(bytes), "{s}: gpuMemory");
        assert_eq!(slice_check(s), Ok(()), "{s}: ResourceSlice");
        assert_eq!(catalog_memory(s), Some(bytes), "{s}: catalog");
        // The quantity is fine; MPS needs at least 1Mi.
        assert_eq!(
            opaque_limit(s),
            Err(format!("{PINNED}: {s} is out of range (at least 1Mi)")),
            "{s}"
        );
    }
}

#[test]
fn a_negative_amount_is_a_quantity_but_no_memory() {
    assert_eq!(
        webhook("-1"),
        Err(format!("{GPU_MEMORY}: `-1` is negative"))
    );
    // The API server accepts a negative capacity; the catalog does not price it.
    assert_eq!(slice_check("-1"), Ok(()));
    assert_eq!(catalog_memory("-1"), None);
    assert_eq!(
        opaque_limit("-1"),
        Err(format!("{PINNED}: -1 is out of range (at least 1Mi)"))
    );
}

#[test]
fn garbage_is_refused_by_every_reader_naming_its_field() {
    for s in ["garbage", "10GB", "1 Gi", "1..5", "5Xi", ""] {
        let w = webhook(s).unwrap_err();
        assert!(
            w.starts_with(&format!("{GPU_MEMORY}: `{s}` is not a quantity: ")),
            "{s}: {w}"
        );
        let v = slice_check(s).unwrap_err();
        assert!(v.starts_with(CAPACITY), "{s}: {v}");
        assert_eq!(catalog_memory(s), None, "{s}");
        let o = opaque_limit(s).unwrap_err();
        assert!(
            o.starts_with(&format!("{PINNED}: `{s}` is not a valid quantity: ")),
            "{s}: {o}"
        );
    }
}

#[test]
fn amounts_past_what_kubernetes_counts_are_capped_in_binary_and_refused_in_decimal() {
    // Binary suffixes cap at 2^63-1, as the API server caps them.
    let max = i64::MAX as u64;
    assert_eq!(webhook("9Ei"), Ok(max));
    assert_eq!(catalog_memory("9Ei"), Some(max));
    assert_eq!(opaque_limit("9Ei"), Ok(max));
    // Decimal values are not capped, and Value() cannot return them.
    assert!(webhook("1e19").unwrap_err().contains("more bytes than"));
    assert_eq!(slice_check("1e19"), Ok(()));
    assert_eq!(catalog_memory("1e19"), None);
    assert_eq!(
        opaque_limit("1e19"),
        Err(format!(
            "{PINNED}: 1e19 is out of range (at most 2^63-1 bytes)"
        ))
    );
}
