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
//!
//! Escrow ([`crate::quota::escrow`]): once a batch has admitted to a Reject-mode quota, the
//! replica holds a share of its headroom in the status and admits within it at once, with no
//! write ([`Committer::submit`]'s fast path). The batch task records those admissions as
//! reservations every [`super::escrow::FLUSH_INTERVAL`], or at once when less than half of the share is
//! left (one write for all of them, which also re-sizes the share) and gives the share back after [`super::escrow::IDLE_RETURN`] without admissions. While a write is
//! in flight the fast path spends only what both the old and the new share cover, so whatever
//! the write's fate, the status covers every admission made. Denials that are only due to
//! another replica's share are decided again for up to half the deadline.

mod round;

use super::escrow::{EscrowDue, LocalEscrow};
use crate::quota::escrow;
use crate::quota::{Denial, Fit, GpuQuota, Op, ReservationState};
use kube::api::Api;
use kube::runtime::reflector::Store;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify};

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
#[derive(Debug, Clone)]
pub struct CommitOptions {
    /// Conflict retries of one batch; `deadline` also bounds how long a request waits for its
    /// answer (keep it well under the API server's 10 s webhook timeout).
    pub budget: RetryBudget,
    /// The most ops decided and written together.
    pub max_batch: usize,
    /// This replica process's name on its escrows (unique per process).
    pub holder: String,
    /// Hold escrows (false: every admission waits for its own batch's write).
    pub escrow: bool,
}

impl Default for CommitOptions {
    fn default() -> Self {
        CommitOptions {
            budget: RetryBudget::default(),
            max_batch: 256,
            holder: super::escrow::holder_name(&crate::elector::identity("gpuplane-webhook")),
            escrow: true,
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
    /// The quota's status holds as many reservations as it may: retry later.
    Backpressure(String),
    /// The quota does not exist any more.
    Gone,
    Failed(CommitError),
}

struct Pending {
    op: Op,
    attempts: u32,
    since: Instant,
    tx: Option<oneshot::Sender<Answer>>,
}

impl Pending {
    fn new(op: Op, tx: Option<oneshot::Sender<Answer>>) -> Pending {
        Pending {
            op,
            attempts: 0,
            since: Instant::now(),
            tx,
        }
    }
}

#[derive(Default)]
struct QueueState {
    pending: VecDeque<Pending>,
    running: bool,
    /// The quota as this replica last wrote or read it.
    last: Option<GpuQuota>,
    escrow: LocalEscrow,
}

struct QuotaQueue {
    namespace: String,
    name: String,
    state: Mutex<QueueState>,
    /// Wakes a batch task waiting for its escrow's next flush when an op arrives.
    wake: Notify,
}

/// Writes counted by outcome (what `/metrics` and the bench report).
#[derive(Debug, Default)]
pub struct CommitCounters {
    pub batches: std::sync::atomic::AtomicU64,
    pub writes: std::sync::atomic::AtomicU64,
    pub conflicts: std::sync::atomic::AtomicU64,
    /// Admissions made within an escrow (no write waited for).
    pub escrowed: std::sync::atomic::AtomicU64,
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

    /// Answers `op` from this replica's escrow for GpuQuota `namespace/name` when it can, or
    /// puts it on the quota's queue and waits for its answer.
    pub async fn submit(self: &Arc<Self>, namespace: &str, name: &str, op: Op) -> Answer {
        if let Some(answer) = self.from_escrow(namespace, name, &op) {
            return answer;
        }
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
        if self.from_escrow(namespace, name, &op).is_none() {
            drop(self.enqueue(namespace, name, op));
        }
    }

    /// The fast path: a reservation admitted within this replica's escrow (recorded by the
    /// next flush), or a release of one not yet recorded.
    fn from_escrow(self: &Arc<Self>, namespace: &str, name: &str, op: &Op) -> Option<Answer> {
        if !self.opts.escrow {
            return None;
        }
        let queue = lock(&self.queues)
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()?;
        let now = Instant::now();
        let answer = {
            let mut s = lock(&queue.state);
            let answer = match op {
                Op::Reserve {
                    reservation,
                    charge,
                    retreat: false,
                } if escrow::priced(s.escrow.hard(), charge) => {
                    let mut r = reservation.clone();
                    r.state = ReservationState::Reserved;
                    r.charge = charge.usage.clone();
                    s.escrow
                        .admit(&r, now)
                        .then(|| Answer::Fits(Fit::default()))
                }
                Op::Release { key } => s.escrow.release(key).then_some(Answer::Released),
                _ => None,
            }?;
            if !std::mem::replace(&mut s.running, true) {
                let me = self.clone();
                let q = queue.clone();
                tokio::spawn(async move { me.drain(q).await });
            } else if s.escrow.low() {
                queue.wake.notify_one();
            }
            answer
        };
        if matches!(answer, Answer::Fits(_)) {
            self.counters
                .escrowed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Some(answer)
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
                    wake: Notify::new(),
                })
            })
            .clone();
        let start = {
            let mut s = lock(&queue.state);
            s.pending.push_back(Pending::new(op, Some(tx)));
            !std::mem::replace(&mut s.running, true)
        };
        queue.wake.notify_one();
        if start {
            let me = self.clone();
            tokio::spawn(async move { me.drain(queue).await });
        }
        rx
    }

    /// The batch task: batches until the queue is empty and its escrow owes nothing.
    async fn drain(self: Arc<Self>, queue: Arc<QuotaQueue>) {
        let api: Api<GpuQuota> = Api::namespaced(self.client.clone(), &queue.namespace);
        let mut last = lock(&queue.state).last.take();
        loop {
            let next = {
                let mut s = lock(&queue.state);
                let due = match s.pending.is_empty() {
                    true => s.escrow.due(Instant::now()),
                    false => EscrowDue::Now,
                };
                if let EscrowDue::Nothing = due {
                    s.running = false;
                    s.last = last;
                    return;
                }
                let n = s.pending.len().min(self.opts.max_batch.max(1));
                (due, s.pending.drain(..n).collect::<Vec<Pending>>())
            };
            let batch = match next {
                (EscrowDue::In(wait), _) => {
                    // An op arriving meanwhile is batched at once.
                    let _ = tokio::time::timeout(wait, queue.wake.notified()).await;
                    continue;
                }
                (_, batch) => batch,
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
}
