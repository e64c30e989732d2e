//! The driver both controller loops share (the quota loop and the namespace labeler): inputs
//! from watches mark namespaces due after a short batch window, namespaces come due again when
//! a reconcile asks (a deadline, a backoff), and every known namespace comes due at each resync.
//! A loop may also have periodic work of its own (a tick). Nothing runs before the loop's
//! caches have listed once.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A loop over namespaces.
pub trait Keyed {
    type Input;
    /// Whether the caches are filled enough to decide.
    fn ready(&self) -> bool;
    /// Applies one input; the namespaces to reconcile because of it.
    fn apply(&mut self, input: Self::Input) -> BTreeSet<String>;
    /// Every namespace a resync reconciles.
    fn known(&self) -> BTreeSet<String>;
    /// Reconciles `due`; when each wants to run again, if it does.
    fn run(&mut self, due: Vec<String>) -> impl Future<Output = Vec<(String, Instant)>> + Send;
    /// When the loop's own periodic work ([`Keyed::tick`]) is due, if it has any.
    fn next_tick(&self) -> Option<Instant> {
        None
    }
    /// The loop's periodic work (the quota loop's GPU-hours flush); the namespaces to
    /// reconcile because of it.
    fn tick(&mut self) -> impl Future<Output = BTreeSet<String>> + Send {
        async { BTreeSet::new() }
    }
}

/// How the driver schedules.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Inputs arriving within this window are handled in one run.
    pub batch: Duration,
    /// Every known namespace is reconciled at least this often.
    pub resync: Duration,
    /// An input brings a namespace forward when it is due later (the quota loop: a
    /// reservation's grace may be minutes away); otherwise a namespace already due (a backoff)
    /// keeps its time (the labeler: the retry reads the caches anyway).
    pub sooner: bool,
}

/// Runs `k` until `stop` resolves or the inputs end.
pub async fn drive<K: Keyed>(
    k: &mut K,
    mut inputs: mpsc::Receiver<K::Input>,
    timing: Timing,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    let mut due: BTreeMap<String, Instant> = BTreeMap::new();
    let schedule = |due: &mut BTreeMap<String, Instant>, ns: String, at: Instant| {
        let e = due.entry(ns).or_insert(at);
        if timing.sooner {
            *e = (*e).min(at);
        }
    };
    let mut next_resync = Instant::now() + timing.resync;
    loop {
        let wake = due
            .values()
            .min()
            .copied()
            .unwrap_or(next_resync)
            .min(next_resync)
            .min(k.next_tick().unwrap_or(next_resync));
        let ready = k.ready();
        tokio::select! {
            biased;
            _ = &mut stop => break,
            msg = inputs.recv() => {
                let Some(input) = msg else { break };
                let at = Instant::now() + timing.batch;
                for ns in k.apply(input) {
                    schedule(&mut due, ns, at);
                }
            }
            _ = tokio::time::sleep_until(wake), if ready => {
                let now = Instant::now();
                if now >= next_resync {
                    for ns in k.known() {
                        schedule(&mut due, ns, now);
                    }
                    next_resync = now + timing.resync;
                }
                if k.next_tick().is_some_and(|t| t <= now) {
                    for ns in k.tick().await {
                        schedule(&mut due, ns, now);
                    }
                }
                let run: Vec<String> = due
                    .iter()
                    .filter(|(_, t)| **t <= now)
                    .map(|(ns, _)| ns.clone())
                    .collect();
                for ns in &run {
                    due.remove(ns);
                }
                for (ns, at) in k.run(run).await {
                    schedule(&mut due, ns, at);
                }
            }
        }
    }
}
