//! The quota's times: RFC 3339 to the second, as the API server writes them, and ages that
//! tolerate clocks apart. Below `status` and `escrow`, which both read them.

use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

/// Now, to the second, as RFC 3339 (`2025-01-02T03:04:05Z`).
pub fn now_rfc3339() -> String {
    rfc3339(Timestamp::now())
}

/// How long before `now` the time `since` was; `None` when it is later (clocks apart).
pub fn age(since: Timestamp, now: Timestamp) -> Option<Duration> {
    let ms = now.as_millisecond().checked_sub(since.as_millisecond())?;
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// `t` to the second, as RFC 3339.
pub fn rfc3339(t: Timestamp) -> String {
    Timestamp::from_second(t.as_second())
        .unwrap_or(t)
        .to_string()
}
