//! Charging what devices do to who holds them: a pure function from the latest samples, the
//! ledger's holders and each process's container to the rows a scrape exports.
//!
//! - Every device the node has gets a row, held or not, answering or not.
//! - A device with exactly one holder of the whole device carries that holder's labels on its
//!   own readings; a shared device (shares, time-sliced replicas) carries none there, because
//!   its readings are everyone's, and each container's part comes from its own processes.
//! - Each process is charged to its container, one row per (device, container): never per PID,
//!   so the series count is bounded by the containers holding devices. A container using a
//!   device it does not hold still shows, with an empty `api`; processes outside any pod are
//!   summed into one row with empty pod labels.

use super::{ProcessUse, Sample};
use crate::inventory::DeviceUuid;
use std::collections::BTreeMap;

/// How a device is named in every row.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceLabels {
    pub uuid: String,
    /// The GPU's index (a MIG device's parent's).
    pub gpu: String,
    /// The MIG profile (`1g.10gb`); empty for a whole GPU.
    pub mig_profile: String,
    /// The share of its GPU the device is, `(numerator, denominator)`: `(1, 1)` for a GPU,
    /// the quota's share for a MIG device (`1g.10gb` of a 7-slice GPU: `(1, 7)`); `(0, 0)`:
    /// unknown, taken as a whole GPU. Not exported as a label.
    pub gpu_share: (u64, u64),
}

impl DeviceLabels {
    /// [`Self::gpu_share`] in whole GPUs.
    pub fn whole_gpus(&self) -> f64 {
        match self.gpu_share {
            (_, 0) => 1.0,
            // Shares are small fractions (at most 7ths), exact in f64.
            #[allow(clippy::cast_precision_loss)]
            (n, d) => n as f64 / d as f64,
        }
    }
}

/// A pod's container, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Workload {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

/// One holder of a device, as exported: empty fields are unknown or do not apply.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hold {
    /// `device-plugin` or `dra`; empty for use without a hold.
    pub api: String,
    pub namespace: String,
    pub pod: String,
    /// Empty where the hold is the pod's or the claim's, not one container's.
    pub container: String,
    pub claim: String,
    /// The allocation's `shareID`; empty for a hold of the whole device.
    pub share: String,
}

impl Hold {
    /// Whether `w`'s processes run under this hold.
    fn covers(&self, w: &Workload) -> bool {
        self.namespace == w.namespace
            && self.pod == w.pod
            && !self.pod.is_empty()
            && (self.container.is_empty() || self.container == w.container)
    }
}

/// A device, its single whole-device holder (or none) and its sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRow {
    pub device: DeviceLabels,
    pub holder: Hold,
    pub sample: Sample,
}

/// One container's use of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    pub device: DeviceLabels,
    /// The hold it runs under, with the container filled in.
    pub holder: Hold,
    pub memory_bytes: u64,
    /// Summed over its processes, capped at 100; `None` where no process was sampled.
    pub sm_util_percent: Option<u32>,
}

/// Everything one scrape exports about devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributed {
    pub devices: Vec<DeviceRow>,
    /// Every holder of every device.
    pub holders: Vec<(DeviceLabels, Hold)>,
    pub usage: Vec<UsageRow>,
}

/// Attributes `samples` (by device UUID) over `devices` to `holds` (by device UUID), charging
/// each process to the container `containers` names for its PID. Devices without a sample yet
/// (the first round has not reached them) are left out until it does.
pub fn attribute(
    devices: &[(DeviceUuid, DeviceLabels)],
    samples: &BTreeMap<DeviceUuid, Sample>,
    holds: &BTreeMap<DeviceUuid, Vec<Hold>>,
    containers: &BTreeMap<u32, Workload>,
) -> Attributed {
    let mut out = Attributed::default();
    for (uuid, labels) in devices {
        let Some(sample) = samples.get(uuid) else {
            continue;
        };
        let device_holds = holds.get(uuid).map_or(&[][..], Vec::as_slice);
        let holder = match device_holds {
            [only] if only.share.is_empty() => only.clone(),
            _ => Hold::default(),
        };
        out.holders
            .extend(device_holds.iter().map(|h| (labels.clone(), h.clone())));
        if let Sample::Answered(r) = sample {
            out.usage
                .extend(usage(labels, &r.processes, device_holds, containers));
        }
        out.devices.push(DeviceRow {
            device: labels.clone(),
            holder,
            sample: sample.clone(),
        });
    }
    out
}

fn usage(
    device: &DeviceLabels,
    processes: &[ProcessUse],
    holds: &[Hold],
    containers: &BTreeMap<u32, Workload>,
) -> Vec<UsageRow> {
    let mut per: BTreeMap<Hold, (u64, Option<u32>)> = BTreeMap::new();
    for p in processes {
        let holder = match containers.get(&p.pid) {
            Some(w) => {
                let mut h = holds
                    .iter()
                    .find(|h| h.covers(w))
                    .cloned()
                    .unwrap_or_default();
                h.namespace.clone_from(&w.namespace);
                h.pod.clone_from(&w.pod);
                h.container.clone_from(&w.container);
                h
            }
            None => Hold::default(),
        };
        let e = per.entry(holder).or_default();
        e.0 += p.memory_bytes.unwrap_or(0);
        if let Some(u) = p.sm_util_percent {
            e.1 = Some(e.1.unwrap_or(0).saturating_add(u).min(100));
        }
    }
    per.into_iter()
        .map(|(holder, (memory_bytes, sm_util_percent))| UsageRow {
            device: device.clone(),
            holder,
            memory_bytes,
            sm_util_percent,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Readings;

    fn uuid(name: &str) -> DeviceUuid {
        let tag = if name == "GPU-a" { 'a' } else { 'b' };
        DeviceUuid::parse(format!("GPU-0000000{tag}-0000-0000-0000-000000000000")).unwrap()
    }

    fn device(name: &str) -> (DeviceUuid, DeviceLabels) {
        (
            uuid(name),
            DeviceLabels {
                uuid: name.into(),
                gpu: "0".into(),
                mig_profile: String::new(),
                gpu_share: (1, 1),
            },
        )
    }

    fn workload(ns: &str, pod: &str, c: &str) -> Workload {
        Workload {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
        }
    }

    fn share(claim: &str, pod: &str, share: &str) -> Hold {
        Hold {
            api: "dra".into(),
            namespace: "ml".into(),
            pod: pod.into(),
            claim: claim.into(),
            share: share.into(),
            ..Hold::default()
        }
    }

    fn answered(processes: &[(u32, u64, Option<u32>)]) -> Sample {
        Sample::Answered(Readings {
            gpu_util_percent: Some(70),
            processes: processes
                .iter()
                .map(|&(pid, m, u)| ProcessUse {
                    pid,
                    memory_bytes: Some(m),
                    sm_util_percent: u,
                })
                .collect(),
            ..Readings::default()
        })
    }

    #[test]
    fn two_shares_of_one_gpu_are_charged_each_its_own_processes() {
        let devices = [device("GPU-a")];
        let samples = BTreeMap::from([(
            uuid("GPU-a"),
            answered(&[
                (10, 3, Some(40)),
                (11, 1, Some(5)),
                (20, 7, Some(25)),
                (99, 2, None),
            ]),
        )]);
        let holds = BTreeMap::from([(
            uuid("GPU-a"),
            vec![share("c1", "p1", "s1"), share("c2", "p2", "s2")],
        )]);
        let containers = BTreeMap::from([
            (10, workload("ml", "p1", "main")),
            (11, workload("ml", "p1", "main")),
            (20, workload("ml", "p2", "train")),
        ]);
        let a = attribute(&devices, &samples, &holds, &containers);
        assert_eq!(
            a.devices[0].holder,
            Hold::default(),
            "a shared GPU's own readings are no one's"
        );
        assert_eq!(a.holders.len(), 2);
        let rows: Vec<(String, String, String, u64, Option<u32>)> = a
            .usage
            .iter()
            .map(|u| {
                (
                    u.holder.pod.clone(),
                    u.holder.container.clone(),
                    u.holder.share.clone(),
                    u.memory_bytes,
                    u.sm_util_percent,
                )
            })
            .collect();
        assert_eq!(
            rows,
            vec![
                (String::new(), String::new(), String::new(), 2, None),
                ("p1".into(), "main".into(), "s1".into(), 4, Some(45)),
                ("p2".into(), "train".into(), "s2".into(), 7, Some(25)),
            ]
        );
    }

    #[test]
    fn a_whole_gpu_holder_labels_the_readings_and_an_unheld_user_shows_without_an_api() {
        let devices = [device("GPU-a"), device("GPU-b")];
        let hold = Hold {
            api: "device-plugin".into(),
            namespace: "ml".into(),
            pod: "p1".into(),
            container: "main".into(),
            ..Hold::default()
        };
        let samples = BTreeMap::from([
            (uuid("GPU-a"), answered(&[(10, 3, None), (30, 1, None)])),
            (uuid("GPU-b"), Sample::Failed("GPU is lost".into())),
        ]);
        let holds = BTreeMap::from([(uuid("GPU-a"), vec![hold.clone()])]);
        let containers = BTreeMap::from([
            (10, workload("ml", "p1", "main")),
            (30, workload("other", "sneaky", "c")),
        ]);
        let a = attribute(&devices, &samples, &holds, &containers);
        assert_eq!(a.devices[0].holder, hold);
        assert_eq!(
            a.devices[1].sample,
            Sample::Failed("GPU is lost".into()),
            "a failing device is kept"
        );
        assert_eq!(a.usage[0].holder.api, "", "{:?}", a.usage);
        assert_eq!(a.usage[0].holder.pod, "sneaky");
        assert_eq!(a.usage[1].holder, hold);
    }

    #[test]
    fn a_device_not_sampled_yet_is_left_out() {
        let a = attribute(
            &[device("GPU-a")],
            &BTreeMap::new(),
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert!(a.devices.is_empty());
    }
}
