//! Busy seconds per hold (pure): each sampling round, every hold present in the round before
//! too adds its busyness ([`HeldUse::busy_percent`]) in whole GPUs (a MIG device's utilization
//! times its share of the GPU) times the time since that round. A counter only ever grows while its hold lasts, and stays [`LINGER`] after the
//! hold ends so that a scrape reads its last value; the controller books what Prometheus kept
//! of it (busy GPU-hours). A hold whose busyness is unknown (a MIG device without per-process
//! samples) adds nothing.

use super::attribute::{DeviceLabels, Hold};
use super::idle::HeldUse;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long a counter is kept after its hold ended: past Prometheus' lookback (5m) and any
/// scrape interval, so its last value is scraped.
pub const LINGER: Duration = Duration::from_secs(600);

/// Busy seconds per (device, hold), with when the hold was last seen.
#[derive(Debug, Default)]
pub struct BusyCounters {
    last_round: Option<Instant>,
    totals: BTreeMap<(DeviceLabels, Hold), (f64, Instant)>,
}

impl BusyCounters {
    /// Takes one round's `uses` at `now`.
    pub fn observe(&mut self, uses: &[HeldUse], now: Instant) {
        let since = self
            .last_round
            .map_or(Duration::ZERO, |l| now.saturating_duration_since(l));
        for u in uses {
            let key = (u.device.clone(), u.holder.clone());
            let held_before = self
                .totals
                .get(&key)
                .is_some_and(|(_, seen)| Some(*seen) == self.last_round);
            let e = self.totals.entry(key).or_insert((0.0, now));
            if held_before {
                if let Some(p) = u.busy_percent {
                    let scale = if u.busy_of_device {
                        u.device.whole_gpus()
                    } else {
                        1.0
                    };
                    e.0 += f64::from(p.min(100)) / 100.0 * scale * since.as_secs_f64();
                }
            }
            e.1 = now;
        }
        self.totals
            .retain(|_, (_, seen)| now.saturating_duration_since(*seen) <= LINGER);
        self.last_round = Some(now);
    }

    /// Every counter: device, hold, busy seconds.
    pub fn totals(&self) -> Vec<(DeviceLabels, Hold, f64)> {
        self.totals
            .iter()
            .map(|((d, h), (s, _))| (d.clone(), h.clone(), *s))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::telemetry::idle::held_use as used;

    #[test]
    fn a_hold_adds_its_busyness_times_the_time_since_the_round_before() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut c = BusyCounters::default();
        // First seen: nothing yet (it may have begun just now).
        c.observe(&[used("p", Some(80))], at(0));
        assert_eq!(c.totals()[0].2, 0.0);
        c.observe(&[used("p", Some(80))], at(10));
        c.observe(&[used("p", None)], at(20));
        c.observe(&[used("p", Some(50)), used("q", Some(100))], at(30));
        let t = c.totals();
        assert_eq!(t.len(), 2);
        assert!((t[0].2 - 13.0).abs() < 1e-9, "{t:?}");
        assert_eq!(t[1].2, 0.0, "q is new this round");
        // Gone: kept unchanged for LINGER, then dropped; back later, it starts over.
        c.observe(&[], at(40));
        assert!((c.totals()[0].2 - 13.0).abs() < 1e-9);
        c.observe(&[], at(40 + LINGER.as_secs()));
        assert_eq!(c.totals().len(), 0);
    }

    #[test]
    fn a_mig_device_counts_its_share_of_the_gpu_and_process_use_counts_as_is() {
        let t0 = Instant::now();
        let mut mig = used("m", Some(70));
        mig.device.mig_profile = "1g.10gb".into();
        mig.device.gpu_share = (1, 7);
        let mut share = used("s", Some(30));
        share.device.uuid = "GPU-2".into();
        share.busy_of_device = false;
        share.device.gpu_share = (1, 7);
        let mut c = BusyCounters::default();
        c.observe(&[mig.clone(), share.clone()], t0);
        c.observe(&[mig, share], t0 + Duration::from_secs(10));
        let t = c.totals();
        // 70% of a seventh for 10 s; 30% of the GPU's SMs for 10 s.
        assert!((t[0].2 - 1.0).abs() < 1e-9, "{t:?}");
        assert!((t[1].2 - 3.0).abs() < 1e-9, "{t:?}");
    }
}
