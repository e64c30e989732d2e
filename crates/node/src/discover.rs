//! `gpuplane discover`: renders what a node has as a table for people or JSON for scripts.
//!
//! Pure rendering over a [`Discovery`]; the caller picks the source and prints the string.

use crate::inventory::{Gpu, Inventory};
use crate::source::Discovery;
use serde::Serialize;
use std::fmt::Write;

/// The JSON document `discover -o json` prints.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Report<'a> {
    source: &'a str,
    #[serde(flatten)]
    inventory: &'a Inventory,
    lost: Vec<LostReport<'a>>,
}

#[derive(Serialize)]
struct LostReport<'a> {
    index: u32,
    reason: &'a str,
}

pub fn render_json(source: &str, d: &Discovery) -> Result<String, serde_json::Error> {
    let report = Report {
        source,
        inventory: &d.inventory,
        lost: d
            .lost
            .iter()
            .map(|l| LostReport {
                index: l.index,
                reason: &l.reason,
            })
            .collect(),
    };
    serde_json::to_string_pretty(&report)
}

fn gib(mib: u64) -> String {
    format!("{:.1} GiB", mib as f64 / 1024.0)
}

fn mig_state(g: &Gpu) -> String {
    let now = if g.mig.current { "on" } else { "off" };
    if g.mig.pending != g.mig.current {
        format!(
            "{now} (pending {})",
            if g.mig.pending { "on" } else { "off" }
        )
    } else {
        now.to_string()
    }
}

/// Lays out rows as left-aligned columns separated by two spaces.
fn columns(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows.first().map_or(0, Vec::len))
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

pub fn render_table(source: &str, d: &Discovery) -> String {
    let inv = &d.inventory;
    let mut out = String::new();
    let _ = writeln!(out, "Source: {source}");
    let _ = writeln!(
        out,
        "Driver {}, CUDA {}, {} GPU(s), {} MIG device(s)\n",
        inv.driver_version,
        inv.cuda_driver_version,
        inv.gpus.len(),
        inv.mig_device_count()
    );
    out.push_str(&columns(&gpu_rows(inv)));
    if inv.mig_device_count() > 0 {
        out.push_str("\nMIG devices\n");
        out.push_str(&columns(&mig_rows(inv)));
    }
    let _ = writeln!(
        out,
        "\nTopology{}",
        if inv.topology.nvswitch {
            " (NVSwitch fabric: all GPUs connected all-to-all)"
        } else {
            ""
        }
    );
    out.push_str(&columns(&topology_rows(inv)));
    out.push_str("\nLegend: X = self, NV# = # NVLinks, PIX = one PCIe switch, PXB = several PCIe switches,\n        PHB = host bridge, NODE = same NUMA node, SYS = across sockets, PSB = same board\n");
    for l in &d.lost {
        let _ = writeln!(out, "\nGPU {} is not served: {}", l.index, l.reason);
    }
    out
}

/// A table's header row.
fn header(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

/// One row per GPU.
fn gpu_rows(inv: &Inventory) -> Vec<Vec<String>> {
    let mut rows = vec![header(&[
        "GPU",
        "PRODUCT",
        "MEMORY",
        "CC",
        "NUMA",
        "PCI BUS ID",
        "MIG",
        "UUID",
    ])];
    for g in &inv.gpus {
        rows.push(vec![
            g.index.to_string(),
            g.product_name.clone(),
            gib(g.memory_mib),
            g.cuda_compute_capability.clone(),
            numa(g),
            g.pci_bus_id.clone(),
            mig_state(g),
            g.uuid.to_string(),
        ]);
    }
    rows
}

/// One row per MIG device, under its GPU's index.
fn mig_rows(inv: &Inventory) -> Vec<Vec<String>> {
    let mut rows = vec![header(&[
        "GPU", "GI", "CI", "PROFILE", "SLICES", "MEMORY", "SMS", "UUID",
    ])];
    for g in &inv.gpus {
        for m in &g.mig_devices {
            rows.push(vec![
                g.index.to_string(),
                m.gpu_instance_id.to_string(),
                m.compute_instance_id.to_string(),
                m.profile.to_string(),
                format!("{}-{}", m.placement.start, m.placement.end() - 1),
                gib(m.memory_mib),
                m.multiprocessors.to_string(),
                m.uuid.to_string(),
            ]);
        }
    }
    rows
}

/// The GPU-to-GPU matrix as `nvidia-smi topo -m` prints it, with each GPU's NUMA node.
fn topology_rows(inv: &Inventory) -> Vec<Vec<String>> {
    let mut names = vec![String::new()];
    names.extend(inv.gpus.iter().map(|g| format!("GPU{}", g.index)));
    names.push("NUMA".into());
    let mut rows = vec![names];
    for a in &inv.gpus {
        let mut row = vec![format!("GPU{}", a.index)];
        for b in &inv.gpus {
            row.push(match inv.topology.link(a.index, b.index) {
                _ if a.index == b.index => "X".into(),
                Some(l) if l.nvlinks > 0 => format!("NV{}", l.nvlinks),
                Some(l) => l.level.short().into(),
                None => "?".into(),
            });
        }
        row.push(numa(a));
        rows.push(row);
    }
    rows
}

fn numa(g: &Gpu) -> String {
    g.numa_node.map_or("-".into(), |n| n.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{DeviceSource, SimSource};

    fn discovery(profile: &str) -> Discovery {
        SimSource::new(crate::sim::load(profile).unwrap())
            .discover()
            .unwrap()
    }

    #[test]
    fn the_table_shows_the_cube_mesh_link_matrix() {
        let table = render_table("sim:dgx1-v100", &discovery("dgx1-v100"));
        let gpu0 = table.lines().find(|l| l.starts_with("GPU0 ")).unwrap();
        let cells: Vec<&str> = gpu0.split_whitespace().collect();
        assert_eq!(
            cells,
            ["GPU0", "X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS", "0"]
        );
    }

    #[test]
    fn json_has_the_documented_fields() {
        let v: serde_json::Value = serde_json::from_str(
            &render_json("sim:a100-mig-mixed", &discovery("a100-mig-mixed")).unwrap(),
        )
        .unwrap();
        assert_eq!(v["gpus"][2]["index"], 2);
        assert_eq!(v["gpus"][2]["numaNode"], 1);
        assert_eq!(v["gpus"][2]["migDevices"][0]["profile"], "1g.5gb+me");
        assert_eq!(v["topology"]["nvswitch"], false);
        assert_eq!(v["topology"]["links"][0]["nvlinks"], 4);
        assert!(v["gpus"][0]["uuid"].as_str().unwrap().starts_with("GPU-"));
    }

    #[test]
    fn a_lost_gpu_is_listed_and_left_out() {
        let sim = SimSource::new(crate::sim::load("dgx-h100").unwrap());
        let uuid = sim.discover().unwrap().inventory.gpus[5].uuid.clone();
        sim.set_lost(&uuid, true);
        let table = render_table("sim", &sim.discover().unwrap());
        assert!(table.contains("GPU 5 is not served"));
        assert!(!table.lines().any(|l| l.starts_with("GPU5 ")));
    }
}
