//! WATCH: newline-delimited `{"type", "object"}` events over a chunked response, resuming
//! after a resourceVersion from the store's history (410 Gone when it is older than that).

use super::http::Body;
use super::ops::ListOptions;
use super::resources::{ApiError, ResourceInfo};
use super::store::{res_key, Event, EventType};
use super::{lock, Shared};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Bytes, Frame};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};

pub(crate) struct WatchSpec {
    pub info: ResourceInfo,
    pub ns: Option<String>,
    pub opts: ListOptions,
    /// Start after this resourceVersion; None starts at the current one.
    pub after: Option<u64>,
    /// Send the current objects as ADDED first (`resourceVersion` "" or "0", or
    /// `sendInitialEvents=true`).
    pub initial: bool,
    /// End the initial objects with a bookmark annotated `k8s.io/initial-events-end`
    /// (`sendInitialEvents=true`).
    pub initial_end_bookmark: bool,
    pub bookmarks: bool,
    pub timeout: Duration,
}

fn line(kind: &str, object: &Value) -> Frame<Bytes> {
    encoded_line(kind, &serde_json::to_vec(object).unwrap_or_default())
}

/// A watch line around an object already encoded as JSON.
fn encoded_line(kind: &str, object: &[u8]) -> Frame<Bytes> {
    let mut bytes = Vec::with_capacity(object.len() + 32);
    bytes.extend_from_slice(br#"{"type":""#);
    bytes.extend_from_slice(kind.as_bytes());
    bytes.extend_from_slice(br#"","object":"#);
    bytes.extend_from_slice(object);
    bytes.extend_from_slice(b"}\n");
    Frame::data(Bytes::from(bytes))
}

fn bookmark(info: &ResourceInfo, rv: u64, initial_end: bool) -> Frame<Bytes> {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        &json!({"kind": info.kind, "apiVersion": info.api_version(), "metadata": meta}),
    )
}

/// What a watcher with this spec sees of `e`, with selector transitions as the watch cache
/// reports them (an object leaving the selection is DELETED, one entering it ADDED).
fn translate(spec: &WatchSpec, e: &Event) -> Option<&'static str> {
    if e.res != res_key(&spec.info) || spec.ns.as_ref().is_some_and(|n| *n != e.namespace) {
        return None;
    }
    let now = spec.opts.matches(&e.object);
    let before = e.prev.as_ref().is_some_and(|p| spec.opts.matches(p));
    let kind = match (e.kind, before, now) {
        (EventType::Added, _, true) => EventType::Added,
        (EventType::Modified, true, true) => EventType::Modified,
        (EventType::Modified, false, true) => EventType::Added,
        (EventType::Modified, true, false) => EventType::Deleted,
        (EventType::Deleted, true, _) => EventType::Deleted,
        _ => return None,
    };
    Some(kind.as_str())
}

/// Starts a watch; the returned body streams until the timeout, `drop_watches`, a 410, or the
/// client going away.
pub(crate) fn start(shared: Arc<Shared>, spec: WatchSpec) -> Body {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(256);
    let mut drops = shared.drops.subscribe();
    drops.borrow_and_update();
    let opening = open(&shared, &spec);
    tokio::spawn(async move {
        for f in opening.frames {
            if tx.send(Ok(f)).await.is_err() {
                return;
            }
        }
        if opening.gone {
            return;
        }
        follow(&shared, &spec, opening.changes, drops, opening.pos, tx).await;
    });
    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed_unsync()
}

/// How a watch opens, read in one look at the store.
struct Opening {
    /// The store's change signal, subscribed while the store was locked, so nothing after
    /// `pos` is missed.
    changes: watch::Receiver<u64>,
    /// What is sent first: the initial objects (and their end bookmark), or the 410.
    frames: Vec<Frame<Bytes>>,
    /// The resourceVersion the events follow from.
    pos: u64,
    /// The resourceVersion asked for is older than the history: the watch ends after the 410.
    gone: bool,
}

fn open(shared: &Shared, spec: &WatchSpec) -> Opening {
    let store = lock(&shared.store);
    let mut changes = store.subscribe();
    changes.borrow_and_update();
    let mut frames: Vec<Frame<Bytes>> = Vec::new();
    let mut pos = spec.after.unwrap_or(store.rv);
    let too_old = spec.after.and_then(|rv| store.too_old(rv));
    match &too_old {
        Some(gone) => frames.push(line("ERROR", &gone.to_status())),
        None if spec.initial => {
            frames.extend(
                store
                    .iter(&spec.info, spec.ns.as_deref())
                    .filter(|(_, v)| spec.opts.matches(v))
                    .map(|(_, v)| line("ADDED", v)),
            );
            pos = store.rv;
            if spec.initial_end_bookmark && spec.bookmarks {
                frames.push(bookmark(&spec.info, pos, true));
            }
        }
        None => {}
    }
    Opening {
        changes,
        frames,
        pos,
        gone: too_old.is_some(),
    }
}

/// Sends the events after `pos` as they come, with bookmarks if asked for, until the
/// timeout, `drop_watches`, a 410, or the client going away.
async fn follow(
    shared: &Shared,
    spec: &WatchSpec,
    mut changes: watch::Receiver<u64>,
    mut drops: watch::Receiver<u64>,
    mut pos: u64,
    tx: mpsc::Sender<Result<Frame<Bytes>, Infallible>>,
) {
    let res = res_key(&spec.info);
    let deadline = Instant::now() + spec.timeout;
    let mut ticks = tokio::time::interval(shared.bookmark_every);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        let found: Result<(Vec<Arc<Event>>, u64), ApiError> = {
            let store = lock(&shared.store);
            changes.borrow_and_update();
            store.events_after(&res, pos)
        };
        match found {
            Err(gone) => {
                let _ = tx.send(Ok(line("ERROR", &gone.to_status()))).await;
                return;
            }
            Ok((events, current)) => {
                for e in &events {
                    if let Some(kind) = translate(spec, e) {
                        if tx.send(Ok(encoded_line(kind, e.encoded()))).await.is_err() {
                            return;
                        }
                    }
                }
                pos = current;
            }
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = drops.changed() => return,
            _ = tokio::time::sleep_until(deadline) => {
                if spec.bookmarks {
                    let _ = tx.send(Ok(bookmark(&spec.info, pos, false))).await;
                }
                return;
            }
            _ = ticks.tick(), if spec.bookmarks => {
                if tx.send(Ok(bookmark(&spec.info, pos, false))).await.is_err() {
                    return;
                }
            }
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doubles::apiserver::selector::LabelSelector;

    fn spec(sel: &str) -> WatchSpec {
        WatchSpec {
            info: ResourceInfo::new("", "v1", "pods", "Pod", true),
            ns: Some("a".into()),
            opts: ListOptions {
                labels: LabelSelector::parse(sel).unwrap(),
                ..ListOptions::default()
            },
            after: None,
            initial: false,
            initial_end_bookmark: false,
            bookmarks: false,
            timeout: Duration::from_secs(1),
        }
    }

    fn event(kind: EventType, ns: &str, before: Option<&str>, now: &str) -> Event {
        let obj = |app: &str| json!({"metadata": {"labels": {"app": app}}});
        Event::new(
            2,
            ("".into(), "v1".into(), "pods".into()),
            ns.into(),
            kind,
            Arc::new(obj(now)),
            before.map(|b| Arc::new(obj(b))),
        )
    }

    #[test]
    fn objects_moving_across_the_selector_are_added_or_deleted() {
        let s = spec("app=gpu");
        let kind = |e: Event| translate(&s, &e);
        assert_eq!(
            kind(event(EventType::Modified, "a", Some("web"), "gpu")),
            Some("ADDED")
        );
        assert_eq!(
            kind(event(EventType::Modified, "a", Some("gpu"), "web")),
            Some("DELETED")
        );
        assert_eq!(
            kind(event(EventType::Modified, "a", Some("gpu"), "gpu")),
            Some("MODIFIED")
        );
        assert_eq!(
            kind(event(EventType::Modified, "a", Some("web"), "web")),
            None
        );
        assert_eq!(kind(event(EventType::Added, "b", None, "gpu")), None);
        assert_eq!(
            kind(event(EventType::Deleted, "a", Some("gpu"), "gpu")),
            Some("DELETED")
        );
    }
}
