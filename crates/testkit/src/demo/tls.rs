//! TLS for the demo's webhook: a throwaway CA made in process signs a serving certificate for
//! `localhost`, written as the PEM files the webhook reads (as from a Secret); the demo's client
//! trusts that CA only. AdmissionReviews then travel over real HTTPS with verification on, as
//! from the API server. Also the small HTTPS client that posts them.

use gpuplane_model::report::chain;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

/// The name the serving certificate is for, and the one the client asks for.
const SERVER_NAME: &str = "localhost";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("making the demo's certificates: {}", chain(.0))]
    Certificate(rcgen::Error),
    #[error("writing {}: {}", path.display(), chain(.cause))]
    Write {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("TLS client set-up: {}", chain(.0))]
    Rustls(rustls::Error),
    #[error("connecting to the webhook at {addr}: {}", chain(.cause))]
    Connect {
        addr: SocketAddr,
        cause: std::io::Error,
    },
    #[error("HTTP to the webhook: {}", chain(.0))]
    Http(hyper::Error),
    #[error("building the request: {}", chain(.0))]
    Request(hyper::http::Error),
    #[error("the webhook answered {status} with a body that is not JSON: {}", chain(.cause))]
    Body {
        status: u16,
        cause: serde_json::Error,
    },
}

gpuplane_model::causes_from!(TlsError {
    Certificate(rcgen::Error),
    Rustls(rustls::Error),
    Http(hyper::Error),
    Request(hyper::http::Error),
});

/// A TLS client config (ring, safe default protocol versions, no client certificate) that
/// trusts the CA `ca` only.
pub fn client_trusting(ca: CertificateDer<'static>) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca)?;
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// The webhook's certificate files and a client config that trusts them.
pub struct DemoPki {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// The CA's certificate, PEM (what a webhook configuration's `caBundle` carries).
    pub ca_pem: String,
    client: Arc<rustls::ClientConfig>,
}

impl DemoPki {
    /// Makes a CA and a serving certificate for `localhost` and 127.0.0.1, and writes
    /// `tls.crt` and `tls.key` into `dir`.
    pub fn issue(dir: &Path) -> Result<DemoPki, TlsError> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Distinct subjects: with rcgen's one default name for both, OpenSSL clients (curl)
        // take the serving certificate for a self-signed one and refuse it.
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "gpuplane demo CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![SERVER_NAME.to_string(), "127.0.0.1".into()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, SERVER_NAME);
        let cert = params.signed_by(&key, &ca)?;
        let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
        for (path, text) in [(&cert_file, cert.pem()), (&key_file, key.serialize_pem())] {
            std::fs::write(path, text).map_err(|source| TlsError::Write {
                path: path.clone(),
                cause: source,
            })?;
        }
        Ok(DemoPki {
            cert_file,
            key_file,
            ca_pem: ca.pem(),
            client: Arc::new(client_trusting(ca.der().clone())?),
        })
    }

    /// POSTs `body` as JSON to `https://localhost:<port><path>` at `addr`, verifying the
    /// webhook's certificate; returns the status and the JSON answer.
    pub async fn post_json(
        &self,
        addr: SocketAddr,
        path: &str,
        body: &Value,
    ) -> Result<(u16, Value), TlsError> {
        let connect = |source| TlsError::Connect {
            addr,
            cause: source,
        };
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(connect)?;
        let name = ServerName::try_from(SERVER_NAME)
            .map_err(|e| connect(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
        let tls = tokio_rustls::TlsConnector::from(self.client.clone())
            .connect(name, tcp)
            .await
            .map_err(connect)?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        let driver = tokio::spawn(conn);
        let req = hyper::Request::post(path)
            .header(hyper::header::HOST, SERVER_NAME)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        let answer = sender.send_request(req).await;
        let result = match answer {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let bytes = resp.into_body().collect().await?.to_bytes();
                serde_json::from_slice(&bytes)
                    .map(|v| (status, v))
                    .map_err(|source| TlsError::Body {
                        status,
                        cause: source,
                    })
            }
            Err(e) => Err(e.into()),
        };
        driver.abort();
        result
    }
}
