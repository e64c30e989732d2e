//! Reads raw samples from a Prometheus the cluster already runs, for the busy GPU-hours
//! ledger: one instant query of a range selector (`NAME[RANGEms]` at a time) through the HTTP
//! API (`GET /api/v1/query`, <https://prometheus.io/docs/prometheus/latest/querying/api/>),
//! whose matrix answer holds every sample the server stored in the range. Plain HTTP, as an
//! in-cluster Service serves it, or HTTPS verified against a CA bundle; with an optional bearer
//! token (a query frontend behind an authenticating proxy, e.g. OpenShift's Thanos querier
//! taking the controller's ServiceAccount token) or basic auth (Prometheus' own
//! `basic_auth_users`, Grafana Mimir behind its gateway), each read from files at every query
//! so a rotated Secret is used; and extra headers (a Mimir or Cortex tenant's `X-Scope-OrgID`).
//! One connection per query (a few per flush).
//!
//! The workload's `namespace` and `pod` labels are read as the agent wrote them, or as
//! `exported_namespace` / `exported_pod` where the scrape config attached the agent pod's own
//! (Prometheus renames the scraped ones on a clash unless `honor_labels` is set).

use gpuplane_model::controller::hours::PodSeries;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

/// How long one query may take, connection included.
const QUERY_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read (an hour of 15 s samples of thousands of series fits).
const MAX_ANSWER_BYTES: usize = 64 << 20;
/// The CA bundle an https server is verified against when no `--prometheus-ca-file` is given:
/// the system's (Debian's ca-certificates, which the distroless image carries at this path).
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Why a query failed; each names the server and what to check.
#[derive(Debug, thiserror::Error)]
pub enum PrometheusError {
    #[error("--prometheus-url {0:?} is not an http(s)://HOST:PORT[/PATH] address")]
    Url(String),
    #[error("--prometheus-ca-file is for an https --prometheus-url, not {0:?}")]
    CaWithoutTls(String),
    #[error("the CA bundle {} for --prometheus-url: {cause}; pass --prometheus-ca-file with the PEM of the CA that signed Prometheus' certificate", path.display())]
    Ca { path: PathBuf, cause: String },
    #[error("Prometheus at {url}: {what}: {cause}")]
    Io {
        url: String,
        what: &'static str,
        cause: String,
    },
    #[error("Prometheus at {url}: reading the {what} {}: {cause}", path.display())]
    Credential {
        url: String,
        what: &'static str,
        path: PathBuf,
        cause: String,
    },
    #[error(
        "--prometheus-header {0:?}: {1}; write it as NAME: VALUE, e.g. \"X-Scope-OrgID: team-a\""
    )]
    Header(String, &'static str),
    #[error("Prometheus at {url} answered {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("Prometheus at {url} gave an answer that is not a matrix of samples: {cause}")]
    Answer { url: String, cause: String },
    #[error("Prometheus at {url} did not answer within {QUERY_TIMEOUT:?}")]
    Timeout { url: String },
}

/// How to reach the server beyond its URL.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// PEM CA certificates an https server's certificate must chain to; `None`:
    /// [`SYSTEM_CA_BUNDLE`].
    pub ca_file: Option<PathBuf>,
    pub credentials: Option<Credentials>,
    /// Headers sent with every query, each `NAME: VALUE`.
    pub headers: Vec<String>,
}

/// Who the controller is to the server: files read at each query (a projected
/// ServiceAccount token, or a Secret's keys, is rotated under the controller's feet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credentials {
    /// `Authorization: Bearer` with the file's token.
    BearerTokenFile(PathBuf),
    /// `Authorization: Basic` (RFC 7617) with the user and password the files hold, e.g. the
    /// `username` and `password` keys of a `kubernetes.io/basic-auth` Secret.
    Basic {
        username_file: PathBuf,
        password_file: PathBuf,
    },
}

/// A Prometheus server's HTTP API.
#[derive(Debug, Clone)]
pub struct Prometheus {
    url: String,
    /// `host:port` to connect to.
    authority: String,
    /// The path prefix (a server behind a route prefix), without a trailing `/`.
    prefix: String,
    /// For https: the client config and the name the certificate must carry.
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    credentials: Option<Credentials>,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

impl Prometheus {
    /// Reads `http(s)://HOST:PORT[/PATH]`; for https, loads the CA bundle now, so a bad one
    /// stops the controller at start rather than every flush.
    pub fn new(url: &str, access: &Access) -> Result<Prometheus, PrometheusError> {
        let bad = || PrometheusError::Url(url.to_string());
        let uri: http::Uri = url.parse().map_err(|_| bad())?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(bad()),
        };
        if uri.query().is_some() {
            return Err(bad());
        }
        let host = uri.host().ok_or_else(bad)?;
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = match (https, &access.ca_file) {
            (false, Some(_)) => return Err(PrometheusError::CaWithoutTls(url.to_string())),
            (false, None) => None,
            (true, ca) => {
                let ca = ca.as_deref().unwrap_or(Path::new(SYSTEM_CA_BUNDLE));
                // An IPv6 literal comes bracketed in the URI; the certificate names the address.
                let name = host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string();
                let name = ServerName::try_from(name).map_err(|_| bad())?;
                Some((Arc::new(client_config(ca)?), name))
            }
        };
        Ok(Prometheus {
            url: url.trim_end_matches('/').to_string(),
            authority: format!("{host}:{port}"),
            prefix: uri.path().trim_end_matches('/').to_string(),
            tls,
            credentials: access.credentials.clone(),
            headers: access
                .headers
                .iter()
                .map(|h| header(h))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Every sample of the series `name` in the `range_ms` before `at_ms` (ms since the epoch),
    /// per series with a pod, in time order.
    pub async fn samples(
        &self,
        name: &str,
        range_ms: i64,
        at_ms: i64,
    ) -> Result<Vec<PodSeries>, PrometheusError> {
        let query: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("query", &format!("{name}[{}ms]", range_ms.max(1)))
            .append_pair("time", &format!("{:.3}", at_ms as f64 / 1000.0))
            .finish();
        let path = format!("{}/api/v1/query?{query}", self.prefix);
        let body = tokio::time::timeout(QUERY_TIMEOUT, self.get(&path))
            .await
            .map_err(|_| PrometheusError::Timeout {
                url: self.url.clone(),
            })??;
        parse_matrix(&body).map_err(|cause| PrometheusError::Answer {
            url: self.url.clone(),
            cause,
        })
    }

    /// A failure `what` (connecting, the handshake, …) on the way to this Prometheus.
    fn io(&self, what: &'static str, cause: impl std::fmt::Display) -> PrometheusError {
        PrometheusError::Io {
            url: self.url.clone(),
            what,
            cause: cause.to_string(),
        }
    }

    async fn get(&self, path: &str) -> Result<Bytes, PrometheusError> {
        let authorization = self.authorization().await?;
        let tcp = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| self.io("connecting", e))?;
        match &self.tls {
            None => self.exchange(tcp, path, authorization).await,
            Some((config, name)) => {
                let tls = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| self.io("TLS handshake", e))?;
                self.exchange(tls, path, authorization).await
            }
        }
    }

    /// The `Authorization` header's value from the credentials' files as they are now.
    async fn authorization(&self) -> Result<Option<String>, PrometheusError> {
        use base64::Engine as _;
        Ok(match &self.credentials {
            None => None,
            Some(Credentials::BearerTokenFile(file)) => {
                let token = self.secret("bearer token", file).await?;
                Some(format!("Bearer {token}"))
            }
            Some(Credentials::Basic {
                username_file,
                password_file,
            }) => {
                let user = self.secret("basic-auth username", username_file).await?;
                if user.contains(':') {
                    return Err(self.credential(
                        "basic-auth username",
                        username_file,
                        "it holds a ':', which basic auth cannot carry in a user name".into(),
                    ));
                }
                let password = self.secret("basic-auth password", password_file).await?;
                let pair =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                Some(format!("Basic {pair}"))
            }
        })
    }

    /// The one line credential file `file` (`what`) holds now, its newline dropped; never logged.
    async fn secret(&self, what: &'static str, file: &Path) -> Result<String, PrometheusError> {
        let text = tokio::fs::read_to_string(file)
            .await
            .map_err(|e| self.credential(what, file, e.to_string()))?;
        // A Secret's key holds the value alone; a file written by hand ends in a newline.
        let value = text.trim_end_matches(['\r', '\n']);
        if value.is_empty() || value.contains(['\r', '\n']) {
            let why = "it must hold one non-empty line";
            return Err(self.credential(what, file, why.into()));
        }
        Ok(value.to_string())
    }

    fn credential(&self, what: &'static str, path: &Path, cause: String) -> PrometheusError {
        PrometheusError::Credential {
            url: self.url.clone(),
            what,
            path: path.to_path_buf(),
            cause,
        }
    }

    /// One GET over `stream`, its body if the status is a success.
    async fn exchange<S>(
        &self,
        stream: S,
        path: &str,
        authorization: Option<String>,
    ) -> Result<Bytes, PrometheusError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| self.io("starting HTTP", e))?;
        let conn = tokio::spawn(conn);
        let mut request = http::Request::get(path).header(http::header::HOST, &self.authority);
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        if let Some(authorization) = authorization {
            request = request.header(http::header::AUTHORIZATION, authorization);
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| self.io("building the query", e))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| self.io("querying", e))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| self.io("reading the answer", e))?
            .to_bytes();
        conn.abort();
        if !status.is_success() {
            return Err(PrometheusError::Status {
                url: self.url.clone(),
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body).chars().take(300).collect(),
            });
        }
        Ok(body)
    }
}

/// A `--prometheus-header` value, `NAME: VALUE`, as a header to send. The connection's own
/// headers and the credentials' are refused: the client sets those.
fn header(raw: &str) -> Result<(http::HeaderName, http::HeaderValue), PrometheusError> {
    let bad = |why| PrometheusError::Header(raw.to_string(), why);
    let (name, value) = raw.split_once(':').ok_or_else(|| bad("no ':'"))?;
    let name = http::HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| bad("not a header name"))?;
    let value = http::HeaderValue::from_str(value.trim()).map_err(|_| bad("not a header value"))?;
    use http::header::{AUTHORIZATION, CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
    if name == AUTHORIZATION {
        return Err(bad(
            "Authorization comes from --prometheus-bearer-token-file or --prometheus-username-file",
        ));
    }
    if [HOST, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING].contains(&name) {
        return Err(bad("the client sets this header itself"));
    }
    Ok((name, value))
}

/// A client config (ring, TLS 1.2 and 1.3) trusting the CA certificates in `ca`.
fn client_config(ca: &Path) -> Result<rustls::ClientConfig, PrometheusError> {
    let failed = |cause: String| PrometheusError::Ca {
        path: ca.to_path_buf(),
        cause,
    };
    let certs = CertificateDer::pem_file_iter(ca)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| failed(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(failed("no CA certificate in it".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| failed(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[derive(Deserialize)]
struct Answer {
    status: String,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    data: Option<Data>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Data {
    result_type: String,
    result: Vec<MatrixSeries>,
}

#[derive(Deserialize)]
struct MatrixSeries {
    metric: HashMap<String, String>,
    /// `[seconds since the epoch, "value"]`.
    values: Vec<(f64, String)>,
}

/// A query's matrix as series per pod; series without a pod (unheld devices) are left out.
pub fn parse_matrix(body: &[u8]) -> Result<Vec<PodSeries>, String> {
    let answer: Answer = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    if answer.status != "success" {
        return Err(answer.error.unwrap_or(answer.status));
    }
    let data = answer.data.ok_or("no data")?;
    if data.result_type != "matrix" {
        return Err(format!("resultType {}", data.result_type));
    }
    let label = |m: &HashMap<String, String>, name: &str| {
        m.get(&format!("exported_{name}"))
            .or_else(|| m.get(name))
            .cloned()
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for s in data.result {
        let (namespace, pod) = (label(&s.metric, "namespace"), label(&s.metric, "pod"));
        if pod.is_empty() {
            continue;
        }
        let mut points = Vec::with_capacity(s.values.len());
        for (t, v) in s.values {
            let v: f64 = v.parse().map_err(|_| format!("sample value {v:?}"))?;
            #[allow(clippy::cast_possible_truncation)]
            points.push(((t * 1000.0).round() as i64, v));
        }
        out.push(PodSeries {
            namespace,
            pod,
            points,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_matrix_reads_as_series_per_pod_with_exported_labels_first() {
        let body = br#"{"status":"success","data":{"resultType":"matrix","result":[
            {"metric":{"__name__":"x","namespace":"gpuplane-system","pod":"agent-1","exported_namespace":"ml","exported_pod":"train"},"values":[[1796000000.5,"1.5"],[1796000010.5,"3"]]},
            {"metric":{"namespace":"ml","pod":"infer"},"values":[[1796000000,"2"]]},
            {"metric":{"namespace":"","pod":""},"values":[[1796000000,"9"]]}]}}"#;
        let got = parse_matrix(body).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].namespace.as_str(), got[0].pod.as_str()),
            ("ml", "train")
        );
        assert_eq!(
            got[0].points,
            vec![(1_796_000_000_500, 1.5), (1_796_000_010_500, 3.0)]
        );
        assert_eq!(got[1].pod, "infer");
        let error = br#"{"status":"error","errorType":"bad_data","error":"parse error"}"#;
        assert_eq!(parse_matrix(error).unwrap_err(), "parse error");
        let vector = br#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
        assert!(parse_matrix(vector).is_err());
    }

    #[test]
    fn http_and_https_addresses_are_taken_and_a_ca_needs_https() {
        let none = Access::default();
        let p = Prometheus::new("http://prometheus.monitoring:9090/prom/", &none).unwrap();
        assert_eq!(p.authority, "prometheus.monitoring:9090");
        assert_eq!(p.prefix, "/prom");
        assert!(p.tls.is_none());
        assert_eq!(
            Prometheus::new("http://127.0.0.1", &none)
                .unwrap()
                .authority,
            "127.0.0.1:80"
        );
        for bad in ["ftp://p:9090", "p:9090", "http://p:9090/?x=1", ""] {
            assert!(Prometheus::new(bad, &none).is_err(), "{bad}");
        }
        let dir = tempfile::tempdir().unwrap();
        let missing = Access {
            ca_file: Some(dir.path().join("ca.crt")),
            ..Access::default()
        };
        let e = Prometheus::new("https://thanos-querier:9091", &missing).unwrap_err();
        assert!(e.to_string().contains("ca.crt"), "{e}");
        let e = Prometheus::new("http://p:9090", &missing).unwrap_err();
        assert!(matches!(e, PrometheusError::CaWithoutTls(_)), "{e}");
        std::fs::write(dir.path().join("ca.crt"), "not a certificate\n").unwrap();
        let e = Prometheus::new("https://p", &missing).unwrap_err();
        assert!(e.to_string().contains("no CA certificate"), "{e}");
    }

    #[test]
    fn headers_are_name_colon_value_and_may_not_replace_the_clients_own() {
        let (name, value) = header(" X-Scope-OrgID :  team-a ").unwrap();
        assert_eq!(
            (name.as_str(), value.to_str().unwrap()),
            ("x-scope-orgid", "team-a")
        );
        for (bad, why) in [
            ("X-Scope-OrgID team-a", "no ':'"),
            ("X Scope: a", "not a header name"),
            ("X-Tenant: a\nb", "not a header value"),
            ("authorization: Bearer x", "Authorization comes from"),
            ("Host: elsewhere", "sets this header itself"),
        ] {
            let e = header(bad).unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains("--prometheus-header"),
                "{bad}: {e}"
            );
        }
    }
}
