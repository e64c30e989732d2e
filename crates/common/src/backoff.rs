//! The one backoff every retry loop here uses: backon's exponential backoff, the crate
//! kube-runtime's watchers back off with (their `default_backoff`), set up once.
//!
//! Loops that keep a failure count per key (a namespace) ask [`after`]; loops that retry in
//! place take the iterator from [`exponential`]. Pauses are whole milliseconds: backon
//! multiplies in `f32`, which leaves nanosecond dust on every doubling.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Successive pauses, in whole milliseconds.
#[derive(Debug)]
pub struct Pauses(ExponentialBackoff);

impl Iterator for Pauses {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let d = self.0.next()?;
        let ms = (d.as_nanos() + 500_000) / 1_000_000;
        Some(Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
    }
}

/// Pauses of `first`, doubling per failure up to `cap`, without end.
pub fn exponential(first: Duration, cap: Duration) -> Pauses {
    Pauses(builder(first, cap).build())
}

/// Like [`exponential`], each pause stretched by up to its own length pseudo-randomly, so
/// many agents failing together do not retry in step.
pub fn jittered(first: Duration, cap: Duration) -> Pauses {
    Pauses(builder(first, cap).with_jitter().build())
}

/// The pause after the `failures`-th consecutive failure (counted from 1).
pub fn after(first: Duration, cap: Duration, failures: u32) -> Duration {
    // Past 32 doublings every pause is the cap anyway.
    let n = usize::try_from(failures.saturating_sub(1).min(32)).unwrap_or(32);
    exponential(first, cap).nth(n).unwrap_or(cap)
}

fn builder(first: Duration, cap: Duration) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(first.min(cap))
        .with_max_delay(cap)
        .with_factor(2.0)
        .without_max_times()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().copied().map(Duration::from_millis).collect()
    }

    #[test]
    fn pauses_double_up_to_the_cap_and_never_end() {
        let got: Vec<_> = exponential(Duration::from_millis(100), Duration::from_secs(1))
            .take(7)
            .collect();
        assert_eq!(got, ms(&[100, 200, 400, 800, 1000, 1000, 1000]));
        let n = exponential(Duration::from_millis(1), Duration::from_secs(1)).take(100);
        assert_eq!(n.count(), 100);
    }

    #[test]
    fn after_counts_failures_from_one() {
        let first = Duration::from_millis(200);
        let cap = Duration::from_secs(30);
        let got: Vec<_> = [0, 1, 2, 3, 9, 40, u32::MAX]
            .map(|n| after(first, cap, n))
            .into();
        assert_eq!(got, ms(&[200, 200, 400, 800, 30_000, 30_000, 30_000]));
    }

    #[test]
    fn jitter_stays_within_one_pause_above_the_plain_one() {
        let plain = exponential(Duration::from_millis(100), Duration::from_secs(2));
        let jittered = jittered(Duration::from_millis(100), Duration::from_secs(2));
        for (p, j) in plain.zip(jittered).take(10) {
            assert!(j >= p && j <= p * 2, "{j:?} vs {p:?}");
        }
    }

    #[test]
    fn a_first_pause_above_the_cap_is_the_cap() {
        assert_eq!(
            after(Duration::from_secs(5), Duration::from_secs(1), 1),
            Duration::from_secs(1)
        );
    }
}
