//! The one home for polling: look at a check until it proves the awaited state, and fail naming
//! what was awaited once a time limit has passed (a hang guard, not a timing assertion). The
//! async forms serve the tests on tokio; the blocking form serves the real-cluster tier
//! (tests/cluster, which also includes this file by path); all share one deadline policy.

use std::future::Future;
use std::time::{Duration, Instant};

/// The usual limit of the async forms, for callers without a limit of their own.
pub const LIMIT: Duration = Duration::from_secs(20);

/// The pause between two looks of the async forms (their checks are cheap reads).
const PAUSE: Duration = Duration::from_millis(20);

/// What a check answers: `true` or `Some(value)` once the awaited state is proven.
pub trait Check {
    /// What a proven state gives the caller (`()` for a `bool` check).
    type Proof;
    /// The proof, or `None` while the state is not there yet.
    fn proof(self) -> Option<Self::Proof>;
}

impl Check for bool {
    type Proof = ();
    fn proof(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Check for Option<T> {
    type Proof = T;
    fn proof(self) -> Option<T> {
        self
    }
}

/// The deadline policy every form shares: one deadline from the first look, a fixed pause
/// between looks, and a panic naming what was awaited (and how long) once it has passed.
struct Patience<'a> {
    what: &'a str,
    limit: Duration,
    deadline: Instant,
    pause: Duration,
}

impl<'a> Patience<'a> {
    fn new(what: &'a str, limit: Duration, pause: Duration) -> Self {
        let deadline = Instant::now() + limit;
        Self {
            what,
            limit,
            deadline,
            pause,
        }
    }

    /// After a look that proved nothing: the pause before the next look, or `None` once the
    /// deadline has passed.
    fn next_pause(&self) -> Option<Duration> {
        (Instant::now() < self.deadline).then_some(self.pause)
    }

    /// The failure once the deadline has passed, with `context` (if any) on its own lines.
    fn give_up(&self, context: &str) -> ! {
        let (limit, what) = (self.limit, self.what);
        if context.is_empty() {
            panic!("gave up after {limit:?} waiting for {what}");
        }
        panic!("gave up after {limit:?} waiting for {what}\n{context}");
    }
}

/// Waits until `check` proves the awaited state, looking every 20 ms; panics naming `what`
/// after `limit`. Gives the proof (`()` for a `bool` check).
pub async fn eventually<C: Check>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> C,
) -> C::Proof {
    eventually_async(what, limit, || std::future::ready(check())).await
}

/// [`eventually`] for a check that must await (an API call, a lock): `check` gives a future
/// of the answer.
pub async fn eventually_async<F, Fut>(
    what: &str,
    limit: Duration,
    mut check: F,
) -> <Fut::Output as Check>::Proof
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Check,
{
    let patience = Patience::new(what, limit, PAUSE);
    loop {
        if let Some(proof) = check().await.proof() {
            return proof;
        }
        let Some(pause) = patience.next_pause() else {
            patience.give_up("")
        };
        tokio::time::sleep(pause).await;
    }
}

/// The blocking form, for the real-cluster tier (its tests run no runtime).
pub mod blocking {
    use super::{Check, Patience};
    use std::time::Duration;

    /// The real cluster's limit: pods start, images load and kubelets sync in it.
    pub const LIMIT: Duration = Duration::from_secs(120);

    /// The pause between two looks (each look is a `kubectl` or an API call).
    const PAUSE: Duration = Duration::from_millis(250);

    /// Polls `check` every 250 ms until it gives a value; panics after [`LIMIT`] naming `what`.
    pub fn eventually<C: Check>(what: &str, check: impl FnMut() -> C) -> C::Proof {
        eventually_or(what, check, String::new)
    }

    /// [`eventually`], adding `context()` (e.g. a `kubectl describe`) to the panic message.
    pub fn eventually_or<C: Check>(
        what: &str,
        mut check: impl FnMut() -> C,
        context: impl FnOnce() -> String,
    ) -> C::Proof {
        let patience = Patience::new(what, LIMIT, PAUSE);
        loop {
            if let Some(proof) = check().proof() {
                return proof;
            }
            let Some(pause) = patience.next_pause() else {
                patience.give_up(&context())
            };
            std::thread::sleep(pause);
        }
    }
}
