//! The HTTPS server: routing, content type, body size limit, health and metrics.
//!
//! `POST /validate` and `POST /mutate` take an AdmissionReview (`Content-Type:
//! application/json`, at most [`MAX_BODY`] bytes) and answer one; a body that is not one is
//! answered 400 (415 for another content type, 413 when too large) with a plain-text message.
//! `GET /healthz` and `GET /readyz` answer as [`super::health`] says (200 or 503, a plain-text
//! body). The metrics listener (plain HTTP) serves `GET /metrics` and the same probes.

use super::admit::Admitter;
use super::cluster::Cluster;
use super::commit::CommitCounters;
use super::health::{self, Probes};
use super::metrics::{exposition, Metrics, Webhook};
use super::review;
use crate::controller_metrics::QueueMetrics;
use crate::httpserve::{serve, ServeLimits};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use std::sync::Arc;
use std::time::Instant;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

/// Largest AdmissionReview body read: a Pod may be up to ~1.5 MiB (etcd's limit) and an
/// UPDATE carries two.
pub const MAX_BODY: usize = 4 * 1024 * 1024;

type Body = Full<Bytes>;

fn text(code: StatusCode, msg: impl Into<String>) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(msg.into() + "\n")));
    *r.status_mut() = code;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn json(v: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(
        serde_json::to_vec(v).unwrap_or_default(),
    )));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn is_json(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

async fn admission(
    admitter: Arc<Admitter>,
    req: Request<Incoming>,
    mutate: bool,
) -> Response<Body> {
    let started = Instant::now();
    let r = decide(&admitter, req, mutate).await;
    let webhook = if mutate {
        Webhook::Mutate
    } else {
        Webhook::Validate
    };
    admitter.metrics.decided(webhook, started.elapsed());
    r
}

async fn decide(admitter: &Admitter, req: Request<Incoming>, mutate: bool) -> Response<Body> {
    let fail = |code: StatusCode, msg: String| {
        admitter.metrics.rejected_body(code.as_u16());
        text(code, msg)
    };
    if !is_json(&req) {
        return fail(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "expected Content-Type: application/json".into(),
        );
    }
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return fail(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body exceeds {MAX_BODY} bytes"),
        );
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return fail(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body exceeds {MAX_BODY} bytes"),
            )
        }
        Err(e) => return fail(StatusCode::BAD_REQUEST, format!("reading the body: {e}")),
    };
    let request = match review::decode(&body) {
        Ok(r) => r,
        Err(e) => return fail(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let verdict = if mutate {
        admitter.mutate(&request).await
    } else {
        admitter.validate(&request).await
    };
    if !verdict.allowed {
        tracing::info!(
            uid = %request.uid,
            kind = %request.kind.kind,
            namespace = request.namespace.as_deref().unwrap_or(""),
            name = request.name.as_deref().unwrap_or(""),
            reason = %verdict.message,
            "admission denied"
        );
    }
    match review::encode(&request, &verdict) {
        Ok(answer) => json(&answer),
        Err(e) => fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the answer: {e}"),
        ),
    }
}

/// `/healthz` or `/readyz` (`ready` picks which).
fn probe_answer(probes: &Probes, ready: bool) -> Response<Body> {
    let view = probes.view();
    let (ok, body) = if ready {
        health::readyz(&view, &probes.settings())
    } else {
        health::healthz(&view, &probes.settings())
    };
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    // The body already ends with a newline.
    text(code, body.trim_end().to_string())
}

/// Answers one HTTPS request.
pub async fn handle(
    admitter: Arc<Admitter>,
    probes: Arc<Probes>,
    req: Request<Incoming>,
) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/validate") => admission(admitter, req, false).await,
        (&Method::POST, "/mutate") => admission(admitter, req, true).await,
        (&Method::GET, "/healthz") => probe_answer(&probes, false),
        (&Method::GET, "/readyz") => probe_answer(&probes, true),
        (_, "/validate") | (_, "/mutate") => text(StatusCode::METHOD_NOT_ALLOWED, "use POST"),
        _ => text(StatusCode::NOT_FOUND, "not found"),
    }
}

/// Serves HTTPS on `listener` until `stop` turns true; `probes` learn when it no longer serves.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    admitter: Arc<Admitter>,
    probes: Arc<Probes>,
    stop: watch::Receiver<bool>,
) {
    let p = probes.clone();
    let answer = move |_peer, req| handle(admitter.clone(), p.clone(), req);
    let tls = Some(TlsAcceptor::from(tls));
    serve(
        "webhook",
        listener,
        tls,
        ServeLimits::default(),
        answer,
        stop,
    )
    .await;
    probes.set_serving(false);
}

/// What the plain-HTTP listener reports.
pub struct Reporter {
    pub metrics: Arc<Metrics>,
    pub cluster: Arc<Cluster>,
    pub probes: Arc<Probes>,
    /// The group commit's and escrow's counts.
    pub commits: Arc<CommitCounters>,
    /// The quota loops' metrics, when they run in this process.
    pub loops: Option<Arc<QueueMetrics>>,
}

impl Reporter {
    fn answer(&self, req: &Request<Incoming>) -> Response<Body> {
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/metrics") => {
                let body = exposition(
                    &self.metrics,
                    &self.cluster.cached_quotas(),
                    &self.probes,
                    &self.commits,
                    self.loops.as_deref(),
                );
                // As encoded: nothing may follow its `# EOF`.
                let mut r = Response::new(Full::new(Bytes::from(body)));
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
                );
                r
            }
            (&Method::GET, "/healthz") => probe_answer(&self.probes, false),
            (&Method::GET, "/readyz") => probe_answer(&self.probes, true),
            _ => text(StatusCode::NOT_FOUND, "not found"),
        }
    }
}

/// Serves the metrics and probes over plain HTTP until `stop` turns true.
pub async fn serve_metrics(
    listener: TcpListener,
    reporter: Arc<Reporter>,
    stop: watch::Receiver<bool>,
) {
    let answer = move |_peer, req: Request<Incoming>| {
        let r = reporter.answer(&req);
        async move { r }
    };
    serve(
        "webhook-metrics",
        listener,
        None,
        ServeLimits::default(),
        answer,
        stop,
    )
    .await;
}
