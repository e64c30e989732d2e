//! The `topology` section of a profile turned into the inventory's [`Topology`]: direct
//! NVLinks or an NVSwitch fabric, and the PCIe groups that decide each pair's path level.

use super::{invalid, GpuSpec, Invalid, ModelSpec, PcieSpec, TopologySpec, MAX_NVLINKS};
use crate::inventory::{Gpu, Link, PathLevel, Topology};
use std::collections::BTreeMap;

/// The PCIe groups nearest first, each with its field name and the level it gives a pair.
type PcieGroups<'t> = [(&'static str, &'t Vec<Vec<u32>>, PathLevel); 4];

pub(super) fn build_topology(
    models: &BTreeMap<String, ModelSpec>,
    specs: &[GpuSpec],
    gpus: &[Gpu],
    t: &TopologySpec,
) -> Result<Topology, Invalid> {
    let n = gpus.len() as u32;
    if t.nvswitch && !t.nvlinks.is_empty() {
        return Err(invalid(
            "topology.nvlinks",
            "direct NVLinks and an NVSwitch fabric cannot be mixed in one profile",
        ));
    }
    let direct = direct_nvlinks(&t.nvlinks, n)?;
    let fabric_links = |i: usize| models.get(&specs[i].model).map_or(0, |m| m.nvlinks);
    if t.nvswitch {
        if let Some(i) = (0..gpus.len()).find(|&i| fabric_links(i) == 0) {
            return Err(invalid(
                format!("gpus[{i}].model"),
                "on an NVSwitch fabric every GPU model needs `nvlinks` > 0",
            ));
        }
    }
    let groups = pcie_groups(&t.pcie, n)?;
    let mut links = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            let shared =
                |list: &Vec<Vec<u32>>| list.iter().any(|g| g.contains(&a) && g.contains(&b));
            let level = groups
                .iter()
                .find(|(_, list, _)| shared(list))
                .map(|(_, _, l)| *l)
                .unwrap_or_else(|| {
                    match (gpus[a as usize].numa_node, gpus[b as usize].numa_node) {
                        (Some(x), Some(y)) if x == y => PathLevel::NumaNode,
                        _ => PathLevel::System,
                    }
                });
            let nvlinks = if t.nvswitch {
                fabric_links(a as usize).min(fabric_links(b as usize))
            } else {
                direct.get(&(a, b)).copied().unwrap_or(0)
            };
            links.push(Link {
                from: a,
                to: b,
                nvlinks,
                level,
            });
        }
    }
    Ok(Topology {
        nvswitch: t.nvswitch,
        links,
    })
}

/// The direct NVLinks of `n` GPUs by (lower, higher) index, each pair once and no GPU over
/// NVML's link count.
fn direct_nvlinks(nvlinks: &[[u32; 3]], n: u32) -> Result<BTreeMap<(u32, u32), u32>, Invalid> {
    let mut direct: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    let mut per_gpu = vec![0u32; n as usize];
    for (i, [a, b, count]) in nvlinks.iter().copied().enumerate() {
        let f = format!("topology.nvlinks[{i}]");
        if a >= n || b >= n {
            return Err(invalid(
                f,
                format!(
                    "links GPU {a} and GPU {b}, but the profile has GPUs 0..{}",
                    n - 1
                ),
            ));
        }
        if a == b || count == 0 {
            return Err(invalid(
                f,
                "a link needs two different GPUs and a positive count",
            ));
        }
        if direct.insert((a.min(b), a.max(b)), count).is_some() {
            return Err(invalid(f, format!("GPUs {a} and {b} are linked twice")));
        }
        for g in [a, b] {
            per_gpu[g as usize] += count;
            if per_gpu[g as usize] > MAX_NVLINKS {
                return Err(invalid(
                    f,
                    format!("GPU {g} would have more than NVML's {MAX_NVLINKS} NVLinks"),
                ));
            }
        }
    }
    Ok(direct)
}

/// The PCIe groups, checked to name only GPUs below `n`.
fn pcie_groups(pcie: &PcieSpec, n: u32) -> Result<PcieGroups<'_>, Invalid> {
    let groups: PcieGroups<'_> = [
        ("sameBoard", &pcie.same_board, PathLevel::SameBoard),
        ("singleSwitch", &pcie.single_switch, PathLevel::SingleSwitch),
        (
            "multipleSwitches",
            &pcie.multiple_switches,
            PathLevel::MultipleSwitches,
        ),
        ("hostBridge", &pcie.host_bridge, PathLevel::HostBridge),
    ];
    for (name, list, _) in &groups {
        for (i, group) in list.iter().enumerate() {
            if let Some(g) = group.iter().find(|g| **g >= n) {
                return Err(invalid(
                    format!("topology.pcie.{name}[{i}]"),
                    format!("GPU {g} does not exist (the profile has GPUs 0..{})", n - 1),
                ));
            }
        }
    }
    Ok(groups)
}
