//! What the bench sees through watches, with when it saw it: each pod's reason on the
//! explainer's condition (and when it last changed), and the first sighting of any object
//! state a check names (a node's allocatable, a pod gone), the floor of a change's latency.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::{watcher, WatchStreamExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

const CONDITION: &str = "gpuplane.dev/GPUsAvailable";
/// The condition the bench writes itself, for the floor of a flip.
pub const FLOOR_CONDITION: &str = "bench.gpuplane.dev/Floor";

/// A pod's reason as the bench last saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub reason: Option<String>,
    /// When the reason became what it is.
    pub since: Instant,
}

#[derive(Default)]
pub struct Book {
    /// "ns/name" -> reason.
    pub pods: HashMap<String, Seen>,
    /// Object states by key ("node:<name>:<gpus>", "gone:<ns>/<name>", "pod:<ns>/<name>").
    pub sightings: HashMap<String, Instant>,
}

pub type Shared = Arc<Mutex<Book>>;

fn reason(p: &Pod) -> Option<String> {
    let c = p.status.as_ref()?.conditions.as_ref()?;
    c.iter()
        .find(|c| c.type_ == CONDITION)
        .and_then(|c| c.reason.clone())
}

/// The reason on the bench's own condition, if the pod carries it.
fn floor_written(p: &Pod) -> Option<String> {
    let c = p.status.as_ref()?.conditions.as_ref()?;
    c.iter()
        .find(|c| c.type_ == FLOOR_CONDITION)
        .and_then(|c| c.reason.clone())
}

fn key(p: &Pod) -> String {
    let m = &p.metadata;
    format!(
        "{}/{}",
        m.namespace.as_deref().unwrap_or(""),
        m.name.as_deref().unwrap_or("")
    )
}

/// Starts the watches (pods of every namespace, nodes) feeding `book`.
pub fn start(client: &kube::Client, book: &Shared) {
    let pods = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default());
    let b = book.clone();
    tokio::spawn(async move {
        let mut s = Box::pin(pods.default_backoff());
        while let Some(ev) = s.next().await {
            let Ok(ev) = ev else { continue };
            let now = Instant::now();
            let mut b = b.lock().unwrap();
            match ev {
                watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                    let k = key(&p);
                    b.sightings.entry(format!("pod:{k}")).or_insert(now);
                    if p.metadata.deletion_timestamp.is_some() {
                        b.sightings.entry(format!("gone:{k}")).or_insert(now);
                    }
                    let gates = p.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref());
                    if k.starts_with("queued/") && gates.is_none_or(|g| g.is_empty()) {
                        b.sightings.entry(format!("ungated:{k}")).or_insert(now);
                    }
                    if let Some(r) = floor_written(&p) {
                        b.sightings.entry(format!("floor:{k}:{r}")).or_insert(now);
                    }
                    let r = reason(&p);
                    if b.pods.get(&k).is_none_or(|s| s.reason != r) {
                        b.pods.insert(
                            k,
                            Seen {
                                reason: r,
                                since: now,
                            },
                        );
                    }
                }
                watcher::Event::Delete(p) => {
                    b.sightings
                        .entry(format!("gone:{}", key(&p)))
                        .or_insert(now);
                }
                _ => {}
            }
        }
    });
    let nodes = watcher(Api::<Node>::all(client.clone()), watcher::Config::default());
    let b = book.clone();
    tokio::spawn(async move {
        let mut s = Box::pin(nodes.default_backoff());
        while let Some(ev) = s.next().await {
            let Ok(ev) = ev else { continue };
            let now = Instant::now();
            let mut b = b.lock().unwrap();
            match ev {
                watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                    let name = n.metadata.name.clone().unwrap_or_default();
                    let gpus = n
                        .status
                        .as_ref()
                        .and_then(|s| s.allocatable.as_ref())
                        .and_then(|a| a.get("nvidia.com/gpu"))
                        .map_or("0".to_string(), |q| q.0.clone());
                    b.sightings
                        .entry(format!("node:{name}:{gpus}"))
                        .or_insert(now);
                }
                watcher::Event::Delete(n) => {
                    let name = n.metadata.name.clone().unwrap_or_default();
                    b.sightings
                        .entry(format!("gone:node/{name}"))
                        .or_insert(now);
                }
                _ => {}
            }
        }
    });
}

/// Waits (polling the book) until `done` holds; panics after `limit` naming `what`.
pub async fn until(book: &Shared, what: &str, limit: Duration, done: impl Fn(&Book) -> bool) {
    let began = Instant::now();
    loop {
        if done(&book.lock().unwrap()) {
            return;
        }
        if began.elapsed() > limit {
            let b = book.lock().unwrap();
            let mut by: HashMap<Option<String>, usize> = HashMap::new();
            for s in b.pods.values() {
                *by.entry(s.reason.clone()).or_insert(0) += 1;
            }
            panic!("timed out after {limit:?} waiting for {what}; pods by reason: {by:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// When `key` was first seen.
pub fn sighted(book: &Shared, key: &str) -> Option<Instant> {
    book.lock().unwrap().sightings.get(key).copied()
}

/// How many of the pods whose key starts with `prefix` show `reason`.
pub fn count(b: &Book, prefix: &str, reason: &str) -> usize {
    b.pods
        .iter()
        .filter(|(k, s)| k.starts_with(prefix) && s.reason.as_deref() == Some(reason))
        .count()
}

/// For the pods whose key starts with `prefix`: how long after `t0` each took on its reason.
pub fn latencies(b: &Book, prefix: &str, t0: Instant) -> Vec<Duration> {
    b.pods
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, s)| s.since.saturating_duration_since(t0))
        .collect()
}
