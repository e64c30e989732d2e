//! Leader election I/O: reads and writes the Lease, following the decisions of the model's
//! `controller::lease` (to which it passes the runtime's clock, so tests with a paused clock
//! drive both), and runs work only while leading ([`lead`]).
//!
//! Every write carries the resourceVersion it read (PUT; create for a missing Lease), so two
//! candidates racing for one Lease cannot both win: the loser gets 409 and reads again.
//! After every round the candidate's [`Role`] is published for `/readyz` ([`Elector::reporting`]).

use gpuplane_model::controller::lease::{self, Decision, LeaseTimings, LeaseView, Observation};
use gpuplane_model::report::chain;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use std::future::Future;
use std::pin::Pin;
use tokio::sync::watch;
use tokio::time::Instant;

/// Why an election round failed (the round is retried after the retry period).
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    /// The API server answered with an error other than a lost race.
    #[error("{op} Lease {namespace}/{name}: {}", chain(.cause))]
    Api {
        op: &'static str,
        namespace: String,
        name: String,
        cause: Box<kube::Error>,
    },
    /// The API server did not answer within the time left.
    #[error("Lease {namespace}/{name}: no answer in time")]
    Timeout { namespace: String, name: String },
    /// The timings are not usable.
    #[error("leader election timings: {0}")]
    Timings(String),
}

/// Where a candidate stands after a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Leader,
    /// Someone else leads (`Some`), or nobody does yet.
    Follower(Option<String>),
}

/// One candidate for one Lease.
pub struct Elector {
    api: Api<Lease>,
    namespace: String,
    name: String,
    identity: String,
    timings: LeaseTimings,
    observed: Option<Observation>,
    /// Start of the last successful create/renew/take-over request, while we hold the Lease.
    renewed_at: Option<Instant>,
    /// Where the role is published after each round.
    role: watch::Sender<Role>,
}

impl Elector {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        timings: LeaseTimings,
    ) -> Result<Elector, ElectionError> {
        timings.validate().map_err(ElectionError::Timings)?;
        Ok(Elector {
            api: Api::namespaced(client, namespace),
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            timings,
            observed: None,
            renewed_at: None,
            role: watch::channel(Role::Follower(None)).0,
        })
    }

    /// Publishes this candidate's role on `role` after every round of [`Elector::campaign`].
    pub fn reporting(mut self, role: watch::Sender<Role>) -> Elector {
        self.role = role;
        self
    }

    /// The role at `now`: leading, or following whoever else holds the Lease as last read.
    fn role_at(&self, now: Instant) -> Role {
        if self.is_leading(now) {
            return Role::Leader;
        }
        Role::Follower(
            self.observed
                .as_ref()
                .and_then(|o| o.view.holder.clone())
                .filter(|h| *h != self.identity),
        )
    }

    fn publish_role(&self, now: Instant) {
        let role = self.role_at(now);
        self.role.send_if_modified(|r| {
            let changed = *r != role;
            *r = role;
            changed
        });
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether we lead at `now`: we hold the Lease and renewed it within the renew deadline.
    pub fn is_leading(&self, now: Instant) -> bool {
        self.renewed_at
            .is_some_and(|r| lease::still_leading(r.into_std(), now.into_std(), &self.timings))
    }

    fn api_error(&self, op: &'static str, source: kube::Error) -> ElectionError {
        ElectionError::Api {
            op,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            cause: Box::new(source),
        }
    }

    /// One round: read the Lease, decide, write. A lost race (409) is not an error: the
    /// next round reads the winner.
    pub async fn step(&mut self) -> Result<Role, ElectionError> {
        let start = Instant::now();
        let current = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|e| self.api_error("reading", e))?;
        self.observed = current
            .as_ref()
            .map(|l| lease::observe(self.observed.as_ref(), view_of(l), start.into_std()));
        let decision = lease::decide(
            &self.identity,
            self.observed.as_ref(),
            start.into_std(),
            &self.timings,
        );
        let written = match (decision, current) {
            (Decision::Follow { holder, .. }, _) => {
                self.renewed_at = None;
                return Ok(Role::Follower(Some(holder)));
            }
            (Decision::Create, _) | (_, None) => {
                let fresh = self.fresh_lease();
                match self.api.create(&PostParams::default(), &fresh).await {
                    Ok(l) => l,
                    Err(e) if is_conflict(&e) => return Ok(self.lost_race()),
                    Err(e) => return Err(self.api_error("creating", e)),
                }
            }
            (d @ (Decision::Renew | Decision::TakeOver), Some(mut l)) => {
                let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
                let spec = l.spec.get_or_insert_with(LeaseSpec::default);
                if d == Decision::TakeOver {
                    spec.acquire_time = Some(now.clone());
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.holder_identity = Some(self.identity.clone());
                spec.lease_duration_seconds = Some(self.timings.lease_seconds());
                spec.renew_time = Some(now);
                match self
                    .api
                    .replace(&self.name, &PostParams::default(), &l)
                    .await
                {
                    Ok(l) => l,
                    Err(e) if is_conflict(&e) => return Ok(self.lost_race()),
                    Err(e) => return Err(self.api_error("updating", e)),
                }
            }
        };
        self.observed = Some(lease::observe(None, view_of(&written), start.into_std()));
        self.renewed_at = Some(start);
        Ok(Role::Leader)
    }

    /// Someone wrote between our read and our write. A leader keeps leading until its deadline
    /// (the next round will tell whether the Lease is still ours).
    fn lost_race(&mut self) -> Role {
        if self.is_leading(Instant::now()) {
            Role::Leader
        } else {
            self.renewed_at = None;
            Role::Follower(None)
        }
    }

    fn fresh_lease(&self) -> Lease {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.identity.clone()),
                lease_duration_seconds: Some(self.timings.lease_seconds()),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        }
    }

    /// Gives the Lease up if we hold it (holder cleared, so a follower takes it at once).
    /// Call only after the work has stopped.
    pub async fn release(&mut self) -> Result<(), ElectionError> {
        self.renewed_at = None;
        for _ in 0..3 {
            let Some(mut l) = self
                .api
                .get_opt(&self.name)
                .await
                .map_err(|e| self.api_error("reading", e))?
            else {
                return Ok(());
            };
            let spec = l.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
            match self
                .api
                .replace(&self.name, &PostParams::default(), &l)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(self.api_error("releasing", e)),
            }
        }
        Ok(())
    }

    /// Runs rounds until `quit` turns true, publishing whether we lead on `leading`; then
    /// releases the Lease if held.
    pub async fn campaign(mut self, leading: watch::Sender<bool>, mut quit: watch::Receiver<bool>) {
        let t = self.timings;
        loop {
            if *quit.borrow() {
                break;
            }
            let start = Instant::now();
            let budget = match self.renewed_at {
                Some(r) if self.is_leading(start) => (r + t.renew_deadline) - start,
                _ => t.renew_deadline,
            };
            match tokio::time::timeout(budget, self.step()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(identity = %self.identity, error = %e, "leader election round failed")
                }
                Err(_) => tracing::warn!(
                    identity = %self.identity,
                    error = %ElectionError::Timeout { namespace: self.namespace.clone(), name: self.name.clone() },
                    "leader election round failed"
                ),
            }
            let now = Instant::now();
            let lead = self.is_leading(now);
            self.publish_role(now);
            leading.send_if_modified(|l| {
                let changed = *l != lead;
                if changed {
                    tracing::info!(identity = %self.identity, lease = %self.name, leading = lead, "leadership changed");
                }
                *l = lead;
                changed
            });
            let mut next = start + t.retry_period;
            if let Some(r) = self.renewed_at.filter(|_| lead) {
                next = next.min(r + t.renew_deadline);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = quit.changed() => {}
            }
            // Leadership may have lapsed while sleeping (the deadline is one of the wake-ups).
            if !self.is_leading(Instant::now()) {
                leading.send_if_modified(|l| std::mem::replace(l, false));
                self.publish_role(Instant::now());
            }
        }
        leading.send_replace(false);
        self.role.send_replace(Role::Follower(None));
        if let Err(e) = self.release().await {
            tracing::warn!(identity = %self.identity, error = %e, "releasing the Lease failed");
        }
    }
}

/// A future that resolves when the work must stop.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs `work` whenever `elector` leads, until `shutdown`. `work` gets a stop signal that
/// resolves when leadership is lost or shutdown begins, and should return soon after; it is
/// awaited to the end before the Lease is released, so a successor never overlaps with it.
pub async fn lead<W, Fut>(elector: Elector, shutdown: impl Future<Output = ()>, mut work: W)
where
    W: FnMut(StopSignal) -> Fut,
    Fut: Future<Output = ()>,
{
    let (leading_tx, mut leading) = watch::channel(false);
    let (quit_tx, quit_rx) = watch::channel(false);
    let (shut_tx, shut_rx) = watch::channel(false);
    // Dropping `lead` (the process going away) stops campaigning too, without a release.
    let mut election = AbortOnDrop(Some(tokio::spawn(elector.campaign(leading_tx, quit_rx))));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            r = leading.wait_for(|l| *l) => if r.is_err() { break },
        }
        let mut lost = leading.clone();
        let mut shutting = shut_rx.clone();
        let stop: StopSignal = Box::pin(async move {
            tokio::select! {
                _ = lost.wait_for(|l| !*l) => {}
                _ = shutting.wait_for(|s| *s) => {}
            }
        });
        let running = work(stop);
        tokio::pin!(running);
        loop {
            tokio::select! {
                _ = &mut shutdown, if !*shut_tx.borrow() => {
                    shut_tx.send_replace(true);
                }
                _ = &mut running => break,
            }
        }
        if *shut_tx.borrow() {
            break;
        }
    }
    // Only now, with the work finished, may the Lease go.
    quit_tx.send_replace(true);
    if let Some(task) = election.0.take() {
        if let Err(e) = task.await {
            tracing::warn!(error = %e, "the leader election task failed");
        }
    }
}

struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.abort();
        }
    }
}

fn view_of(l: &Lease) -> LeaseView {
    let spec = l.spec.as_ref();
    LeaseView {
        holder: spec
            .and_then(|s| s.holder_identity.clone())
            .filter(|h| !h.is_empty()),
        duration: spec
            .and_then(|s| s.lease_duration_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map(std::time::Duration::from_secs),
        version: l.metadata.resource_version.clone().unwrap_or_default(),
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// A replica identity: `host` (the pod name in a Deployment) and a process-unique suffix, so
/// a restarted process never mistakes the Lease for its own.
pub fn identity(host: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{host}_{:x}{:05x}", std::process::id(), nanos & 0xfffff)
}
