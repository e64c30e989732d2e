//! PCI addresses and the approximate PCIe root of each GPU (see the parent module's docs on
//! `resource.kubernetes.io/pcieRoot`).

use crate::inventory::{Inventory, PathLevel};
use std::collections::BTreeMap;

/// A PCI address in the kubelet's (sysfs) form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl std::fmt::Display for PciAddress {
    /// `0000:18:00.0`: lower-case hex, domain at least four digits.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// Parses NVML's `00000000:18:00.0` (or the sysfs `0000:18:00.0`, any case).
pub fn pci_address(text: &str) -> Option<PciAddress> {
    let mut parts = text.trim().split(':');
    let (domain, bus, devfn) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let (device, function) = devfn.split_once('.')?;
    Some(PciAddress {
        domain: u32::from_str_radix(domain, 16).ok()?,
        bus: u8::from_str_radix(bus, 16).ok()?,
        device: u8::from_str_radix(device, 16).ok().filter(|d| *d < 32)?,
        function: u8::from_str_radix(function, 16).ok().filter(|f| *f < 8)?,
    })
}

/// Approximate PCIe root per GPU index (see the module docs): GPUs joined by a path no
/// farther than one host bridge share a root, named `pci<domain>:<lowest bus>`.
pub fn pcie_roots(inv: &Inventory) -> BTreeMap<u32, String> {
    let addrs: BTreeMap<u32, PciAddress> = inv
        .gpus
        .iter()
        .filter_map(|g| pci_address(&g.pci_bus_id).map(|a| (g.index, a)))
        .collect();
    // Union-find over GPU indices.
    let mut parent: BTreeMap<u32, u32> = addrs.keys().map(|i| (*i, *i)).collect();
    fn find(parent: &BTreeMap<u32, u32>, mut i: u32) -> u32 {
        while let Some(&p) = parent.get(&i) {
            if p == i {
                break;
            }
            i = p;
        }
        i
    }
    for link in &inv.topology.links {
        if link.level > PathLevel::HostBridge {
            continue;
        }
        let (Some(a), Some(b)) = (addrs.get(&link.from), addrs.get(&link.to)) else {
            continue;
        };
        if a.domain != b.domain {
            continue;
        }
        let (ra, rb) = (find(&parent, link.from), find(&parent, link.to));
        if ra != rb {
            let (lo, hi) = if ra < rb { (ra, rb) } else { (rb, ra) };
            parent.insert(hi, lo);
        }
    }
    let mut lowest_bus: BTreeMap<u32, (u32, u8)> = BTreeMap::new();
    for (i, a) in &addrs {
        let root = find(&parent, *i);
        let e = lowest_bus.entry(root).or_insert((a.domain, a.bus));
        if a.bus < e.1 {
            e.1 = a.bus;
        }
    }
    addrs
        .keys()
        .filter_map(|i| {
            lowest_bus
                .get(&find(&parent, *i))
                .map(|(domain, bus)| (*i, format!("pci{domain:04x}:{bus:02x}")))
        })
        .collect()
}
