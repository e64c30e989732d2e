//! Names of devices in the DRA world: one DNS label per whole GPU and per MIG device, stable
//! across restarts for an unchanged inventory (they appear in ResourceSlices and allocations).

use super::{DeviceUuid, Gpu, Inventory, MigDevice};

/// A device as DRA sees it: a whole GPU or one MIG device on its parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRef<'a> {
    Gpu(&'a Gpu),
    Mig { parent: &'a Gpu, mig: &'a MigDevice },
}

impl<'a> DeviceRef<'a> {
    /// The unit's UUID (GPU or MIG).
    pub fn uuid(&self) -> &'a DeviceUuid {
        match self {
            DeviceRef::Gpu(g) => &g.uuid,
            DeviceRef::Mig { mig, .. } => &mig.uuid,
        }
    }

    /// The physical GPU.
    pub fn gpu(&self) -> &'a Gpu {
        match self {
            DeviceRef::Gpu(g) => g,
            DeviceRef::Mig { parent, .. } => parent,
        }
    }

    /// `gpu-<index>` or `gpu-<index>-mig-<profile letters and digits>-<gi>[-<ci>]`, e.g.
    /// `gpu-0-mig-1g10gb-7`; the GPU-instance id keeps two MIG devices of one profile apart.
    pub fn dra_name(&self) -> String {
        match self {
            DeviceRef::Gpu(g) => format!("gpu-{}", g.index),
            DeviceRef::Mig { parent, mig } => {
                let profile = profile_label(&mig.profile);
                let ci = if mig.compute_instance_id == 0 {
                    String::new()
                } else {
                    format!("-{}", mig.compute_instance_id)
                };
                format!(
                    "gpu-{}-mig-{}-{}{}",
                    parent.index, profile, mig.gpu_instance_id, ci
                )
            }
        }
    }
}

/// A MIG profile name as it appears in DRA device names: its letters and digits, lower case
/// (`1g.10gb+me` -> `1g10gbme`).
pub fn profile_label(profile: &str) -> String {
    profile
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect::<String>()
        .to_ascii_lowercase()
}

impl Inventory {
    /// Every DRA device: whole GPUs with MIG off, and the MIG devices of GPUs with MIG on (a
    /// partitioned GPU is not also offered whole: NVIDIA's driver did that and double-booked it).
    /// GPUs partitioned by dynamic MIG (`mig.dynamic`) are left out: the `dynamic_mig` module
    /// names their devices.
    pub fn dra_devices(&self) -> Vec<DeviceRef<'_>> {
        let mut out = Vec::new();
        for g in self.gpus.iter().filter(|g| !g.mig.dynamic) {
            if g.mig.current {
                out.extend(
                    g.mig_devices
                        .iter()
                        .map(|m| DeviceRef::Mig { parent: g, mig: m }),
                );
            } else {
                out.push(DeviceRef::Gpu(g));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_are_dns_labels_and_unique() {
        for p in crate::sim::bundled_names() {
            let inv = crate::sim::load(p).unwrap();
            let names: Vec<String> = inv.dra_devices().iter().map(|d| d.dra_name()).collect();
            let mut unique = names.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), names.len(), "{p}");
            for n in &names {
                assert!(
                    n.len() <= 63
                        && n.bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                    "{n}"
                );
            }
        }
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        assert_eq!(inv.dra_devices()[0].dra_name(), "gpu-0-mig-3g20gb-1");
        assert!(inv.dra_device("gpu-3").is_some());
        assert!(
            inv.dra_device("gpu-0").is_none(),
            "a MIG-enabled GPU is not offered whole"
        );
    }
}
