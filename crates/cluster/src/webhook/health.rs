//! What `/healthz` and `/readyz` of `gpuplane controller` say, from state the webhook's tasks
//! keep current: whether the HTTPS listener serves, when the API server last answered the
//! probe (a GpuQuota list and a watch opened from it, every [`ProbeSettings::interval`]), the
//! caches' last watch error, and this replica's part in leader election.
//!
//! `/readyz` fails (503) only while the webhook does not serve. With the API server away the
//! replica stays ready and says so in the body: the webhook keeps answering from its caches,
//! and taking every replica out of the Service at once would turn an API outage into denying
//! every pod in scope (`failurePolicy: Fail`), including those the caches can answer.
//! `/healthz` only says whether the probe loop turns (the runtime schedules tasks and timers).

use crate::elector::Role;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How often the API server is probed, and how long without an answer counts as away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeSettings {
    pub interval: Duration,
    /// The API server is away when no probe succeeded for this long (also each probe's
    /// timeout).
    pub stale_after: Duration,
}

impl Default for ProbeSettings {
    fn default() -> Self {
        ProbeSettings {
            interval: Duration::from_secs(5),
            stale_after: Duration::from_secs(20),
        }
    }
}

impl ProbeSettings {
    /// The probe loop counts as stalled when it has not turned for this long: twice its
    /// longest iteration (a pause and a probe that times out).
    pub fn stalled_after(&self) -> Duration {
        (self.interval + self.stale_after) * 2
    }
}

#[derive(Debug)]
struct State {
    heartbeat: Instant,
    last_ok: Option<Instant>,
    last_error: Option<String>,
    watch_error: Option<(Instant, &'static str, String)>,
}

/// Shared by the webhook's tasks; read by the probe handlers.
#[derive(Debug)]
pub struct Probes {
    settings: ProbeSettings,
    serving: AtomicBool,
    role: Option<watch::Receiver<Role>>,
    state: Mutex<State>,
}

/// What the probes report at one moment (plain data; [`readyz`] and [`healthz`] render it).
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub serving: bool,
    /// Time since the API server last answered a probe; `None`: never.
    pub since_contact: Option<Duration>,
    /// Why the last failed probe failed, if the last probe failed.
    pub last_error: Option<String>,
    /// The caches' last watch error: how long ago, which resource, what.
    pub watch_error: Option<(Duration, &'static str, String)>,
    /// `None`: no quota loops in this process (the webhook alone).
    pub role: Option<Role>,
    pub since_heartbeat: Duration,
}

impl Probes {
    /// `role` follows the Lease elector of the loops beside the webhook, if any.
    pub fn new(settings: ProbeSettings, role: Option<watch::Receiver<Role>>) -> Probes {
        Probes {
            settings,
            serving: AtomicBool::new(false),
            role,
            state: Mutex::new(State {
                heartbeat: Instant::now(),
                last_ok: None,
                last_error: None,
                watch_error: None,
            }),
        }
    }

    pub fn settings(&self) -> ProbeSettings {
        self.settings
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::Relaxed);
    }

    /// The probe loop turned.
    pub fn heartbeat(&self) {
        self.lock().heartbeat = Instant::now();
    }

    /// The API server answered.
    pub fn api_ok(&self) {
        let mut s = self.lock();
        s.last_ok = Some(Instant::now());
        s.last_error = None;
    }

    pub fn api_failed(&self, error: String) {
        self.lock().last_error = Some(error);
    }

    /// A cache's watch failed (it retries with backoff).
    pub fn watch_failed(&self, resource: &'static str, error: String) {
        self.lock().watch_error = Some((Instant::now(), resource, error));
    }

    pub fn view(&self) -> View {
        let now = Instant::now();
        let s = self.lock();
        View {
            serving: self.serving.load(Ordering::Relaxed),
            since_contact: s.last_ok.map(|t| now.duration_since(t)),
            last_error: s.last_error.clone(),
            watch_error: s
                .watch_error
                .as_ref()
                .map(|(t, r, e)| (now.duration_since(*t), *r, e.clone())),
            role: self.role.as_ref().map(|r| r.borrow().clone()),
            since_heartbeat: now.duration_since(s.heartbeat),
        }
    }

    /// Whether the API server answered a probe within the bound.
    pub fn api_reachable(&self) -> bool {
        reachable(&self.view(), &self.settings)
    }
}

fn reachable(v: &View, s: &ProbeSettings) -> bool {
    v.since_contact.is_some_and(|d| d <= s.stale_after)
}

/// `/readyz`: whether ready (200, else 503) and a plain-text body, one fact a line.
pub fn readyz(v: &View, s: &ProbeSettings) -> (bool, String) {
    let api = reachable(v, s);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}",
        match (v.serving, api) {
            (false, _) => "not ready: the webhook is not serving",
            (true, true) => "ready",
            (true, false) =>
                "ready, degraded: the API server is away; answering from the last known state",
        }
    );
    let _ = writeln!(
        out,
        "webhook: {}",
        if v.serving { "serving" } else { "not serving" }
    );
    match (api, v.since_contact) {
        (true, Some(d)) => {
            let _ = writeln!(
                out,
                "api: reachable (last answer {:.1}s ago)",
                d.as_secs_f64()
            );
        }
        (_, since) => {
            let since = since.map_or("never answered".to_string(), |d| {
                format!("no answer for {:.1}s", d.as_secs_f64())
            });
            let why = v
                .last_error
                .as_deref()
                .map_or(String::new(), |e| format!("; last error: {e}"));
            let _ = writeln!(
                out,
                "api: away ({since}{why}); answering from the last known state: pods without GPU \
                 requests and pods of namespaces without a GpuQuota are admitted, GPU pods under a \
                 GpuQuota are denied until it is back"
            );
        }
    }
    if let Some((ago, resource, e)) = v.watch_error.as_ref().filter(|w| w.0 <= s.stale_after) {
        let _ = writeln!(
            out,
            "watches: {resource} failed {:.1}s ago (retrying): {e}",
            ago.as_secs_f64()
        );
    }
    let _ = writeln!(
        out,
        "role: {}",
        match &v.role {
            None => "none (no quota loops in this process)".to_string(),
            Some(Role::Leader) => "leader (runs the quota loops)".to_string(),
            Some(Role::Follower(Some(h))) => format!("follower (leader: {h})"),
            Some(Role::Follower(None)) => "follower (no leader seen)".to_string(),
        }
    );
    (v.serving, out)
}

/// `/healthz`: whether alive (200, else 503) and a one-line body.
pub fn healthz(v: &View, s: &ProbeSettings) -> (bool, String) {
    if v.since_heartbeat > s.stalled_after() {
        return (
            false,
            format!(
                "stalled: the probe loop has not turned for {:.1}s\n",
                v.since_heartbeat.as_secs_f64()
            ),
        );
    }
    (true, "ok\n".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> View {
        View {
            serving: true,
            since_contact: Some(Duration::from_millis(100)),
            last_error: None,
            watch_error: None,
            role: Some(Role::Leader),
            since_heartbeat: Duration::from_secs(1),
        }
    }

    #[test]
    fn serving_with_the_api_reachable_is_ready_and_names_the_role() {
        let (ok, body) = readyz(&view(), &ProbeSettings::default());
        assert!(ok);
        assert_eq!(
            body,
            "ready\nwebhook: serving\napi: reachable (last answer 0.1s ago)\nrole: leader (runs the quota loops)\n"
        );
    }

    #[test]
    fn an_api_away_past_the_bound_is_reported_but_stays_ready() {
        let s = ProbeSettings::default();
        let v = View {
            since_contact: Some(s.stale_after + Duration::from_secs(1)),
            last_error: Some("connection refused".into()),
            watch_error: Some((Duration::from_secs(2), "gpuquotas", "500".into())),
            role: Some(Role::Follower(None)),
            ..view()
        };
        let (ok, body) = readyz(&v, &s);
        assert!(ok, "{body}");
        assert!(
            body.starts_with("ready, degraded: the API server is away"),
            "{body}"
        );
        assert!(
            body.contains("api: away (no answer for 21.0s; last error: connection refused)"),
            "{body}"
        );
        assert!(
            body.contains("watches: gpuquotas failed 2.0s ago (retrying): 500\n"),
            "{body}"
        );
        assert!(
            body.ends_with("role: follower (no leader seen)\n"),
            "{body}"
        );
    }

    #[test]
    fn not_serving_is_not_ready() {
        let v = View {
            serving: false,
            since_contact: None,
            role: None,
            ..view()
        };
        let (ok, body) = readyz(&v, &ProbeSettings::default());
        assert!(!ok);
        assert!(body.starts_with("not ready: the webhook is not serving\nwebhook: not serving\napi: away (never answered)"), "{body}");
        assert!(
            body.ends_with("role: none (no quota loops in this process)\n"),
            "{body}"
        );
    }

    #[test]
    fn a_stalled_probe_loop_fails_liveness() {
        let s = ProbeSettings::default();
        assert_eq!(healthz(&view(), &s), (true, "ok\n".to_string()));
        let v = View {
            since_heartbeat: s.stalled_after() + Duration::from_secs(1),
            ..view()
        };
        let (ok, body) = healthz(&v, &s);
        assert!(!ok);
        assert!(
            body.starts_with("stalled: the probe loop has not turned for 51.0s"),
            "{body}"
        );
    }
}
