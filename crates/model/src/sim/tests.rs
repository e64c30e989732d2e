use super::*;
use crate::inventory::PathLevel;

const MINIMAL: &str = r#"
driverVersion: "550.90.07"
cudaDriverVersion: "12.4"
models:
  a100:
    productName: NVIDIA A100-SXM4-40GB
    brand: Nvidia
    architecture: Ampere
    cudaComputeCapability: "8.0"
    memoryMiB: 40960
    migCatalogue: a100-40gb
gpus:
  - model: a100
    pciBusId: "00000000:01:00.0"
    numaNode: 0
    mig:
      enabled: true
      devices: [{ profile: 3g.20gb }, { profile: 3g.20gb }]
  - { model: a100, pciBusId: "00000000:02:00.0", numaNode: 0 }
"#;

fn rejected(text: &str) -> (String, String) {
    match from_str("test.yaml", "test", text) {
        Err(ProfileError::Invalid { field, reason, .. }) => (field, reason),
        other => panic!("expected a validation error, got {other:?}"),
    }
}

#[test]
fn every_bundled_profile_loads() {
    for name in bundled_names() {
        let inv = load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let n = inv.gpus.len() as u32;
        assert_eq!(inv.topology.links.len() as u32, n * (n - 1) / 2, "{name}");
    }
}

#[test]
fn dgx1_v100_has_the_hybrid_cube_mesh_with_six_links_per_gpu() {
    let inv = load("dgx1-v100").unwrap();
    for g in 0..8 {
        let total: u32 = (0..8)
            .filter(|o| *o != g)
            .map(|o| inv.topology.link(g, o).unwrap().nvlinks)
            .sum();
        assert_eq!(total, 6, "GPU {g}");
    }
    assert_eq!(inv.topology.link(0, 3).unwrap().nvlinks, 2);
    assert_eq!(inv.topology.link(0, 5).unwrap().nvlinks, 0);
    assert_eq!(
        inv.topology.link(0, 1).unwrap().level,
        PathLevel::SingleSwitch
    );
    assert_eq!(inv.topology.link(0, 2).unwrap().level, PathLevel::NumaNode);
    assert_eq!(inv.topology.link(3, 4).unwrap().level, PathLevel::System);
    assert!(!inv.topology.nvswitch);
}

#[test]
fn h100_mig_single_has_56_uniform_mig_devices_with_distinct_placements() {
    let inv = load("h100-mig-single").unwrap();
    assert_eq!(inv.mig_device_count(), 56);
    for gpu in &inv.gpus {
        let starts: Vec<u32> = gpu.mig_devices.iter().map(|m| m.placement.start).collect();
        assert_eq!(starts, vec![0, 1, 2, 3, 4, 5, 6]);
        assert!(gpu
            .mig_devices
            .iter()
            .all(|m| m.profile == "1g.10gb" && m.parent_uuid == gpu.uuid));
    }
    assert!(inv.topology.nvswitch);
    assert!(inv.topology.links.iter().all(|l| l.nvlinks == 18));
}

#[test]
fn generated_uuids_are_stable_and_well_formed() {
    let a = load("dgx-h100").unwrap();
    let b = load("dgx-h100").unwrap();
    assert_eq!(a, b);
    assert!(a.gpus[0].uuid.starts_with("GPU-") && a.gpus[0].uuid.len() == 40);
    assert_ne!(a.gpus[0].uuid, a.gpus[1].uuid);
}

#[test]
fn automatic_placement_takes_the_first_free_allowed_slice() {
    let inv = from_str("t", "t", MINIMAL).unwrap();
    let starts: Vec<u32> = inv.gpus[0]
        .mig_devices
        .iter()
        .map(|m| m.placement.start)
        .collect();
    assert_eq!(starts, vec![0, 4]);
}

#[test]
fn an_unknown_mig_profile_is_rejected_with_its_field() {
    let (field, reason) = rejected(&MINIMAL.replace(
        "{ profile: 3g.20gb }, { profile: 3g.20gb }",
        "{ profile: 3g.25gb }",
    ));
    assert_eq!(field, "gpus[0].mig.devices[0].profile");
    assert!(reason.contains("unknown MIG profile `3g.25gb`"), "{reason}");
}

#[test]
fn overlapping_mig_placements_are_rejected() {
    let (field, reason) = rejected(&MINIMAL.replace(
        "{ profile: 3g.20gb }, { profile: 3g.20gb }",
        "{ profile: 3g.20gb, placement: 0 }, { profile: 2g.10gb, placement: 2 }",
    ));
    assert_eq!(field, "gpus[0].mig.devices[1].placement");
    assert!(reason.contains("overlaps"), "{reason}");
}

#[test]
fn mig_devices_exceeding_the_gpu_are_rejected() {
    let (field, reason) = rejected(&MINIMAL.replace(
        "{ profile: 3g.20gb }, { profile: 3g.20gb }",
        "{ profile: 4g.20gb }, { profile: 4g.20gb }",
    ));
    assert_eq!(field, "gpus[0].mig.devices[1]");
    assert!(reason.contains("compute slices"), "{reason}");
}

#[test]
fn a_link_to_a_missing_gpu_is_rejected() {
    let text = format!("{MINIMAL}topology:\n  nvlinks: [[0, 5, 2]]\n");
    let (field, reason) = rejected(&text);
    assert_eq!(field, "topology.nvlinks[0]");
    assert!(reason.contains("GPU 5"), "{reason}");
}

#[test]
fn an_unknown_model_reference_is_rejected() {
    let (field, reason) = rejected(&MINIMAL.replace("- { model: a100,", "- { model: h100,"));
    assert_eq!(field, "gpus[1].model");
    assert!(reason.contains("no model `h100`"), "{reason}");
}

#[test]
fn a_bad_pci_address_is_rejected() {
    let (field, _) = rejected(&MINIMAL.replace("00000000:02:00.0", "02:00.0"));
    assert_eq!(field, "gpus[1].pciBusId");
}

#[test]
fn unknown_fields_are_parse_errors_naming_the_file() {
    let err = from_str(
        "my.yaml",
        "my",
        &MINIMAL.replace("numaNode: 0\n    mig", "numaNod: 0\n    mig"),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ProfileError::Parse { .. }));
    assert!(msg.contains("my.yaml") && msg.contains("numaNod"), "{msg}");
}

#[test]
fn a_missing_profile_names_the_bundled_ones() {
    let msg = load("/nonexistent/profile.yaml").unwrap_err().to_string();
    assert!(
        msg.contains("dgx-h100") && msg.contains("/nonexistent/profile.yaml"),
        "{msg}"
    );
}

#[test]
fn a_gpu_has_a_mig_table_only_where_its_product_name_leads_to_its_own() {
    let inv = from_str("t.yaml", "t", MINIMAL).unwrap();
    assert_eq!(inv.gpus[0].mig.table.as_deref(), Some("a100-40gb"));
    // NVML discovery would look up the table by product name, find none and say so.
    let renamed = MINIMAL.replace("NVIDIA A100-SXM4-40GB", "Custom Accelerator");
    let inv = from_str("t.yaml", "t", &renamed).unwrap();
    assert!(inv.gpus[0].mig.capable);
    assert_eq!(inv.gpus[0].mig.table, None);
}
