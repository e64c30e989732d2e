//! [`keep_published`]: the loop around [`SlicePublisher::sync`]. It syncs at start, when the
//! desired slices change, when the watch on this node's slices shows a change we did not make,
//! after a failed sync and every `resync`, counting syncs by outcome.

use super::SlicePublisher;
use crate::metrics::{self, SliceSync, SliceSyncLabel};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};

/// Timing of [`keep_published`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopOptions {
    /// Sync this often even when nothing was noticed (missed watch events, manual edits).
    pub resync: Duration,
    /// Pause after a failed sync before the next.
    pub retry: Duration,
    /// Watch this node's slices to notice deletions and edits by others.
    pub watch: bool,
}

impl Default for LoopOptions {
    fn default() -> Self {
        LoopOptions {
            resync: Duration::from_secs(300),
            retry: Duration::from_secs(10),
            watch: true,
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<Event<ResourceSlice>, watcher::Error>> + Send>>;

/// Keeps `desired` published until `shutdown` completes or the sender of `desired` is
/// dropped; returns the publisher (for a final `sync(vec![])` if the caller wants the slices
/// gone). Syncs at start, on every change of `desired`, on watch events we did not cause,
/// after a failure (every `options.retry`) and every `options.resync`.
pub async fn keep_published<S>(
    mut publisher: SlicePublisher,
    mut desired: watch::Receiver<Vec<ResourceSlice>>,
    options: LoopOptions,
    shutdown: S,
) -> SlicePublisher
where
    S: Future<Output = ()>,
{
    let mut events: EventStream = if options.watch {
        let config = watcher::Config::default().fields(&publisher.field_selector());
        Box::pin(watcher::watcher(publisher.api.clone(), config).default_backoff())
    } else {
        Box::pin(tokio_stream::pending())
    };
    tokio::pin!(shutdown);
    let mut due = Some(tokio::time::Instant::now());
    loop {
        let now = tokio::time::Instant::now();
        if due.is_some_and(|d| d <= now) {
            let want = desired.borrow_and_update().clone();
            let result = publisher.sync(want).await;
            let outcome = if result.is_ok() {
                SliceSync::Ok
            } else {
                SliceSync::Failed
            };
            metrics::node()
                .slice_syncs
                .get_or_create(&SliceSyncLabel { outcome })
                .inc();
            due = match result {
                Ok(_) => None,
                Err(e) => {
                    tracing::warn!(node = %publisher.node, driver = %publisher.driver, error = %e, retry_in = ?options.retry, "ResourceSlices not published");
                    Some(tokio::time::Instant::now() + options.retry)
                }
            };
        }
        let wake = due.unwrap_or_else(|| tokio::time::Instant::now() + options.resync);
        tokio::select! {
            () = &mut shutdown => return publisher,
            changed = desired.changed() => {
                if changed.is_err() {
                    return publisher;
                }
                due = Some(tokio::time::Instant::now());
            }
            event = events.next() => match event {
                Some(Ok(Event::Delete(s))) if !publisher.is_own(&s, true) => {
                    tracing::info!(slice = s.metadata.name.as_deref().unwrap_or_default(), "ResourceSlice deleted by someone else; publishing again");
                    due = Some(tokio::time::Instant::now());
                }
                Some(Ok(Event::Apply(s))) if !publisher.is_own(&s, false) => {
                    // Maybe a manual edit, maybe an orphan: sync compares and writes only a difference.
                    due = due.or(Some(tokio::time::Instant::now()));
                }
                // After a (re-)list the watch may have missed deletions.
                Some(Ok(Event::InitDone)) => due = due.or(Some(tokio::time::Instant::now())),
                Some(Ok(_)) => {}
                Some(Err(e)) => tracing::debug!(error = %e, "ResourceSlice watch failed; it retries with backoff"),
                None => events = Box::pin(tokio_stream::pending()),
            },
            () = tokio::time::sleep_until(wake) => {
                due = Some(tokio::time::Instant::now());
            }
        }
    }
}
