//! The one lifecycle of every gRPC socket we serve (the device plugin's per resource, DRA's
//! and its registration socket): bind with mode 0600, serve through [`super::incoming`],
//! notice when the file was deleted or replaced or the server died ([`Served::gone`]), and on
//! stop remove the file first, and only while it is still ours, then give in-flight calls
//! [`STOP_GRACE`] before aborting.

use super::SocketError;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long a stopping server may take to finish in-flight calls before it is aborted.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// The identity of the file at `path`, if any: inode numbers are reused at once on some file
/// systems, so the modification time (set by `bind`, untouched by `chmod`) is part of it.
pub type FileId = (u64, u64, i64, i64);

pub fn file_id(path: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec()))
}

/// One gRPC server on a unix socket we created.
pub struct Served {
    what: &'static str,
    socket: PathBuf,
    id: Option<FileId>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    replaced_logged: bool,
}

impl Served {
    /// Binds `socket` (see [`super::bind`]) and serves `router` on it until `stop` turns
    /// true; `what` names the socket in logs. Services that hold streams open subscribe to
    /// `stop` to end them.
    pub fn start(
        what: &'static str,
        socket: &Path,
        router: tonic::transport::server::Router,
        stop: watch::Sender<bool>,
    ) -> Result<Served, SocketError> {
        let listener = super::bind(socket)?;
        let mut stopped = stop.subscribe();
        let path = socket.to_path_buf();
        let task = tokio::spawn(async move {
            let incoming = super::incoming(listener);
            let result = router
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
            if let Err(e) = result {
                tracing::error!(socket = %path.display(), error = %e, "{what} server stopped");
            }
        });
        Ok(Served {
            what,
            socket: socket.to_path_buf(),
            id: file_id(socket),
            stop,
            task,
            replaced_logged: false,
        })
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Our socket file is gone or its server died: it must be served again.
    pub fn gone(&mut self) -> bool {
        if self.task.is_finished() {
            return true;
        }
        match file_id(&self.socket) {
            None => true,
            Some(id) if Some(id) == self.id => false,
            Some(_) => {
                if !self.replaced_logged {
                    tracing::warn!(
                        socket = %self.socket.display(),
                        "{} socket replaced by another process (another agent instance?); leaving it alone",
                        self.what
                    );
                    self.replaced_logged = true;
                }
                false
            }
        }
    }

    /// Removes the socket file if it is still ours, then stops the server (open streams end,
    /// in-flight calls get [`STOP_GRACE`]). File first: a socket file nobody listens on is what
    /// a kubelet must never find (it dials, gets "connection refused" and backs off).
    pub async fn stop(mut self) {
        // File work, off the runtime: a stat and an unlink of the socket, if still ours.
        let (socket, id, what) = (self.socket.clone(), self.id, self.what);
        let removed = tokio::task::spawn_blocking(move || {
            if id.is_some() && file_id(&socket) == id {
                remove_socket(&socket, what);
            }
        });
        if let Err(e) = removed.await {
            tracing::warn!(socket = %self.socket.display(), error = %e, "removing the {} socket did not finish", self.what);
        }
        let _ = self.stop.send(true);
        if tokio::time::timeout(STOP_GRACE, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!(socket = %self.socket.display(), "{} server did not stop within {STOP_GRACE:?}; aborting it", self.what);
            self.task.abort();
        }
    }
}

pub fn remove_socket(path: &Path, what: &str) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(socket = %path.display(), error = %e, "could not remove {what} socket");
        }
    }
}
