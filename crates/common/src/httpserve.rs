//! The one hardened HTTP serving loop behind every HTTP listener of the product: the
//! webhook's HTTPS, its metrics/probe listener and the node agent's metrics/probe listener.
//!
//! Each connection holds a slot of a bounded pool (more wait in the listen backlog), gets
//! `TCP_NODELAY`, a TLS handshake deadline when TLS is on, and a deadline for its request
//! headers (HTTP/1.1; HTTP/2 when the client negotiates it). An accept error (EMFILE under
//! descriptor pressure, for one) backs off, doubling from 10 ms to 1 s, instead of spinning.
//! When `stop` turns true the loop stops accepting and open connections are shut down
//! gracefully, each given [`ServeLimits::drain`] to finish.

use hyper::body::{Body, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_rustls::TlsAcceptor;

/// Bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time a client has for the TLS handshake.
    pub handshake: Duration,
    /// Time a client has to send a request's headers.
    pub headers: Duration,
    /// Time open connections get to finish once the listener stops.
    pub drain: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_connections: 4096,
            handshake: Duration::from_secs(10),
            headers: Duration::from_secs(10),
            drain: Duration::from_secs(5),
        }
    }
}

/// Backoff after a failed accept.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await.is_ok();
}

/// Serves `listener` until `stop` turns true: every connection (over TLS when `tls` is given)
/// is answered by the service `handler(peer)` returns. `what` names the listener in logs.
pub async fn serve<H, F, B>(
    what: &'static str,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: ServeLimits,
    handler: H,
    mut stop: watch::Receiver<bool>,
) where
    H: Fn(SocketAddr, Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let handler = Arc::new(handler);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let pauses = || crate::backoff::exponential(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
    let mut backoff = pauses();
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            _ = stopped(&mut stop) => return,
        };
        let (tcp, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => {
                    backoff = pauses();
                    a
                }
                Err(e) => {
                    let backoff = backoff.next().unwrap_or(ACCEPT_BACKOFF_MAX);
                    tracing::warn!(listener = what, error = %e, retry_in = ?backoff, "accepting a connection failed");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stopped(&mut stop) => return,
                    }
                    continue;
                }
            },
            _ = stopped(&mut stop) => return,
        };
        // Answers go out at once: with Nagle's algorithm, a TLS handshake's last records (the
        // session tickets) wait for the client's delayed ACK, ~40 ms per new connection.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(listener = what, %peer, error = %e, "TCP_NODELAY could not be set");
        }
        let handler = handler.clone();
        let tls = tls.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req| {
                let answer = handler(peer, req);
                async move { Ok::<_, Infallible>(answer.await) }
            });
            match tls {
                Some(acceptor) => {
                    let stream = match tokio::time::timeout(limits.handshake, acceptor.accept(tcp))
                        .await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(listener = what, %peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(listener = what, %peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    connection(what, peer, TokioIo::new(stream), svc, limits, stop).await;
                }
                None => connection(what, peer, TokioIo::new(tcp), svc, limits, stop).await,
            }
        });
    }
}

/// One connection, shut down gracefully when `stop` turns true.
async fn connection<I, S, B>(
    what: &'static str,
    peer: SocketAddr,
    io: I,
    svc: S,
    limits: ServeLimits,
    mut stop: watch::Receiver<bool>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.headers);
    let conn = builder.serve_connection(io, svc);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(listener = what, %peer, error = %e, "connection ended with an error");
            }
        }
        _ = stopped(&mut stop) => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(limits.drain, conn).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use hyper::body::Bytes;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn server(limits: ServeLimits) -> (SocketAddr, watch::Sender<bool>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = watch::channel(false);
        let answer = |_peer, _req| async { Response::new(Full::new(Bytes::from_static(b"ok"))) };
        tokio::spawn(serve("test", listener, None, limits, answer, stopped));
        (addr, stop)
    }

    async fn get(tcp: &mut TcpStream) -> String {
        tcp.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 1024];
        let n = tcp.read(&mut buf).await.unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[tokio::test]
    async fn a_client_that_sends_no_headers_is_cut_off_at_the_deadline() {
        let (addr, _stop) = server(ServeLimits {
            headers: Duration::from_millis(200),
            ..ServeLimits::default()
        })
        .await;
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let mut buf = [0u8; 256];
        // The server closes (possibly after a 408) instead of waiting for ever.
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match idle.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a slow client kept its connection");
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_wait_for_a_free_slot() {
        let (addr, _stop) = server(ServeLimits {
            max_connections: 1,
            ..ServeLimits::default()
        })
        .await;
        let mut first = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut first).await.contains("200 OK"));
        // The second connection is accepted by the kernel but not served while the first holds
        // the only slot.
        let mut second = TcpStream::connect(addr).await.unwrap();
        second
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 1024];
        let early = tokio::time::timeout(Duration::from_millis(300), second.read(&mut buf)).await;
        assert!(early.is_err(), "served beyond the cap");
        drop(first);
        let n = tokio::time::timeout(Duration::from_secs(10), second.read(&mut buf))
            .await
            .expect("served once the slot was free")
            .unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    }

    #[tokio::test]
    async fn stopping_ends_accepting_and_closes_idle_connections() {
        let (addr, stop) = server(ServeLimits {
            drain: Duration::from_millis(200),
            ..ServeLimits::default()
        })
        .await;
        let mut open = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut open).await.contains("200 OK"));
        stop.send_replace(true);
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(10), open.read(&mut buf))
            .await
            .expect("the idle connection was closed")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
}
