//! Leader election over a Lease: exactly one leader, take-over only after the silent leader's
//! Lease expires, and only the leader runs the work.

use super::*;

fn fast_lease() -> LeaseTimings {
    LeaseTimings {
        lease_duration: Duration::from_secs(1),
        renew_deadline: Duration::from_millis(600),
        retry_period: Duration::from_millis(100),
    }
}

fn candidate(server: &ApiServerDouble, id: &str) -> Elector {
    Elector::new(server.client().unwrap(), NS, LEASE, id, fast_lease()).unwrap()
}

#[tokio::test]
async fn two_candidates_racing_for_a_missing_lease_elect_exactly_one() {
    let server = ApiServerDouble::start().await.unwrap();
    for round in 0..5 {
        let name = format!("{LEASE}-{round}");
        let mk = |id| Elector::new(server.client().unwrap(), NS, &name, id, fast_lease()).unwrap();
        let (mut a, mut b) = (mk("a"), mk("b"));
        let (ra, rb) = tokio::join!(a.step(), b.step());
        let roles = [ra.unwrap(), rb.unwrap()];
        let leaders = roles.iter().filter(|r| **r == Role::Leader).count();
        assert_eq!(leaders, 1, "round {round}: {roles:?}");
        // A second round tells the loser who leads.
        let (ra, rb) = tokio::join!(a.step(), b.step());
        let roles = [ra.unwrap(), rb.unwrap()];
        assert!(
            roles == [Role::Leader, Role::Follower(Some("a".into()))]
                || roles == [Role::Follower(Some("b".into())), Role::Leader],
            "{roles:?}"
        );
    }
}

#[tokio::test]
async fn a_follower_takes_over_only_after_the_silent_leader_lease_expires() {
    let server = ApiServerDouble::start().await.unwrap();
    let (mut a, mut b) = (candidate(&server, "a"), candidate(&server, "b"));
    assert_eq!(a.step().await.unwrap(), Role::Leader);
    assert_eq!(b.step().await.unwrap(), Role::Follower(Some("a".into())));
    // While a renews, b follows.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(a.step().await.unwrap(), Role::Leader);
        assert_eq!(b.step().await.unwrap(), Role::Follower(Some("a".into())));
    }
    // a dies (stops renewing): b takes over once a lease duration passed on its own clock.
    let died = Instant::now();
    let took_over = loop {
        if b.step().await.unwrap() == Role::Leader {
            break Instant::now();
        }
        assert!(died.elapsed() < Duration::from_secs(5), "b never took over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let after = took_over - died;
    assert!(
        after >= Duration::from_millis(850),
        "took over after {after:?}"
    );
    assert!(!a.is_leading(Instant::now()), "a must have stepped down");
    let l = lease(&server).await.spec.unwrap();
    assert_eq!(l.holder_identity.as_deref(), Some("b"));
    assert_eq!(l.lease_transitions, Some(1));
    assert_eq!(l.lease_duration_seconds, Some(1));
    // The old leader, back, follows.
    assert_eq!(a.step().await.unwrap(), Role::Follower(Some("b".into())));
}

/// (candidate, started (true) or stopped, when)
type WorkLog = Arc<Mutex<Vec<(&'static str, bool, Instant)>>>;

/// Runs `lead` for one candidate; its work records when it starts and stops. Also returns the
/// role the candidate publishes after its rounds.
fn spawn_candidate(
    server: &ApiServerDouble,
    id: &'static str,
    log: WorkLog,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    tokio::sync::watch::Receiver<Role>,
) {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (role_tx, role) = tokio::sync::watch::channel(Role::Follower(None));
    let el = candidate(server, id).reporting(role_tx);
    let task = tokio::spawn(async move {
        elector::lead(
            el,
            async move {
                let _ = stop_rx.await;
            },
            |stop| {
                let log = log.clone();
                async move {
                    log.lock().unwrap().push((id, true, Instant::now()));
                    stop.await;
                    log.lock().unwrap().push((id, false, Instant::now()));
                }
            },
        )
        .await
    });
    (stop_tx, task, role)
}

/// Waits until `log` shows `id`'s work started.
async fn wait_leads(log: &WorkLog, id: &str) {
    eventually_async(&format!("{id} leading"), LIMIT, || async {
        log.lock().unwrap().iter().any(|e| e.0 == id && e.1)
    })
    .await;
}

/// Waits until a candidate's `role` says it follows `leader`: a round of it has read the Lease
/// that `leader` holds (one that took the Lease would say `Leader`).
async fn wait_follows(role: &mut tokio::sync::watch::Receiver<Role>, leader: &str) {
    let want = Role::Follower(Some(leader.into()));
    let followed = tokio::time::timeout(Duration::from_secs(5), role.wait_for(|r| *r == want))
        .await
        .map(|r| r.is_ok());
    assert_eq!(
        followed,
        Ok(true),
        "never followed {leader}: {:?}",
        *role.borrow()
    );
}

fn leaders_over_time(log: &[(&'static str, bool, Instant)]) -> Vec<&'static str> {
    let mut running: Vec<&str> = Vec::new();
    let mut seq = Vec::new();
    for (id, started, _) in log {
        if *started {
            running.push(id);
            assert_eq!(running.len(), 1, "two leaders at once: {log:?}");
            seq.push(*id);
        } else {
            running.retain(|r| r != id);
        }
    }
    seq
}

#[tokio::test]
async fn only_the_leader_runs_the_work_and_a_shutdown_hands_over_at_once() {
    let server = ApiServerDouble::start().await.unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (stop_a, task_a, _) = spawn_candidate(&server, "a", log.clone());
    wait_leads(&log, "a").await;
    let (stop_b, task_b, mut role_b) = spawn_candidate(&server, "b", log.clone());
    wait_follows(&mut role_b, "a").await;
    assert_eq!(leaders_over_time(&log.lock().unwrap()), ["a"]);

    // A graceful shutdown releases the Lease: b leads well before a lease duration passes.
    let t = Instant::now();
    stop_a.send(()).unwrap();
    task_a.await.unwrap();
    let stopped_a = log.lock().unwrap().iter().any(|e| e.0 == "a" && !e.1);
    assert!(stopped_a, "a's work was not stopped before a returned");
    let b_started = loop {
        if let Some(e) = log.lock().unwrap().iter().find(|e| e.0 == "b" && e.1) {
            break e.2;
        }
        assert!(t.elapsed() < Duration::from_secs(3), "b never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        b_started - t < Duration::from_millis(600),
        "{:?}",
        b_started - t
    );
    assert_eq!(leaders_over_time(&log.lock().unwrap()), ["a", "b"]);
    stop_b.send(()).unwrap();
    task_b.await.unwrap();
    let l = lease(&server).await.spec.unwrap();
    assert_eq!(l.holder_identity, None);
}

#[tokio::test]
async fn a_killed_leader_is_replaced_after_the_lease_duration_and_never_overlaps() {
    let server = ApiServerDouble::start().await.unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (_stop_a, task_a, _) = spawn_candidate(&server, "a", log.clone());
    wait_leads(&log, "a").await;
    let (stop_b, task_b, mut role_b) = spawn_candidate(&server, "b", log.clone());
    wait_follows(&mut role_b, "a").await;
    // Kill a: no release, no more renewals.
    task_a.abort();
    let killed = Instant::now();
    // a's work died with it.
    log.lock().unwrap().push(("a", false, killed));
    let b_started = loop {
        if let Some(e) = log.lock().unwrap().iter().find(|e| e.0 == "b" && e.1) {
            break e.2;
        }
        assert!(killed.elapsed() < Duration::from_secs(5), "b never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let after = b_started - killed;
    assert!(
        after >= Duration::from_millis(400) && after < Duration::from_millis(2500),
        "b led {after:?} after the kill"
    );
    assert_eq!(leaders_over_time(&log.lock().unwrap()), ["a", "b"]);
    stop_b.send(()).unwrap();
    task_b.await.unwrap();
}
