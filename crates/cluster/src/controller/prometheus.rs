//! Reads raw samples from a Prometheus the cluster already runs, for the busy GPU-hours
//! ledger: one instant query of a range selector (`NAME[RANGEms]` at a time) through the HTTP
//! API (`GET /api/v1/query`, <https://prometheus.io/docs/prometheus/latest/querying/api/>),
//! whose matrix answer holds every sample the server stored in the range. Plain HTTP, as an
//! in-cluster Service serves it; one connection per query (a few queries per flush).
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
use std::time::Duration;

/// How long one query may take, connection included.
const QUERY_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read (an hour of 15 s samples of thousands of series fits).
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// Why a query failed; each names the server and what to check.
#[derive(Debug, thiserror::Error)]
pub enum PrometheusError {
    #[error("--prometheus-url {0:?} is not an http://HOST:PORT[/PATH] address (https is not supported: point it at the in-cluster Service)")]
    Url(String),
    #[error("Prometheus at {url}: {what}: {cause}")]
    Io {
        url: String,
        what: &'static str,
        cause: String,
    },
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

/// A Prometheus server's HTTP API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prometheus {
    url: String,
    /// `host:port` to connect to.
    authority: String,
    /// The path prefix (a server behind a route prefix), without a trailing `/`.
    prefix: String,
}

impl Prometheus {
    /// Reads `http://HOST:PORT[/PATH]`.
    pub fn new(url: &str) -> Result<Prometheus, PrometheusError> {
        let bad = || PrometheusError::Url(url.to_string());
        let uri: http::Uri = url.parse().map_err(|_| bad())?;
        if uri.scheme_str() != Some("http") || uri.query().is_some() {
            return Err(bad());
        }
        let host = uri.host().ok_or_else(bad)?;
        let port = uri.port_u16().unwrap_or(80);
        Ok(Prometheus {
            url: url.trim_end_matches('/').to_string(),
            authority: format!("{host}:{port}"),
            prefix: uri.path().trim_end_matches('/').to_string(),
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

    async fn get(&self, path: &str) -> Result<Bytes, PrometheusError> {
        let io = |what: &'static str| {
            let url = self.url.clone();
            move |e: &dyn std::fmt::Display| PrometheusError::Io {
                url,
                what,
                cause: e.to_string(),
            }
        };
        let tcp = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| io("connecting")(&e))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| io("starting HTTP")(&e))?;
        let conn = tokio::spawn(conn);
        let request = http::Request::get(path)
            .header(http::header::HOST, &self.authority)
            .body(Empty::<Bytes>::new())
            .map_err(|e| io("building the query")(&e))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| io("querying")(&e))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| io("reading the answer")(&*e))?
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
    fn only_plain_http_addresses_are_taken() {
        let p = Prometheus::new("http://prometheus.monitoring:9090/prom/").unwrap();
        assert_eq!(p.authority, "prometheus.monitoring:9090");
        assert_eq!(p.prefix, "/prom");
        assert_eq!(
            Prometheus::new("http://127.0.0.1").unwrap().authority,
            "127.0.0.1:80"
        );
        for bad in ["https://p:9090", "p:9090", "http://p:9090/?x=1", ""] {
            assert!(Prometheus::new(bad).is_err(), "{bad}");
        }
    }
}
