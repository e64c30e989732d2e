//! `gpuplane controller` benchmarks. Each figure is printed next to a floor measured in the
//! same run on the same machine, and the ratio, because shared machines are noisy:
//! - admission webhook decision latency (p50/p99) and decisions per second at 1, 64 and 512
//!   concurrent clients, over HTTPS with persistent connections: pod CREATE AdmissionReviews
//!   against a Reject-mode GpuQuota large enough that every pod is admitted (so every decision
//!   records a reservation in the GpuQuota status, in batches: the group commit), vs a bare
//!   hyper + rustls handler on loopback answering a fixed small JSON body, driven by the same
//!   client at the same concurrency. The GpuQuota status writes are counted at the API server
//!   double. A second floor is one API round trip: a GpuQuota status PUT through the same kube
//!   client against the same double; the 1-client p50 target is 3x the TLS floor plus that.
//!
//! - Queue mode release rate: pods released per second from a queue of [`QUEUED`] gated pods
//!   under one Queue-mode GpuQuota with room for all, the loop started with the pods already
//!   there (as after a leader change), timed until the last gate is removed; vs the same number
//!   of bare gate-removal PATCHes (the loop's own guarded JSON patch, `writes::ungate`) against
//!   the same API server double, with the same client and the loop's write concurrency.
//!
//! The webhook runs in process against the API server double, with an rcgen test CA. Each
//! concurrency level uses its own namespace and GpuQuota, so every level starts from an empty
//! reservation list.
//!
//! As in a cluster, every allowed pod is then stored in the API server double and the real
//! quota loop runs beside the webhook: it counts stored pods in `used` and drops their
//! reservations. Each status write carries the reservations still in the status, so the figures
//! depend on how well the loop keeps the list short (the bench prints what is left per level).
//!
//! Run: `cargo bench --bench controller [webhook|queue]` (results are kept in benches/results/).

mod common;

use common::{percentiles, row};

use gpuplane_shell::controller::metrics::QueueMetrics;
use gpuplane_shell::controller::pods::PodRef;
use gpuplane_shell::controller::queue::{self, QueueOptions};
use gpuplane_shell::controller::writes::{self, Ungated};
use gpuplane_shell::quota::{GpuQuota, SCHEDULING_GATE};
use gpuplane_shell::webhook::{self, WebhookOptions};
use gpuplane_testkit::doubles::admission::pod_create_review;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Timed requests per concurrency level (rounded up to a multiple of the concurrency).
const REQUESTS: usize = 1024;
const CONCURRENCY: [usize; 3] = [1, 64, 512];
/// Gated pods in the queue benchmark.
const QUEUED: usize = 10_000;
/// The floor's answer: about the size of an admission answer.
const FLOOR_BODY: &[u8] = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"u","allowed":true}}"#;

/// A test CA, a leaf for localhost, and the files the webhook loads.
struct Pki {
    ca_der: CertificateDer<'static>,
    cert_der: CertificateDer<'static>,
    key_der: Vec<u8>,
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tls.crt"), leaf.pem()).unwrap();
        std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).unwrap();
        Pki {
            ca_der: ca.der().clone(),
            cert_der: leaf.der().clone(),
            key_der: key.serialize_der(),
            dir,
        }
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    fn client_config(&self) -> Arc<rustls::ClientConfig> {
        Arc::new(gpuplane_testkit::demo::tls::client_trusting(self.ca_der.clone()).unwrap())
    }

    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let key = PrivateKeyDer::try_from(self.key_der.clone()).unwrap();
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![self.cert_der.clone()], key)
        .unwrap();
        Arc::new(cfg)
    }
}

/// One persistent HTTP/1.1 connection over TLS; the same client for the webhook and the floor.
struct Conn {
    tls: TlsStream<tokio::net::TcpStream>,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(cfg: &Arc<rustls::ClientConfig>, addr: SocketAddr) -> Conn {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let tls = tokio_rustls::TlsConnector::from(cfg.clone())
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        Conn {
            tls,
            buf: Vec::with_capacity(8192),
        }
    }

    /// POSTs `body` and returns the status and the answer's body (Content-Length framed).
    async fn post(&mut self, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        self.tls.write_all(&req).await.unwrap();
        self.tls.flush().await.unwrap();
        let mut chunk = [0u8; 8192];
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).to_ascii_lowercase();
                let status = head
                    .split(' ')
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .expect("a Content-Length framed answer");
                while self.buf.len() < end + 4 + len {
                    match self.tls.read(&mut chunk).await {
                        Ok(n) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
                        _ => return (0, Vec::new()),
                    }
                }
                let body = self.buf[end + 4..end + 4 + len].to_vec();
                self.buf.drain(..end + 4 + len);
                return (status, body);
            }
            match self.tls.read(&mut chunk).await {
                Ok(n) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
                // Closed by the server: status 0, counted apart.
                _ => return (0, Vec::new()),
            }
        }
    }
}

fn bench_pod(ns: &str, i: usize) -> Value {
    let name = format!("p-{i:05}");
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}")},
        "spec": {"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
}

fn pod_review(ns: &str, i: usize) -> Vec<u8> {
    serde_json::to_vec(&pod_create_review(
        &format!("req-{ns}-{i}"),
        &bench_pod(ns, i),
    ))
    .unwrap()
}

/// Called with a request's index once it was allowed (the API server then stores the pod).
type OnAllowed = Option<tokio::sync::mpsc::UnboundedSender<usize>>;

/// The outcome of one concurrency level.
struct Level {
    samples: Vec<Duration>,
    wall: Duration,
    allowed: usize,
    denied: usize,
    /// Requests whose connection the server closed before answering.
    closed: usize,
    /// Opening and warming up the connections (untimed).
    setup: Duration,
}

/// `clients` connections (opened and warmed up with one untimed request each, then released
/// together), each sending `per_client` requests back to back; `body(i)` is request `i`'s body.
async fn drive(
    cfg: &Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    path: &'static str,
    clients: usize,
    per_client: usize,
    body: Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync>,
    on_allowed: OnAllowed,
) -> Level {
    let total = clients * per_client;
    let setup = Instant::now();
    let mut conns = Vec::with_capacity(clients);
    for c in 0..clients {
        let mut conn = Conn::open(cfg, addr).await;
        // Untimed warm-up in a namespace without a GpuQuota: admitted without a write.
        let (status, _) = conn.post(path, &pod_review("warmup", total + c)).await;
        assert_eq!(status, 200, "warm-up answer");
        conns.push(conn);
    }
    let start = Arc::new(tokio::sync::Barrier::new(clients + 1));
    let mut tasks = Vec::with_capacity(clients);
    let setup = setup.elapsed();
    for (c, mut conn) in conns.into_iter().enumerate() {
        let start = start.clone();
        let body = body.clone();
        let on_allowed = on_allowed.clone();
        tasks.push(tokio::spawn(async move {
            let bodies: Vec<Vec<u8>> = (0..per_client).map(|k| body(c * per_client + k)).collect();
            start.wait().await;
            let mut out = Vec::with_capacity(per_client);
            for (k, b) in bodies.into_iter().enumerate() {
                let t = Instant::now();
                let (status, answer) = conn.post(path, &b).await;
                let took = t.elapsed();
                if let Some(tx) = &on_allowed {
                    if answer.windows(14).any(|w| w == br#""allowed":true"#) {
                        let _ = tx.send(c * per_client + k);
                    }
                }
                out.push((took, status, answer));
                if status == 0 {
                    break;
                }
            }
            out
        }));
    }
    start.wait().await;
    let t = Instant::now();
    let mut level = Level {
        samples: Vec::with_capacity(total),
        wall: Duration::ZERO,
        allowed: 0,
        denied: 0,
        closed: 0,
        setup,
    };
    let mut answers = Vec::with_capacity(total);
    for task in tasks {
        answers.extend(task.await.unwrap());
    }
    level.wall = t.elapsed();
    for (d, status, answer) in answers {
        if status == 0 {
            level.closed += 1;
            continue;
        }
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        level.samples.push(d);
        let v: Value = serde_json::from_slice(&answer).unwrap();
        if v["response"]["allowed"] == json!(false) {
            level.denied += 1;
        } else {
            level.allowed += 1;
        }
    }
    level
}

/// The floor: hyper (HTTP/1.1) over rustls on loopback, answering a fixed small JSON body.
async fn floor_server(tls: Arc<rustls::ServerConfig>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            // As the webhook does.
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(|req: hyper::Request<Incoming>| async move {
                    // Read the body, as any handler must.
                    let _ = http_body_util::BodyExt::collect(req.into_body()).await;
                    let mut r = hyper::Response::new(Full::new(Bytes::from_static(FLOOR_BODY)));
                    r.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("application/json"),
                    );
                    Ok::<_, std::convert::Infallible>(r)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

fn quota(api: &ApiServerDouble, ns: &str) {
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "bench", "namespace": ns},
        "spec": {"hard": {"gpus": 1_000_000}, "mode": "Reject"}}),
    )
    .unwrap();
}

fn gated_pod(ns: &str, i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p-{i:05}"), "namespace": ns, "uid": format!("uid-{ns}-{i}")},
        "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}],
            "containers": [{"name": "main", "image": "cuda",
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
}

/// Removes the gate of every pod of `ns` with `concurrency` PATCHes in flight; the pods
/// ungated.
async fn bare_ungate(client: &kube::Client, ns: &str, concurrency: usize) -> usize {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods: Vec<PodRef> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(PodRef::of)
        .collect();
    let work = Arc::new(std::sync::Mutex::new(pods));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (api, work) = (api.clone(), work.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            loop {
                let Some(p) = work.lock().unwrap().pop() else {
                    return done;
                };
                if writes::ungate(&api, &p).await.unwrap() == Ungated::Removed {
                    done += 1;
                }
            }
        }));
    }
    let mut done = 0;
    for t in tasks {
        done += t.await.unwrap();
    }
    done
}

async fn queue_bench() {
    let api = ApiServerDouble::start().await.unwrap();
    // Every pod's events stay in the history, so watches resume instead of re-listing.
    api.set_history_limit(4 * QUEUED + 1000);
    let ns = "bench-queue";
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "bench", "namespace": ns},
        "spec": {"hard": {"gpus": 1_000_000}, "mode": "Queue"}}),
    )
    .unwrap();
    for i in 0..QUEUED {
        api.put_json(gated_pod(ns, i)).unwrap();
    }
    let client = api.client().unwrap();
    let opts = QueueOptions {
        batch: Duration::from_millis(20),
        ..QueueOptions::default()
    };
    let concurrency = opts.concurrency;
    let metrics = Arc::new(QueueMetrics::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let t = Instant::now();
    let task = tokio::spawn(queue::run(client.clone(), opts, metrics.clone(), async {
        let _ = stopped.await;
    }));
    while metrics.snapshot().released < QUEUED as u64 {
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "the loop released {:?} in 10 minutes",
            metrics.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = t.elapsed();
    let _ = stop.send(());
    task.await.unwrap();
    let m = metrics.snapshot();
    let patches = api.count_requests("PATCH", "/pods/");

    // The floor: the same gate removals, bare, on a second queue in the same API server.
    let floor_ns = "bench-floor";
    for i in 0..QUEUED {
        api.put_json(gated_pod(floor_ns, i)).unwrap();
    }
    let ft = Instant::now();
    let floor_done = bare_ungate(&client, floor_ns, concurrency).await;
    let floor_took = ft.elapsed();
    assert_eq!(floor_done, QUEUED, "the floor ungated every pod");

    let rate = QUEUED as f64 / took.as_secs_f64();
    let floor_rate = QUEUED as f64 / floor_took.as_secs_f64();
    println!(
        "queue: {QUEUED} gated pods under one Queue-mode GpuQuota with room for all, loop started with them queued;"
    );
    println!(
        "floor: {QUEUED} bare gate-removal PATCHes (writes::ungate), same API server double and client, {concurrency} in flight"
    );
    println!(
        "{:<56} {rate:>9.0}/s | floor {floor_rate:>9.0}/s | ratio {:>5.2}x (floor/queue)",
        format!("pods released per second ({QUEUED} queued)"),
        floor_rate / rate
    );
    println!(
        "{:<56} {:.2?} | floor {:.2?} | cycles {} status writes {} (conflicts {}) gate PATCHes {patches}",
        "",
        took,
        floor_took,
        m.cycles,
        m.status_writes,
        m.status_conflicts
    );
    api.stop().await;
}

/// One API round trip: `n` GpuQuota status PUTs in a row (each with the resourceVersion the
/// last one returned), through the real kube client against the double.
async fn api_round_trips(client: &kube::Client, ns: &str, n: usize) -> Vec<Duration> {
    let api: Api<GpuQuota> = Api::namespaced(client.clone(), ns);
    let mut q = api.get("bench").await.unwrap();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let t = Instant::now();
        match api
            .replace_status("bench", &PostParams::default(), &q)
            .await
        {
            Ok(next) => {
                out.push(t.elapsed());
                q = next;
            }
            // The controller loop wrote it in between: read again, not counted.
            Err(kube::Error::Api(s)) if s.code == 409 => q = api.get("bench").await.unwrap(),
            Err(e) => panic!("{e}"),
        }
    }
    out
}

async fn webhook_bench() {
    let api = Arc::new(ApiServerDouble::start().await.unwrap());
    for c in CONCURRENCY {
        quota(&api, &format!("bench-{c}"));
    }
    quota(&api, "bench-rtt");
    // The controller loop runs as in a cluster: the API server stores every allowed pod, the
    // loop counts it in `used` and drops its reservation, so the status holds only
    // admissions in flight.
    let loop_metrics = Arc::new(QueueMetrics::default());
    let (stop_loop, loop_stopped) = tokio::sync::oneshot::channel::<()>();
    let loop_task = tokio::spawn(queue::run(
        api.client().unwrap(),
        QueueOptions {
            batch: Duration::from_millis(20),
            ..QueueOptions::default()
        },
        loop_metrics.clone(),
        async {
            let _ = loop_stopped.await;
        },
    ));
    let pki = Pki::new();
    let mut opts = WebhookOptions::new(pki.path("tls.crt"), pki.path("tls.key"), "gpuplane-system");
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(20);
    let wh = webhook::start(api.client().unwrap(), opts).await.unwrap();
    let floor_addr = floor_server(pki.server_config()).await;
    let cfg = pki.client_config();
    let (rtt_p50, rtt_p99) =
        percentiles(api_round_trips(&api.client().unwrap(), "bench-rtt", REQUESTS.min(512)).await);

    println!(
        "webhook: POST /validate, pod CREATE with nvidia.com/gpu: 1, Reject-mode GpuQuota (gpus: 1000000),"
    );
    println!(
        "HTTPS with persistent connections; floor: bare hyper + rustls handler, fixed {}-byte JSON answer",
        FLOOR_BODY.len()
    );
    for c in CONCURRENCY {
        let per_client = REQUESTS.div_ceil(c);
        let ns = format!("bench-{c}");
        let writes_before =
            api.count_requests("PUT", "gpuquotas") + api.count_requests("PATCH", "gpuquotas");
        let hook_writes_before = wh.commits.writes.load(Ordering::Relaxed);
        let conflicts_before = wh.commits.conflicts.load(Ordering::Relaxed);
        let escrowed_before = wh.commits.escrowed.load(Ordering::Relaxed);
        let loop_before = loop_metrics.snapshot();
        let (created_tx, mut created_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
        let creator = {
            let (api, ns) = (api.clone(), ns.clone());
            tokio::spawn(async move {
                while let Some(i) = created_rx.recv().await {
                    api.put_json(bench_pod(&ns, i)).unwrap();
                }
            })
        };
        let body: Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync> = {
            let ns = ns.clone();
            Arc::new(move |i| pod_review(&ns, i))
        };
        let hook = drive(
            &cfg,
            wh.addr(),
            "/validate",
            c,
            per_client,
            body,
            Some(created_tx),
        )
        .await;
        creator.await.unwrap();
        let writes = api.count_requests("PUT", "gpuquotas")
            + api.count_requests("PATCH", "gpuquotas")
            - writes_before;
        let hook_writes = wh.commits.writes.load(Ordering::Relaxed) - hook_writes_before;
        let conflicts = wh.commits.conflicts.load(Ordering::Relaxed) - conflicts_before;
        let escrowed = wh.commits.escrowed.load(Ordering::Relaxed) - escrowed_before;
        let loop_after = loop_metrics.snapshot();
        let floor_body: Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync> =
            Arc::new(|i| pod_review("floor", i));
        let floor = drive(
            &cfg,
            floor_addr,
            "/validate",
            c,
            per_client,
            floor_body,
            None,
        )
        .await;
        if hook.samples.is_empty() || floor.samples.is_empty() {
            println!("{c} clients: every connection was closed before answering");
            continue;
        }
        let n = hook.samples.len();
        let hook_rate = n as f64 / hook.wall.as_secs_f64();
        let floor_rate = floor.samples.len() as f64 / floor.wall.as_secs_f64();
        let (hook_p50, hook_p99) = percentiles(hook.samples.clone());
        let floor_p50 = percentiles(floor.samples.clone()).0;
        row(
            &format!("decision latency, {c:>3} clients ({n} requests)"),
            percentiles(hook.samples),
            percentiles(floor.samples),
        );
        println!(
            "{:<56} {hook_rate:>9.0}/s | floor {floor_rate:>9.0}/s | ratio {:>5.2}x (floor/webhook)",
            format!("decisions per second, {c:>3} clients"),
            floor_rate / hook_rate
        );
        let reservations = api
            .get_json(
                "quota.gpuplane.dev/v1alpha1",
                "gpuquotas",
                Some(&ns),
                "bench",
            )
            .and_then(|q| q["status"]["reservations"].as_array().map(|a| a.len()))
            .unwrap_or(0);
        println!(
            "{:<56} allowed {} denied {} closed {} (floor closed {}); connections set up in {:.1?} (floor {:.1?})",
            "",
            hook.allowed,
            hook.denied,
            hook.closed,
            floor.closed,
            hook.setup,
            floor.setup
        );
        println!(
            "{:<56} GpuQuota status writes {writes}: webhook {hook_writes} (1 per {:.1} admissions, {escrowed} admitted within its escrow; {conflicts} conflicts), controller {} ({} conflicts, {} cycles); reservations left {reservations}",
            "",
            hook.allowed as f64 / hook_writes.max(1) as f64,
            loop_after.status_writes - loop_before.status_writes,
            loop_after.status_conflicts - loop_before.status_conflicts,
            loop_after.cycles - loop_before.cycles,
        );
        let target = match c {
            1 => {
                let bound = floor_p50 * 3 + rtt_p50;
                format!(
                    "target p50 <= 3 x floor p50 + one API round trip (p50 {rtt_p50:.1?}, p99 {rtt_p99:.1?}) = {bound:.1?}: p50 {hook_p50:.1?}, {:.2}x the bound",
                    hook_p50.as_secs_f64() / bound.as_secs_f64()
                )
            }
            64 => format!(
                "target >= 2000/s and <= 1 webhook write per 16 admissions: {hook_rate:.0}/s, 1 write per {:.1}",
                hook.allowed as f64 / hook_writes.max(1) as f64
            ),
            _ => format!("target p99 <= 100ms: p99 {hook_p99:.1?}"),
        };
        println!("{:<56} {target}", "");
    }
    let counters = wh.metrics.render();
    let counters: Vec<&str> = counters
        .lines()
        .filter(|l| {
            l.starts_with("gpuplane_webhook_admissions_total")
                || l.starts_with("gpuplane_webhook_reservation_contended_total")
        })
        .collect();
    println!("{}", counters.join("\n"));
    let _ = stop_loop.send(());
    loop_task.await.unwrap();
    wh.stop().await;
    if let Ok(api) = Arc::try_unwrap(api) {
        api.stop().await;
    }
}

fn main() {
    // `cargo bench --bench controller queue`: only the sections whose name contains the filter
    // (cargo passes `--bench` itself).
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if wanted("webhook") {
            webhook_bench().await;
        }
        if wanted("queue") {
            queue_bench().await;
        }
    });
}
