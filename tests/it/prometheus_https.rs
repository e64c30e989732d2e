//! The busy GPU-hours reader against a Prometheus behind HTTPS and a bearer token (a Thanos
//! querier behind an authenticating proxy, as OpenShift runs one) or basic auth and a tenant
//! header (Grafana Mimir behind its gateway): the client verifies the server against the CA
//! file it was given, sends the credentials its files hold at each query (a rotated one is used
//! at the next), and names what went wrong otherwise: an untrusted certificate, a refused
//! token, a credential file that cannot be sent. The server is a TLS double on loopback
//! answering the query API's matrix as Prometheus does.

use gpuplane_cluster::controller::prometheus::{Access, Credentials, Prometheus};
use gpuplane_testkit::demo::tls::DemoPki;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use std::path::Path;
use std::sync::{Arc, Mutex};

const MATRIX: &str = r#"{"status":"success","data":{"resultType":"matrix","result":[
    {"metric":{"__name__":"gpuplane_container_gpu_busy_seconds_total","namespace":"ml","pod":"train"},
     "values":[[1796000000,"4"],[1796000010,"12"]]}]}}"#;

/// What the double saw: each query's path, Authorization and X-Scope-OrgID headers.
type Seen = Arc<Mutex<Vec<(String, Option<String>, Option<String>)>>>;

/// A TLS server at 127.0.0.1 with `pki`'s certificate that answers `/prom/api/v1/query` with
/// [`MATRIX`] when the Authorization header is `authorization`'s current value, 401 otherwise.
async fn serve(
    pki: &DemoPki,
    authorization: Arc<Mutex<String>>,
    seen: Seen,
) -> std::net::SocketAddr {
    let cert =
        gpuplane_cluster::webhook::tls::ReloadingCert::new(&pki.cert_file, &pki.key_file).unwrap();
    let config = Arc::new(Arc::new(cert).server_config().unwrap());
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let Ok(tls) = acceptor.accept(tcp).await else {
                continue;
            };
            let (authorization, seen) = (authorization.clone(), seen.clone());
            let service = hyper::service::service_fn(move |req: http::Request<_>| {
                let header = |name: &str| {
                    let value = req.headers().get(name)?.to_str().ok();
                    value.map(String::from)
                };
                let auth = header("authorization");
                let path = req.uri().path().to_string();
                let tenant = header("x-scope-orgid");
                seen.lock()
                    .unwrap()
                    .push((path.clone(), auth.clone(), tenant));
                let want = authorization.lock().unwrap().clone();
                let (status, body) = if auth.as_deref() != Some(want.as_str()) {
                    (401, "Unauthorized".to_string())
                } else if path == "/prom/api/v1/query" {
                    (200, MATRIX.to_string())
                } else {
                    (404, "not found".to_string())
                };
                let response = http::Response::builder()
                    .status(status)
                    .body(Full::new(Bytes::from(body)));
                async move { response }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service),
            );
        }
    });
    addr
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[tokio::test]
async fn busy_time_is_read_over_verified_https_with_the_token_its_file_holds_now() {
    let dir = tempfile::tempdir().unwrap();
    let pki = DemoPki::issue(dir.path()).unwrap();
    let (ca, token_file) = (dir.path().join("ca.pem"), dir.path().join("token"));
    write(&ca, &pki.ca_pem);
    write(&token_file, "first\n");
    let token = Arc::new(Mutex::new("Bearer first".to_string()));
    let seen = Seen::default();
    let addr = serve(&pki, token.clone(), seen.clone()).await;
    let url = format!("https://127.0.0.1:{}/prom/", addr.port());
    let access = Access {
        ca_file: Some(ca),
        credentials: Some(Credentials::BearerTokenFile(token_file.clone())),
        headers: Vec::new(),
    };
    let prometheus = Prometheus::new(&url, &access).unwrap();
    let at = 1_796_000_020_000;
    let series = prometheus
        .samples("gpuplane_container_gpu_busy_seconds_total", 60_000, at)
        .await
        .unwrap();
    assert_eq!(series.len(), 1);
    assert_eq!(
        (series[0].namespace.as_str(), series[0].pod.as_str()),
        ("ml", "train")
    );
    assert_eq!(
        series[0].points,
        vec![(1_796_000_000_000, 4.0), (1_796_000_010_000, 12.0)]
    );

    // The token is rotated: the next query sends the new one.
    *token.lock().unwrap() = "Bearer second".into();
    write(&token_file, "second");
    prometheus.samples("x", 1_000, at).await.unwrap();
    let auths: Vec<Option<String>> = seen.lock().unwrap().iter().map(|s| s.1.clone()).collect();
    assert!(seen.lock().unwrap().iter().all(|s| s.2.is_none()));
    assert_eq!(
        auths,
        [Some("Bearer first".into()), Some("Bearer second".into())]
    );

    // A token the server refuses is its answer, named.
    write(&token_file, "stale");
    let e = prometheus.samples("x", 1_000, at).await.unwrap_err();
    assert!(e.to_string().contains("answered 401"), "{e}");
}

#[tokio::test]
async fn basic_auth_comes_from_its_files_at_each_query_with_the_tenant_header() {
    let dir = tempfile::tempdir().unwrap();
    let pki = DemoPki::issue(dir.path()).unwrap();
    let ca = dir.path().join("ca.pem");
    write(&ca, &pki.ca_pem);
    // As a kubernetes.io/basic-auth Secret mounts them: each key a file, no newline.
    let (user, password) = (dir.path().join("username"), dir.path().join("password"));
    write(&user, "gpuplane");
    write(&password, "s3cret: with spaces");
    // RFC 7617: base64 of "gpuplane:s3cret: with spaces".
    let want = Arc::new(Mutex::new(
        "Basic Z3B1cGxhbmU6czNjcmV0OiB3aXRoIHNwYWNlcw==".to_string(),
    ));
    let seen = Seen::default();
    let addr = serve(&pki, want.clone(), seen.clone()).await;
    let access = Access {
        ca_file: Some(ca),
        credentials: Some(Credentials::Basic {
            username_file: user.clone(),
            password_file: password.clone(),
        }),
        headers: vec!["X-Scope-OrgID: team-a".into()],
    };
    let url = format!("https://127.0.0.1:{}/prom", addr.port());
    let prometheus = Prometheus::new(&url, &access).unwrap();
    let at = 1_796_000_020_000;
    let series = prometheus.samples("x", 60_000, at).await.unwrap();
    assert_eq!(series[0].points.len(), 2);
    // The Secret is rotated: the next query sends the new password.
    write(&password, "rotated\n");
    *want.lock().unwrap() = "Basic Z3B1cGxhbmU6cm90YXRlZA==".into();
    prometheus.samples("x", 60_000, at).await.unwrap();
    let sent: Vec<_> = seen.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "{sent:?}");
    for (_, auth, tenant) in &sent {
        assert!(auth.as_deref().is_some_and(|a| a.starts_with("Basic ")));
        assert_eq!(tenant.as_deref(), Some("team-a"));
    }
    // What cannot be sent is named with its file, and nothing is sent.
    for (file, text, why) in [
        (&user, "team:a", "holds a ':'"),
        (&password, "", "one non-empty line"),
    ] {
        let keep = std::fs::read_to_string(file).unwrap();
        write(file, text);
        let e = prometheus.samples("x", 1_000, at).await.unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains(why) && e.contains(&file.display().to_string()),
            "{e}"
        );
        write(file, &keep);
    }
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_server_whose_certificate_the_ca_file_does_not_sign_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (served, other) = (dir.path().join("served"), dir.path().join("other"));
    std::fs::create_dir_all(&served).unwrap();
    std::fs::create_dir_all(&other).unwrap();
    let pki = DemoPki::issue(&served).unwrap();
    let stranger = DemoPki::issue(&other).unwrap();
    let ca = dir.path().join("ca.pem");
    write(&ca, &stranger.ca_pem);
    let token = Arc::new(Mutex::new(String::new()));
    let seen = Seen::default();
    let addr = serve(&pki, token, seen.clone()).await;
    let access = Access {
        ca_file: Some(ca),
        ..Access::default()
    };
    let url = format!("https://127.0.0.1:{}/prom", addr.port());
    let prometheus = Prometheus::new(&url, &access).unwrap();
    let e = prometheus.samples("x", 1_000, 1).await.unwrap_err();
    assert!(e.to_string().contains("TLS handshake"), "{e}");
    assert!(seen.lock().unwrap().is_empty(), "no query may pass");
}
