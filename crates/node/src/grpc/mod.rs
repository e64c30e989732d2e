//! gRPC over unix sockets: the one place that binds, serves and dials them.
//!
//! The kubelet talks to plugins over unix sockets only. Binding removes a stale socket file
//! first (a crashed agent leaves one) and creates the socket with its final mode 0600; dialing
//! gives tonic a connector that ignores the URI, since tonic needs one but a unix socket has no
//! address. Every server takes its connections from [`incoming`], which puts each one through
//! [`authority::Rewriter`]: kubelet clients send `:authority` values h2 would reset (the plugin
//! watcher sends the percent-encoded socket path), and this is where they become `localhost`.

pub mod authority;
pub mod served;

pub use served::{Served, STOP_GRACE};

use gpuplane_model::report::chain;
use hyper_util::rt::TokioIo;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The socket could not be created.
    #[error("binding unix socket {path}: {}", chain(.cause))]
    Bind {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// The peer's socket could not be reached.
    #[error("connecting to unix socket {path}: {}", chain(.cause))]
    Connect {
        path: PathBuf,
        cause: tonic::transport::Error,
    },
}

/// Binds a fresh socket at `path` (replacing a stale file) with mode 0600 from its creation.
pub fn bind(path: &Path) -> Result<UnixListener, SocketError> {
    let err = |source| SocketError::Bind {
        path: path.to_path_buf(),
        cause: source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let listener = bind_owner_only(path).map_err(err)?;
    // Already 0600 on Linux; said once more for any kernel that ignores the socket's mode.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

/// Creates, binds and listens on a unix socket whose file is 0600 from the moment it exists:
/// Linux gives a new socket file the mode of the socket's own inode (less the umask), and
/// `fchmod` sets that before `bind`. No umask change (a umask is per process: another thread
/// creating a directory at that moment would get it), and no temporary name in a directory the
/// kubelet watches (its plugin watcher stats every new entry, and logs an error for one that
/// is already gone).
fn bind_owner_only(path: &Path) -> std::io::Result<UnixListener> {
    use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
    use nix::sys::stat::{fchmod, Mode};
    use std::os::fd::AsRawFd;
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    fchmod(&fd, Mode::from_bits_truncate(0o600))?;
    socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    socket::listen(&fd, Backlog::new(1024)?)?;
    UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
}

/// Connects a tonic channel to the gRPC server on the unix socket at `path`.
pub async fn connect(path: &Path) -> Result<Channel, SocketError> {
    connect_with(path, |s| s).await
}

/// [`connect`], with each connection wrapped by `wrap` (test doubles use it to speak exactly as
/// a given real client does).
pub async fn connect_with<S, F>(path: &Path, wrap: F) -> Result<Channel, SocketError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    F: Fn(UnixStream) -> S + Clone + Send + 'static,
{
    let target = path.to_path_buf();
    // The URI is never dialled; the kubelet uses the same placeholder authority.
    let endpoint = Endpoint::from_static("http://localhost");
    endpoint
        .connect_with_connector(tower::service_fn(move |_| {
            let target = target.clone();
            let wrap = wrap.clone();
            async move {
                UnixStream::connect(target)
                    .await
                    .map(|s| TokioIo::new(wrap(s)))
            }
        }))
        .await
        .map_err(|source| SocketError::Connect {
            path: path.to_path_buf(),
            cause: source,
        })
}

/// The connections of `listener`, each with its requests' `:authority` made acceptable to h2:
/// what every gRPC server on a unix socket serves.
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<Normalized<UnixStream>>> + Send + 'static {
    tokio_stream::wrappers::UnixListenerStream::new(listener)
        .map(|conn| conn.map(|s| Normalized::new(s, authority::Policy::Normalize)))
}

/// A connection whose client-to-server bytes pass through an [`authority::Rewriter`] on the
/// way in; writes pass unchanged.
pub struct Normalized<S> {
    inner: S,
    rewriter: authority::Rewriter,
    /// Rewritten bytes not yet read by the server.
    ready: Vec<u8>,
    /// How much of `ready` was read.
    taken: usize,
    scratch: Box<[u8]>,
}

impl<S> Normalized<S> {
    pub fn new(inner: S, policy: authority::Policy) -> Self {
        Normalized {
            inner,
            rewriter: authority::Rewriter::new(policy),
            ready: Vec::new(),
            taken: 0,
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Normalized<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.taken < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.taken);
                buf.put_slice(&this.ready[this.taken..this.taken + n]);
                this.taken += n;
                if this.taken == this.ready.len() {
                    this.ready.clear();
                    this.taken = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.rewriter.passes_through() {
                // The fast path: nothing left to rewrite on this connection.
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut raw = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut raw))?;
            if raw.filled().is_empty() {
                // End of stream; an incomplete frame left behind is h2's to notice.
                return Poll::Ready(Ok(()));
            }
            this.rewriter
                .push(raw.filled(), &mut this.ready)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Normalized<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Normalized<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn a_socket_is_owner_only_from_its_creation_whatever_the_umask() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        // The most permissive umask: only fchmod-before-bind can make the file 0600.
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let bound = bind_owner_only(&path);
        nix::sys::stat::umask(old);
        let _listener = bound.unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }
}
