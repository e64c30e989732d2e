//! The admission webhook over real HTTPS (a test CA from rcgen), against the API server
//! double: the seed scenario, exactness under concurrency across two replicas, hostile bodies,
//! certificate reload, Queue mode, claims, and an API server that goes away; whole controller
//! replicas (webhook and loops): `/readyz` through leadership and an API outage, and
//! `/metrics` per GpuQuota after a known scenario.

use crate::support::eventually::{eventually_async, LIMIT};
use gpuplane_cluster::controller::lease::LeaseTimings;
use gpuplane_cluster::controller::ControllerOptions;
use gpuplane_cluster::replica::{self, Replica};
use gpuplane_cluster::webhook::health::ProbeSettings;
use gpuplane_cluster::webhook::{self, RunningWebhook, WebhookOptions};
use gpuplane_model::quota::{GpuQuota, ReservationState, SCHEDULING_GATE};
use gpuplane_testkit::doubles::apiserver::{ApiServerDouble, Fault};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

mod admission;
mod api_access;
mod concurrency;
mod hostile_input;
mod kueue;
mod replica_probes;
mod replica_reservations;

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

async fn readyz(r: &Replica) -> (u16, String) {
    get(r.webhook().metrics_addr().unwrap(), "/readyz").await
}

/// The text value of the series `series` (name and labels, exactly as rendered) in `metrics`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
