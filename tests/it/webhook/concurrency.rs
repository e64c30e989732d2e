//! Concurrent creates over one or two replicas, a replica killed mid-batch, and borrowers
//! racing over a cohort: never more admitted than the quota allows.

use super::*;
use std::collections::BTreeSet;

/// 500 concurrent pod creates spread over `replicas` webhook replicas against
/// `devices: {nvidia.com/gpu: 37}`.
async fn five_hundred_concurrent_creates_admit_exactly_37(replicas: usize) {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 37}}}),
    )
    .await;
    let pki = Pki::new();
    let mut hooks = Vec::new();
    for _ in 0..replicas {
        hooks.push(replica(&api, &pki).await);
    }
    let addrs: Vec<SocketAddr> = hooks.iter().map(|h| h.addr()).collect();
    let tls = pki.client_config();
    let mut tasks = Vec::new();
    for i in 0..500 {
        let addr = addrs[i % addrs.len()];
        let tls = tls.clone();
        tasks.push(tokio::spawn(async move {
            let body = pod_review(
                &format!("uid-{i}"),
                gpu_pod(&format!("p-{i}"), "nvidia.com/gpu", 1),
            );
            response(&post(&tls, addr, "/validate", &body).await)
        }));
    }
    let mut admitted = 0;
    let mut messages = std::collections::BTreeSet::new();
    for t in tasks {
        let r = t.await.unwrap();
        if r["allowed"] == true {
            admitted += 1;
        } else {
            messages.insert(
                r["status"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
    }
    assert_eq!(admitted, 37, "denials: {messages:?}");
    assert_eq!(
        messages.into_iter().collect::<Vec<_>>(),
        vec![
            "devices[nvidia.com/gpu]: requested 1, used 37 of 37 in GpuQuota team-a/q".to_string()
        ]
    );
    // Admissions made within an escrow are recorded by its next flush, and idle escrows are
    // given back: then every admission is a reservation.
    let mut status = stored_quota(&api, "q").status.unwrap();
    let t = std::time::Instant::now();
    while !status.escrows.is_empty() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        status = stored_quota(&api, "q").status.unwrap();
    }
    assert!(status.escrows.is_empty(), "{:?}", status.escrows);
    assert_eq!(status.reservations.len(), 37);
    assert_eq!(status.reserved.devices["nvidia.com/gpu"], 37);
    // Group commit and escrow: far fewer status writes than admissions.
    let writes = api.count_requests("PUT", "/gpuquotas/q/status");
    let escrowed: u64 = hooks
        .iter()
        .map(|h| {
            h.commits
                .escrowed
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    eprintln!(
        "{replicas} replica(s): 37 admitted ({escrowed} within an escrow) with {writes} GpuQuota status writes"
    );
    for h in hooks {
        h.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_concurrent_creates_over_two_replicas_admit_exactly_37() {
    five_hundred_concurrent_creates_admit_exactly_37(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_concurrent_creates_on_one_replica_admit_exactly_37() {
    five_hundred_concurrent_creates_admit_exactly_37(1).await;
}

/// A webhook replica on a runtime of its own, so that the test can kill it: shutting that
/// runtime down drops every task at its next await (a batch between its status read and its
/// write, or with its write in flight), as SIGKILL would; its connections close unanswered.
struct Doomed {
    addr: SocketAddr,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Doomed {
    fn start(api: &ApiServerDouble, pki: &Pki) -> Doomed {
        let config = api.config().unwrap();
        let (cert, key) = (pki.cert_path(), pki.key_path());
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (kill, killed) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let wh = rt.block_on(async move {
                let mut opts = WebhookOptions::new(cert, key, "gpuplane-system");
                opts.addr = "127.0.0.1:0".parse().unwrap();
                opts.sync_timeout = Duration::from_secs(10);
                let client = kube::Client::try_from(config).unwrap();
                webhook::start(client, opts).await.unwrap()
            });
            addr_tx.send(wh.addr()).unwrap();
            rt.block_on(async move {
                let _ = killed.await;
            });
            // Every task stops where it is; nothing is let finish.
            rt.shutdown_timeout(Duration::ZERO);
            drop(wh);
        });
        Doomed {
            addr: addr_rx.recv().unwrap(),
            kill: Some(kill),
            thread: Some(thread),
        }
    }

    fn kill(&mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

/// A small xorshift generator: the test prints its seed, so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below.max(1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_mid_batch_never_admits_more_than_hard_nor_without_a_durable_reservation_or_escrow(
) {
    let mut rng = Rng(test_seed());
    let pki = Pki::new();
    let tls = pki.client_config();
    for round in 0..3 {
        killed_mid_batch_round(round, &mut rng, &pki, &tls).await;
    }
}

/// `GPUPLANE_TEST_SEED`, or one from the clock; printed, so a failure can be replayed.
fn test_seed() -> u64 {
    let seed = std::env::var("GPUPLANE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("GPUPLANE_TEST_SEED={seed}");
    seed
}

/// What a round drew from the seed, for its report.
struct Draw {
    hard: usize,
    put_ms: u64,
    get_ms: u64,
    answered: u64,
    kill_after: u64,
}

/// A create sent to one of the replicas: the pod's name, whether it went to the doomed
/// replica, and its answer (none when the connection closed unanswered).
type Create = tokio::task::JoinHandle<(String, bool, Option<Value>)>;

/// One round: a quota, a survivor and a doomed replica, creates spread over both, the doomed
/// one killed mid-batch, the survivor filling what is left, and the quota's status checked.
async fn killed_mid_batch_round(
    round: usize,
    rng: &mut Rng,
    pki: &Pki,
    tls: &Arc<rustls::ClientConfig>,
) {
    let api = ApiServerDouble::start().await.unwrap();
    // Room for about half of the creates: the kill lands while admissions still fit.
    let hard = 60 + rng.next(60) as usize;
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": hard}}}),
    )
    .await;
    let survivor = replica(&api, pki).await;
    let doomed = Doomed::start(&api, pki);
    // Slow status writes (carried out, answered late) and reads of the quota, so that
    // the kill lands while batches are between their read and their write, or with the
    // write landed and its answer still on the way.
    let put_ms = 2 + rng.next(15);
    let get_ms = 1 + rng.next(10);
    api.inject(Fault::delay(
        "PUT",
        "/gpuquotas/q/status",
        Duration::from_millis(put_ms),
    ));
    api.inject(Fault::delay(
        "GET",
        "/gpuquotas/q",
        Duration::from_millis(get_ms),
    ));
    let doomed_answers = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks = spread_creates(rng, tls, doomed.addr, survivor.addr(), &doomed_answers);
    let (answered, kill_after) = kill_mid_batch(rng, doomed, &doomed_answers).await;
    let (mut admitted, unanswered) = first_answers(round, tasks).await;
    // The survivor fills what is left: whatever the killed replica wrote, and its escrow
    // (which covers what it admitted and never recorded), still count.
    api.clear_faults();
    admitted.extend(fill_the_rest(tls, survivor.addr(), hard).await);
    let draw = Draw {
        hard,
        put_ms,
        get_ms,
        answered,
        kill_after,
    };
    let escrowed = check_round(round, &draw, unanswered, &admitted, &api).await;
    survivor.stop().await;
    if escrowed > 0 {
        dead_escrow_dropped(round, &api, pki).await;
    }
    api.stop().await;
}

/// 200 creates, each to the doomed replica or the survivor at random, arriving over 400 ms
/// (the doomed replica has batches turning all along); `doomed_answers` counts the doomed
/// replica's answers.
fn spread_creates(
    rng: &mut Rng,
    tls: &Arc<rustls::ClientConfig>,
    doomed: SocketAddr,
    survivor: SocketAddr,
    doomed_answers: &Arc<std::sync::atomic::AtomicU64>,
) -> Vec<Create> {
    let n = 200;
    let mut tasks = Vec::new();
    for i in 0..n {
        let to_doomed = rng.next(2) == 0;
        let addr = if to_doomed { doomed } else { survivor };
        let tls = tls.clone();
        let doomed_answers = doomed_answers.clone();
        let arrive = Duration::from_millis(rng.next(400));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(arrive).await;
            let name = format!("p-{i}");
            let body = pod_review(&format!("uid-{i}"), gpu_pod(&name, "nvidia.com/gpu", 1));
            let head = format!(
                "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}",
                body.len()
            );
            let r = try_raw(&tls, addr, head, body).await.ok().map(|a| response(&a));
            if to_doomed && r.is_some() {
                doomed_answers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            (name, to_doomed, r)
        }));
    }
    tasks
}

/// Kills the doomed replica once it has answered a few (its batches are turning), at a random
/// moment while the rest still arrive; how many answers it waited for, and the ms after.
async fn kill_mid_batch(
    rng: &mut Rng,
    mut doomed: Doomed,
    doomed_answers: &std::sync::atomic::AtomicU64,
) -> (u64, u64) {
    let answered = 1 + rng.next(8);
    let t = std::time::Instant::now();
    while doomed_answers.load(std::sync::atomic::Ordering::Relaxed) < answered
        && t.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let kill_after = rng.next(200);
    tokio::time::sleep(Duration::from_millis(kill_after)).await;
    tokio::task::spawn_blocking(move || doomed.kill())
        .await
        .unwrap();
    (answered, kill_after)
}

/// The answers to the first creates: the admitted pods, and how many went unanswered (only
/// ever by the doomed replica); every refusal is the quota's, or the doomed replica's error.
async fn first_answers(round: usize, tasks: Vec<Create>) -> (BTreeSet<String>, u32) {
    let mut admitted = BTreeSet::new();
    let mut unanswered = 0;
    for t in tasks {
        let (name, to_doomed, r) = t.await.unwrap();
        match r {
            Some(r) if r["allowed"] == true => {
                admitted.insert(name);
            }
            Some(r) => {
                let m = r["status"]["message"].as_str().unwrap_or_default();
                assert!(
                    m.starts_with("devices[nvidia.com/gpu]: requested 1, used ")
                        || (to_doomed && r["status"]["code"] != 403),
                    "round {round}: {r}"
                );
            }
            None => {
                assert!(
                    to_doomed,
                    "round {round}: the survivor did not answer {name}"
                );
                unanswered += 1;
            }
        }
    }
    (admitted, unanswered)
}

/// `hard + 5` creates to the survivor, all at once (those held by the dead replica's escrow
/// wait out their half deadline side by side); the pods it admitted.
async fn fill_the_rest(
    tls: &Arc<rustls::ClientConfig>,
    survivor: SocketAddr,
    hard: usize,
) -> Vec<String> {
    let mut late = Vec::new();
    for i in 0..hard + 5 {
        let tls = tls.clone();
        late.push(tokio::spawn(async move {
            let name = format!("late-{i}");
            let body = pod_review(
                &format!("uid-late-{i}"),
                gpu_pod(&name, "nvidia.com/gpu", 1),
            );
            (
                name,
                response(&post(&tls, survivor, "/validate", &body).await),
            )
        }));
    }
    let mut admitted = Vec::new();
    for t in late {
        let (name, r) = t.await.unwrap();
        if r["allowed"] == true {
            admitted.push(name);
        }
    }
    admitted
}

/// Reports the round and checks the quota's status: every admitted pod covered by a durable
/// reservation or the dead replica's escrow, never more than `hard`, and the quota filled.
/// The devices still held in escrow.
async fn check_round(
    round: usize,
    draw: &Draw,
    unanswered: u32,
    admitted: &BTreeSet<String>,
    api: &ApiServerDouble,
) -> u64 {
    let Draw {
        hard,
        put_ms,
        get_ms,
        answered,
        kill_after,
    } = *draw;
    // The survivor gives its own escrow back once idle; the dead replica's stays.
    let mut status = stored_quota(api, "q").status.unwrap();
    let t = std::time::Instant::now();
    while status.escrows.len() > 1 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        status = stored_quota(api, "q").status.unwrap();
    }
    let durable: BTreeSet<String> = status.reservations.iter().map(|r| r.name.clone()).collect();
    let escrowed: u64 = status
        .escrows
        .iter()
        .map(|e| e.amount.devices.get("nvidia.com/gpu").copied().unwrap_or(0))
        .sum();
    let uncovered: Vec<&String> = admitted.difference(&durable).collect();
    eprintln!(
        "round {round}: hard {hard}, writes +{put_ms}ms, reads +{get_ms}ms, killed {kill_after}ms \
         after its answer {answered}: {} admitted, {} reserved, {escrowed} held in {} escrow(s), \
         {unanswered} unanswered (reserved, never answered: {}; admitted within the dead \
         replica's escrow: {})",
        admitted.len(),
        durable.len(),
        status.escrows.len(),
        durable.difference(admitted).count(),
        uncovered.len(),
    );
    assert!(
        status.escrows.len() <= 1,
        "round {round}: {:?}",
        status.escrows
    );
    assert!(
        uncovered.iter().all(|n| n.starts_with("p-")) && uncovered.len() as u64 <= escrowed,
        "round {round}: admitted without a durable reservation or escrow: {uncovered:?}"
    );
    assert!(admitted.len() <= hard, "round {round}");
    assert_eq!(
        durable.len() as u64 + escrowed,
        hard as u64,
        "round {round}: the quota is filled, never over"
    );
    assert_eq!(
        status.reserved.devices["nvidia.com/gpu"],
        durable.len() as u64
    );
    escrowed
}

/// The controller drops the dead replica's escrow once it was not renewed for the grace
/// (here 2 s; none of its pods exist, so its reservations go too).
async fn dead_escrow_dropped(round: usize, api: &ApiServerDouble, pki: &Pki) {
    let ctl =
        controller_replica_with_grace(api, pki, "gc", false, Some(Duration::from_secs(2)), None)
            .await;
    let t = std::time::Instant::now();
    loop {
        let s = stored_quota(api, "q").status.unwrap_or_default();
        if s.escrows.is_empty() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "round {round}: the dead replica's escrow stays: {:?}",
            s.escrows
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ctl.stop().await;
}

fn ns_gpu_pod(ns: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}")},
        "spec": {"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
}

fn reserved_in(api: &ApiServerDouble, ns: &str) -> u64 {
    let q: GpuQuota = serde_json::from_value(
        api.get_json("quota.gpuplane.dev/v1alpha1", "gpuquotas", Some(ns), "q")
            .unwrap(),
    )
    .unwrap();
    q.status
        .map(|s| {
            s.reserved
                .devices
                .get("nvidia.com/gpu")
                .copied()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn borrowers_racing_over_two_replicas_never_borrow_more_than_the_cohort_has_unused() {
    let api = ApiServerDouble::start().await.unwrap();
    // The lender has 10 unused; the borrowers none of their own, so that every admission
    // borrows (a quota may always use its own `hard`, lent or not: only borrowing is bounded
    // by what the rest of the cohort has unused).
    for (ns, hard) in [("lend", 10), ("team-a", 0), ("team-b", 0)] {
        api.put_json(
            json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "q", "namespace": ns},
            "spec": {"hard": {"devices": {"nvidia.com/gpu": hard}}, "cohort": "research"}}),
        )
        .unwrap();
    }
    let pki = Pki::new();
    let (r1, r2) = (replica(&api, &pki).await, replica(&api, &pki).await);
    let tls = pki.client_config();
    let mut tasks = Vec::new();
    for i in 0..120 {
        let ns = if i % 2 == 0 { "team-a" } else { "team-b" };
        let addr = if (i / 2) % 2 == 0 {
            r1.addr()
        } else {
            r2.addr()
        };
        let tls = tls.clone();
        tasks.push(tokio::spawn(async move {
            let body = pod_review(&format!("uid-{i}"), ns_gpu_pod(ns, &format!("p-{i}")));
            response(&post(&tls, addr, "/validate", &body).await)
        }));
    }
    let mut admitted = 0u64;
    for t in tasks {
        let r = t.await.unwrap();
        if r["allowed"] == true {
            admitted += 1;
        } else {
            let m = r["status"]["message"].as_str().unwrap_or_default();
            assert!(m.contains("cohort research has "), "{r}");
            assert_eq!(r["status"]["code"], 403, "{r}");
        }
    }
    let held = reserved_in(&api, "team-a") + reserved_in(&api, "team-b");
    eprintln!("racing: {admitted} admitted, {held} reserved of 10 to borrow");
    assert!(
        admitted <= 10,
        "{admitted} admitted: more than the cohort had"
    );
    assert!(held <= 10, "{held} reserved: more than the cohort had");
    // Nothing leaked either: what is left can still be borrowed, exactly.
    for i in 0..30 {
        let ns = if i % 2 == 0 { "team-a" } else { "team-b" };
        let addr = if i % 4 < 2 { r1.addr() } else { r2.addr() };
        let r = response(
            &post(
                &tls,
                addr,
                "/validate",
                &pod_review(
                    &format!("uid-more-{i}"),
                    ns_gpu_pod(ns, &format!("more-{i}")),
                ),
            )
            .await,
        );
        if r["allowed"] == true {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10);
    assert_eq!(
        reserved_in(&api, "team-a") + reserved_in(&api, "team-b"),
        10
    );
    assert_eq!(reserved_in(&api, "lend"), 0);
    r1.stop().await;
    r2.stop().await;
}
