//! How the kubelet's gRPC clients dial unix sockets, down to the `:authority` each one sends, so
//! that a double can never be politer than the real kubelet (ours once sent `localhost` where the
//! plugin watcher sends the percent-encoded socket path, and a driver that passed every test
//! could not register with a real kubelet).
//!
//! Facts from the kubelet's Go sources: the plugin watcher dials `plugins_registry/*.sock` with a
//! bare path target and no authority override ([`Authority::EncodedPath`]); the device manager
//! sets `localhost`; the DRA client dials `unix:<path>`, which also yields `localhost`. grpc-java
//! and older grpc-go send the raw path; some clients send an empty value or none.

use gpuplane_node::grpc::{self, authority, SocketError};
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::Channel;

/// The `:authority` a client sends on a unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authority {
    /// `localhost`: the device manager, the DRA client.
    Localhost,
    /// grpc-go's percent-encoded socket path: the plugin watcher.
    EncodedPath,
    /// The socket path as it is: grpc-java, older grpc-go.
    RawPath,
    /// An empty value: older grpc-go for `unix://` targets.
    Empty,
    /// No `:authority` at all.
    Absent,
}

impl Authority {
    pub const ALL: [Authority; 5] = [
        Authority::Localhost,
        Authority::EncodedPath,
        Authority::RawPath,
        Authority::Empty,
        Authority::Absent,
    ];

    /// The header value sent when dialing `path`; `None` for no header.
    pub fn value(self, path: &Path) -> Option<Vec<u8>> {
        let path = path.to_string_lossy();
        match self {
            Authority::Localhost => Some(authority::Policy::LOCALHOST.to_vec()),
            Authority::EncodedPath => {
                Some(authority::grpc_go_encoded_authority(&path).into_bytes())
            }
            Authority::RawPath => Some(path.as_bytes().to_vec()),
            Authority::Empty => Some(Vec::new()),
            Authority::Absent => None,
        }
    }
}

/// Dials `path` sending `authority` on every request.
pub async fn connect(path: &Path, authority: Authority) -> Result<Channel, SocketError> {
    let policy = authority::Policy::Send(authority.value(path));
    grpc::connect_with(path, move |s| Rewriting::new(s, policy.clone())).await
}

/// A connection whose outgoing bytes pass through an [`authority::Rewriter`]; reads pass
/// unchanged.
pub struct Rewriting<S> {
    inner: S,
    rewriter: authority::Rewriter,
    out: Vec<u8>,
    sent: usize,
}

impl<S> Rewriting<S> {
    pub fn new(inner: S, policy: authority::Policy) -> Self {
        Rewriting {
            inner,
            rewriter: authority::Rewriter::new(policy),
            out: Vec::new(),
            sent: 0,
        }
    }
}

impl<S: AsyncWrite + Unpin> Rewriting<S> {
    /// Writes what the rewriter produced until none is left.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.out.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewriting<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        this.rewriter
            .push(buf, &mut this.out)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        // Accepted: what is not written now goes out with the next write or flush.
        if let Poll::Ready(Err(e)) = this.drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewriting<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}
