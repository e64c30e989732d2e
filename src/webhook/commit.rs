//! Group commit of reservations (I/O shell around [`crate::quota::decide_batch`]).
//!
//! One queue per GpuQuota per replica. A request puts its [`Op`] on the queue of its quota and
//! waits for the answer; the first one to find the queue idle spawns the quota's batch task
//! (its own task, so a client that disconnects strands nobody). The task takes everything
//! queued (at most [`CommitOptions::max_batch`]), decides it in arrival order on one state,
//! writes the status once with the resourceVersion that state was read at, and answers each
//! request; what arrived while the write was in flight is the next batch.
//!
//! Exactness: an admission is answered only after the write that recorded it succeeded (a
//! request whose reservation was not durably written is never admitted). The state decided on
//! is the one this task last wrote (the PUT's answer) or read, or the watch cache's copy when
//! that is newer; a 409 Conflict (another replica, the controller) reads again and decides the
//! whole batch again. A batch that needs no write
//! (all denied, all already recorded) is only answered from a state read in this round, never
//! from the remembered one. A borrowing admission is also re-checked against the cohort read
//! after the write ([`crate::quota::stale_borrowers`]); one that no longer fits is decided
//! again in the next batch (its reservation stays until then, which only errs on the safe
//! side) and, after [`BORROW_ATTEMPTS`], denied and released.

use crate::quota::{borrows, decide_batch, stale_borrowers, Denial, Fit, GpuQuota, Op, Outcome};
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Retry bounds of one batch: how often and how long a 409 is re-decided.
#[derive(Debug, Clone, Copy)]
pub struct RetryBudget {
    pub max_attempts: u32,
    /// Give up after this long (keep it under the webhook's timeout).
    pub deadline: Duration,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            max_attempts: 200,
            deadline: Duration::from_secs(8),
        }
    }
}

/// A borrowing admission is decided at most this many times before it is denied.
pub const BORROW_ATTEMPTS: u32 = 8;

/// Bounds of the group commit.
#[derive(Debug, Clone, Copy)]
pub struct CommitOptions {
    /// Conflict retries of one batch; `deadline` also bounds how long a request waits for its
    /// answer (keep it well under the API server's 10 s webhook timeout).
    pub budget: RetryBudget,
    /// The most ops decided and written together.
    pub max_batch: usize,
}

impl Default for CommitOptions {
    fn default() -> Self {
        CommitOptions {
            budget: RetryBudget::default(),
            max_batch: 256,
        }
    }
}

/// Why a request got no decision.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommitError {
    #[error("GpuQuota {quota}: {message}")]
    Api { quota: String, message: String },
    #[error("GpuQuota {quota}: still conflicting after {attempts} attempts in {elapsed:?}")]
    Contended {
        quota: String,
        attempts: u32,
        elapsed: Duration,
    },
    #[error("GpuQuota {quota}: no decision within {waited:?}")]
    Timeout { quota: String, waited: Duration },
    #[error("GpuQuota {quota}: the batch writing it stopped before answering")]
    Stopped { quota: String },
    #[error("GpuQuota {quota}: {message}")]
    Math { quota: String, message: String },
}

/// The answer to one op.
#[derive(Debug, Clone)]
pub enum Answer {
    /// Fits; for a `Reserve`, durably recorded.
    Fits(Fit),
    Denied(Denial),
    Queued,
    Released,
    /// The quota does not exist any more.
    Gone,
    Failed(CommitError),
}

struct Pending {
    op: Op,
    attempts: u32,
    tx: Option<oneshot::Sender<Answer>>,
}

#[derive(Default)]
struct QueueState {
    pending: VecDeque<Pending>,
    running: bool,
    /// The quota as this replica last wrote or read it.
    last: Option<GpuQuota>,
}

struct QuotaQueue {
    namespace: String,
    name: String,
    state: Mutex<QueueState>,
}

/// Writes counted by outcome (what `/metrics` and the bench report).
#[derive(Debug, Default)]
pub struct CommitCounters {
    pub batches: std::sync::atomic::AtomicU64,
    pub writes: std::sync::atomic::AtomicU64,
    pub conflicts: std::sync::atomic::AtomicU64,
}

/// The group committer of one replica.
pub struct Committer {
    client: kube::Client,
    quotas: Store<GpuQuota>,
    opts: CommitOptions,
    queues: Mutex<HashMap<(String, String), Arc<QuotaQueue>>>,
    pub counters: Arc<CommitCounters>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Committer {
    /// `quotas`: the watch-fed cache the cohort peers are taken from.
    pub fn new(client: kube::Client, quotas: Store<GpuQuota>, opts: CommitOptions) -> Arc<Self> {
        Arc::new(Committer {
            client,
            quotas,
            opts,
            queues: Mutex::new(HashMap::new()),
            counters: Arc::default(),
        })
    }

    /// Puts `op` on the queue of GpuQuota `namespace/name` and waits for its answer.
    pub async fn submit(self: &Arc<Self>, namespace: &str, name: &str, op: Op) -> Answer {
        let rx = self.enqueue(namespace, name, op);
        let waited = self.opts.budget.deadline + Duration::from_secs(1);
        match tokio::time::timeout(waited, rx).await {
            Ok(Ok(a)) => a,
            Ok(Err(_)) => Answer::Failed(CommitError::Stopped {
                quota: format!("{namespace}/{name}"),
            }),
            Err(_) => Answer::Failed(CommitError::Timeout {
                quota: format!("{namespace}/{name}"),
                waited,
            }),
        }
    }

    /// Queues `op` without waiting (a release nobody waits for).
    pub fn submit_detached(self: &Arc<Self>, namespace: &str, name: &str, op: Op) {
        drop(self.enqueue(namespace, name, op));
    }

    fn enqueue(self: &Arc<Self>, namespace: &str, name: &str, op: Op) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        let queue = lock(&self.queues)
            .entry((namespace.to_string(), name.to_string()))
            .or_insert_with(|| {
                Arc::new(QuotaQueue {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    state: Mutex::new(QueueState::default()),
                })
            })
            .clone();
        let start = {
            let mut s = lock(&queue.state);
            s.pending.push_back(Pending {
                op,
                attempts: 0,
                tx: Some(tx),
            });
            !std::mem::replace(&mut s.running, true)
        };
        if start {
            let me = self.clone();
            tokio::spawn(async move { me.drain(queue).await });
        }
        rx
    }

    /// The batch task: batches until the queue is empty.
    async fn drain(self: Arc<Self>, queue: Arc<QuotaQueue>) {
        let api: Api<GpuQuota> = Api::namespaced(self.client.clone(), &queue.namespace);
        let mut last = lock(&queue.state).last.take();
        loop {
            let batch: Vec<Pending> = {
                let mut s = lock(&queue.state);
                if s.pending.is_empty() {
                    s.running = false;
                    s.last = last;
                    return;
                }
                let n = s.pending.len().min(self.opts.max_batch.max(1));
                s.pending.drain(..n).collect()
            };
            let retry = self.round(&api, &queue, &mut last, batch).await;
            if !retry.is_empty() {
                let mut s = lock(&queue.state);
                for p in retry.into_iter().rev() {
                    s.pending.push_front(p);
                }
            }
        }
    }

    fn peers(&self, quota: &GpuQuota) -> Vec<GpuQuota> {
        let Some(cohort) = quota.spec.cohort.as_deref() else {
            return Vec::new();
        };
        let id = quota.id();
        self.quotas
            .state()
            .iter()
            .filter(|p| p.spec.cohort.as_deref() == Some(cohort) && p.id() != id)
            .map(|p| (**p).clone())
            .collect()
    }

    /// `remembered`, or the watch cache's copy when that is newer (the controller wrote since):
    /// deciding on it spares a 409 and a read.
    fn newest(&self, remembered: GpuQuota) -> GpuQuota {
        let version = |q: &GpuQuota| {
            q.metadata
                .resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
        };
        let cached = self.quotas.get(&ObjectRef::from_obj(&remembered));
        match (cached, version(&remembered)) {
            (Some(c), Some(mine)) if version(&c).is_some_and(|v| v > mine) => (*c).clone(),
            _ => remembered,
        }
    }

    /// The cohort's other quotas, read now.
    async fn fresh_peers(&self, quota: &GpuQuota) -> Result<Vec<GpuQuota>, kube::Error> {
        let mut out = Vec::new();
        for p in self.peers(quota) {
            let (Some(ns), Some(name)) = (p.metadata.namespace.as_deref(), &p.metadata.name) else {
                continue;
            };
            let api: Api<GpuQuota> = Api::namespaced(self.client.clone(), ns);
            if let Some(q) = api.get_opt(name).await? {
                out.push(q);
            }
        }
        Ok(out)
    }

    /// Decides and writes one batch, answers what is final, and returns the ops to decide
    /// again (borrowers whose borrowing did not hold up).
    async fn round(
        &self,
        api: &Api<GpuQuota>,
        queue: &QuotaQueue,
        last: &mut Option<GpuQuota>,
        mut batch: Vec<Pending>,
    ) -> Vec<Pending> {
        use std::sync::atomic::Ordering::Relaxed;
        let id = format!("{}/{}", queue.namespace, queue.name);
        let ops: Vec<Op> = batch.iter().map(|p| p.op.clone()).collect();
        let start = Instant::now();
        let budget = self.opts.budget;
        let mut attempt = 0u32;
        self.counters.batches.fetch_add(1, Relaxed);
        // Every waiter of the batch gets `answer` (one that was already answered keeps its own).
        let answer_all = |batch: &mut Vec<Pending>, answer: Answer| {
            for p in batch.iter_mut() {
                if let Some(tx) = p.tx.take() {
                    let _ = tx.send(answer.clone());
                }
            }
        };
        let fail = |batch: &mut Vec<Pending>, e: CommitError| answer_all(batch, Answer::Failed(e));
        let (written, outcomes) = loop {
            attempt += 1;
            let (mut quota, fresh) = match last.take().map(|q| self.newest(q)) {
                Some(q) => (q, false),
                None => match api.get_opt(&queue.name).await {
                    Ok(Some(q)) => (q, true),
                    Ok(None) => {
                        answer_all(&mut batch, Answer::Gone);
                        return Vec::new();
                    }
                    Err(e) => {
                        fail(
                            &mut batch,
                            CommitError::Api {
                                quota: id.clone(),
                                message: e.to_string(),
                            },
                        );
                        return Vec::new();
                    }
                },
            };
            let peers = self.peers(&quota);
            let decided = decide_batch(&mut quota, &peers, &ops);
            if !decided.changed {
                if fresh {
                    break (quota, decided.outcomes);
                }
                // Decided on the remembered state: answer only from a fresh read.
                continue;
            }
            self.counters.writes.fetch_add(1, Relaxed);
            match api
                .replace_status(&queue.name, &PostParams::default(), &quota)
                .await
            {
                Ok(q) => break (q, decided.outcomes),
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    self.counters.conflicts.fetch_add(1, Relaxed);
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    answer_all(&mut batch, Answer::Gone);
                    return Vec::new();
                }
                Err(e) => {
                    // The write may or may not have landed: nobody is admitted; a
                    // reservation that did land is collected by the controller.
                    fail(
                        &mut batch,
                        CommitError::Api {
                            quota: id.clone(),
                            message: e.to_string(),
                        },
                    );
                    return Vec::new();
                }
            }
            if attempt >= budget.max_attempts || start.elapsed() >= budget.deadline {
                fail(
                    &mut batch,
                    CommitError::Contended {
                        quota: id.clone(),
                        attempts: attempt,
                        elapsed: start.elapsed(),
                    },
                );
                return Vec::new();
            }
            // A little jitter spreads competing replicas apart.
            let jitter = u64::from(start.elapsed().subsec_nanos() % 5_000)
                + u64::from(attempt.min(20)) * 200;
            tokio::time::sleep(Duration::from_micros(jitter)).await;
        };

        // Borrowers: check again against the cohort as it is now, after our write.
        let mut again: HashMap<usize, Denial> = HashMap::new();
        if borrows(&outcomes) {
            match self.fresh_peers(&written).await {
                Ok(fresh) => {
                    again.extend(stale_borrowers(&written, &fresh, &ops, &outcomes));
                }
                Err(e) => {
                    let err = CommitError::Api {
                        quota: id.clone(),
                        message: format!("reading the cohort: {e}"),
                    };
                    for (i, o) in outcomes.iter().enumerate() {
                        if matches!(o, Outcome::Fits(f) if !f.borrowed.is_empty()) {
                            again.insert(
                                i,
                                Denial {
                                    quota: id.clone(),
                                    reasons: vec![format!("{err}; try again")],
                                },
                            );
                        }
                    }
                }
            }
        }
        *last = Some(written);

        let mut retry = Vec::new();
        for (i, (mut p, outcome)) in batch.into_iter().zip(outcomes).enumerate() {
            if let Some(denial) = again.remove(&i) {
                p.attempts += 1;
                if p.attempts < BORROW_ATTEMPTS {
                    if let Op::Reserve { retreat, .. } = &mut p.op {
                        *retreat = true;
                    }
                    retry.push(p);
                } else {
                    if let Some(tx) = p.tx.take() {
                        let _ = tx.send(Answer::Denied(denial));
                    }
                    retry.push(Pending {
                        op: Op::Release { key: p.op.key() },
                        attempts: 0,
                        tx: None,
                    });
                }
                continue;
            }
            let answer = match outcome {
                Outcome::Fits(f) => Answer::Fits(f),
                Outcome::Denied(d) => Answer::Denied(d),
                Outcome::Queued => Answer::Queued,
                Outcome::Released => Answer::Released,
                Outcome::Failed(message) => Answer::Failed(CommitError::Math {
                    quota: id.clone(),
                    message,
                }),
            };
            if let Some(tx) = p.tx.take() {
                let _ = tx.send(answer);
            }
        }
        if !retry.is_empty() {
            // Let the other borrower's batch finish before deciding again.
            let pause = 200 + u64::from(start.elapsed().subsec_nanos() % 2_000);
            tokio::time::sleep(Duration::from_micros(pause)).await;
        }
        retry
    }
}
