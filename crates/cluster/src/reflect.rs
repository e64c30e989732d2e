//! One way to keep a watch-fed cache: a kube-runtime reflector store and the future that feeds
//! it, with backoff, telling the caller of each change and each watch error, and logging a
//! failing watch once per outage (and its recovery) rather than once per retry. The webhook's
//! caches, the shared [`crate::published::Devices`] and the controller's explainer use it.

use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use std::future::Future;
use tokio_stream::{Stream, StreamExt};

/// Objects per page when a watch lists pods or ResourceSlices (kube's default is 500). Each
/// page is decoded whole before the store keeps what it keeps: 500 workload pods or slices
/// are tens of MiB at once, and the allocator keeps that memory resident after. With 100, the
/// controller's RSS in `cargo bench --bench controller_memory` fell by ~22 MiB (ci build); the
/// price is five times the list requests when a watch (re)lists.
pub const LIST_PAGE: u32 = 100;

/// A store of what `api` lists under `config`, and the future that keeps it (until the
/// stream ends). `changed` runs after every event applied; `failed` on every watch error,
/// while the store keeps its last state.
pub fn reflected<K: Cached>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    changed: impl Fn() + Send + 'static,
    failed: impl Fn(&watcher::Error) + Send + 'static,
) -> (Store<K>, impl Future<Output = ()> + Send) {
    reflected_shaped(api, config, what, Shape::whole(), changed, failed)
}

/// What a watch-fed store can hold: any cluster API object kube knows the type of.
pub trait Cached:
    kube::Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Cached for K where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Which objects a store keeps and what of them: what the watch selectors cannot say.
pub struct Shape<K> {
    /// Whether the store keeps the object at all; must not change over an object's life (an
    /// object dropped is never deleted from the store).
    pub keep: fn(&K) -> bool,
    /// Drops what no reader needs, before the store keeps it.
    pub slim: fn(&mut K),
}

impl<K> Shape<K> {
    /// Every object, whole (but for managed fields).
    pub fn whole() -> Shape<K> {
        Shape {
            keep: |_| true,
            slim: |_| {},
        }
    }
}

/// [`reflected`], keeping only the objects and the parts of them that `shape` says.
pub fn reflected_shaped<K: Cached>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    shape: Shape<K>,
    changed: impl Fn() + Send + 'static,
    failed: impl Fn(&watcher::Error) + Send + 'static,
) -> (Store<K>, impl Future<Output = ()> + Send) {
    let (reader, writer) = reflector::store();
    // managedFields are most of a small object's bytes and no reader of these caches looks
    // at them: dropped before the store keeps the object (at 1,000 nodes and 6,000 pods this
    // is most of the controller's memory).
    let Shape { keep, slim } = shape;
    let events = watcher(api, config)
        .default_backoff()
        .filter(move |ev| match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => keep(o),
            Ok(watcher::Event::Delete(o)) => keep(o),
            _ => true,
        })
        .modify(move |o| {
            o.managed_fields_mut().clear();
            slim(o);
        });
    let stream = reflector::reflector(writer, events);
    let feed = follow(stream, what, move |_| changed(), failed);
    (reader, feed)
}

/// Runs a watch's `events` until they end: `apply` on each event, `failed` on each error,
/// logging a failing watch once per outage (and its recovery) rather than once per retry.
pub async fn follow<T>(
    events: impl Stream<Item = Result<T, watcher::Error>> + Send,
    what: &'static str,
    mut apply: impl FnMut(T) + Send,
    failed: impl Fn(&watcher::Error) + Send,
) {
    // On the heap: several watch streams inline make a future too large for a worker's stack.
    let mut events = Box::pin(events);
    let mut failing = false;
    while let Some(ev) = events.next().await {
        match ev {
            Ok(ev) => {
                if failing {
                    tracing::info!(resource = what, "watch recovered");
                    failing = false;
                }
                apply(ev);
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(resource = what, error = %e, "watch failing; working from the last known state");
                    failing = true;
                }
                failed(&e);
            }
        }
    }
}
