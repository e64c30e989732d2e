//! Events on ResourceClaims for the prepare failures a user must see (a device the other API
//! holds, a bad opaque config, an unhealthy device): the kubelet's own Event on the pod
//! carries the error text, but not on the claim and not what to do about it.
//!
//! The DRA core decides which failures those are ([`PrepareError::user_event`]); this shell
//! posts them as `events.k8s.io/v1` Events regarding the claim (reporting controller: the
//! driver name; instance: the node name), best-effort (a failed write is logged and never
//! fails the prepare) and deduplicated, since the kubelet retries a failed prepare for as long
//! as the pod exists: the same reason and note for the same claim is posted once per window.
//!
//! [`PrepareError::user_event`]: crate::dra::core::PrepareError::user_event

use crate::dra::core::{PrepareError, UnprepareError, UserEvent};
use crate::dra::{ClaimRef, ClaimUid, DeviceHealthReport, DraDriver, PreparedDevice};
use crate::kube_events::Reporter;
use crate::metrics::{AgentCounters, ClaimEvent as ClaimEventOutcome};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tracing::{debug, warn};

/// The same Event for the same claim is posted at most once per this long.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(600);
/// Longest wait for one Event write; the write runs beside the prepare, never in its way.
const POST_TIMEOUT: Duration = Duration::from_secs(30);
/// Claims remembered at most; a node prepares far fewer at once.
const MAX_REMEMBERED: usize = 4096;

/// (claim UID, reason, note).
type Key = (String, &'static str, String);

/// Which Events were posted lately. Pure: the caller passes the clock.
#[derive(Debug)]
struct Dedup {
    window: Duration,
    posted: HashMap<Key, Instant>,
}

impl Dedup {
    fn new(window: Duration) -> Dedup {
        Dedup {
            window,
            posted: HashMap::new(),
        }
    }

    /// Whether `key` may be posted now (and records that it is).
    fn admit(&mut self, key: Key, now: Instant) -> bool {
        if self
            .posted
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < self.window)
        {
            return false;
        }
        if self.posted.len() >= MAX_REMEMBERED {
            let window = self.window;
            self.posted.retain(|_, at| now.duration_since(*at) < window);
            if self.posted.len() >= MAX_REMEMBERED {
                if let Some(oldest) = self
                    .posted
                    .iter()
                    .min_by_key(|(_, at)| **at)
                    .map(|(k, _)| k.clone())
                {
                    self.posted.remove(&oldest);
                }
            }
        }
        self.posted.insert(key, now);
        true
    }

    /// Forgets `key`, so the next occurrence is posted again (its write failed).
    fn forget(&mut self, key: &Key) {
        self.posted.remove(key);
    }
}

fn lock(m: &Mutex<Dedup>) -> MutexGuard<'_, Dedup> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The Event object for one failure of `claim`. Pure.
pub fn claim_event(
    claim: &ClaimRef,
    event: &UserEvent,
    driver: &str,
    node: &str,
    now: Timestamp,
) -> Event {
    // Event names are DNS subdomains (<= 253 characters); upstream's recorders name them
    // `<object>.<unix nanos in hex>`.
    let stem: String = claim.name.chars().take(200).collect();
    let regarding = ObjectReference {
        api_version: Some("resource.k8s.io/v1".into()),
        kind: Some("ResourceClaim".into()),
        namespace: Some(claim.namespace.to_string()),
        name: Some(claim.name.to_string()),
        uid: Some(claim.uid.to_string()),
        ..ObjectReference::default()
    };
    let reporter = Reporter { driver, node };
    let name = format!("{stem}.{:x}", now.as_nanosecond());
    reporter.event(
        name,
        regarding,
        ("PrepareResources", event.reason),
        &event.note,
        now,
    )
}

/// Posts Events on ResourceClaims. Cheap to clone.
#[derive(Clone)]
pub struct ClaimEvents {
    client: kube::Client,
    driver: String,
    node: String,
    dedup: Arc<Mutex<Dedup>>,
    /// The agent's counters: each Event posted, deduplicated or failed is counted there.
    counters: AgentCounters,
}

impl ClaimEvents {
    pub fn new(
        client: kube::Client,
        driver: &str,
        node: &str,
        counters: AgentCounters,
    ) -> ClaimEvents {
        ClaimEvents {
            client,
            driver: driver.into(),
            node: node.into(),
            dedup: Arc::new(Mutex::new(Dedup::new(DEFAULT_WINDOW))),
            counters,
        }
    }

    /// Posts `event` about `claim` in the background, unless the same was posted within the
    /// window (counted as deduplicated before this returns). Needs a tokio runtime.
    pub fn report(&self, claim: &ClaimRef, event: &UserEvent) {
        let key: Key = (claim.uid.to_string(), event.reason, event.note.clone());
        if !lock(&self.dedup).admit(key.clone(), Instant::now()) {
            debug!(claim = %format!("{}/{}", claim.namespace, claim.name), reason = event.reason,
                "Event already posted lately; not posting it again");
            self.counters.claim_event(ClaimEventOutcome::Deduplicated);
            return;
        }
        let object = claim_event(claim, event, &self.driver, &self.node, Timestamp::now());
        let api: Api<Event> = Api::namespaced(self.client.clone(), &claim.namespace);
        let dedup = self.dedup.clone();
        let counters = self.counters.clone();
        let label = format!("{}/{}", claim.namespace, claim.name);
        let reason = event.reason;
        tokio::spawn(async move {
            let failed = match tokio::time::timeout(
                POST_TIMEOUT,
                api.create(&PostParams::default(), &object),
            )
            .await
            {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {POST_TIMEOUT:?}")),
            };
            match failed {
                None => counters.claim_event(ClaimEventOutcome::Posted),
                Some(error) => {
                    warn!(claim = %label, reason, error = %error,
                        "posting an Event on the ResourceClaim failed; the next failure posts it again");
                    lock(&dedup).forget(&key);
                    counters.claim_event(ClaimEventOutcome::Failed);
                }
            }
        });
    }
}

/// A DRA driver as the kubelet sees it, plus Events for the failures users must see.
pub struct ReportingDriver<D> {
    inner: D,
    events: ClaimEvents,
}

impl<D: DraDriver> ReportingDriver<D> {
    pub fn new(inner: D, events: ClaimEvents) -> ReportingDriver<D> {
        ReportingDriver { inner, events }
    }
}

#[async_trait::async_trait]
impl<D: DraDriver> DraDriver for ReportingDriver<D> {
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<Vec<PreparedDevice>, PrepareError>> {
        let asked: Vec<ClaimRef> = claims.clone();
        let out = self.inner.prepare(claims).await;
        for c in &asked {
            match out.get(&c.uid) {
                // Prepared, but the user must know if a share's limits are not enforced.
                Some(Ok(_)) => {
                    if let Some(event) = self.inner.share_notice(&c.uid).await {
                        self.events.report(c, &event);
                    }
                }
                Some(Err(e)) => {
                    if let Some(event) = e.user_event() {
                        self.events.report(c, &event);
                    }
                }
                None => {}
            }
        }
        out
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<(), UnprepareError>> {
        self.inner.unprepare(claims).await
    }

    fn device_health(&self) -> Vec<DeviceHealthReport> {
        self.inner.device_health()
    }

    fn health_changes(&self) -> watch::Receiver<u64> {
        self.inner.health_changes()
    }

    async fn share_notice(&self, uid: &ClaimUid) -> Option<UserEvent> {
        self.inner.share_notice(uid).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(uid: &str, note: &str) -> Key {
        (uid.into(), "DeviceInUse", note.into())
    }

    #[test]
    fn the_same_event_is_posted_once_per_window_and_a_new_one_at_once() {
        let mut d = Dedup::new(Duration::from_secs(600));
        let t0 = Instant::now();
        assert!(d.admit(key("a", "x"), t0));
        assert!(!d.admit(key("a", "x"), t0 + Duration::from_secs(30)));
        // Another note (a new problem) or another claim is news.
        assert!(d.admit(key("a", "y"), t0 + Duration::from_secs(31)));
        assert!(d.admit(key("b", "x"), t0 + Duration::from_secs(32)));
        // Once the window passed, a reminder.
        assert!(d.admit(key("a", "x"), t0 + Duration::from_secs(601)));
        // A failed write is forgotten, so the next retry posts it.
        d.forget(&key("b", "x"));
        assert!(d.admit(key("b", "x"), t0 + Duration::from_secs(40)));
    }

    #[test]
    fn memory_stays_bounded() {
        let mut d = Dedup::new(Duration::from_secs(600));
        let t0 = Instant::now();
        for i in 0..(MAX_REMEMBERED + 10) {
            assert!(d.admit(
                key(&i.to_string(), "x"),
                t0 + Duration::from_millis(i as u64)
            ));
        }
        assert!(d.posted.len() <= MAX_REMEMBERED);
        // The newest are remembered.
        assert!(!d.admit(key(&(MAX_REMEMBERED + 9).to_string(), "x"), t0));
    }

    #[test]
    fn the_event_regards_the_claim_and_names_the_reporter() {
        let c = ClaimRef::parse("team-a", "0b5c", "train").unwrap();
        let ev = UserEvent {
            reason: "DeviceUnhealthy",
            note: "device gpu-0 is unhealthy: delete the pod.".into(),
        };
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let e = claim_event(&c, &ev, "gpu.gpuplane.dev", "node-a", now);
        let r = e.regarding.unwrap();
        assert_eq!(
            (r.kind.as_deref(), r.name.as_deref(), r.uid.as_deref()),
            (Some("ResourceClaim"), Some("train"), Some("0b5c"))
        );
        assert_eq!(r.api_version.as_deref(), Some("resource.k8s.io/v1"));
        assert_eq!(e.metadata.namespace.as_deref(), Some("team-a"));
        assert!(e.metadata.name.unwrap().starts_with("train."));
        assert_eq!(e.reporting_controller.as_deref(), Some("gpu.gpuplane.dev"));
        assert_eq!(e.reporting_instance.as_deref(), Some("node-a"));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.note.as_deref(), Some(ev.note.as_str()));
    }
}
