//! The HTTPS plumbing of the webhook benchmark: a test CA, a persistent-connection client,
//! the driver that runs one concurrency level, and the floor server (bare hyper + rustls).

use super::pod_review;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// The floor's answer: about the size of an admission answer.
pub const FLOOR_BODY: &[u8] = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"u","allowed":true}}"#;

/// A test CA, a leaf for localhost, and the files the webhook loads.
pub struct Pki {
    ca_der: CertificateDer<'static>,
    cert_der: CertificateDer<'static>,
    key_der: Vec<u8>,
    dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Pki {
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

    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        Arc::new(gpuplane_testkit::demo::tls::client_trusting(self.ca_der.clone()).unwrap())
    }

    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
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

/// Called with a request's index once it was allowed (the API server then stores the pod).
pub type OnAllowed = Option<tokio::sync::mpsc::UnboundedSender<usize>>;

/// The outcome of one concurrency level.
pub struct Level {
    pub samples: Vec<Duration>,
    pub wall: Duration,
    pub allowed: usize,
    pub denied: usize,
    /// Of the denied, those refused as retryable backpressure (code 429).
    pub backpressure: usize,
    /// Requests whose connection the server closed before answering.
    pub closed: usize,
    /// Opening and warming up the connections (untimed).
    pub setup: Duration,
}

/// `clients` connections (opened and warmed up with one untimed request each, then released
/// together), each sending `per_client` requests back to back; `body(i)` is request `i`'s body.
pub async fn drive(
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
        backpressure: 0,
        closed: 0,
        setup,
    };
    let mut answers = Vec::with_capacity(total);
    for task in tasks {
        answers.extend(task.await.unwrap());
    }
    level.wall = t.elapsed();
    tally(&mut level, answers);
    level
}

/// Counts each answer (latency, HTTP status, body) into `level`.
fn tally(level: &mut Level, answers: Vec<(Duration, u16, Vec<u8>)>) {
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
            if v["response"]["status"]["code"] == json!(429) {
                level.backpressure += 1;
            }
        } else {
            level.allowed += 1;
        }
    }
}

/// The floor: hyper (HTTP/1.1) over rustls on loopback, answering a fixed small JSON body.
pub async fn floor_server(tls: Arc<rustls::ServerConfig>) -> SocketAddr {
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
