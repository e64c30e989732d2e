//! The admission webhook over real HTTPS (a test CA from rcgen), against the API server
//! double: the seed scenario, exactness under concurrency across two replicas, hostile bodies,
//! certificate reload, Queue mode, claims, and an API server that goes away; whole controller
//! replicas (webhook and loops): `/readyz` through leadership and an API outage, and
//! `/metrics` per GpuQuota after a known scenario.

use crate::support::eventually::{eventually_async, LIMIT};
use gpuplane_shell::quota::{GpuQuota, ReservationState, SCHEDULING_GATE};
use gpuplane_shell::webhook::{self, RunningWebhook, WebhookOptions};
use gpuplane_testkit::doubles::apiserver::{ApiServerDouble, Fault};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

const NS: &str = "team-a";

/// A test CA and the webhook's certificate files.
struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let pki = Pki {
            ca,
            dir: tempfile::tempdir().unwrap(),
        };
        pki.issue();
        pki
    }

    fn cert_path(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    fn key_path(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }

    /// Issues a new leaf for localhost and 127.0.0.1, replaces the files (atomically, as a
    /// Secret volume update does), and returns the leaf's DER.
    fn issue(&self) -> Vec<u8> {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        for (path, text) in [
            (self.cert_path(), cert.pem()),
            (self.key_path(), key.serialize_pem()),
        ] {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        }
        cert.der().to_vec()
    }

    fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut cfg = gpuplane_testkit::demo::tls::client_trusting(self.ca.der().clone()).unwrap();
        // Every connection does a full handshake, so it sees the certificate served now (a
        // resumed session reports the certificate of the session it resumes).
        cfg.resumption = rustls::client::Resumption::disabled();
        Arc::new(cfg)
    }
}

/// An HTTP/1.1 answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: Vec<u8>,
    peer_cert: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends raw `head` (request line and headers, without the blank line) and `body` over a new
/// TLS connection; reads the answer to the end (the request says `Connection: close`).
async fn raw(
    tls: &Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    head: String,
    body: Vec<u8>,
) -> Answer {
    try_raw(tls, addr, head, body)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`raw`], with a refused or closed connection as an error (a killed replica).
async fn try_raw(
    tls: &Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    head: String,
    body: Vec<u8>,
) -> Result<Answer, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let conn = tokio_rustls::TlsConnector::from(tls.clone())
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let peer_cert = conn
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let (mut rd, mut wr) = tokio::io::split(conn);
    let writer = tokio::spawn(async move {
        let _ = wr
            .write_all(format!("{head}\r\nConnection: close\r\n\r\n").as_bytes())
            .await;
        for chunk in body.chunks(64 * 1024) {
            if wr.write_all(chunk).await.is_err() {
                break;
            }
        }
        let _ = wr.flush().await;
        wr
    });
    let mut out = Vec::new();
    let _ = rd.read_to_end(&mut out).await;
    writer.abort();
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no answer: {}", String::from_utf8_lossy(&out)))?;
    let head = String::from_utf8_lossy(&out[..split]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut body = out[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Ok(Answer {
        status,
        body,
        peer_cert,
    })
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(p) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..p]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[p + 2..p + 2 + n]);
        b = &b[p + 2 + n + 2..];
    }
    out
}

async fn post(
    tls: &Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    path: &str,
    body: &[u8],
) -> Answer {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}",
        body.len()
    );
    raw(tls, addr, head, body.to_vec()).await
}

fn review(
    uid: &str,
    kind: (&str, &str, &str),
    operation: &str,
    object: Value,
    old: Option<Value>,
    user: &str,
) -> Value {
    let (group, version, k) = kind;
    let resource = match k {
        "Pod" => "pods",
        "ResourceClaim" => "resourceclaims",
        _ => "deployments",
    };
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": k},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": k},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "name": object["metadata"]["name"],
            "namespace": object["metadata"]["namespace"],
            "operation": operation,
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": old,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    })
}

fn pod_review(uid: &str, pod: Value) -> Vec<u8> {
    serde_json::to_vec(&review(
        uid,
        ("", "v1", "Pod"),
        "CREATE",
        pod,
        None,
        "alice",
    ))
    .unwrap()
}

fn pod(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "spec": spec})
}

fn gpu_pod(name: &str, resource: &str, n: u32) -> Value {
    pod(
        name,
        json!({"containers": [{"name": "main", "image": "cuda", "resources": {"limits": {resource: n.to_string()}}}]}),
    )
}

fn response(a: &Answer) -> Value {
    assert_eq!(a.status, 200, "{}", a.text());
    a.json()["response"].clone()
}

async fn quota(api: &ApiServerDouble, name: &str, spec: Value) {
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": name, "namespace": NS}, "spec": spec}),
    )
    .unwrap();
}

fn stored_quota(api: &ApiServerDouble, name: &str) -> GpuQuota {
    serde_json::from_value(
        api.get_json("quota.gpuplane.dev/v1alpha1", "gpuquotas", Some(NS), name)
            .unwrap(),
    )
    .unwrap()
}

/// The shipped DeviceClasses, node `small` with one 15Gi GPU and node `h100` with 1g.10gb MIG
/// devices of 10Gi.
fn seed_devices(api: &ApiServerDouble) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/daemonset/deviceclasses.yaml"
    ))
    .unwrap();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc).unwrap();
        api.put_json(v).unwrap();
    }
    let dev = |name: &str, ty: &str, profile: Option<&str>, mem: &str| {
        let mut attrs =
            json!({"type": {"string": ty}, "productName": {"string": "NVIDIA H100 80GB HBM3"}});
        if let Some(p) = profile {
            attrs["profile"] = json!({"string": p});
        }
        json!({"name": name, "attributes": attrs, "capacity": {"memory": {"value": mem}}})
    };
    for (node, devices) in [
        ("small", vec![dev("gpu-0", "gpu", None, "15Gi")]),
        (
            "h100",
            vec![
                dev("gpu-0-mig-0", "mig", Some("1g.10gb"), "10Gi"),
                dev("gpu-0-mig-1", "mig", Some("1g.10gb"), "10Gi"),
            ],
        ),
    ] {
        api.put_json(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": format!("{node}-gpu-gpuplane-dev-0")},
            "spec": {"driver": "gpu.gpuplane.dev", "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}}))
            .unwrap();
    }
}

async fn replica(api: &ApiServerDouble, pki: &Pki) -> RunningWebhook {
    let mut opts = WebhookOptions::new(pki.cert_path(), pki.key_path(), "gpuplane-system");
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    opts.sync_timeout = Duration::from_secs(10);
    webhook::start(api.client().unwrap(), opts).await.unwrap()
}

/// A replica over `api` once it holds GpuQuota `name` of `spec`, with the PKI it serves from.
async fn replica_with_quota(
    api: &ApiServerDouble,
    name: &str,
    spec: Value,
) -> (RunningWebhook, Pki) {
    quota(api, name, spec).await;
    let pki = Pki::new();
    (replica(api, &pki).await, pki)
}

/// The validating webhook's answer to the creation of `pod`.
async fn validate_create(wh: &RunningWebhook, pki: &Pki, uid: &str, pod: Value) -> Value {
    let body = pod_review(uid, pod);
    response(&post(&pki.client_config(), wh.addr(), "/validate", &body).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_scenario_admits_15gi_and_denies_10gi_more_with_the_reason() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(
        &api,
        "default",
        json!({"hard": {"gpuMemory": "20Gi"}, "mode": "Reject"}),
    )
    .await;
    // Pod A gets its GPU through a claim template: class gpu.gpuplane.dev, whose only
    // published device has 15Gi.
    api.put_json(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}))
        .unwrap();
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();

    let a = pod(
        "pod-a",
        json!({"containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}),
    );
    let r = response(&post(&tls, wh.addr(), "/validate", &pod_review("uid-1", a)).await);
    assert_eq!(r["uid"], "uid-1");
    assert_eq!(r["allowed"], true, "{r}");

    // Pod B asks for a 1g.10gb MIG device through the device plugin: priced at 10Gi from
    // the slices.
    let b = gpu_pod("pod-b", "nvidia.com/mig-1g.10gb", 1);
    let r = response(&post(&tls, wh.addr(), "/validate", &pod_review("uid-2", b)).await);
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(r["status"]["code"], 403);
    assert_eq!(
        r["status"]["message"],
        "gpuMemory: requested 10Gi, used 15Gi of 20Gi in GpuQuota team-a/default"
    );

    // A CPU-only pod is not affected by a full quota.
    let cpu = pod(
        "cpu",
        json!({"containers": [{"name": "main", "image": "x", "resources": {"limits": {"cpu": "1"}}}]}),
    );
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("uid-3", cpu)).await)["allowed"],
        true
    );

    let q = stored_quota(&api, "default");
    let status = q.status.unwrap();
    assert_eq!(status.reservations.len(), 1);
    let r = &status.reservations[0];
    assert_eq!(
        (r.name.as_str(), r.uid.as_deref(), r.state),
        ("pod-a", Some("uid-pod-a"), ReservationState::Reserved)
    );
    assert_eq!(status.reserved.gpu_memory.to_string(), "15Gi");
    assert_eq!(status.reserved.gpus.to_string(), "1");

    // Metrics count what happened.
    let m = wh.metrics.render();
    assert!(
        m.contains("gpuplane_webhook_admissions_total{webhook=\"validate\",result=\"denied\"} 1"),
        "{m}"
    );
    wh.stop().await;
}

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
    let mut rng = Rng(seed);
    let pki = Pki::new();
    let tls = pki.client_config();
    for round in 0..3 {
        let api = ApiServerDouble::start().await.unwrap();
        // Room for about half of the creates: the kill lands while admissions still fit.
        let hard = 60 + rng.next(60) as usize;
        quota(
            &api,
            "q",
            json!({"hard": {"devices": {"nvidia.com/gpu": hard}}}),
        )
        .await;
        let survivor = replica(&api, &pki).await;
        let mut doomed = Doomed::start(&api, &pki);
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
        let n = 200;
        let mut tasks = Vec::new();
        let doomed_answers = Arc::new(std::sync::atomic::AtomicU64::new(0));
        for i in 0..n {
            let to_doomed = rng.next(2) == 0;
            let addr = if to_doomed {
                doomed.addr
            } else {
                survivor.addr()
            };
            let tls = tls.clone();
            let doomed_answers = doomed_answers.clone();
            // Arrivals spread over 400 ms: the doomed replica has batches turning all along.
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
        // Once the doomed replica has answered a few (its batches are turning), at a random
        // moment while the rest still arrive.
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
        let mut admitted = std::collections::BTreeSet::new();
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
        // The survivor fills what is left: whatever the killed replica wrote, and its escrow
        // (which covers what it admitted and never recorded), still count. The creates go
        // at once: those held by the dead replica's escrow wait out their half deadline
        // side by side.
        api.clear_faults();
        let mut late = Vec::new();
        for i in 0..hard + 5 {
            let tls = tls.clone();
            let addr = survivor.addr();
            late.push(tokio::spawn(async move {
                let name = format!("late-{i}");
                let body = pod_review(
                    &format!("uid-late-{i}"),
                    gpu_pod(&name, "nvidia.com/gpu", 1),
                );
                (name, response(&post(&tls, addr, "/validate", &body).await))
            }));
        }
        for t in late {
            let (name, r) = t.await.unwrap();
            if r["allowed"] == true {
                admitted.insert(name);
            }
        }
        // The survivor gives its own escrow back once idle; the dead replica's stays.
        let mut status = stored_quota(&api, "q").status.unwrap();
        let t = std::time::Instant::now();
        while status.escrows.len() > 1 && t.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            status = stored_quota(&api, "q").status.unwrap();
        }
        let durable: std::collections::BTreeSet<String> =
            status.reservations.iter().map(|r| r.name.clone()).collect();
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
            durable.difference(&admitted).count(),
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
        survivor.stop().await;
        if escrowed > 0 {
            // The controller drops the dead replica's escrow once it was not renewed for the
            // grace (here 2 s; none of its pods exist, so its reservations go too).
            let ctl = controller_replica_with_grace(
                &api,
                &pki,
                "gc",
                false,
                Some(Duration::from_secs(2)),
                None,
            )
            .await;
            let t = std::time::Instant::now();
            loop {
                let s = stored_quota(&api, "q").status.unwrap_or_default();
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
        api.stop().await;
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_hostile_bodies_get_clean_answers() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(&api, "q", json!({"hard": {"gpus": 1}})).await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let addr = wh.addr();

    // Not JSON.
    let a = post(&tls, addr, "/validate", b"{not json").await;
    assert_eq!(a.status, 400);
    assert!(
        a.text().contains("not a valid AdmissionReview"),
        "{}",
        a.text()
    );
    // Empty body.
    assert_eq!(post(&tls, addr, "/validate", b"").await.status, 400);
    // Nested far deeper than a parser should follow.
    assert_eq!(
        post(&tls, addr, "/validate", "[".repeat(100_000).as_bytes())
            .await
            .status,
        400
    );
    // Missing uid, empty uid, wrong apiVersion, no request.
    let mut r = review(
        "u",
        ("", "v1", "Pod"),
        "CREATE",
        gpu_pod("p", "nvidia.com/gpu", 1),
        None,
        "alice",
    );
    r["request"].as_object_mut().unwrap().remove("uid");
    let a = post(&tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("uid"), "{}", a.text());
    r["request"]["uid"] = json!("");
    let a = post(&tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await;
    assert_eq!(
        (a.status, a.text().trim()),
        (400, "the AdmissionReview request has an empty uid")
    );
    // Fields a later Kubernetes adds (envelope, request, userInfo, the object) change nothing:
    // the normal answer, here an admission within the quota.
    r["request"]["uid"] = json!("u");
    r["extraField"] = json!(true);
    r["request"]["extraField"] = json!(true);
    r["request"]["userInfo"]["extraField"] = json!({"a": 1});
    r["request"]["object"]["spec"]["extraField"] = json!([1]);
    // A dry run: decided, but it reserves nothing (the quota is for the checks below).
    r["request"]["dryRun"] = json!(true);
    let a = post(&tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let answer: serde_json::Value = serde_json::from_str(&a.text()).unwrap();
    assert_eq!(answer["response"]["uid"], "u");
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    let a = post(
        &tls,
        addr,
        "/validate",
        br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":null}"#,
    )
    .await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("admission.k8s.io/v1"));
    assert_eq!(
        post(
            &tls,
            addr,
            "/mutate",
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#
        )
        .await
        .status,
        400
    );

    // Wrong content type.
    let body = pod_review("u", gpu_pod("p", "nvidia.com/gpu", 1));
    let head = format!("POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\nContent-Length: {}", body.len());
    let a = raw(&tls, addr, head, body.clone()).await;
    assert_eq!(a.status, 415);
    let head = format!(
        "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}",
        body.len()
    );
    assert_eq!(raw(&tls, addr, head, body.clone()).await.status, 415);

    // Huge bodies: declared, and streamed without a length.
    let head = "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 104857600".to_string();
    let a = raw(&tls, addr, head, vec![b' '; 1024]).await;
    assert_eq!(a.status, 413);
    let mut chunked = Vec::new();
    for _ in 0..80 {
        chunked.extend_from_slice(format!("{:x}\r\n", 64 * 1024).as_bytes());
        chunked.extend_from_slice(&vec![b' '; 64 * 1024]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let head = "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked".to_string();
    let a = raw(&tls, addr, head, chunked).await;
    assert_eq!(a.status, 413, "{}", a.text());

    // A kind this webhook does not handle: an AdmissionReview that denies, with the uid.
    let dep = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": NS}});
    let r = review(
        "u-dep",
        ("apps", "v1", "Deployment"),
        "CREATE",
        dep,
        None,
        "alice",
    );
    let resp = response(&post(&tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await);
    assert_eq!(
        (resp["uid"].as_str(), resp["allowed"].as_bool()),
        (Some("u-dep"), Some(false))
    );
    assert_eq!(resp["status"]["code"], 400);
    assert!(resp["status"]["message"]
        .as_str()
        .unwrap()
        .contains("Pods and ResourceClaims"));
    // A Pod object that is not a Pod.
    let bad = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": NS}, "spec": {"containers": "many"}});
    let resp = response(&post(&tls, addr, "/validate", &pod_review("u-bad", bad)).await);
    assert_eq!(
        (resp["allowed"].as_bool(), resp["status"]["code"].as_u64()),
        (Some(false), Some(400))
    );
    assert!(resp["status"]["message"]
        .as_str()
        .unwrap()
        .starts_with("cannot decode the Pod"));
    // A quantity that is not a whole number of devices.
    let frac = gpu_pod("frac", "nvidia.com/gpu", 1);
    let mut frac = frac;
    frac["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = json!("500m");
    let resp = response(&post(&tls, addr, "/validate", &pod_review("u-frac", frac)).await);
    assert_eq!(resp["allowed"], false);
    assert!(
        resp["status"]["message"]
            .as_str()
            .unwrap()
            .contains("not a whole"),
        "{resp}"
    );

    // Wrong method and path.
    let a = raw(
        &tls,
        addr,
        "GET /validate HTTP/1.1\r\nHost: localhost".into(),
        vec![],
    )
    .await;
    assert_eq!(a.status, 405);
    let a = raw(
        &tls,
        addr,
        "GET /nope HTTP/1.1\r\nHost: localhost".into(),
        vec![],
    )
    .await;
    assert_eq!(a.status, 404);
    let a = raw(
        &tls,
        addr,
        "GET /healthz HTTP/1.1\r\nHost: localhost".into(),
        vec![],
    )
    .await;
    assert_eq!((a.status, a.text().trim()), (200, "ok"));

    // After all that, a good request still gets a good answer.
    let resp = response(
        &post(
            &tls,
            addr,
            "/validate",
            &pod_review("u-ok", gpu_pod("ok", "nvidia.com/gpu", 1)),
        )
        .await,
    );
    assert_eq!(resp["allowed"], true, "{resp}");
    let m = wh.metrics.render();
    assert!(
        m.contains("gpuplane_webhook_rejected_bodies_total{code=\"413\"} 2"),
        "{m}"
    );
    wh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_certificate_files_are_served_to_new_connections() {
    let api = ApiServerDouble::start().await.unwrap();
    let pki = Pki::new();
    let first = std::fs::read_to_string(pki.cert_path()).unwrap();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let get = |tls: Arc<rustls::ClientConfig>, addr| async move {
        raw(
            &tls,
            addr,
            "GET /healthz HTTP/1.1\r\nHost: localhost".into(),
            vec![],
        )
        .await
    };
    let a = get(tls.clone(), wh.addr()).await;
    assert_eq!(a.status, 200);
    let first_der = CertificateDer::from_pem_slice(first.as_bytes());
    assert_eq!(a.peer_cert, first_der.unwrap().to_vec());

    let second = pki.issue();
    let b = get(tls.clone(), wh.addr()).await;
    assert_eq!(b.status, 200);
    assert_eq!(
        b.peer_cert, second,
        "a new connection sees the new certificate"
    );

    // A broken pair (a key that does not match) is not taken: the last good one stays.
    let other = KeyPair::generate().unwrap();
    std::fs::write(pki.key_path(), other.serialize_pem()).unwrap();
    let c = get(tls.clone(), wh.addr()).await;
    assert_eq!(c.peer_cert, second);
    let third = pki.issue();
    assert_eq!(get(tls, wh.addr()).await.peer_cert, third);
    wh.stop().await;
}

use rustls::pki_types::pem::PemObject;

/// `spec.requireLabels`: a GPU pod lacking a required label, or carrying it empty, is refused
/// before anything is charged, naming the pod, the quota and each label; with them it is
/// admitted; a pod asking for no GPU is not the quota's business.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_pod_without_a_required_label_is_refused_naming_it() {
    let api = ApiServerDouble::start().await.unwrap();
    let (wh, pki) = replica_with_quota(
        &api,
        "default",
        json!({"hard": {"devices": {"nvidia.com/gpu": 2}}, "requireLabels": ["team", "example.com/cost-center"]}),
    )
    .await;
    let validate = |uid: &'static str, p: Value| validate_create(&wh, &pki, uid, p);
    let labelled = |name: &str, labels: Value| {
        let mut p = gpu_pod(name, "nvidia.com/gpu", 1);
        p["metadata"]["labels"] = labels;
        p
    };
    let r = validate("u1", gpu_pod("anonymous", "nvidia.com/gpu", 1)).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(r["status"]["code"], 403);
    assert_eq!(
        r["status"]["message"],
        format!(
            "pod {NS}/anonymous is refused by GpuQuota {NS}/default: it lacks the label(s) team, \
             example.com/cost-center that this quota requires on every GPU pod; add them to the \
             pod (or its template)"
        )
    );
    let r = validate(
        "u2",
        labelled(
            "blank",
            json!({"team": "", "example.com/cost-center": "42"}),
        ),
    )
    .await;
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(
        r["status"]["message"],
        format!(
            "pod {NS}/blank is refused by GpuQuota {NS}/default: it lacks the label(s) team \
             (empty) that this quota requires on every GPU pod (an empty value names no owner); \
             add them with a value to the pod (or its template)"
        )
    );
    // Refused before any reservation: nothing charged.
    assert!(stored_quota(&api, "default")
        .status
        .is_none_or(|s| s.reservations.is_empty()));
    let owned = labelled(
        "owned",
        json!({"team": "vision", "example.com/cost-center": "42"}),
    );
    let r = validate("u3", owned).await;
    assert_eq!(r["allowed"], true, "{r}");
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    let r = validate("u4", cpu).await;
    assert_eq!(r["allowed"], true, "{r}");
    wh.stop().await;
}

/// In Queue mode a GPU pod lacking an owner label is refused at admission, gate or no gate,
/// never queued; a key no pod can carry (an older CRD let it in) refuses every GPU pod naming
/// the key, and the webhook goes on answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_mode_refuses_an_unowned_pod_instead_of_queueing_it_and_names_a_bad_key() {
    let api = ApiServerDouble::start().await.unwrap();
    let spec = |keys: Value| json!({"hard": {"devices": {"nvidia.com/gpu": 1}}, "mode": "Queue", "requireLabels": keys});
    let (wh, pki) = replica_with_quota(&api, "q", spec(json!(["team"]))).await;
    let validate = |uid: &'static str, p: Value| validate_create(&wh, &pki, uid, p);
    // As the mutating webhook leaves it: gated.
    let gated = |name: &str, team: Option<&str>| {
        let mut p = gpu_pod(name, "nvidia.com/gpu", 4);
        p["spec"]["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
        if let Some(t) = team {
            p["metadata"]["labels"] = json!({"team": t});
        }
        p
    };
    let r = validate("u1", gated("unowned", None)).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(
        r["status"]["message"],
        format!(
            "pod {NS}/unowned is refused by GpuQuota {NS}/q: it lacks the label(s) team that \
             this quota requires on every GPU pod; add them to the pod (or its template)"
        )
    );
    assert!(stored_quota(&api, "q")
        .status
        .is_none_or(|s| s.reservations.is_empty()));
    let r = validate("u2", gated("owned", Some("vision"))).await;
    assert_eq!(r["allowed"], true, "{r}");
    let status = stored_quota(&api, "q").status.unwrap();
    assert_eq!(status.reservations.len(), 1);
    assert_eq!(status.reservations[0].name, "owned");
    assert_eq!(status.reservations[0].state, ReservationState::Queued);

    let mut q = serde_json::to_value(stored_quota(&api, "q")).unwrap();
    q["spec"] = spec(json!(["team", "team name"]));
    api.put_json(q).unwrap();
    let mut answer = Value::Null;
    for i in 0..100 {
        answer = validate("u3", gated("owned-too", Some("vision"))).await;
        let m = answer["status"]["message"].as_str().unwrap_or_default();
        if m.contains("team name") || i == 99 {
            break;
        }
        // The webhook's watch of the quota has not seen the edit yet.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(answer["allowed"], false, "{answer}");
    assert_eq!(
        answer["status"]["message"],
        format!(
            "pod {NS}/owned-too is refused by GpuQuota {NS}/q: its spec.requireLabels names \
             `team name`, which no pod can carry (a label key is an optional DNS-subdomain \
             prefix and `/`, then at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends); fix \
             the GpuQuota's requireLabels"
        )
    );
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    let r = validate("u4", cpu).await;
    assert_eq!(r["allowed"], true, "{r}");
    wh.stop().await;
}

/// A temporary raise is `hard` while it lasts and nothing once it expired; a quota with raises
/// decides every admission on its latest state (no escrow that could outlive a raise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_raise_admits_until_it_expires_and_never_after() {
    let api = ApiServerDouble::start().await.unwrap();
    let raises = |launch_expires: &str| {
        json!({"hard": {"devices": {"nvidia.com/gpu": 1}}, "temporary": [
            {"hard": {"devices": {"nvidia.com/gpu": 5}}, "expires": "2020-01-01T00:00:00Z", "reason": "old"},
            {"hard": {"devices": {"nvidia.com/gpu": 1}}, "expires": launch_expires, "reason": "launch"}]})
    };
    quota(&api, "default", raises("2999-01-01T00:00:00Z")).await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let validate = |uid: &'static str, name: &'static str| {
        let body = pod_review(uid, gpu_pod(name, "nvidia.com/gpu", 1));
        let tls = tls.clone();
        let addr = wh.addr();
        async move { response(&post(&tls, addr, "/validate", &body).await) }
    };
    for (uid, name) in [("u1", "a"), ("u2", "b")] {
        let r = validate(uid, name).await;
        assert_eq!(r["allowed"], true, "{name}: {r}");
    }
    let r = validate("u3", "c").await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("devices[nvidia.com/gpu]: requested 1, used 2 of 2 in GpuQuota"),
        "the expired raise adds nothing, the live one adds 1: {r}"
    );
    let s = stored_quota(&api, "default").status.unwrap();
    assert!(
        s.escrows.is_empty(),
        "no escrow under a raise: {:?}",
        s.escrows
    );
    assert_eq!(s.reservations.len(), 2);

    // The launch raise runs out: the next admission sees the base of 1, with 2 held.
    let mut q = serde_json::to_value(stored_quota(&api, "default")).unwrap();
    q["spec"] = raises("2020-06-01T00:00:00Z");
    api.put_json(q).unwrap();
    let mut answer = Value::Null;
    for i in 0..100 {
        answer = validate("u4", "d").await;
        let m = answer["status"]["message"].as_str().unwrap_or_default();
        if m.contains("used 2 of 1 in GpuQuota") || i == 99 {
            break;
        }
        // The webhook's watch of the quota has not seen the edit yet.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(answer["allowed"], false, "{answer}");
    assert!(
        answer["status"]["message"]
            .as_str()
            .unwrap()
            .contains("devices[nvidia.com/gpu]: requested 1, used 2 of 1 in GpuQuota"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_mode_gates_gpu_pods_and_records_them_as_queued() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 1}}, "mode": "Queue"}),
    )
    .await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    // The mutating webhook adds the gate (a JSON patch), only to GPU pods.
    let p = gpu_pod("big", "nvidia.com/gpu", 4);
    let r = response(&post(&tls, wh.addr(), "/mutate", &pod_review("u1", p.clone())).await);
    assert_eq!(
        (r["allowed"].as_bool(), r["patchType"].as_str()),
        (Some(true), Some("JSONPatch"))
    );
    let patch = gpuplane_shell::webhook::review::base64(
        serde_json::to_string(&json!([{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": SCHEDULING_GATE}]}])).unwrap().as_bytes(),
    );
    assert_eq!(r["patch"], patch);
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    let r = response(&post(&tls, wh.addr(), "/mutate", &pod_review("u2", cpu)).await);
    assert!(r.get("patch").is_none(), "{r}");
    // The gated pod (over the quota) is admitted and recorded as queued, not reserved.
    let mut gated = p;
    gated["spec"]["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &pod_review("u3", gated.clone()),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    let status = stored_quota(&api, "q").status.unwrap();
    assert_eq!(status.reservations[0].state, ReservationState::Queued);
    assert_eq!(status.queued.devices["nvidia.com/gpu"], 4);
    assert!(status.reserved.is_zero());
    // Only the controller removes the gate.
    let mut ungated = gated.clone();
    ungated["spec"]["schedulingGates"] = json!([]);
    let upd = |user: &str| {
        serde_json::to_vec(&review(
            "u4",
            ("", "v1", "Pod"),
            "UPDATE",
            ungated.clone(),
            Some(gated.clone()),
            user,
        ))
        .unwrap()
    };
    let r = response(&post(&tls, wh.addr(), "/validate", &upd("alice")).await);
    assert_eq!(r["allowed"], false);
    assert!(r["status"]["message"]
        .as_str()
        .unwrap()
        .contains("removed by the gpuplane controller"));
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &upd("system:serviceaccount:gpuplane-system:gpuplane-controller"),
        )
        .await,
    );
    assert_eq!(r["allowed"], true);
    wh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_claims_are_charged_and_template_claims_are_not_charged_twice() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(
        &api,
        "q",
        json!({"hard": {"gpus": "1/7", "devices": {"mig.gpuplane.dev": 1}}}),
    )
    .await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let claim = |name: &str, owned: bool| {
        let mut c = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "m", "exactly": {"deviceClassName": "mig.gpuplane.dev"}}]}}});
        if owned {
            c["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": "gpu"});
            c["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "x", "controller": true}]);
        }
        c
    };
    let send = |c: Value, user: &str| {
        serde_json::to_vec(&review(
            "u",
            ("resource.k8s.io", "v1", "ResourceClaim"),
            "CREATE",
            c,
            None,
            user,
        ))
        .unwrap()
    };
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(claim("c1", false), "alice"),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(claim("c2", false), "alice"),
        )
        .await,
    );
    assert_eq!(r["allowed"], false);
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("gpus: requested 1/7, used 1/7 of 1/7 in GpuQuota team-a/q"),
        "{msg}"
    );
    assert!(
        msg.contains("devices[mig.gpuplane.dev]: requested 1, used 1 of 1"),
        "{msg}"
    );
    // A claim made from a pod's template by the resourceclaim controller: charged via the pod.
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(
                claim("p-gpu-x", true),
                "system:serviceaccount:kube-system:resource-claim-controller",
            ),
        )
        .await,
    );
    assert_eq!(r["allowed"], true);
    // The same metadata from anyone else is charged like any claim.
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(claim("sneaky", true), "alice"),
        )
        .await,
    );
    assert_eq!(r["allowed"], false);
    // The claim the scheduler makes for a pod's nvidia.com/gpu served through DRA: the pod
    // was charged its nvidia.com/gpu, so the claim is not charged again; from anyone else, or
    // by the scheduler without the annotation, it is.
    let extended = |name: &str| {
        let mut c = claim(name, true);
        c["metadata"]["annotations"] =
            json!({"resource.kubernetes.io/extended-resource-claim": "true"});
        c
    };
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(extended("p-extended-resources-x"), "system:kube-scheduler"),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    for (c, user) in [
        (extended("sneaky-2"), "alice"),
        (claim("sneaky-3", true), "system:kube-scheduler"),
    ] {
        let r = response(&post(&tls, wh.addr(), "/validate", &send(c, user)).await);
        assert_eq!(r["allowed"], false, "{user}: {r}");
    }
    wh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_api_server_away_it_answers_from_its_last_state_and_fails_closed() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(&api, "q", json!({"hard": {"gpus": 8}})).await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    api.inject(Fault::status("*", "/", 500));
    api.drop_watches();
    // No quota in that namespace (known from the cache): admitted.
    let mut other = gpu_pod("x", "nvidia.com/gpu", 1);
    other["metadata"]["namespace"] = json!("elsewhere");
    let r = response(&post(&tls, wh.addr(), "/validate", &pod_review("u1", other)).await);
    assert_eq!(r["allowed"], true, "{r}");
    // A pod that needs no GPU: admitted.
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("u2", cpu)).await)["allowed"],
        true
    );
    // A GPU pod under a quota: the reservation cannot be written, so it is denied.
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &pod_review("u3", gpu_pod("g", "nvidia.com/gpu", 1)),
        )
        .await,
    );
    assert_eq!(r["allowed"], false);
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .starts_with("cannot reserve GPU quota"),
        "{r}"
    );
    // Back again: admitted.
    api.clear_faults();
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &pod_review("u4", gpu_pod("g", "nvidia.com/gpu", 1)),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    wh.stop().await;
}

#[tokio::test]
async fn without_api_access_start_fails_with_a_clear_message() {
    let pki = Pki::new();
    let mut opts = WebhookOptions::new(pki.cert_path(), pki.key_path(), "gpuplane-system");
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(5);
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
    let err = webhook::start(client, opts.clone())
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("cannot list GpuQuotas"), "{err}");
    // And a missing certificate is named.
    opts.tls_cert_file = Path::new("/nonexistent/tls.crt").to_path_buf();
    let api = ApiServerDouble::start().await.unwrap();
    let err = webhook::start(api.client().unwrap(), opts)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("/nonexistent/tls.crt"), "{err}");
}

fn manifests(file: &str) -> Vec<Value> {
    let path = format!("{}/daemonset/controller/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// (verb, group, resource with subresource) of one logged request.
fn rbac_verb(method: &str, path_and_query: &str) -> (String, String, String) {
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts[0] {
        "api" => ("", &parts[2..]),
        _ => (parts[1], &parts[3..]),
    };
    let rest = if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
        &rest[2..]
    } else {
        rest
    };
    let resource = match rest {
        [r, _, sub] => format!("{r}/{sub}"),
        [r, ..] => r.to_string(),
        [] => String::new(),
    };
    let named = rest.len() >= 2;
    let verb = match method {
        "GET"
            if query
                .split('&')
                .any(|q| q == "watch=true" || q == "watch=1") =>
        {
            "watch"
        }
        "GET" if named => "get",
        "GET" => "list",
        "PUT" => "update",
        "POST" => "create",
        "PATCH" => "patch",
        "DELETE" if named => "delete",
        _ => "deletecollection",
    };
    (verb.to_string(), group.to_string(), resource)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_every_call_the_webhook_makes() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(&api, "default", json!({"hard": {"gpuMemory": "20Gi"}})).await;
    api.put_json(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}))
        .unwrap();
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let a = pod(
        "a",
        json!({"containers": [{"name": "c", "image": "x"}], "resourceClaims": [{"name": "g", "resourceClaimTemplateName": "one-gpu"}]}),
    );
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("u1", a)).await)["allowed"],
        true
    );
    let b = gpu_pod("b", "nvidia.com/mig-1g.10gb", 1);
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("u2", b)).await)["allowed"],
        false
    );
    wh.stop().await;

    let rbac = manifests("rbac.yaml");
    let role = rbac.iter().find(|m| m["kind"] == "ClusterRole").unwrap();
    let allows = |verb: &str, group: &str, resource: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            let has = |k: &str, v: &str| r[k].as_array().unwrap().iter().any(|x| x == v);
            has("verbs", verb) && has("apiGroups", group) && has("resources", resource)
        })
    };
    let calls: std::collections::BTreeSet<_> = api
        .requests()
        .iter()
        .map(|(m, p)| rbac_verb(m, p))
        .collect();
    for (verb, group, resource) in &calls {
        assert!(
            allows(verb, group, resource),
            "rbac.yaml does not allow {verb} {group}/{resource}; calls: {calls:?}"
        );
    }
    // What the scenario must have exercised.
    for c in [
        ("update", "quota.gpuplane.dev", "gpuquotas/status"),
        ("get", "resource.k8s.io", "resourceclaimtemplates"),
        ("watch", "resource.k8s.io", "resourceslices"),
    ] {
        assert!(
            calls.contains(&(c.0.to_string(), c.1.to_string(), c.2.to_string())),
            "{c:?} not called: {calls:?}"
        );
    }
}

#[test]
fn webhook_configurations_fail_closed_and_spare_system_namespaces() {
    let hooks = manifests("webhooks.yaml");
    let service = &manifests("service.yaml")[0];
    let deployment = manifests("deployment.yaml")
        .into_iter()
        .find(|m| m["kind"] == "Deployment")
        .unwrap();
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "gpuplane-controller");
    let args: Vec<&str> = pod["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--webhook-addr=0.0.0.0:9443"));
    let mut kinds = Vec::new();
    for cfg in &hooks {
        kinds.push(cfg["kind"].as_str().unwrap().to_string());
        for w in cfg["webhooks"].as_array().unwrap() {
            let name = w["name"].as_str().unwrap();
            let excluded = &w["namespaceSelector"]["matchExpressions"][0];
            assert_eq!(
                (excluded["key"].as_str(), excluded["operator"].as_str()),
                (Some("kubernetes.io/metadata.name"), Some("NotIn")),
                "{name}"
            );
            let values = excluded["values"].as_array().unwrap();
            assert!(
                values.contains(&json!("kube-system"))
                    && values.contains(&json!("gpuplane-system")),
                "{name}"
            );
            assert_eq!(w["admissionReviewVersions"], json!(["v1"]));
            let svc = &w["clientConfig"]["service"];
            assert_eq!(
                (&svc["name"], &svc["namespace"]),
                (
                    &service["metadata"]["name"],
                    &service["metadata"]["namespace"]
                )
            );
            assert_eq!(svc["port"], service["spec"]["ports"][0]["port"]);
            if cfg["kind"] == "ValidatingWebhookConfiguration" {
                assert_eq!(w["failurePolicy"], "Fail", "{name}");
                assert_eq!(svc["path"], "/validate");
            } else {
                assert_eq!(svc["path"], "/mutate");
            }
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration"
        ]
    );
    let crd = &manifests("crd.yaml")[0];
    assert_eq!(
        crd["spec"]["versions"][0]["subresources"]["status"],
        json!({})
    );
}

// ---- whole replicas: probes and metrics ----

use gpuplane_shell::controller::lease::LeaseTimings;
use gpuplane_shell::controller::replica::{self, Replica};
use gpuplane_shell::controller::ControllerOptions;
use gpuplane_shell::webhook::health::ProbeSettings;

/// A plain HTTP/1.1 GET; the status and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tcp.read_to_end(&mut out).await.unwrap();
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..split]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut body = out[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A whole controller replica named `id`: webhook, probes every 100 ms (away after 1 s
/// without an answer), and the loops under a fast Lease (or without one).
async fn controller_replica_with_grace(
    api: &ApiServerDouble,
    pki: &Pki,
    id: &str,
    elect: bool,
    grace: Option<Duration>,
    resync: Option<Duration>,
) -> Replica {
    let mut w = WebhookOptions::new(pki.cert_path(), pki.key_path(), "gpuplane-system");
    w.addr = "127.0.0.1:0".parse().unwrap();
    w.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    w.sync_timeout = Duration::from_secs(10);
    w.probes = ProbeSettings {
        interval: Duration::from_millis(100),
        stale_after: Duration::from_secs(1),
    };
    let mut l = ControllerOptions::new("gpuplane-system", id);
    l.leader_elect = elect;
    l.lease = LeaseTimings {
        lease_duration: Duration::from_secs(1),
        renew_deadline: Duration::from_millis(600),
        retry_period: Duration::from_millis(100),
    };
    l.queue.batch = Duration::from_millis(20);
    l.queue.resync = Duration::from_millis(300);
    if let Some(g) = grace {
        l.queue.settings.grace = g;
    }
    if let Some(r) = resync {
        l.queue.resync = r;
    }
    replica::start(api.client().unwrap(), w, l).await.unwrap()
}

async fn controller_replica(api: &ApiServerDouble, pki: &Pki, id: &str, elect: bool) -> Replica {
    controller_replica_with_grace(api, pki, id, elect, None, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_seen_turns_its_reservation_into_usage_at_once_while_another_waits_out_its_grace() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 4}}, "mode": "Reject"}),
    )
    .await;
    let pki = Pki::new();
    // Default grace (2 minutes) and a resync far away: only the pod's own event can bring
    // the namespace's next reconcile forward.
    let r = controller_replica_with_grace(
        &api,
        &pki,
        "r1",
        false,
        None,
        Some(Duration::from_secs(600)),
    )
    .await;
    let tls = pki.client_config();
    for name in ["ghost", "p-0"] {
        let r = response(
            &post(
                &tls,
                r.webhook().addr(),
                "/validate",
                &pod_review(&format!("uid-{name}"), gpu_pod(name, "nvidia.com/gpu", 1)),
            )
            .await,
        );
        assert_eq!(r["allowed"], true);
    }
    // The loop has seen both reservations (and set its next deadline to the ghost's grace): it
    // decides on a fresh list of the namespace's GpuQuotas, and one came after both were
    // written (the webhook answers once its write is done).
    let written = api.requests().len();
    let quota_list = format!("/namespaces/{NS}/gpuquotas");
    eventually_async(
        "the loop's list of the quotas after both reservations",
        LIMIT,
        || async {
            api.requests()[written..].iter().any(|(method, path)| {
                let (path, query) = path.split_once('?').unwrap_or((path, ""));
                method == "GET" && path.ends_with(&quota_list) && !query.contains("watch=")
            })
        },
    )
    .await;
    api.put_json(gpu_pod("p-0", "nvidia.com/gpu", 1)).unwrap();
    eventually_async("p-0's reservation to turn into usage", LIMIT, || async {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        let names: Vec<&str> = s.reservations.iter().map(|r| r.name.as_str()).collect();
        names == ["ghost"] && s.used.devices.get("nvidia.com/gpu") == Some(&1)
    })
    .await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reservations_become_usage_once_their_pods_exist_and_expire_when_they_never_appear() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 4}}, "mode": "Reject"}),
    )
    .await;
    let pki = Pki::new();
    let r =
        controller_replica_with_grace(&api, &pki, "r1", false, Some(Duration::from_secs(3)), None)
            .await;
    let tls = pki.client_config();
    let addr = r.webhook().addr();
    let admit = |name: &'static str| {
        let tls = tls.clone();
        async move {
            response(
                &post(
                    &tls,
                    addr,
                    "/validate",
                    &pod_review(&format!("uid-{name}"), gpu_pod(name, "nvidia.com/gpu", 1)),
                )
                .await,
            )
        }
    };
    for name in ["p-0", "p-1", "p-2", "ghost"] {
        assert_eq!(admit(name).await["allowed"], true);
    }
    let full = admit("extra").await;
    assert_eq!(
        full["status"]["message"],
        "devices[nvidia.com/gpu]: requested 1, used 4 of 4 in GpuQuota team-a/q"
    );
    // Three of them are created (pending: not scheduled yet); "ghost" never is.
    for name in ["p-0", "p-1", "p-2"] {
        api.put_json(gpu_pod(name, "nvidia.com/gpu", 1)).unwrap();
    }
    let state = || {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        let names: Vec<String> = s.reservations.iter().map(|r| r.name.clone()).collect();
        (
            names,
            s.used.devices.get("nvidia.com/gpu").copied().unwrap_or(0),
        )
    };
    eventually_async(
        "the pods' reservations to turn into usage",
        LIMIT,
        || async {
            let (names, used) = state();
            used == 3 && names.iter().all(|n| n == "ghost")
        },
    )
    .await;
    eventually_async("the ghost's reservation to expire", LIMIT, || async {
        state() == (vec![], 3)
    })
    .await;
    // The numbers are the same as before: one more fits, the next is denied.
    assert_eq!(admit("p-3").await["allowed"], true);
    let full = admit("p-4").await;
    assert_eq!(
        full["status"]["message"],
        "devices[nvidia.com/gpu]: requested 1, used 4 of 4 in GpuQuota team-a/q"
    );
    r.stop().await;
}

async fn readyz(r: &Replica) -> (u16, String) {
    get(r.webhook().metrics_addr().unwrap(), "/readyz").await
}

/// Waits until `/readyz` of `r` has a line starting with `prefix`; returns the answer.
async fn readyz_until(r: &Replica, prefix: &str) -> (u16, String) {
    let start = std::time::Instant::now();
    loop {
        let answer = readyz(r).await;
        if answer.1.lines().any(|l| l.starts_with(prefix)) {
            return answer;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for readyz to say {prefix:?}; last:\n{}",
            answer.1
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_tells_leader_from_follower_and_reports_an_api_outage_while_answering() {
    let api = ApiServerDouble::start().await.unwrap();
    let pki = Pki::new();
    let a = controller_replica(&api, &pki, "replica-a", true).await;
    let (status, body) = readyz_until(&a, "role: leader").await;
    assert_eq!(status, 200, "{body}");
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(lines[0], "ready", "{body}");
    assert_eq!(lines[1], "webhook: serving", "{body}");
    assert!(
        lines[2].starts_with("api: reachable (last answer "),
        "{body}"
    );
    assert_eq!(lines[3], "role: leader (runs the quota loops)", "{body}");
    // The same answer over HTTPS on the webhook's port.
    let tls = pki.client_config();
    let https = raw(
        &tls,
        a.webhook().addr(),
        "GET /readyz HTTP/1.1\r\nHost: localhost".into(),
        Vec::new(),
    )
    .await;
    assert_eq!(https.status, 200);
    assert!(https.text().contains("role: leader"), "{}", https.text());
    let (status, body) = get(a.webhook().metrics_addr().unwrap(), "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    let b = controller_replica(&api, &pki, "replica-b", true).await;
    let (status, body) = readyz_until(&b, "role: follower (leader: replica-a)").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("ready\nwebhook: serving\napi: reachable"),
        "{body}"
    );
    let (_, m) = get(b.webhook().metrics_addr().unwrap(), "/metrics").await;
    assert!(m.contains("\ngpuplane_controller_leader 0\n"), "{m}");
    assert!(m.contains("\ngpuplane_controller_api_reachable 1\n"), "{m}");

    // The API server goes away: both stay ready, say so, and keep answering from their caches;
    // the leader cannot renew the Lease and steps down.
    let outage = api.inject(Fault::status("*", "/", 500));
    api.drop_watches();
    for r in [&a, &b] {
        let (status, body) = readyz_until(r, "api: away").await;
        assert_eq!(status, 200, "{body}");
        assert!(
            body.starts_with("ready, degraded: the API server is away; answering from the last known state\nwebhook: serving\n"),
            "{body}"
        );
        assert!(
            body.contains("GPU pods under a GpuQuota are denied until it is back"),
            "{body}"
        );
        readyz_until(r, "role: follower").await;
        let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
        let answer = post(
            &tls,
            r.webhook().addr(),
            "/validate",
            &pod_review("u-cpu", cpu),
        )
        .await;
        assert_eq!(response(&answer)["allowed"], true);
    }
    let (_, m) = get(a.webhook().metrics_addr().unwrap(), "/metrics").await;
    assert!(m.contains("\ngpuplane_controller_api_reachable 0\n"), "{m}");

    // Back: reachable again, and one of them leads.
    api.clear_fault(outage);
    for r in [&a, &b] {
        let (status, body) = readyz_until(r, "api: reachable").await;
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("ready\n"), "{body}");
    }
    eventually_async("a leader again", LIMIT, || async {
        let (_, ra) = readyz(&a).await;
        let (_, rb) = readyz(&b).await;
        ra.contains("role: leader") != rb.contains("role: leader")
    })
    .await;
    a.stop().await;
    b.stop().await;
}

/// The text value of the series `series` (name and labels, exactly as rendered) in `metrics`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_count_admissions_denials_queue_and_usage_per_gpuquota() {
    let api = ApiServerDouble::start().await.unwrap();
    // Reject mode in team-a: room for two GPUs.
    quota(
        &api,
        "gold",
        json!({"hard": {"devices": {"nvidia.com/gpu": 2}}, "mode": "Reject"}),
    )
    .await;
    // Queue mode in team-q: two GPUs, one held by a running pod.
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "queue", "namespace": "team-q"},
        "spec": {"hard": {"gpus": 2}, "mode": "Queue"}}),
    )
    .unwrap();
    let queued = |name: &str, gated: bool| {
        let mut spec = json!({"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]});
        if gated {
            spec["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
        } else {
            spec["nodeName"] = json!("node-1");
        }
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team-q", "uid": format!("uid-{name}")},
            "spec": spec})
    };
    api.put_json(queued("running", false)).unwrap();
    let pki = Pki::new();
    let r = controller_replica(&api, &pki, "replica-m", false).await;
    let tls = pki.client_config();
    for i in 0..3 {
        let body = pod_review(
            &format!("u{i}"),
            gpu_pod(&format!("p{i}"), "nvidia.com/gpu", 1),
        );
        let allowed =
            response(&post(&tls, r.webhook().addr(), "/validate", &body).await)["allowed"] == true;
        assert_eq!(allowed, i < 2, "pod {i}");
    }
    for name in ["q0", "q1", "q2"] {
        api.put_json(queued(name, true)).unwrap();
    }
    let addr = r.webhook().metrics_addr().unwrap();
    let wanted = [
        ("gpuplane_quota_queue_length{namespace=\"team-q\",quota=\"queue\"}", 2.0),
        ("gpuplane_quota_released_total{namespace=\"team-q\",quota=\"queue\"}", 1.0),
        ("gpuplane_quota_reserved{namespace=\"team-a\",quota=\"gold\",resource=\"devices[nvidia.com/gpu]\"}", 2.0),
    ];
    // One queued pod released, two waiting, the reservations seen by the cache. The released
    // pod is charged once: reserved until the controller's cache counts it in `used` (when
    // that happens is the cache's timing, so either state passes, never both or neither).
    let team_q = |m: &str, what: &str| {
        sample(
            m,
            &format!(
                "gpuplane_quota_{what}{{namespace=\"team-q\",quota=\"queue\",resource=\"gpus\"}}"
            ),
        )
    };
    let start = std::time::Instant::now();
    let m = loop {
        let m = get(addr, "/metrics").await.1;
        let charged_once = team_q(&m, "reserved")
            .zip(team_q(&m, "used"))
            .map(|(r, u)| r + u)
            == Some(2.0);
        if charged_once
            && wanted
                .iter()
                .all(|(series, want)| sample(&m, series) == Some(*want))
        {
            break m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out; last:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let at = |ns: &str, q: &str| format!("{{namespace=\"{ns}\",quota=\"{q}\"}}");
    for (series, want) in [
        (format!("gpuplane_quota_admissions_total{}", at(NS, "gold")), 2.0),
        (format!("gpuplane_quota_denials_total{}", at(NS, "gold")), 1.0),
        ("gpuplane_webhook_decision_seconds_count{webhook=\"validate\"}".to_string(), 3.0),
        ("gpuplane_webhook_admissions_total{webhook=\"validate\",result=\"denied\"}".to_string(), 1.0),
        (format!("gpuplane_quota_wait_seconds_count{}", at("team-q", "queue")), 1.0),
        ("gpuplane_quota_hard{namespace=\"team-a\",quota=\"gold\",resource=\"devices[nvidia.com/gpu]\"}".to_string(), 2.0),
        ("gpuplane_quota_used{namespace=\"team-a\",quota=\"gold\",resource=\"devices[nvidia.com/gpu]\"}".to_string(), 0.0),
        ("gpuplane_quota_hard{namespace=\"team-q\",quota=\"queue\",resource=\"gpus\"}".to_string(), 2.0),
        ("gpuplane_quota_pods_released_total".to_string(), 1.0),
        ("gpuplane_controller_leader".to_string(), 1.0),
    ] {
        assert_eq!(sample(&m, &series), Some(want), "{series} in:\n{m}");
    }
    assert!(m.ends_with("\n# EOF\n"), "one OpenMetrics exposition:\n{m}");
    // Every series sits under its family's TYPE line, once (OpenMetrics names a counter's
    // family without the `_total` of its samples).
    for family in [
        "gpuplane_quota_admissions counter",
        "gpuplane_quota_wait_seconds histogram",
        "gpuplane_webhook_decision_seconds histogram",
        "gpuplane_quota_queue_length gauge",
        "gpuplane_quota_used gauge",
    ] {
        assert_eq!(
            m.matches(&format!("# TYPE {family}\n")).count(),
            1,
            "{family} in:\n{m}"
        );
    }
    r.stop().await;
}

/// One client creating pods one after another: after the first admission, the replica admits
/// within its escrow (no write waited for), records those admissions in few writes, never more
/// than `hard`, and gives its escrow back when idle, leaving one reservation per admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_steady_stream_is_admitted_within_an_escrow_with_few_writes_and_exactly() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 100}}}),
    )
    .await;
    let pki = Pki::new();
    let hook = replica(&api, &pki).await;
    let tls = pki.client_config();
    let mut admitted = 0;
    let mut denials = std::collections::BTreeSet::new();
    for i in 0..120 {
        let body = pod_review(
            &format!("uid-{i}"),
            gpu_pod(&format!("p-{i}"), "nvidia.com/gpu", 1),
        );
        let r = response(&post(&tls, hook.addr(), "/validate", &body).await);
        if r["allowed"] == true {
            admitted += 1;
        } else {
            denials.insert(
                r["status"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
    }
    let escrowed = hook
        .commits
        .escrowed
        .load(std::sync::atomic::Ordering::Relaxed);
    let writes = api.count_requests("PUT", "/gpuquotas/q/status");
    eprintln!(
        "120 one by one: {admitted} admitted, {escrowed} within an escrow, {writes} status writes"
    );
    assert_eq!(admitted, 100, "{denials:?}");
    assert_eq!(
        denials.into_iter().collect::<Vec<_>>(),
        ["devices[nvidia.com/gpu]: requested 1, used 100 of 100 in GpuQuota team-a/q"]
    );
    assert!(escrowed >= 50, "{escrowed} admitted within an escrow");
    assert!(writes <= 60, "{writes} writes for 100 admissions");
    // Operators see the same counts.
    let (code, metrics) = get(hook.metrics_addr().unwrap(), "/metrics").await;
    assert_eq!(code, 200);
    assert_eq!(
        sample(&metrics, "gpuplane_webhook_escrow_admissions_total"),
        Some(escrowed as f64),
        "{metrics}"
    );
    let webhook_writes = sample(&metrics, "gpuplane_webhook_status_writes_total").unwrap_or(0.0);
    assert!(
        webhook_writes >= 1.0 && webhook_writes <= writes as f64,
        "{metrics}"
    );
    let t = std::time::Instant::now();
    let mut status = stored_quota(&api, "q").status.unwrap();
    while !status.escrows.is_empty() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        status = stored_quota(&api, "q").status.unwrap();
    }
    assert!(
        status.escrows.is_empty(),
        "idle escrow kept: {:?}",
        status.escrows
    );
    assert_eq!(status.reservations.len(), 100);
    assert_eq!(status.reserved.devices["nvidia.com/gpu"], 100);
    hook.stop().await;
}

/// Issue 28: a pod naming a ResourceClaimTemplate not created yet (`kubectl apply -f dir/` in
/// the wrong order) is admitted gated and charged nothing, in Reject mode too; once the
/// template exists the controller prices the pod from it and keeps it gated with the quota's
/// reason while it does not fit, or releases it into the quota's usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_whose_template_is_not_created_yet_waits_gated_and_is_charged_once_it_exists() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"mig.gpuplane.dev": 1}}, "mode": "Reject"}),
    )
    .await;
    let pki = Pki::new();
    let r = controller_replica(&api, &pki, "r1", false).await;
    let tls = pki.client_config();
    let addr = r.webhook().addr();
    let w = pod(
        "w",
        json!({"containers": [{"name": "main", "image": "cuda"}],
               "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}),
    );
    let waiting = "waiting for ResourceClaimTemplate team-a/t to be created";
    // The mutating webhook gates it and says why.
    let m = response(&post(&tls, addr, "/mutate", &pod_review("u1", w.clone())).await);
    assert_eq!(m["allowed"], true, "{m}");
    assert_eq!(m["patchType"], "JSONPatch", "{m}");
    assert!(m["warnings"][0].as_str().unwrap().contains(waiting), "{m}");
    // Ungated (the mutating webhook was away), it is denied as before: fail closed.
    let v = response(&post(&tls, addr, "/validate", &pod_review("u2", w.clone())).await);
    assert_eq!(v["allowed"], false, "{v}");
    assert!(v["status"]["message"].as_str().unwrap().contains(
        "ResourceClaimTemplate team-a/t not found, and the pod arrived without the scheduling gate"
    ));
    // Gated, it is admitted and charged nothing.
    let mut gated = w;
    gated["spec"]["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
    let v = response(&post(&tls, addr, "/validate", &pod_review("u3", gated.clone())).await);
    assert_eq!(v["allowed"], true, "{v}");
    assert!(v["warnings"][0].as_str().unwrap().contains(waiting), "{v}");
    let s = stored_quota(&api, "q").status.unwrap_or_default();
    assert!(s.reservations.is_empty() && s.reserved.is_zero(), "{s:?}");
    // Only the controller removes the gate, in Reject mode too.
    let mut ungated = gated.clone();
    ungated["spec"]["schedulingGates"] = json!([]);
    let upd = serde_json::to_vec(&review(
        "u4",
        ("", "v1", "Pod"),
        "UPDATE",
        ungated,
        Some(gated.clone()),
        "alice",
    ))
    .unwrap();
    let v = response(&post(&tls, addr, "/validate", &upd).await);
    assert_eq!(v["allowed"], false, "{v}");

    api.put_json(gated).unwrap();
    let condition = |api: &ApiServerDouble| -> Option<(bool, String)> {
        let p = api.get_json("v1", "pods", Some(NS), "w")?;
        let gated = p["spec"]["schedulingGates"]
            .as_array()
            .is_some_and(|g| !g.is_empty());
        let c = p["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "QuotaAdmitted")?
            .clone();
        Some((gated, c["message"].as_str()?.to_string()))
    };
    eventually_async("the pod told it waits for its template", LIMIT, || async {
        condition(&api).is_some_and(|(g, m)| g && m.contains(waiting))
    })
    .await;
    // The template arrives asking for two MIG devices: more than the quota ever allows.
    let template = |count: u32| {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": NS},
            "spec": {"spec": {"devices": {"requests": [{"name": "m", "exactly":
                {"deviceClassName": "mig.gpuplane.dev", "allocationMode": "ExactCount", "count": count}}]}}}})
    };
    api.put_json(template(2)).unwrap();
    eventually_async(
        "the pod kept gated with the quota's reason",
        LIMIT,
        || async {
            condition(&api).is_some_and(|(g, m)| {
                g && m.contains("devices[mig.gpuplane.dev]") && m.contains("GpuQuota team-a/q")
            })
        },
    )
    .await;
    assert!(stored_quota(&api, "q")
        .status
        .unwrap_or_default()
        .used
        .is_zero());
    // One device fits: released, and charged once, through the pod.
    api.put_json(template(1)).unwrap();
    eventually_async("the pod released and counted in used", LIMIT, || async {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        condition(&api).is_some_and(|(g, _)| !g)
            && s.used.devices.get("mig.gpuplane.dev") == Some(&1)
            && s.reservations.is_empty()
    })
    .await;
    r.stop().await;
}

/// Past `MAX_RESERVATIONS` admitted-but-unseen pods the webhook refuses with a retryable 429
/// naming the GpuQuota; the status stays bounded; once the controller sees the pods (and drops
/// their entries), admissions resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_reservation_cap_admissions_back_off_until_the_controller_catches_up() {
    use gpuplane_shell::quota::escrow::MAX_UNFLUSHED;
    use gpuplane_shell::quota::MAX_RESERVATIONS;
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 100_000}}}),
    )
    .await;
    let pki = Pki::new();
    let r = controller_replica(&api, &pki, "r1", false).await;
    let tls = pki.client_config();
    let admit = |i: usize| {
        let tls = tls.clone();
        let addr = r.webhook().addr();
        async move {
            let name = format!("p-{i}");
            let body = pod_review(&format!("uid-{name}"), gpu_pod(&name, "nvidia.com/gpu", 1));
            response(&post(&tls, addr, "/validate", &body).await)
        }
    };
    // Nothing is stored: the controller sees none of the pods, so every entry stays.
    let mut admitted = 0;
    let refusal = loop {
        let a = admit(admitted).await;
        if a["allowed"] != true {
            break a;
        }
        admitted += 1;
        assert!(admitted <= MAX_RESERVATIONS, "admitted past the cap");
    };
    assert!(
        admitted >= MAX_RESERVATIONS - MAX_UNFLUSHED,
        "{admitted} admitted"
    );
    assert_eq!(refusal["status"]["code"], 429, "{refusal}");
    let why = refusal["status"]["message"].as_str().unwrap_or_default();
    assert!(
        why.contains("GpuQuota team-a/q") && why.contains("try again"),
        "{why}"
    );
    let status = stored_quota(&api, "q").status.unwrap();
    let bytes = serde_json::to_vec(&status).unwrap().len();
    assert!(status.reservations.len() <= MAX_RESERVATIONS);
    assert!(bytes < 256 * 1024, "{bytes} bytes");
    assert_eq!(status.reserved.devices["nvidia.com/gpu"], admitted as u64);

    // The pods are created: the controller counts them and drops their entries.
    for i in 0..admitted {
        api.put_json(gpu_pod(&format!("p-{i}"), "nvidia.com/gpu", 1))
            .unwrap();
    }
    eventually_async("the entries of seen pods to go", LIMIT, || async {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        s.reservations.is_empty()
            && s.used.devices.get("nvidia.com/gpu") == Some(&(admitted as u64))
    })
    .await;
    assert_eq!(admit(admitted).await["allowed"], true, "admissions resume");
    r.stop().await;
}
