//! Idle held devices: a device someone holds while it does (almost) nothing. Pure: the shell
//! feeds each sampling round's attributed readings and the clock, and posts what this says.
//!
//! How busy a hold is: for a holder of the whole device, the device's utilization where NVML
//! offers it; on a MIG device (no utilization counters) or for a share, the SM use of the
//! holder's own processes, and 0 when it runs none. Where processes run but none is sampled,
//! busyness is unknown and the hold is never called idle.

use super::attribute::{Attributed, DeviceLabels, Hold};
use super::Sample;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// When a hold counts as idle: under `below_percent` busy for `after` without a break.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdlePolicy {
    pub below_percent: u32,
    pub after: Duration,
}

/// One hold's use of its device in one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldUse {
    pub device: DeviceLabels,
    pub holder: Hold,
    /// Percent busy; `None`: unknown.
    pub busy_percent: Option<u32>,
    /// `busy_percent` is the device's own utilization (of the device: a MIG device's share of
    /// its GPU scales it to whole GPUs), not its processes' SM use (already of the whole GPU).
    pub busy_of_device: bool,
    pub memory_used: Option<u64>,
    pub memory_total: Option<u64>,
}

/// Every hold of an answering device, with how busy it is.
pub fn held_uses(a: &Attributed) -> Vec<HeldUse> {
    let mut out = Vec::new();
    for row in &a.devices {
        let Sample::Answered(r) = &row.sample else {
            continue;
        };
        let holds: Vec<&Hold> = a
            .holders
            .iter()
            .filter(|(d, _)| *d == row.device)
            .map(|(_, h)| h)
            .collect();
        let whole = !row.holder.api.is_empty();
        for hold in holds {
            let mine: Vec<_> = a
                .usage
                .iter()
                .filter(|u| u.device == row.device)
                .filter(|u| {
                    u.holder.namespace == hold.namespace
                        && u.holder.pod == hold.pod
                        && (hold.container.is_empty() || u.holder.container == hold.container)
                })
                .collect();
            let own = if mine.is_empty() {
                Some(0)
            } else if mine.iter().all(|u| u.sm_util_percent.is_some()) {
                Some(
                    mine.iter()
                        .filter_map(|u| u.sm_util_percent)
                        .sum::<u32>()
                        .min(100),
                )
            } else {
                None
            };
            let (busy_percent, memory_used) = match (whole, r.gpu_util_percent) {
                (true, Some(util)) => (Some(util), r.memory_used_bytes),
                (true, None) => (own, r.memory_used_bytes),
                (false, _) => (own, Some(mine.iter().map(|u| u.memory_bytes).sum())),
            };
            let busy_of_device = whole && r.gpu_util_percent.is_some();
            out.push(HeldUse {
                device: row.device.clone(),
                holder: hold.clone(),
                busy_percent,
                busy_of_device,
                memory_used,
                memory_total: r.memory_total_bytes,
            });
        }
    }
    out
}

/// Since when each hold has been idle, and whether it was reported.
#[derive(Debug, Default)]
pub struct IdleBook {
    since: BTreeMap<(DeviceLabels, Hold), (Instant, bool)>,
}

/// What one round of [`IdleBook::observe`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct IdleRound {
    /// Every hold and how long it has been idle (zero when busy).
    pub idle_for: Vec<(HeldUse, Duration)>,
    /// Holds idle for the policy's window that were not reported before: one report each.
    pub newly_idle: Vec<(HeldUse, Duration)>,
}

impl IdleBook {
    /// Takes this round's `uses` at `now`. A hold that is gone or busy starts over.
    pub fn observe(&mut self, uses: &[HeldUse], policy: &IdlePolicy, now: Instant) -> IdleRound {
        let mut round = IdleRound::default();
        let mut next = BTreeMap::new();
        for u in uses {
            let key = (u.device.clone(), u.holder.clone());
            let idle = u.busy_percent.is_some_and(|b| b < policy.below_percent);
            if !idle {
                round.idle_for.push((u.clone(), Duration::ZERO));
                continue;
            }
            let (since, reported) = self.since.get(&key).copied().unwrap_or((now, false));
            let idle_for = now.saturating_duration_since(since);
            let report = !reported && idle_for >= policy.after;
            if report {
                round.newly_idle.push((u.clone(), idle_for));
            }
            round.idle_for.push((u.clone(), idle_for));
            next.insert(key, (since, reported || report));
        }
        self.since = next;
        round
    }
}

/// The Event note for an idle hold: "GPU idle 30m: 0% busy, 1.2 GiB of 80 GiB used".
pub fn idle_note(u: &HeldUse, idle_for: Duration) -> String {
    let what = if u.device.mig_profile.is_empty() {
        format!("GPU {}", u.device.gpu)
    } else {
        format!(
            "MIG device {} on GPU {}",
            u.device.mig_profile, u.device.gpu
        )
    };
    let idle = humantime::format_duration(Duration::from_secs(idle_for.as_secs()));
    // GiB with one decimal, as nvidia-smi users read memory.
    #[allow(clippy::cast_precision_loss)]
    let bytes = |b: u64| format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30));
    let memory = match (u.memory_used, u.memory_total) {
        (Some(used), Some(total)) => format!(", {} of {} used", bytes(used), bytes(total)),
        _ => String::new(),
    };
    format!(
        "{what} ({}) idle {idle}: {}% busy{memory}; release it if the workload no longer needs it",
        u.device.uuid,
        u.busy_percent.unwrap_or(0)
    )
}

/// A whole GPU held through DRA by pod `pod` in `ml`, `busy` percent busy, 1 of 80 GiB used.
#[cfg(test)]
pub(crate) fn held_use(pod: &str, busy: Option<u32>) -> HeldUse {
    HeldUse {
        device: DeviceLabels {
            uuid: "GPU-1".into(),
            gpu: "0".into(),
            mig_profile: String::new(),
            gpu_share: (1, 1),
        },
        holder: Hold {
            api: "dra".into(),
            namespace: "ml".into(),
            pod: pod.into(),
            ..Hold::default()
        },
        busy_percent: busy,
        busy_of_device: true,
        memory_used: Some(1 << 30),
        memory_total: Some(80 << 30),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(busy: Option<u32>) -> HeldUse {
        held_use("p", busy)
    }

    #[test]
    fn a_hold_idle_for_the_window_is_reported_once_and_a_busy_round_starts_it_over() {
        let policy = IdlePolicy {
            below_percent: 5,
            after: Duration::from_secs(60),
        };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut book = IdleBook::default();
        assert!(book
            .observe(&[used(Some(0))], &policy, at(0))
            .newly_idle
            .is_empty());
        assert!(book
            .observe(&[used(Some(2))], &policy, at(59))
            .newly_idle
            .is_empty());
        let r = book.observe(&[used(Some(0))], &policy, at(60));
        assert_eq!(r.newly_idle.len(), 1);
        assert_eq!(r.idle_for[0].1, Duration::from_secs(60));
        assert!(
            book.observe(&[used(Some(0))], &policy, at(120))
                .newly_idle
                .is_empty(),
            "once"
        );
        // Busy, then idle again: a new stretch, reported again after a full window.
        book.observe(&[used(Some(50))], &policy, at(130));
        assert!(book
            .observe(&[used(Some(0))], &policy, at(140))
            .newly_idle
            .is_empty());
        assert_eq!(
            book.observe(&[used(Some(0))], &policy, at(200))
                .newly_idle
                .len(),
            1
        );
        // Unknown busyness is never idle.
        let mut fresh = IdleBook::default();
        fresh.observe(&[used(None)], &policy, at(0));
        assert!(fresh
            .observe(&[used(None)], &policy, at(600))
            .newly_idle
            .is_empty());
    }

    #[test]
    fn the_note_says_how_long_how_busy_and_how_much_memory() {
        let note = idle_note(&used(Some(0)), Duration::from_secs(1800));
        assert!(
            note.starts_with("GPU 0 (GPU-1) idle 30m: 0% busy, 1.0 GiB of 80.0 GiB used"),
            "{note}"
        );
    }
}
