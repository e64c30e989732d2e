//! One round of a quota's batch task: decide the batch on the newest state, write the status
//! (deciding again on a conflict), re-check borrowers against the cohort as it is after the
//! write, answer what is final and hand back what is decided again.

use super::{lock, Answer, CommitError, Committer, Pending, QuotaQueue, BORROW_ATTEMPTS};
use crate::quota::escrow::{self, EscrowRound};
use crate::quota::{
    borrows, decide_batch, stale_borrowers, Decided, Denial, GpuQuota, Op, Outcome, Usage,
};
use crate::webhook::escrow::LocalEscrow;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::ObjectRef;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A request held by another replica's escrow is decided again after this pause.
const HELD_PAUSE: Duration = Duration::from_millis(10);

impl Committer {
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
    /// again (borrowers whose borrowing did not hold up, admissions held by other replicas'
    /// escrows).
    pub(super) async fn round(
        &self,
        api: &Api<GpuQuota>,
        queue: &QuotaQueue,
        last: &mut Option<GpuQuota>,
        mut batch: Vec<Pending>,
    ) -> Vec<Pending> {
        self.counters
            .batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}/{}", queue.namespace, queue.name);
        let ops: Vec<Op> = batch.iter().map(|p| p.op.clone()).collect();
        let start = Instant::now();
        let (written, outcomes) = match self.settle(api, queue, last, &ops, &id, start).await {
            Ok(done) => done,
            Err(answer) => {
                // Every waiter gets it (one that was already answered keeps its own).
                for p in batch.iter_mut() {
                    if let Some(tx) = p.tx.take() {
                        let _ = tx.send(answer.clone());
                    }
                }
                return Vec::new();
            }
        };
        // Borrowers: check again against the cohort as it is now, after our write.
        let again = if borrows(&outcomes) {
            self.recheck_borrowers(&written, &ops, &outcomes, &id).await
        } else {
            HashMap::new()
        };
        *last = Some(written);
        let (retry, held) = self.answer(queue, batch, outcomes, again, &id);
        if held {
            // Give the other replicas time to spend or give back their escrows.
            tokio::time::sleep(HELD_PAUSE).await;
        } else if !retry.is_empty() {
            // Let the other borrower's batch finish before deciding again.
            let pause = 200 + u64::from(start.elapsed().subsec_nanos() % 2_000);
            tokio::time::sleep(Duration::from_micros(pause)).await;
        }
        retry
    }

    /// Decides `ops` and writes the status until a write lands (or no write is needed, on a
    /// fresh read); a conflict decides again. `Err`: the answer every waiter gets.
    async fn settle(
        &self,
        api: &Api<GpuQuota>,
        queue: &QuotaQueue,
        last: &mut Option<GpuQuota>,
        ops: &[Op],
        id: &str,
        start: Instant,
    ) -> Result<(GpuQuota, Vec<Outcome>), Answer> {
        use std::sync::atomic::Ordering::Relaxed;
        let budget = self.opts.budget;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let (mut quota, fresh) = self.state_to_decide(api, queue, last, id).await?;
            let decided = self.decide(queue, &mut quota, ops);
            if !decided.changed {
                if fresh {
                    return Ok((quota, decided.outcomes));
                }
                // Decided on the remembered state: answer only from a fresh read.
                continue;
            }
            self.counters.writes.fetch_add(1, Relaxed);
            let result = api
                .replace_status(&queue.name, &PostParams::default(), &quota)
                .await;
            match write_fate(queue, result, decided.escrow, id) {
                Some(Ok(q)) => return Ok((q, decided.outcomes)),
                Some(Err(answer)) => return Err(answer),
                None => {
                    self.counters.conflicts.fetch_add(1, Relaxed);
                }
            }
            if attempt >= budget.max_attempts || start.elapsed() >= budget.deadline {
                return Err(Answer::Failed(CommitError::Contended {
                    quota: id.to_string(),
                    attempts: attempt,
                    elapsed: start.elapsed(),
                }));
            }
            // A little jitter spreads competing replicas apart.
            let jitter = u64::from(start.elapsed().subsec_nanos() % 5_000)
                + u64::from(attempt.min(20)) * 200;
            tokio::time::sleep(Duration::from_micros(jitter)).await;
        }
    }

    /// The quota to decide on, and whether it was read just now: the remembered state (or the
    /// watch cache's newer copy), else a read. `Err`: the quota is gone or cannot be read.
    async fn state_to_decide(
        &self,
        api: &Api<GpuQuota>,
        queue: &QuotaQueue,
        last: &mut Option<GpuQuota>,
        id: &str,
    ) -> Result<(GpuQuota, bool), Answer> {
        if let Some(q) = last.take() {
            return Ok((self.newest(q), false));
        }
        match api.get_opt(&queue.name).await {
            Ok(Some(q)) => Ok((q, true)),
            Ok(None) => {
                lock(&queue.state).escrow = LocalEscrow::default();
                Err(Answer::Gone)
            }
            Err(e) => Err(api_failure(id, e.to_string())),
        }
    }

    /// Decides `ops` on `quota` with this replica's escrow work, under the queue's lock (so
    /// the fast path sees the write's budget from the moment the write is decided).
    fn decide(&self, queue: &QuotaQueue, quota: &mut GpuQuota, ops: &[Op]) -> Decided {
        let now = Timestamp::now();
        let peers: Vec<GpuQuota> = self
            .peers(quota)
            .into_iter()
            .map(|p| p.in_force(now))
            .collect();
        // Eligibility on the spec as written (raises rule escrow out); the decision on the
        // spec in force now. Only the status is written, but `quota` is remembered for the
        // next round, so its own spec goes back.
        let eligible = self.opts.escrow && escrow::eligible(quota);
        let in_force = quota.spec.in_force(now);
        let written = std::mem::replace(&mut quota.spec, in_force);
        let mut s = lock(&queue.state);
        let e = &mut s.escrow;
        e.set_quota(quota.spec.hard.clone(), eligible);
        let round = self.opts.escrow.then(|| EscrowRound {
            holder: self.opts.holder.clone(),
            flush: e.unflushed().to_vec(),
            unit: e.wanted(ops, Instant::now()),
            now,
        });
        let d = decide_batch(quota, &peers, ops, round.as_ref());
        quota.spec = written;
        if d.changed {
            e.start_flight(&d.escrow);
        }
        d
    }

    /// The borrowing admissions of a written batch that no longer fit the cohort as read now.
    async fn recheck_borrowers(
        &self,
        written: &GpuQuota,
        ops: &[Op],
        outcomes: &[Outcome],
        id: &str,
    ) -> HashMap<usize, Denial> {
        match self.fresh_peers(written).await {
            Ok(fresh) => {
                let now = Timestamp::now();
                let fresh: Vec<GpuQuota> = fresh.into_iter().map(|p| p.in_force(now)).collect();
                stale_borrowers(&written.clone().in_force(now), &fresh, ops, outcomes)
                    .into_iter()
                    .collect()
            }
            Err(e) => {
                let err = CommitError::Api {
                    quota: id.to_string(),
                    message: format!("reading the cohort: {e}"),
                };
                let denial = Denial {
                    quota: id.to_string(),
                    reasons: vec![format!("{err}; try again")],
                };
                outcomes
                    .iter()
                    .enumerate()
                    .filter(|(_, o)| matches!(o, Outcome::Fits(f) if !f.borrowed.is_empty()))
                    .map(|(i, _)| (i, denial.clone()))
                    .collect()
            }
        }
    }

    /// Answers what is final and returns what to decide again, and whether an admission is
    /// held by another replica's escrow.
    fn answer(
        &self,
        queue: &QuotaQueue,
        batch: Vec<Pending>,
        outcomes: Vec<Outcome>,
        mut again: HashMap<usize, Denial>,
        id: &str,
    ) -> (Vec<Pending>, bool) {
        let mut retry = Vec::new();
        let mut held = false;
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
                    retry.push(Pending::new(Op::Release { key: p.op.key() }, None));
                }
                continue;
            }
            if matches!(outcome, Outcome::Held(_))
                && p.since.elapsed() < self.opts.budget.deadline / 2
            {
                held = true;
                retry.push(p);
                continue;
            }
            if let (Op::Reserve { charge, .. }, Outcome::Fits(_)) = (&p.op, &outcome) {
                let mut s = lock(&queue.state);
                s.escrow.admitted(charge.usage.clone(), Instant::now());
            }
            let answer = match outcome {
                Outcome::Fits(f) => Answer::Fits(f),
                // Held past half the deadline: the denial is the answer.
                Outcome::Denied(d) | Outcome::Held(d) => Answer::Denied(d),
                Outcome::Queued => Answer::Queued,
                Outcome::Released => Answer::Released,
                Outcome::Backpressure(why) => Answer::Backpressure(why),
                Outcome::Failed(message) => Answer::Failed(CommitError::Math {
                    quota: id.to_string(),
                    message,
                }),
            };
            if let Some(tx) = p.tx.take() {
                let _ = tx.send(answer);
            }
        }
        (retry, held)
    }
}

/// What a status write's result means for the escrow, then for the batch: the quota as written,
/// the answer every waiter gets, or `None` for a conflict (decide again).
fn write_fate(
    queue: &QuotaQueue,
    result: Result<GpuQuota, kube::Error>,
    escrow: Usage,
    id: &str,
) -> Option<Result<GpuQuota, Answer>> {
    let mut s = lock(&queue.state);
    match result {
        Ok(q) => {
            s.escrow.landed(escrow, Instant::now());
            Some(Ok(q))
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            s.escrow.not_landed(false, &escrow);
            None
        }
        Err(kube::Error::Api(e)) if e.code == 404 => {
            s.escrow = LocalEscrow::default();
            Some(Err(Answer::Gone))
        }
        Err(e) => {
            // The write may or may not have landed: nobody is admitted; a reservation that did
            // land is collected by the controller.
            s.escrow.not_landed(true, &escrow);
            Some(Err(api_failure(id, e.to_string())))
        }
    }
}

fn api_failure(id: &str, message: String) -> Answer {
    Answer::Failed(CommitError::Api {
        quota: id.to_string(),
        message,
    })
}
