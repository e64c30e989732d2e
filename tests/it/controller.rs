//! The quota controller's loops against the API server double with the real kube client:
//! leader election over a Lease, and the queue that releases gated GPU pods.

use crate::support::eventually::{eventually_async, LIMIT};
use gpuplane_shell::controller::elector::{self, Elector, Role};
use gpuplane_shell::controller::lease::LeaseTimings;
use gpuplane_shell::controller::metrics::QueueMetrics;
use gpuplane_shell::controller::namespace::QueueSettings;
use gpuplane_shell::controller::queue::{self, QueueOptions};
use gpuplane_shell::quota::{GpuQuota, GpuQuotaSpec, Gpus, Limits, QuotaMode, SCHEDULING_GATE};
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const NS: &str = "gpuplane-system";
const LEASE: &str = "gpuplane-controller";

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

async fn lease(server: &ApiServerDouble) -> Lease {
    let api: Api<Lease> = Api::namespaced(server.client().unwrap(), NS);
    api.get(LEASE).await.unwrap()
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

// ---- the queue ----

const QNS: &str = "team-a";

struct Lab {
    server: ApiServerDouble,
    pods: Api<Pod>,
    metrics: Arc<QueueMetrics>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Lab {
    /// A Queue-mode GpuQuota `team-a/default` of `gpus` GPUs, and the loop running.
    async fn start(gpus: u64, bound: Duration) -> Lab {
        let server = ApiServerDouble::start().await.unwrap();
        let client = server.client().unwrap();
        let quotas: Api<GpuQuota> = Api::namespaced(client.clone(), QNS);
        let spec = GpuQuotaSpec {
            hard: Limits {
                gpus: Some(Gpus::whole(gpus)),
                ..Limits::default()
            },
            mode: QuotaMode::Queue,
            ..GpuQuotaSpec::default()
        };
        quotas
            .create(&PostParams::default(), &GpuQuota::new("default", spec))
            .await
            .unwrap();
        let metrics = Arc::new(QueueMetrics::default());
        let opts = QueueOptions {
            settings: QueueSettings {
                bound,
                grace: Duration::from_secs(120),
            },
            batch: Duration::from_millis(20),
            resync: Duration::from_millis(500),
            note_refresh: Duration::from_millis(200),
            ..QueueOptions::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let m = metrics.clone();
        let task = tokio::spawn(async move {
            let devices =
                gpuplane_shell::published::Devices::start(&client, opts.catalog.clone(), |_, _| {});
            queue::run(client, opts, devices, m, async {
                let _ = stopped.await;
            })
            .await
        });
        Lab {
            pods: Api::namespaced(server.client().unwrap(), QNS),
            server,
            metrics,
            stop: Some(stop),
            task: Some(task),
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }

    async fn create(&self, pod: serde_json::Value) -> Pod {
        let pod: Pod = serde_json::from_value(pod).unwrap();
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap()
    }

    async fn quota(&self) -> GpuQuota {
        let q: Api<GpuQuota> = Api::namespaced(self.server.client().unwrap(), QNS);
        q.get("default").await.unwrap()
    }

    /// Waits until the loop has run `n` more namespace reconciles and the quota has
    /// settled (used by tests that step the world).
    async fn cycles(&self, n: u64) {
        let start = self.metrics.snapshot().cycles;
        eventually_async("the loop to run", LIMIT, || async {
            self.metrics.snapshot().cycles >= start + n
        })
        .await;
    }
}

fn is_gated(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == SCHEDULING_GATE))
}

/// A GPU pod: gated (queued) or running on a node.
fn pod(name: &str, gpus: u32, gated: bool) -> serde_json::Value {
    let mut spec = json!({
        "containers": [{
            "name": "main",
            "image": "busybox",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}
        }]
    });
    if gated {
        spec["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
    } else {
        spec["nodeName"] = json!("node-1");
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": QNS},
        "spec": spec
    })
}

fn member(name: &str, group: &str, size: u32) -> serde_json::Value {
    let mut p = pod(name, 1, true);
    p["metadata"]["labels"] = json!({"quota.gpuplane.dev/pod-group": group});
    p["metadata"]["annotations"] = json!({"quota.gpuplane.dev/pod-group-size": size.to_string()});
    p
}

fn condition(p: &Pod) -> Option<(String, String, String)> {
    condition_of(p, "QuotaAdmitted")
}

/// The condition of type `type_` on `p`: status, reason, message.
fn condition_of(p: &Pod, type_: &str) -> Option<(String, String, String)> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                c.status.clone(),
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
}

async fn events_for(server: &ApiServerDouble, pod: &str) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(server.client().unwrap(), QNS);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(pod))
        .collect()
}

async fn delete(lab: &Lab, name: &str) {
    lab.pods
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

/// Binds a released pod to a node, as the scheduler would.
async fn bind(lab: &Lab, name: &str) {
    lab.pods
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": "node-1"}})),
        )
        .await
        .unwrap();
}

fn names(pods: &[Pod]) -> Vec<String> {
    pods.iter().map(|p| p.name_any()).collect()
}

#[tokio::test]
async fn a_four_pod_group_waits_for_four_free_devices_and_is_released_whole_in_one_cycle() {
    let lab = Lab::start(8, Duration::from_secs(3600)).await;
    for i in 0..6 {
        lab.create(pod(&format!("run-{i}"), 1, false)).await;
    }
    for i in 0..4 {
        lab.create(member(&format!("train-{i}"), "train", 4)).await;
    }
    // 2 free of 8: the group waits, and says why with the numbers. (A cycle that ran while
    // the members were still being created says first that members are missing.)
    eventually_async("the group's members to carry the reason", LIMIT, || async {
        let mut all = true;
        for i in 0..4 {
            let p = lab.pods.get(&format!("train-{i}")).await.unwrap();
            all &= condition(&p).is_some_and(|c| c.0 == "False" && c.2.contains("needs 4 gpus"));
        }
        all
    })
    .await;
    for i in 0..4 {
        let p = lab.pods.get(&format!("train-{i}")).await.unwrap();
        assert!(is_gated(&p));
        let (status, reason, message) = condition(&p).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "Waiting"));
        assert!(
            message.contains("needs 4 gpus, 2 free of 8 in GpuQuota team-a/default"),
            "{message}"
        );
        assert!(
            message.contains("pod group team-a/train (4 pods waiting)"),
            "{message}"
        );
    }
    let ev = events_for(&lab.server, "train-0").await;
    assert!(
        ev.iter()
            .any(|e| e.reason.as_deref() == Some("QuotaInsufficient")
                && e.message
                    .as_deref()
                    .is_some_and(|m| m.contains("needs 4 gpus, 2 free of 8"))),
        "{ev:?}"
    );
    let q = lab.quota().await.status.unwrap();
    assert_eq!(q.used.gpus, Gpus::whole(6));
    assert!(q
        .conditions
        .iter()
        .any(|c| c.type_ == "QueueWaiting" && c.status == "True"));

    // One device frees: 3 free, still not enough; nobody of the group moves.
    delete(&lab, "run-0").await;
    lab.cycles(3).await;
    let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
    let gated: Vec<_> = pods.iter().filter(|p| is_gated(p)).collect();
    assert_eq!(gated.len(), 4, "{:?}", names(&pods));

    // A second one frees: the whole group goes in one cycle.
    lab.server.clear_requests();
    delete(&lab, "run-1").await;
    eventually_async("the group to be released", LIMIT, || async {
        let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
        // (Mid-cycle, four separate writes may be half done; the request log below shows
        // they belong to one cycle.)
        pods.iter().filter(|p| is_gated(p)).count() == 0
    })
    .await;
    // In the request log, the four gate removals come after one status write and no fresh
    // read of the quotas (a new cycle) falls between them.
    let log = lab.server.requests();
    let gates: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, (m, p))| m == "PATCH" && p.contains("/pods/train-") && !p.contains("/status"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(gates.len(), 4, "{log:?}");
    let (first, last) = (gates[0], gates[3]);
    assert!(
        !log[first..last]
            .iter()
            .any(|(m, p)| m == "GET" && p.contains("/gpuquotas") && !p.contains("watch")),
        "the group's gates were removed over more than one cycle: {log:?}"
    );
    let status_write = log[..first]
        .iter()
        .rposition(|(m, p)| m == "PUT" && p.contains("/gpuquotas/default/status"));
    assert!(
        status_write.is_some(),
        "admission not recorded before the gates went"
    );
    // The group is accounted for: reserved by the releasing cycle, or already settled into
    // `used` by the next one (the loop may run it before this read).
    let q = lab.quota().await.status.unwrap();
    assert!(
        (q.reserved.gpus == Gpus::whole(4) && q.used.gpus == Gpus::whole(4))
            || (q.reserved.gpus == Gpus::whole(0) && q.used.gpus == Gpus::whole(8)),
        "reserved {:?}, used {:?}",
        q.reserved.gpus,
        q.used.gpus
    );
    // Admitted pods are told so.
    eventually_async("the condition to turn True", LIMIT, || async {
        let p = lab.pods.get("train-3").await.unwrap();
        condition(&p).is_some_and(|c| c.0 == "True" && c.1 == "Admitted")
    })
    .await;
    assert!(lab.metrics.snapshot().released >= 4);
    lab.stop().await;
}

#[tokio::test]
async fn queued_pods_are_released_by_priority_then_creation_time() {
    let lab = Lab::start(2, Duration::from_secs(3600)).await;
    lab.create(pod("run-0", 1, false)).await;
    lab.create(pod("run-1", 1, false)).await;
    // Created with explicit times (the API server's are to the second).
    let mk = |name: &str, prio: i32, created: &str| {
        let mut p = pod(name, 1, true);
        p["spec"]["priority"] = json!(prio);
        p["metadata"]["creationTimestamp"] = json!(created);
        p
    };
    for p in [
        mk("low-old", 0, "2025-01-01T00:00:00Z"),
        mk("high-new", 10, "2025-01-01T00:03:00Z"),
        mk("high-old", 10, "2025-01-01T00:01:00Z"),
        mk("low-new", 0, "2025-01-01T00:04:00Z"),
    ] {
        lab.server.put_json(p).unwrap();
    }
    eventually_async("all four to wait", LIMIT, || async {
        let p = lab.pods.get("low-new").await.unwrap();
        condition(&p).is_some()
    })
    .await;
    let mut order = Vec::new();
    let mut running = vec!["run-0".to_string(), "run-1".to_string()];
    while order.len() < 4 {
        // Free one device; exactly one waiting pod goes, the next in order.
        let done = running.remove(0);
        delete(&lab, &done).await;
        let t = Instant::now();
        let got = loop {
            let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
            let released: Vec<String> = pods
                .iter()
                .filter(|p| {
                    !is_gated(p) && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none()
                })
                .map(|p| p.name_any())
                .filter(|n| !order.contains(n))
                .collect();
            assert!(
                released.len() <= 1,
                "more than one released for one free device: {released:?}"
            );
            if let Some(n) = released.into_iter().next() {
                break Some(n);
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "nothing released after {done} finished"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let name = got.unwrap();
        bind(&lab, &name).await;
        running.push(name.clone());
        order.push(name);
    }
    assert_eq!(order, ["high-old", "high-new", "low-old", "low-new"]);
    lab.stop().await;
}

#[tokio::test]
async fn a_stream_of_small_pods_cannot_keep_a_large_pod_waiting_past_the_bound() {
    let bound = Duration::from_secs(2);
    let lab = Lab::start(4, bound).await;
    let run_time = Duration::from_millis(600);
    let start = Instant::now();
    let mut small = 0;
    let mut started: Vec<(String, Instant)> = Vec::new();
    let mut large_created = None;
    let mut large_released = None;
    let mut small_released_after_large = 0;
    while start.elapsed() < Duration::from_secs(15) && large_released.is_none() {
        // Two small pods arrive every 200 ms: more than the quota can run.
        for _ in 0..2 {
            lab.create(pod(&format!("small-{small}"), 1, true)).await;
            small += 1;
        }
        if large_created.is_none() && start.elapsed() >= Duration::from_millis(500) {
            lab.create(pod("large", 4, true)).await;
            large_created = Some(Instant::now());
        }
        // The scheduler and kubelet: run released pods, finish small ones after run_time.
        let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
        for p in &pods {
            let name = p.name_any();
            let bound_to_node = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
            if !is_gated(p) && !bound_to_node {
                bind(&lab, &name).await;
                if name == "large" {
                    large_released = Some(Instant::now());
                } else {
                    if large_created.is_some() {
                        small_released_after_large += 1;
                    }
                    started.push((name, Instant::now()));
                }
            }
        }
        let mut i = 0;
        while i < started.len() {
            if started[i].1.elapsed() >= run_time {
                delete(&lab, &started[i].0).await;
                started.remove(i);
            } else {
                i += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let waited = large_released.expect("the large pod starved") - large_created.unwrap();
    eprintln!(
        "large pod waited {waited:?}; {small_released_after_large} small pods backfilled meanwhile"
    );
    // Bound + the run time of what was admitted before it + one cycle and the test's own
    // 200 ms step (and the second-granular creationTimestamp only makes it earlier).
    assert!(
        waited <= bound + run_time + Duration::from_millis(1200),
        "the large pod waited {waited:?}"
    );
    assert!(
        small_released_after_large > 0,
        "small pods never backfilled before the bound: the test proves nothing"
    );
    lab.stop().await;
}

#[tokio::test]
async fn reservations_of_pods_that_never_appeared_are_dropped_and_running_pods_settle_into_used() {
    let lab = Lab::start(8, Duration::from_secs(3600)).await;
    lab.create(pod("runner", 2, false)).await;
    // The webhook reserved for "runner" (now running) and for "ghost" (its create failed),
    // long ago.
    let res = |name: &str| {
        json!({"kind": "Pod", "namespace": QNS, "name": name, "state": "Reserved",
               "charge": {"gpus": "2"}, "since": "2025-01-01T00:00:00Z"})
    };
    let status = json!({"reservations": [res("runner"), res("ghost")], "reserved": {"gpus": "4"}});
    let api: Api<GpuQuota> = Api::namespaced(lab.server.client().unwrap(), QNS);
    // The controller writes this status too: retry on conflict, as any writer must.
    loop {
        let mut q = lab.quota().await;
        q.status = Some(serde_json::from_value(status.clone()).unwrap());
        match api
            .replace_status("default", &PostParams::default(), &q)
            .await
        {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => panic!("{e}"),
        }
    }
    eventually_async("the reservations to go", LIMIT, || async {
        let s = lab.quota().await.status.unwrap_or_default();
        s.reservations.is_empty() && s.used.gpus == Gpus::whole(2)
    })
    .await;
    let s = lab.quota().await.status.unwrap();
    assert_eq!(s.reserved.gpus, Gpus::ZERO);
    lab.stop().await;
}

#[tokio::test]
async fn a_thousand_queued_pods_are_released_in_a_few_cycles_not_one_per_cycle() {
    let lab = Lab::start(100_000, Duration::from_secs(3600)).await;
    let n = 1000;
    for i in 0..n {
        lab.server
            .put_json(pod(&format!("p-{i:05}"), 1, true))
            .unwrap();
    }
    let t = Instant::now();
    eventually_async("every pod to be released", LIMIT, || async {
        lab.metrics.snapshot().released >= n
    })
    .await;
    let took = t.elapsed();
    let m = lab.metrics.snapshot();
    eprintln!(
        "released {n} pods in {took:?} ({:.0}/s); {m:?}",
        n as f64 / took.as_secs_f64()
    );
    // One status write admits as many as the reservation list holds (MAX_RESERVATIONS, 384):
    // three writes for 1000, a few more for stragglers the cache had not seen.
    assert!(m.status_writes <= 8, "{m:?}");
    lab.stop().await;
}

// ---- the namespace label the mutating gate webhook selects on ----

const QUEUE_LABEL: &str = gpuplane_shell::controller::queue_label::QUEUE_LABEL;

/// The namespace labeler running against `server` with fast timings; stopped when the sender
/// is dropped or sent to.
fn start_labeler(
    server: &ApiServerDouble,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    use gpuplane_shell::controller::labeler::{self, LabelerOptions};
    let opts = LabelerOptions {
        batch: Duration::from_millis(10),
        resync: Duration::from_millis(300),
        retry: Duration::from_millis(20),
        retry_cap: Duration::from_millis(200),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = server.client().unwrap();
    let task = tokio::spawn(async move {
        labeler::run(client, opts, async {
            let _ = stopped.await;
        })
        .await
    });
    (stop, task)
}

fn namespace(server: &ApiServerDouble, name: &str, labels: serde_json::Value) {
    server
        .put_json(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels, "annotations": {"owner": "team"}},
            "spec": {"finalizers": ["kubernetes"]}}))
        .unwrap();
}

fn queue_quota(ns: &str, mode: &str) -> serde_json::Value {
    json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "default", "namespace": ns},
        "spec": {"hard": {"gpus": 1}, "mode": mode}})
}

/// The namespace's labels as stored, or None when it does not exist.
fn ns_labels(server: &ApiServerDouble, name: &str) -> Option<serde_json::Value> {
    server
        .get_json("v1", "namespaces", None, name)
        .map(|n| n["metadata"]["labels"].clone())
}

async fn set_mode(server: &ApiServerDouble, ns: &str, mode: &str) {
    let api: Api<GpuQuota> = Api::namespaced(server.client().unwrap(), ns);
    api.patch(
        "default",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"mode": mode}})),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn the_queue_label_follows_queue_quotas_and_comes_back_after_removal_by_hand() {
    let server = ApiServerDouble::start().await.unwrap();
    namespace(&server, "team-q", json!({"team": "q"}));
    namespace(&server, "team-r", json!({"team": "r"}));
    // Labelled by hand, without a Queue quota: the key is the controller's, it goes.
    namespace(
        &server,
        "by-hand",
        json!({QUEUE_LABEL: "true", "team": "h"}),
    );
    let client = server.client().unwrap();
    let quotas = |ns| Api::<GpuQuota>::namespaced(client.clone(), ns);
    for (ns, mode) in [
        ("team-q", "Queue"),
        ("team-r", "Reject"),
        ("ghost", "Queue"),
    ] {
        let q: GpuQuota = serde_json::from_value(queue_quota(ns, mode)).unwrap();
        quotas(ns).create(&PostParams::default(), &q).await.unwrap();
    }
    let (stop, task) = start_labeler(&server);

    let labelled = |ns: &str| ns_labels(&server, ns).is_some_and(|l| l[QUEUE_LABEL] == "true");
    eventually_async(
        "team-q labelled and the hand-set label gone",
        LIMIT,
        || async {
            labelled("team-q")
                && ns_labels(&server, "by-hand").is_some_and(|l| l[QUEUE_LABEL].is_null())
        },
    )
    .await;
    assert_eq!(
        ns_labels(&server, "team-q").unwrap(),
        json!({"team": "q", QUEUE_LABEL: "true"}),
        "other labels stay"
    );
    assert_eq!(ns_labels(&server, "by-hand").unwrap(), json!({"team": "h"}));
    assert_eq!(ns_labels(&server, "team-r").unwrap(), json!({"team": "r"}));

    // Removed by hand (or by a tool applying an old manifest): it comes back.
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            "team-q",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {QUEUE_LABEL: null}}})),
        )
        .await
        .unwrap();
    assert!(!labelled("team-q"));
    eventually_async("the label back on team-q", LIMIT, || async {
        labelled("team-q")
    })
    .await;

    // Switched to Reject: the label goes; back to Queue: it comes back; deleted: it goes.
    set_mode(&server, "team-q", "Reject").await;
    eventually_async("the label off team-q in Reject mode", LIMIT, || async {
        ns_labels(&server, "team-q") == Some(json!({"team": "q"}))
    })
    .await;
    set_mode(&server, "team-r", "Queue").await;
    eventually_async("team-r labelled in Queue mode", LIMIT, || async {
        labelled("team-r")
    })
    .await;
    quotas("team-r")
        .delete("default", &DeleteParams::default())
        .await
        .unwrap();
    eventually_async(
        "the label off team-r with its quota deleted",
        LIMIT,
        || async { ns_labels(&server, "team-r") == Some(json!({"team": "r"})) },
    )
    .await;

    // Several resyncs later: a namespace is never created, nothing but the one label was
    // written, and only through merge patches of namespaces. Each resync decides ghost (it has
    // a Queue quota) again and tries its patch, which 404s: two more such tries, two resyncs.
    let ghost_tries = || server.count_requests("PATCH", "/namespaces/ghost");
    let tried = ghost_tries();
    eventually_async("two more resyncs", LIMIT, || async {
        ghost_tries() >= tried + 2
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap();
    assert!(server.get_json("v1", "namespaces", None, "ghost").is_none());
    for ns in ["team-q", "team-r", "by-hand"] {
        let n = server.get_json("v1", "namespaces", None, ns).unwrap();
        assert_eq!(n["metadata"]["annotations"], json!({"owner": "team"}));
        assert_eq!(n["spec"], json!({"finalizers": ["kubernetes"]}));
    }
    // Writes of Namespace objects: `/api/v1/namespaces[/<name>]`, nothing below a namespace.
    let writes: Vec<(String, String)> = server
        .requests()
        .into_iter()
        .filter(|(m, p)| {
            let path = p.split('?').next().unwrap_or_default();
            m != "GET" && path.starts_with("/api/v1/namespaces") && path.split('/').count() <= 5
        })
        .collect();
    assert!(
        writes.iter().all(|(m, _)| m == "PATCH"),
        "namespace writes: {writes:?}"
    );
    // team-q: add, re-add; team-r: add, remove; by-hand: remove; ghost: tried (404).
    assert!(writes.len() >= 5, "{writes:?}");
}

#[tokio::test]
async fn a_failed_label_patch_is_retried_with_backoff() {
    use gpuplane_testkit::doubles::apiserver::Fault;
    let server = ApiServerDouble::start().await.unwrap();
    namespace(&server, "team-q", json!({}));
    server.inject(Fault::status("PATCH", "/api/v1/namespaces/team-q", 500).times(3));
    server.put_json(queue_quota("team-q", "Queue")).unwrap();
    let (stop, task) = start_labeler(&server);
    eventually_async(
        "team-q labelled despite three failed patches",
        LIMIT,
        || async { ns_labels(&server, "team-q").is_some_and(|l| l[QUEUE_LABEL] == "true") },
    )
    .await;
    assert_eq!(
        server.count_requests("PATCH", "/api/v1/namespaces/team-q"),
        4
    );
    let _ = stop.send(());
    task.await.unwrap();
}

// ---- the explainer ----

fn gpu_node(name: &str, gpus: u64) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
        "status": {"allocatable": {"nvidia.com/gpu": gpus.to_string(), "cpu": "64"},
            "conditions": [{"type": "Ready", "status": "True"}]}})
}

#[tokio::test]
async fn every_new_reason_lands_before_any_event_and_each_pod_gets_one_event() {
    use gpuplane_shell::controller::explainer::{self, ExplainerOptions, CONDITION};
    use gpuplane_shell::published::Devices;
    let server = ApiServerDouble::start().await.unwrap();
    server.put_json(gpu_node("node-1", 2)).unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let names: Vec<String> = (0..5).map(|i| format!("wait-{i}")).collect();
    for name in &names {
        let mut p = pod(name, 4, false);
        p["spec"].as_object_mut().unwrap().remove("nodeName");
        pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap())
            .await
            .unwrap();
    }
    let mut opts = ExplainerOptions::new("replica-1");
    opts.debounce = Duration::from_millis(50);
    // One write at a time, so the order shows: Events go in batches of 4 after the reasons.
    opts.concurrency = 1;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = server.client().unwrap();
    let metrics = Arc::new(QueueMetrics::default());
    let task = tokio::spawn(async move {
        let devices = Devices::start(&client, Default::default(), |_, _| {});
        explainer::run(client, opts, devices, metrics, async {
            let _ = stopped.await;
        })
        .await
    });
    let all_events = || async {
        let mut n = 0;
        for name in &names {
            n += events_for(&server, name).await.len();
        }
        n
    };
    eventually_async("a first Event", LIMIT, || async { all_events().await > 0 }).await;
    for name in &names {
        let c = condition_of(&pods.get(name).await.unwrap(), CONDITION);
        assert_eq!(
            c.map(|c| c.1).as_deref(),
            Some("Capacity"),
            "{name}: its reason before any Event"
        );
    }
    eventually_async("five Events", LIMIT, || async { all_events().await == 5 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for name in &names {
        assert_eq!(
            events_for(&server, name).await.len(),
            1,
            "{name}: one Event"
        );
    }
    let _ = stop.send(());
    task.await.unwrap();
}

#[tokio::test]
async fn a_pending_gpu_pod_carries_why_it_waits_and_one_event_per_change_of_reason() {
    use gpuplane_shell::controller::explainer::{self, ExplainerOptions, CONDITION};
    use gpuplane_shell::published::Devices;
    let server = ApiServerDouble::start().await.unwrap();
    server.put_json(gpu_node("node-1", 2)).unwrap();
    let start = |metrics: Arc<QueueMetrics>| {
        let mut opts = ExplainerOptions::new("replica-1");
        opts.debounce = Duration::from_millis(50);
        opts.message_refresh = Duration::ZERO;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let client = server.client().unwrap();
        let task = tokio::spawn(async move {
            let devices = Devices::start(&client, Default::default(), |_, _| {});
            explainer::run(client, opts, devices, metrics, async {
                let _ = stopped.await;
            })
            .await
        });
        (stop, task)
    };
    let (stop, task) = start(Arc::new(QueueMetrics::default()));
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let mut big = pod("big", 4, false);
    big["spec"].as_object_mut().unwrap().remove("nodeName");
    let big: Pod = serde_json::from_value(big).unwrap();
    pods.create(&PostParams::default(), &big).await.unwrap();
    let said = || async { condition_of(&pods.get("big").await.unwrap(), CONDITION) };
    let capacity = (
        "False".to_string(),
        "Capacity".to_string(),
        "needs 4 nvidia.com/gpu; 2 free in the cluster".to_string(),
    );
    eventually_async("reason Capacity on the pod", LIMIT, || async {
        said().await.as_ref() == Some(&capacity)
    })
    .await;
    eventually_async("an Event", LIMIT, || async {
        !events_for(&server, "big").await.is_empty()
    })
    .await;
    // Changes that leave the reason alone (another node too small, a label) make no Event.
    server.put_json(gpu_node("node-0", 1)).unwrap();
    let message = "needs 4 nvidia.com/gpu; 3 free in the cluster";
    eventually_async("the message follows", LIMIT, || async {
        said().await.is_some_and(|c| c.2 == message)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let evs = events_for(&server, "big").await;
    assert_eq!(evs.len(), 1, "{evs:?}");
    assert_eq!(evs[0].reason.as_deref(), Some("Capacity"));
    assert_eq!(evs[0].type_.as_deref(), Some("Warning"));
    // A new leader does not repeat what the condition already says.
    let _ = stop.send(());
    task.await.unwrap();
    let metrics = Arc::new(QueueMetrics::default());
    let (stop, task) = start(metrics.clone());
    let lines = [
        "gpuplane_pending_gpu_pods{reason=\"Capacity\"} 1",
        "gpuplane_pending_gpu_pods{reason=\"Placement\"} 0",
    ];
    eventually_async("the new leader's first cycle", LIMIT, || async {
        let text = gpuplane_shell::metrics::render(&[metrics.registry()]);
        lines.iter().all(|line| text.lines().any(|l| l == *line))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(events_for(&server, "big").await.len(), 1);
    // A node with room: the reason changes, and a second Event says so.
    server.put_json(gpu_node("node-2", 8)).unwrap();
    eventually_async("another reason", LIMIT, || async {
        said().await.is_some_and(|c| c.1 != "Capacity")
    })
    .await;
    let new = said().await.unwrap().1;
    eventually_async("a second Event", LIMIT, || async {
        events_for(&server, "big").await.len() == 2
    })
    .await;
    let reasons: Vec<_> = events_for(&server, "big")
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    assert!(reasons.contains(&new), "{reasons:?}");
    // Scheduled: the condition turns True and the wait is observed under the last reason.
    pods.patch(
        "big",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"nodeName": "node-2"}})),
    )
    .await
    .unwrap();
    let scheduled = (
        "True".to_string(),
        "Scheduled".to_string(),
        "scheduled to node node-2".to_string(),
    );
    eventually_async("condition True", LIMIT, || async {
        said().await.as_ref() == Some(&scheduled)
    })
    .await;
    let seen = format!("gpuplane_pending_gpu_pod_seconds_count{{reason=\"{new}\"}} 1");
    let text = gpuplane_shell::metrics::render(&[metrics.registry()]);
    assert!(text.lines().any(|l| l == seen), "{seen} in:\n{text}");
    assert_eq!(events_for(&server, "big").await.len(), 2);
    let _ = stop.send(());
    task.await.unwrap();
}

/// The explainer keeps its device catalog between cycles; a new ResourceSlice or a changed
/// DeviceClass must still reach the answer (the catalog is rebuilt when either changes).
#[tokio::test]
async fn the_explainers_kept_device_catalog_follows_slices_and_classes() {
    use gpuplane_shell::controller::explainer::{self, ExplainerOptions, CONDITION};
    use gpuplane_shell::published::Devices;
    let server = ApiServerDouble::start().await.unwrap();
    let class = |product: &str| {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "gpu.gpuplane.dev"},
            "spec": {"selectors": [{"cel": {"expression": format!(
                "device.attributes['gpu.gpuplane.dev'].productName == '{product}'")}}]}})
    };
    server.put_json(class("NVIDIA H100 80GB HBM3")).unwrap();
    server
        .put_json(
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one", "namespace": QNS},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu",
                "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}),
        )
        .unwrap();
    let mut opts = ExplainerOptions::new("replica-1");
    opts.debounce = Duration::from_millis(50);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = server.client().unwrap();
    let metrics = Arc::new(QueueMetrics::default());
    let task = tokio::spawn(async move {
        let devices = Devices::start(&client, Default::default(), |_, _| {});
        explainer::run(client, opts, devices, metrics, async {
            let _ = stopped.await;
        })
        .await
    });
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let claim: Pod = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "claim", "namespace": QNS},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one"}],
            "containers": [{"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}]}}))
    .unwrap();
    pods.create(&PostParams::default(), &claim).await.unwrap();
    let reason =
        || async { condition_of(&pods.get("claim").await.unwrap(), CONDITION).map(|c| c.1) };
    eventually_async("Selector: nothing is published", LIMIT, || async {
        reason().await.as_deref() == Some("Selector")
    })
    .await;
    let text = gpuplane_shell::sim::bundled_text("dgx-h100").unwrap();
    let inv = gpuplane_shell::sim::from_str("dgx-h100", "dgx-h100", text).unwrap();
    let mut health = gpuplane_shell::health::HealthBook::default();
    health.set_inventory(&inv);
    for s in gpuplane_shell::slices::render::render(&inv, &health, "gpu.gpuplane.dev", "node-1") {
        server.put_json(serde_json::to_value(s).unwrap()).unwrap();
    }
    eventually_async("another reason once H100s are published", LIMIT, || async {
        reason().await.is_some_and(|r| r != "Selector")
    })
    .await;
    server.put_json(class("NVIDIA B200")).unwrap();
    eventually_async(
        "Selector again once the class asks for what is not there",
        LIMIT,
        || async { reason().await.as_deref() == Some("Selector") },
    )
    .await;
    let _ = stop.send(());
    task.await.unwrap();
}
