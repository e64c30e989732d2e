//! The webhook's TLS: certificate chain and key from PEM files, reloaded when they change.
//!
//! On every TLS handshake the two files' metadata (inode, size, modification and change
//! times) are compared with those last loaded; when they differ both files are read again. A
//! pair that does not load (a half-written file during rotation, a key that does not match the
//! certificate) is logged and the previous pair stays in use, so rotation never breaks
//! serving. New connections get the new certificate; open ones keep theirs.

use gpuplane_model::report::chain;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio_rustls::rustls;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading TLS certificate file {path}: {}", chain(.cause))]
    Cert {
        path: PathBuf,
        cause: rustls::pki_types::pem::Error,
    },
    #[error("TLS certificate file {0} holds no certificate")]
    NoCert(PathBuf),
    #[error("reading TLS key file {path}: {}", chain(.cause))]
    Key {
        path: PathBuf,
        cause: rustls::pki_types::pem::Error,
    },
    #[error("TLS key {key} does not fit certificate {cert}: {}", chain(.cause))]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        cause: rustls::Error,
    },
    #[error("building the TLS server config: {}", chain(.0))]
    Config(rustls::Error),
}

/// What identifies one version of a file on disk.
type Signature = Option<(u64, u64, i64, i64, i64, i64)>;

fn signature(p: &Path) -> Signature {
    let m = std::fs::metadata(p).ok()?;
    Some((
        m.ino(),
        m.len(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec(),
    ))
}

#[derive(Debug)]
struct Loaded {
    sig: (Signature, Signature),
    key: Arc<CertifiedKey>,
}

/// A certificate resolver that follows two PEM files.
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<Loaded>,
}

fn load(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Cert {
            path: cert.to_path_buf(),
            cause: source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCert(cert.to_path_buf()));
    }
    let der = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Key {
        path: key.to_path_buf(),
        cause: source,
    })?;
    CertifiedKey::from_der(chain, der, provider).map_err(|source| TlsError::Mismatch {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        cause: source,
    })
}

impl ReloadingCert {
    /// Loads the pair now; an error here is fatal (nothing to serve with).
    pub fn new(cert: &Path, key: &Path) -> Result<ReloadingCert, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let sig = (signature(cert), signature(key));
        let loaded = load(cert, key, &provider)?;
        Ok(ReloadingCert {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            loaded: Mutex::new(Loaded {
                sig,
                key: Arc::new(loaded),
            }),
        })
    }

    /// The pair to serve now, reloading it first if the files changed.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let sig = (signature(&self.cert), signature(&self.key));
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if loaded.sig != sig {
            match load(&self.cert, &self.key, &self.provider) {
                Ok(k) => {
                    tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                    loaded.key = Arc::new(k);
                    loaded.sig = sig;
                }
                Err(e) => {
                    // Keep serving the previous pair; try again on the next handshake once
                    // the files change again.
                    tracing::warn!(error = %e, "TLS certificate files changed but do not load; keeping the previous certificate");
                    loaded.sig = sig;
                }
            }
        }
        loaded.key.clone()
    }

    /// A server config (TLS 1.2 and 1.3, ALPN h2 and http/1.1) using this resolver.
    pub fn server_config(self: Arc<Self>) -> Result<rustls::ServerConfig, TlsError> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(self);
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(cfg)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}
