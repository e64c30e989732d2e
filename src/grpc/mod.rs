//! gRPC over unix sockets: the one place that binds and dials them.
//!
//! The kubelet talks to plugins over unix sockets only. Binding removes a stale socket file
//! first (a crashed agent leaves one) and restricts its mode; dialing gives tonic a connector
//! that ignores the URI, since tonic needs one but a unix socket has no address.

use hyper_util::rt::TokioIo;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The socket could not be created.
    #[error("binding unix socket {path}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The peer's socket could not be reached.
    #[error("connecting to unix socket {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
}

/// Binds a fresh socket at `path` (replacing a stale file) with mode 0600.
pub fn bind(path: &Path) -> Result<UnixListener, SocketError> {
    let err = |source| SocketError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

/// Connects a tonic channel to the gRPC server on the unix socket at `path`.
pub async fn connect(path: &Path) -> Result<Channel, SocketError> {
    let target = path.to_path_buf();
    // The URI is never dialled; the kubelet uses the same placeholder authority.
    let endpoint = Endpoint::from_static("http://localhost");
    endpoint
        .connect_with_connector(tower::service_fn(move |_| {
            let target = target.clone();
            async move { UnixStream::connect(target).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| SocketError::Connect {
            path: path.to_path_buf(),
            source,
        })
}
