//! Helpers shared by the benchmarks: percentiles and the "figure next to its floor" row.

use std::time::Duration;

/// p50 and p99 of the samples.
pub fn percentiles(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.50), at(0.99))
}

/// Prints a figure next to the floor measured in the same run, and the ratio.
pub fn row(what: &str, (p50, p99): (Duration, Duration), floor: (Duration, Duration)) {
    println!(
        "{what:<56} p50 {:>9.1?} p99 {:>9.1?} | floor p50 {:>9.1?} p99 {:>9.1?} | ratio p50 {:>5.2}x p99 {:>5.2}x",
        p50,
        p99,
        floor.0,
        floor.1,
        p50.as_secs_f64() / floor.0.as_secs_f64(),
        p99.as_secs_f64() / floor.1.as_secs_f64()
    );
}
