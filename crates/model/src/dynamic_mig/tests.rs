use super::*;
use crate::config::{AgentConfig, ConfigError};
use std::collections::BTreeSet;

fn parse(text: &str) -> Result<AgentConfig, ConfigError> {
    AgentConfig::parse("c.yaml", text)
}

fn select(text: &str) -> Option<GpuSelect> {
    parse(text).unwrap().dynamic_mig.map(|d| d.select)
}

#[test]
fn the_section_selects_gpus_and_is_off_when_absent() {
    assert_eq!(select(""), None);
    assert_eq!(select("health: {}"), None);
    assert_eq!(select("dynamicMig:"), Some(GpuSelect::All));
    assert_eq!(select("dynamicMig: {}"), Some(GpuSelect::All));
    assert_eq!(select("dynamicMig: {gpus: all}"), Some(GpuSelect::All));
    assert_eq!(
        select("dynamicMig: {gpus: [2, 0, 2]}"),
        Some(GpuSelect::Indices(BTreeSet::from([0, 2])))
    );
    assert_eq!(
        select("dynamicMig:\n  models: [NVIDIA H100 80GB HBM3]"),
        Some(GpuSelect::Models(BTreeSet::from([
            "NVIDIA H100 80GB HBM3".to_string()
        ])))
    );
}

#[test]
fn bad_sections_name_the_field() {
    for (text, field, says) in [
        (
            "dynamicMig: {gpus: [0], models: [x]}",
            "dynamicMig.gpus",
            "not both",
        ),
        ("dynamicMig: {gpus: []}", "dynamicMig.gpus", "lists no GPU"),
        (
            "dynamicMig: {gpus: two}",
            "dynamicMig.gpus",
            "`all` or a list",
        ),
        (
            "dynamicMig: {gpus: [-1]}",
            "dynamicMig.gpus",
            "`all` or a list",
        ),
        (
            "dynamicMig: {models: []}",
            "dynamicMig.models",
            "lists no model",
        ),
    ] {
        match parse(text) {
            Err(ConfigError::Invalid {
                field: f, reason, ..
            }) => {
                assert_eq!(f, field, "{text}");
                assert!(reason.contains(says), "{text}: {reason}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
    assert!(matches!(
        parse("dynamicMig: {gpu: [0]}"),
        Err(ConfigError::Parse { .. })
    ));
}

#[test]
fn a_gpu_named_by_both_sharing_and_dynamic_mig_is_a_config_error() {
    let both = "sharing: {consumableCapacity: {gpus: [0, 1, 2]}}\ndynamicMig: {gpus: [2, 1, 5]}";
    match parse(both) {
        Err(ConfigError::Invalid { field, reason, .. }) => {
            assert_eq!(field, "dynamicMig.gpus");
            assert!(
                reason.contains("GPU 1, GPU 2 are also in sharing.consumableCapacity.gpus"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    let models =
        "sharing: {consumableCapacity: {models: [NVIDIA A30]}}\ndynamicMig: {models: [NVIDIA A30]}";
    match parse(models) {
        Err(ConfigError::Invalid { field, reason, .. }) => {
            assert_eq!(field, "dynamicMig.models");
            assert!(reason.contains("`NVIDIA A30` is also in"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // Overlaps the file does not spell out are settled by dynamic MIG winning.
    for ok in [
        "sharing: {consumableCapacity: {gpus: [0]}}\ndynamicMig: {gpus: [1]}",
        "sharing: {consumableCapacity: {}}\ndynamicMig: {gpus: [1]}",
        "sharing: {consumableCapacity: {gpus: [1]}}\ndynamicMig: {}",
        "sharing: {consumableCapacity: {gpus: [1]}}\ndynamicMig: {models: [NVIDIA A30]}",
    ] {
        let c = parse(ok).unwrap();
        assert!(c.shares.is_some() && c.dynamic_mig.is_some(), "{ok}");
    }
}

#[test]
fn dynamic_mig_wins_over_sharing_where_both_select_a_gpu() {
    let mut inv = crate::sim::load("a100-mig-mixed").unwrap();
    inv.gpus[0].mig_devices.clear();
    let cfg = parse("sharing: {consumableCapacity: {migDevices: true}}\ndynamicMig: {gpus: all}")
        .unwrap();
    let p = plan(&inv, cfg.dynamic_mig.as_ref().unwrap(), &|_, _| false);
    mark(&mut inv, &p);
    let shared = crate::sharing::shared_units(&inv, cfg.shares.as_ref());
    assert!(!shared.is_empty());
    assert!(
        !shared.contains_key(&inv.gpus[0].uuid),
        "the dynamic GPU is not also shared"
    );
    // GPU 1 has instances gpuplane did not create: it stays static, and shares.
    assert!(shared.contains_key(&inv.gpus[1].mig_devices[0].uuid));
}

fn all() -> DynamicMigConfig {
    DynamicMigConfig {
        select: GpuSelect::All,
    }
}

fn reason(p: &Participation, index: u32) -> &NotDynamic {
    &p.refused
        .iter()
        .find(|r| r.index == index)
        .unwrap_or_else(|| panic!("GPU {index} is not refused: {p:?}"))
        .reason
}

#[test]
fn only_gpus_whose_instances_are_all_ours_take_part() {
    let inv = crate::sim::load("a100-mig-mixed").unwrap();
    let none = plan(&inv, &all(), &|_, _| false);
    assert!(none.gpus.is_empty());
    let NotDynamic::ForeignInstances { index, instances } = reason(&none, 0) else {
        panic!("{none:?}");
    };
    assert_eq!(*index, 0);
    let listed: Vec<String> = instances
        .iter()
        .map(|f| format!("{}@{}", f.profile, f.start))
        .collect();
    let mut expected: Vec<String> = inv.gpus[0]
        .mig_devices
        .iter()
        .map(|m| format!("{}@{}", m.profile, m.placement.start))
        .collect();
    expected.dedup();
    assert_eq!(listed, expected);
    let three = &inv.gpus[0]
        .mig_devices
        .iter()
        .find(|m| m.profile == "3g.20gb")
        .unwrap();
    let msg = reason(&none, 0).to_string();
    assert!(
        msg.contains(&format!("3g.20gb@4 (GI {})", three.gpu_instance_id)),
        "{msg}"
    );
    assert!(msg.contains("gpuplane never touches them"), "{msg}");

    // Ours: GPUs 0-2 take part with the A100 40GB table; GPU 3 has MIG off.
    let ours = plan(&inv, &all(), &|_, _| true);
    let taking: Vec<(u32, &str)> = ours.gpus.iter().map(|p| (p.index, p.table.name)).collect();
    assert_eq!(
        taking,
        [(0, "a100-40gb"), (1, "a100-40gb"), (2, "a100-40gb")]
    );
    assert_eq!(ours.refused.len(), 1);
    assert_eq!(reason(&ours, 3), &NotDynamic::MigOff { index: 3 });
    let msg = reason(&ours, 3).to_string();
    assert!(
        msg.contains("`nvidia-smi -i 3 -mig 1`") && msg.contains("gpuplane never"),
        "{msg}"
    );

    // Only GPU 1's instances are ours.
    let one = plan(&inv, &all(), &|g, _| g.index == 1);
    assert_eq!(one.gpus.iter().map(|p| p.index).collect::<Vec<_>>(), [1]);
}

#[test]
fn each_obstacle_has_its_reason() {
    let mut inv = crate::sim::load("a100-mig-mixed").unwrap();
    inv.gpus[0].mig.table = None;
    inv.gpus[1].mig.pending = false;
    inv.gpus[3].mig.pending = true;
    inv.gpus[2].mig.table = Some("no-such-table".into());
    let cfg = DynamicMigConfig {
        select: GpuSelect::Indices(BTreeSet::from([0, 1, 2, 3, 7])),
    };
    let p = plan(&inv, &cfg, &|_, _| true);
    assert!(p.gpus.is_empty());
    assert!(matches!(
        reason(&p, 0),
        NotDynamic::NoTable { index: 0, .. }
    ));
    assert!(matches!(
        reason(&p, 2),
        NotDynamic::NoTable { index: 2, .. }
    ));
    assert_eq!(reason(&p, 1), &NotDynamic::DisablePending { index: 1 });
    assert_eq!(reason(&p, 3), &NotDynamic::EnablePending { index: 3 });
    assert_eq!(reason(&p, 7), &NotDynamic::NoSuchGpu { index: 7 });
    assert_eq!(
        p.refused.iter().map(|r| r.index).collect::<Vec<_>>(),
        [0, 1, 2, 3, 7]
    );
    assert!(reason(&p, 0).to_string().contains("a100-40gb"));
    assert!(reason(&p, 3).to_string().contains("nvidia-smi -i 3 -r"));
    assert!(reason(&p, 1).to_string().contains("nvidia-smi -i 1 -mig 1"));
    assert!(reason(&p, 7).to_string().contains("dynamicMig.gpus"));

    for profile in ["pcie-l4x4", "dgx1-v100"] {
        let inv = crate::sim::load(profile).unwrap();
        let p = plan(&inv, &all(), &|_, _| true);
        assert!(p.gpus.is_empty(), "{profile}");
        assert_eq!(p.refused.len(), inv.gpus.len(), "{profile}");
        let r = reason(&p, 0);
        assert!(matches!(r, NotDynamic::NotCapable { .. }), "{profile}");
        assert!(r.to_string().contains("cannot do MIG"), "{r}");
    }
}

#[test]
fn unselected_gpus_are_neither_taken_nor_refused() {
    let inv = crate::sim::load("a100-mig-mixed").unwrap();
    let by_model = DynamicMigConfig {
        select: GpuSelect::Models(BTreeSet::from(["NVIDIA A30".to_string()])),
    };
    assert_eq!(
        plan(&inv, &by_model, &|_, _| true),
        Participation::default()
    );
    let two = DynamicMigConfig {
        select: GpuSelect::Indices(BTreeSet::from([2])),
    };
    let p = plan(&inv, &two, &|_, _| true);
    assert_eq!(p.gpus.iter().map(|p| p.index).collect::<Vec<_>>(), [2]);
    assert!(p.refused.is_empty());
}

#[test]
fn marking_moves_the_gpu_from_static_devices_to_dynamic_ones() {
    let mut inv = crate::sim::load("a100-mig-mixed").unwrap();
    let before = inv.dra_devices().len();
    let gpu2_static = inv.gpus[2].mig_devices.len();
    let p = plan(&inv, &all(), &|g, _| g.index == 2);
    mark(&mut inv, &p);
    assert_eq!(
        inv.gpus.iter().map(|g| g.mig.dynamic).collect::<Vec<_>>(),
        [false, false, true, false]
    );
    assert_eq!(inv.dra_devices().len(), before - gpu2_static);
    assert!(inv.dra_devices().iter().all(|d| d.gpu().index != 2));
    let dynamic = devices(&inv);
    assert!(dynamic.iter().all(|d| d.parent.index == 2));
    // The A100's table: 7 + 7 + 4 + 3 + 2 + 1 + 1 instances, and the whole GPU.
    assert_eq!(dynamic.len(), 26);
    // Marking again from a plan without it clears the mark.
    mark(&mut inv, &Participation::default());
    assert!(inv.gpus.iter().all(|g| !g.mig.dynamic));
    assert!(devices(&inv).is_empty());
}
