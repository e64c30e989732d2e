//! Keeps the namespace label [`QUEUE_LABEL`] in step with the GpuQuotas (I/O shell over
//! [`super::queue_label`]; leader only): watches every GpuQuota and the namespaces that carry
//! the label, and sends a JSON merge patch of that one key to each namespace whose label
//! differs from what its quotas call for. A merge patch, not apply: it fails on a missing
//! namespace instead of creating one. A label removed by hand takes the namespace out of the
//! watch's selection (a delete event), so it is patched again at once; every `resync` each
//! namespace is decided again from the caches. A failed patch is retried with backoff.
//!
//! [`Labeler::drive`] takes the watchers' events as a channel, so tests can feed it; [`run`]
//! wires the real watchers to it.

use super::cache::Cache;
use super::queue_label::{queue_label_patch, QUEUE_LABEL};
use super::watchers::forward;
use crate::quota::GpuQuota;
use gpuplane_model::report::chain;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::ResourceExt;
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::schedule::{drive, Keyed, Timing};

/// Tunables of the labeler.
#[derive(Debug, Clone)]
pub struct LabelerOptions {
    /// Changes arriving within this window are handled together.
    pub batch: Duration,
    /// Every namespace is decided again at least this often.
    pub resync: Duration,
    /// The wait after a failed patch; doubled per further failure, up to `retry_cap`.
    pub retry: Duration,
    pub retry_cap: Duration,
}

impl Default for LabelerOptions {
    fn default() -> Self {
        LabelerOptions {
            batch: Duration::from_millis(50),
            resync: Duration::from_secs(60),
            retry: Duration::from_millis(200),
            retry_cap: Duration::from_secs(30),
        }
    }
}

impl LabelerOptions {
    /// When to try a namespace again after its `failures`-th consecutive failure (from 1).
    pub fn retry_after(&self, failures: u32) -> Duration {
        crate::backoff::after(self.retry, self.retry_cap, failures)
    }
}

/// Why a namespace's label could not be brought in step.
#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    /// The merge patch failed (other than the namespace being gone).
    #[error("patching label {QUEUE_LABEL} of namespace {namespace}: {}", chain(.cause))]
    Patch {
        namespace: String,
        cause: Box<kube::Error>,
    },
}

/// One change seen by a watcher.
#[derive(Debug)]
pub enum LabelInput {
    Quota(Box<Event<GpuQuota>>),
    /// Of the watch selecting namespaces that carry the label.
    Namespace(Box<Event<Namespace>>),
}

/// What one namespace's sync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Synced {
    InStep,
    Patched,
    /// The namespace does not exist (it is never created); decided again at resync.
    Missing,
}

/// The labeler's state.
pub struct Labeler {
    api: Api<Namespace>,
    opts: LabelerOptions,
    quotas: Cache<GpuQuota>,
    /// Namespaces carrying the label (any value), as the selected watch shows them.
    labelled: Cache<Namespace>,
    /// Consecutive failures and the last error logged, per namespace.
    failures: HashMap<String, (u32, String)>,
}

impl Labeler {
    pub fn new(client: kube::Client, opts: LabelerOptions) -> Labeler {
        Labeler {
            api: Api::all(client),
            opts,
            quotas: Cache::default(),
            labelled: Cache::default(),
            failures: HashMap::new(),
        }
    }

    /// Both caches listed once: before that, a namespace's quotas or label may just not be
    /// known yet, and a patch would be wrong.
    fn ready(&self) -> bool {
        self.quotas.is_ready() && self.labelled.is_ready()
    }

    /// Namespaces that may need a patch: those with a GpuQuota and those with the label.
    fn candidates(&self) -> BTreeSet<String> {
        self.quotas
            .namespaces()
            .cloned()
            .chain(self.labelled.all().map(|n| n.name_any()))
            .collect()
    }

    /// Applies one input; returns the namespaces to decide again because of it.
    fn apply(&mut self, input: LabelInput) -> BTreeSet<String> {
        match input {
            LabelInput::Quota(e) => self.quotas.apply(*e),
            LabelInput::Namespace(e) => match *e {
                e @ (Event::Apply(_) | Event::Delete(_) | Event::InitApply(_)) => {
                    let touched = match &e {
                        Event::Apply(n) | Event::Delete(n) | Event::InitApply(n) => {
                            BTreeSet::from([n.name_any()])
                        }
                        Event::Init | Event::InitDone => BTreeSet::new(),
                    };
                    self.labelled.apply(e);
                    touched
                }
                // A relist may drop namespaces without a delete event: decide every one seen
                // before and after.
                e @ (Event::Init | Event::InitDone) => {
                    let mut touched = self.candidates();
                    self.labelled.apply(e);
                    touched.extend(self.candidates());
                    touched
                }
            },
        }
    }

    /// Runs until `stop` resolves or the input ends.
    pub async fn drive(
        &mut self,
        inputs: mpsc::Receiver<LabelInput>,
        stop: impl Future<Output = ()>,
    ) {
        let timing = Timing {
            batch: self.opts.batch,
            resync: self.opts.resync,
            // A backoff already running stays: the retry looks at the caches anyway.
            sooner: false,
        };
        drive(self, inputs, timing, stop).await;
    }

    /// [`Labeler::sync`] with logging and the error policy; when to try again, if at all.
    async fn sync_logged(&mut self, ns: &str) -> Option<Duration> {
        match self.sync(ns).await {
            Ok(done) => {
                let failed = self.failures.remove(ns).is_some();
                match done {
                    Synced::Patched => {
                        tracing::info!(namespace = %ns, label = QUEUE_LABEL, "namespace label in step")
                    }
                    Synced::Missing => {
                        tracing::debug!(namespace = %ns, "namespace does not exist; its label is not written")
                    }
                    Synced::InStep if failed => {
                        tracing::info!(namespace = %ns, label = QUEUE_LABEL, "namespace label in step")
                    }
                    Synced::InStep => {}
                }
                None
            }
            Err(e) => {
                let text = e.to_string();
                let (n, last) = self.failures.entry(ns.to_string()).or_default();
                *n += 1;
                let after = self.opts.retry_after(*n);
                // One line per distinct error, not one per retry.
                if *last != text {
                    tracing::warn!(namespace = %ns, error = %text, retry_in = ?after, "namespace label not written; retrying");
                    *last = text;
                }
                Some(after)
            }
        }
    }

    /// Brings the label of `ns` in step with its quotas as cached.
    async fn sync(&mut self, ns: &str) -> Result<Synced, LabelError> {
        let labels = self
            .labelled
            .get("", ns)
            .and_then(|n| n.metadata.labels.clone())
            .unwrap_or_default();
        let quotas = self.quotas.in_namespace(ns);
        let Some(patch) = queue_label_patch(ns, &labels, quotas.iter().map(|q| &**q)) else {
            return Ok(Synced::InStep);
        };
        match self
            .api
            .patch(ns, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(n) => {
                // What the watch will show: until it does, the same patch is not called for
                // again by the next event or resync.
                let event = if n.labels().contains_key(QUEUE_LABEL) {
                    Event::Apply(n)
                } else {
                    Event::Delete(n)
                };
                self.labelled.apply(event);
                Ok(Synced::Patched)
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Synced::Missing),
            Err(e) => Err(LabelError::Patch {
                namespace: ns.to_string(),
                cause: Box::new(e),
            }),
        }
    }
}

/// Watches GpuQuotas and the labelled namespaces, feeding `tx` until the receiver goes away.
pub fn spawn_watchers(
    client: &kube::Client,
    tx: mpsc::Sender<LabelInput>,
) -> Vec<tokio::task::JoinHandle<()>> {
    vec![
        forward(
            Api::<GpuQuota>::all(client.clone()),
            watcher::Config::default(),
            tx.clone(),
            |e| Some(LabelInput::Quota(Box::new(e))),
        ),
        // Only namespaces with the key, whatever its value: a cluster's many other namespaces
        // cost nothing, and one losing the label leaves the selection as a delete event.
        forward(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default().labels(QUEUE_LABEL),
            tx,
            |e| Some(LabelInput::Namespace(Box::new(e))),
        ),
    ]
}

/// Runs the labeler with real watchers until `stop` resolves.
pub async fn run(client: kube::Client, opts: LabelerOptions, stop: impl Future<Output = ()>) {
    let (tx, rx) = mpsc::channel(256);
    let watchers = spawn_watchers(&client, tx);
    Labeler::new(client, opts).drive(rx, stop).await;
    for w in watchers {
        w.abort();
    }
}

impl Keyed for Labeler {
    type Input = LabelInput;

    fn ready(&self) -> bool {
        Labeler::ready(self)
    }

    fn apply(&mut self, input: LabelInput) -> BTreeSet<String> {
        Labeler::apply(self, input)
    }

    fn known(&self) -> BTreeSet<String> {
        self.candidates()
    }

    async fn run(&mut self, due: Vec<String>) -> Vec<(String, Instant)> {
        let mut again = Vec::new();
        for ns in due {
            if let Some(after) = self.sync_logged(&ns).await {
                again.push((ns, Instant::now() + after));
            }
        }
        again
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_exponentially_up_to_the_cap() {
        let o = LabelerOptions::default();
        let waits: Vec<Duration> = [1, 2, 3, 9, 40].map(|n| o.retry_after(n)).into();
        assert_eq!(
            waits,
            [200, 400, 800, 30_000, 30_000].map(Duration::from_millis)
        );
    }
}
