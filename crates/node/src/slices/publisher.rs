//! Keeps this node's ResourceSlices on the API server equal to the rendered ones (I/O shell).
//!
//! [`SlicePublisher::sync`] lists the slices of this node and driver (field selector
//! `spec.nodeName=<node>,spec.driver=<driver>`), asks [`super::plan`] what differs and
//! makes only those writes: an unchanged pool costs one LIST and no writes, also right after
//! an agent restart, because content is compared and the existing generation reused.
//! Conflicts (409: someone wrote in between, a name already taken, a delete precondition)
//! and vanished objects (404 on update) re-list and try again; 429, 5xx, timeouts and
//! connection failures back off exponentially up to a cap. Attempts per sync are bounded;
//! the caller (or [`keep_published`]) calls `sync` again later.
//!
//! [`keep_published`] is the loop: it syncs when the desired slices change, when a watch on
//! this node's slices shows a change we did not make (the kubelet deletes a node's slices at
//! its start-up), after a failed sync, and every `resync` as a safety net; it counts syncs by
//! outcome in `gpuplane_slice_syncs_total`. A kill between two writes of a sync (crash point
//! `slices.after-write`) leaves an incomplete pool, which consumers ignore until the next
//! agent's first sync completes it.

mod keep;

pub use keep::{keep_published, LoopOptions};

use super::plan::{self, Content, Delete, Echoes};
use super::validate::{validate, validate_pool, Violation};
use crate::crashpoint::{self, Step};
use crate::metrics::{self, SliceOp, SliceOpLabel};
use gpuplane_model::report::chain;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;

/// Why a sync did not finish.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A desired slice would be rejected by the API server; nothing was written.
    #[error("desired ResourceSlice {name:?} is invalid: {}", join(violations))]
    Invalid {
        name: String,
        violations: Vec<Violation>,
    },
    /// A desired slice is not for this publisher's driver, node or pool, or has no name.
    #[error("desired ResourceSlice {name:?} does not belong here: {reason}")]
    Foreign { name: String, reason: String },
    /// The API server answered with an error.
    #[error("{op} ResourceSlice {name:?}: {}", chain(.cause))]
    Api {
        op: &'static str,
        name: String,
        cause: kube::Error,
    },
    /// The API server did not answer in time.
    #[error("{op} ResourceSlice {name:?}: no answer within {after:?}")]
    Timeout {
        op: &'static str,
        name: String,
        after: Duration,
    },
    /// Every attempt of this sync failed with a retryable error.
    #[error("gave up after {attempts} attempts: {last}")]
    Exhausted {
        attempts: u32,
        last: Box<PublishError>,
    },
}

fn join(v: &[Violation]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Someone else wrote: re-list and plan again, after a short pause.
    Conflict,
    /// The server or the network is struggling: back off.
    Transient,
    Never,
}

impl PublishError {
    fn retry(&self) -> Retry {
        match self {
            PublishError::Api {
                cause: source, op, ..
            } => match source {
                kube::Error::Api(status) => match status.code {
                    409 => Retry::Conflict,
                    404 if *op != "list" => Retry::Conflict,
                    408 | 429 | 500..=599 => Retry::Transient,
                    _ => Retry::Never,
                },
                kube::Error::HyperError(_) | kube::Error::Service(_) => Retry::Transient,
                _ => Retry::Never,
            },
            PublishError::Timeout { .. } => Retry::Transient,
            _ => Retry::Never,
        }
    }

    /// Whether calling `sync` again later may succeed (the API server or network was at fault,
    /// not the desired slices). For the tests' assertions; the publisher's loop retries by
    /// `retry`.
    #[doc(hidden)]
    pub fn is_transient(&self) -> bool {
        match self {
            PublishError::Exhausted { .. } => true,
            e => e.retry() != Retry::Never,
        }
    }
}

/// Writes made by one [`SlicePublisher::sync`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStats {
    pub created: usize,
    pub updated: usize,
    pub deleted: usize,
    /// Attempts after the first (conflicts and transient failures).
    pub retries: u32,
    /// The pool generation the slices carry after the sync.
    pub generation: i64,
}

impl SyncStats {
    pub fn writes(&self) -> usize {
        self.created + self.updated + self.deleted
    }
}

/// Attempts and backoff within one sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per sync, the first included.
    pub attempts: u32,
    /// Pause before the first retry; doubles per retry.
    pub initial: Duration,
    /// Longest pause.
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 6,
            initial: Duration::from_millis(200),
            max: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// Pause before retry `n` (0-based): `initial * 2^n`, capped, with up to half of it
    /// shaved off pseudo-randomly so agents on many nodes do not retry in step (half of it,
    /// stretched by up to its own length by the shared jittered backoff).
    pub fn delay(&self, n: u32, kind_conflict: bool) -> Duration {
        let base = if kind_conflict {
            self.initial / 4
        } else {
            self.initial
        };
        let n = usize::try_from(n.min(32)).unwrap_or(32);
        crate::backoff::jittered(base / 2, self.max / 2)
            .nth(n)
            .unwrap_or(self.max)
    }
}

/// Publishes one node's pool for one driver.
pub struct SlicePublisher {
    api: Api<ResourceSlice>,
    driver: String,
    node: String,
    owners: Option<Vec<OwnerReference>>,
    retry: RetryPolicy,
    call_timeout: Duration,
    echoes: Echoes,
    /// Highest pool generation this publisher wrote.
    last_written: i64,
    /// resourceVersions our own creates and updates produced, and UIDs we deleted: the watch
    /// loop ignores those events.
    own_versions: VecDeque<String>,
    own_deletes: VecDeque<String>,
    /// True while the last sync succeeded: the API server holds what we want (readiness).
    published: watch::Sender<bool>,
}

const OWN_MEMORY: usize = 512;

impl SlicePublisher {
    pub fn new(client: kube::Client, driver: impl Into<String>, node: impl Into<String>) -> Self {
        SlicePublisher {
            api: Api::all(client),
            driver: driver.into(),
            node: node.into(),
            owners: None,
            retry: RetryPolicy::default(),
            call_timeout: Duration::from_secs(30),
            echoes: Echoes::new(),
            last_written: 0,
            own_versions: VecDeque::new(),
            own_deletes: VecDeque::new(),
            published: watch::Sender::new(false),
        }
    }

    /// Follows whether the last sync succeeded.
    pub fn published(&self) -> watch::Receiver<bool> {
        self.published.subscribe()
    }

    /// Makes the Node (by its UID) the controlling owner of every slice, so the garbage
    /// collector removes them with the Node object.
    pub fn with_node_owner(mut self, node_uid: impl Into<String>) -> Self {
        self.owners = Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid: node_uid.into(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        self
    }

    /// Another retry policy than the default. For tests, which cannot wait out real backoffs.
    #[doc(hidden)]
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Longest wait for one API call (default 30 s). For tests of an API server that hangs.
    #[doc(hidden)]
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    pub fn driver(&self) -> &str {
        &self.driver
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// `spec.nodeName=<node>,spec.driver=<driver>`.
    pub fn field_selector(&self) -> String {
        format!("spec.nodeName={},spec.driver={}", self.node, self.driver)
    }

    /// Makes the API server hold exactly `desired` for this node and driver: creates what is
    /// missing, updates what differs, deletes the rest (an empty `desired` removes every slice
    /// of this node and driver). Nothing is written when nothing differs.
    pub async fn sync(&mut self, desired: Vec<ResourceSlice>) -> Result<SyncStats, PublishError> {
        let result = self.sync_checked(desired).await;
        self.published.send_replace(result.is_ok());
        result
    }

    async fn sync_checked(
        &mut self,
        desired: Vec<ResourceSlice>,
    ) -> Result<SyncStats, PublishError> {
        let desired = self.check(desired)?;
        let mut stats = SyncStats::default();
        let mut attempt = 0u32;
        loop {
            match self.try_sync(&desired, &mut stats).await {
                Ok(()) => {
                    if stats.writes() > 0 {
                        tracing::info!(node = %self.node, driver = %self.driver, created = stats.created, updated = stats.updated, deleted = stats.deleted, generation = stats.generation, "ResourceSlices published");
                    }
                    for (op, n) in [
                        (SliceOp::Create, stats.created),
                        (SliceOp::Update, stats.updated),
                        (SliceOp::Delete, stats.deleted),
                    ] {
                        if n > 0 {
                            let n = u64::try_from(n).unwrap_or(u64::MAX);
                            metrics::node()
                                .slice_writes
                                .get_or_create(&SliceOpLabel { op })
                                .inc_by(n);
                        }
                    }
                    return Ok(stats);
                }
                Err(e) => {
                    let kind = e.retry();
                    attempt += 1;
                    if kind == Retry::Never {
                        return Err(e);
                    }
                    if attempt >= self.retry.attempts {
                        return Err(PublishError::Exhausted {
                            attempts: attempt,
                            last: Box::new(e),
                        });
                    }
                    let pause = self.retry.delay(attempt - 1, kind == Retry::Conflict);
                    tracing::warn!(node = %self.node, driver = %self.driver, error = %e, retry_in = ?pause, "ResourceSlice sync failed; retrying");
                    stats.retries += 1;
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// Checks the desired slices belong to this publisher, fixes `resourceSliceCount` to their
    /// number and validates them.
    fn check(&self, mut desired: Vec<ResourceSlice>) -> Result<Vec<ResourceSlice>, PublishError> {
        let count = i64::try_from(desired.len()).unwrap_or(i64::MAX);
        let pool = desired.first().map(|d| d.spec.pool.name.clone());
        let mut names = BTreeSet::new();
        for d in &mut desired {
            let name = d.metadata.name.clone().unwrap_or_default();
            let foreign = |reason: String| PublishError::Foreign {
                name: name.clone(),
                reason,
            };
            if name.is_empty() {
                return Err(foreign(
                    "no metadata.name (the publisher matches slices by name)".into(),
                ));
            }
            if !names.insert(name.clone()) {
                return Err(foreign("two desired slices have this name".into()));
            }
            if d.spec.driver != self.driver {
                return Err(foreign(format!(
                    "driver is {:?}, not {:?}",
                    d.spec.driver, self.driver
                )));
            }
            if d.spec.node_name.as_deref() != Some(self.node.as_str()) {
                return Err(foreign(format!(
                    "nodeName is {:?}, not {:?}",
                    d.spec.node_name, self.node
                )));
            }
            if Some(&d.spec.pool.name) != pool.as_ref() {
                return Err(foreign(format!(
                    "pool {:?} differs from the first slice's {:?}",
                    d.spec.pool.name, pool
                )));
            }
            d.spec.pool.resource_slice_count = count;
            d.metadata.resource_version = None;
            d.metadata.uid = None;
            validate(d).map_err(|violations| PublishError::Invalid {
                name: name.clone(),
                violations,
            })?;
        }
        // Across slices: counter sets and the devices consuming them (fields name the slice).
        validate_pool(&desired).map_err(|violations| PublishError::Invalid {
            name: violations
                .first()
                .and_then(|v| v.field.split_once('/'))
                .map_or_else(String::new, |(slice, _)| slice.to_string()),
            violations,
        })?;
        Ok(desired)
    }

    async fn try_sync(
        &mut self,
        desired: &[ResourceSlice],
        stats: &mut SyncStats,
    ) -> Result<(), PublishError> {
        let selector = self.field_selector();
        let lp = ListParams::default().fields(&selector);
        let existing = self.call("list", "", self.api.list(&lp)).await?.items;
        let plan = plan::plan(
            &existing,
            desired,
            &self.driver,
            &self.node,
            self.owners.as_deref(),
            &self.echoes,
            self.last_written,
        );
        stats.generation = plan.generation;
        if !plan.is_empty() {
            self.last_written = self.last_written.max(plan.generation);
        }
        if plan.is_empty() {
            return Ok(());
        }
        tracing::debug!(node = %self.node, creates = plan.creates.len(), updates = plan.updates.len(), deletes = plan.deletes.len() + plan.delete_first.len(), generation = plan.generation, "ResourceSlice plan");
        for d in &plan.delete_first {
            self.delete(d, stats).await?;
        }
        for u in plan.updates {
            let name = u.metadata.name.clone().unwrap_or_default();
            let stored = self
                .call(
                    "update",
                    &name,
                    self.api.replace(&name, &PostParams::default(), &u),
                )
                .await?;
            self.remember(&name, &u, &stored);
            stats.updated += 1;
            crashpoint::reached_at(Step::SlicesAfterWrite, &name);
        }
        for c in plan.creates {
            let name = c.metadata.name.clone().unwrap_or_default();
            let stored = self
                .call("create", &name, self.api.create(&PostParams::default(), &c))
                .await?;
            self.remember(&name, &c, &stored);
            stats.created += 1;
            crashpoint::reached_at(Step::SlicesAfterWrite, &name);
        }
        for d in &plan.deletes {
            self.delete(d, stats).await?;
        }
        Ok(())
    }

    async fn delete(&mut self, d: &Delete, stats: &mut SyncStats) -> Result<(), PublishError> {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: d.uid.clone(),
                resource_version: d.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        self.echoes.remove(&d.name);
        match self
            .call("delete", &d.name, self.api.delete(&d.name, &dp))
            .await
        {
            Ok(_) => {
                stats.deleted += 1;
                if let Some(uid) = &d.uid {
                    push_capped(&mut self.own_deletes, uid.clone());
                }
                crashpoint::reached_at(Step::SlicesAfterWrite, &d.name);
                Ok(())
            }
            // Already gone: what we wanted.
            Err(PublishError::Api {
                cause: kube::Error::Api(s),
                ..
            }) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Records what the server stored for what we sent, when it differs (dropped fields).
    fn remember(&mut self, name: &str, sent: &ResourceSlice, stored: &ResourceSlice) {
        if let Some(rv) = &stored.metadata.resource_version {
            push_capped(&mut self.own_versions, rv.clone());
        }
        let (s, t) = (Content::of(sent), Content::of(stored));
        if s == t {
            self.echoes.remove(name);
        } else {
            if !self.echoes.contains_key(name) {
                tracing::warn!(slice = name, "the API server stored ResourceSlice content different from what was sent (a disabled feature gate drops fields such as device taints); not rewriting it");
            }
            self.echoes.insert(name.to_string(), (s, t));
        }
    }

    async fn call<T>(
        &self,
        op: &'static str,
        name: &str,
        fut: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, PublishError> {
        match tokio::time::timeout(self.call_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(PublishError::Api {
                op,
                name: name.to_string(),
                cause: source,
            }),
            Err(_) => Err(PublishError::Timeout {
                op,
                name: name.to_string(),
                after: self.call_timeout,
            }),
        }
    }

    /// Whether a watch event about this slice is the echo of our own write.
    fn is_own(&self, slice: &ResourceSlice, deleted: bool) -> bool {
        if deleted {
            slice
                .metadata
                .uid
                .as_ref()
                .is_some_and(|u| self.own_deletes.contains(u))
        } else {
            slice
                .metadata
                .resource_version
                .as_ref()
                .is_some_and(|v| self.own_versions.contains(v))
        }
    }
}

fn push_capped(q: &mut VecDeque<String>, v: String) {
    if q.len() >= OWN_MEMORY {
        q.pop_front();
    }
    q.push_back(v);
}
