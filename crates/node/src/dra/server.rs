//! Serves the DRA kubelet plugin: the DRA socket and the registration socket, kept alive until
//! shutdown.
//!
//! Socket layout under the kubelet root (both sockets mode 0600, directories created):
//! - `plugins/<driver>/dra.sock`: `v1.DRAPlugin`, `v1beta1.DRAPlugin`, `v1.DRAResourceHealth`,
//!   `v1alpha1.DRAResourceHealth`;
//! - `plugins_registry/<driver>-reg.sock`: `pluginregistration.Registration`, whose `GetInfo`
//!   points the kubelet at the absolute path of `dra.sock`.
//!
//! The kubelet's plugin watcher reacts to sockets appearing and disappearing in
//! `plugins_registry/`; it may delete ours, and it never tells us it forgot us. So, like the
//! device plugin registrar, this loop polls every [`POLL`]: a socket of ours that vanished (or
//! whose server died) is served again, and a new DRA socket also gets a new registration socket
//! so that the kubelet re-registers and re-opens its health stream. A socket that some other
//! process replaced (another instance of the agent during an update) is left alone and is not
//! removed at shutdown. On shutdown both sockets are removed, the registration socket first.
//!
//! Invariant: the registration socket exists only while the DRA socket accepts, because the
//! kubelet dials the DRA endpoint the moment GetInfo answers. So a dead agent's registration
//! socket is removed at start, the registration socket is created only after the DRA socket
//! answers a connect, it is withdrawn before the DRA socket whenever both go, and a socket
//! file is removed before its server stops (never a file nobody listens on).

use super::health_service::HealthService;
use super::registration::RegistrationService;
use super::service::DraService;
use super::DraDriver;
use crate::grpc::served::{file_id, remove_socket};
use crate::grpc::{self, Served};
use gpuplane_model::report::chain;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How often both sockets are checked. The kubelet must see us again within a second.
pub const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The driver name cannot be used in socket paths.
    #[error("invalid DRA driver name {0:?}: must be a DNS subdomain")]
    DriverName(String),
    /// The kubelet root could not be made absolute.
    #[error("resolving kubelet root {path}: {}", chain(.cause))]
    Root {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error(transparent)]
    Socket(#[from] grpc::SocketError),
}

/// Where the driver's sockets live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraPaths {
    /// `<kubelet-root>/plugins/<driver>/dra.sock`, absolute.
    pub dra_socket: PathBuf,
    /// `<kubelet-root>/plugins_registry/<driver>-reg.sock`, absolute.
    pub registration_socket: PathBuf,
}

impl DraPaths {
    pub fn new(kubelet_root: &Path, driver_name: &str) -> Result<DraPaths, ServeError> {
        if !valid_driver_name(driver_name) {
            return Err(ServeError::DriverName(driver_name.to_string()));
        }
        let root = std::path::absolute(kubelet_root).map_err(|source| ServeError::Root {
            path: kubelet_root.to_path_buf(),
            cause: source,
        })?;
        Ok(DraPaths {
            dra_socket: root.join("plugins").join(driver_name).join("dra.sock"),
            registration_socket: root
                .join("plugins_registry")
                .join(format!("{driver_name}-reg.sock")),
        })
    }
}

/// A DNS subdomain, as Kubernetes requires of driver names; this also keeps it a plain path
/// component.
fn valid_driver_name(name: &str) -> bool {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    !name.is_empty() && name.len() <= 253 && name.split('.').all(label_ok)
}

/// True when something accepts connections on the unix socket at `path` (the registration
/// socket is only created once the DRA socket does).
async fn accepts(path: &Path) -> bool {
    tokio::net::UnixStream::connect(path).await.is_ok()
}

/// The DRA plugin of one driver: its sockets, its registration state and its driver.
pub struct DraServer {
    driver_name: String,
    paths: DraPaths,
    driver: Arc<dyn DraDriver>,
    registration: RegistrationService,
}

impl DraServer {
    pub fn new(
        kubelet_root: &Path,
        driver_name: &str,
        driver: Arc<dyn DraDriver>,
    ) -> Result<DraServer, ServeError> {
        let paths = DraPaths::new(kubelet_root, driver_name)?;
        let registration = RegistrationService::new(driver_name, &paths.dra_socket);
        Ok(DraServer {
            driver_name: driver_name.to_string(),
            paths,
            driver,
            registration,
        })
    }

    pub fn paths(&self) -> &DraPaths {
        &self.paths
    }

    /// The registration service (what `GetInfo` answers, the kubelet's last verdict).
    pub fn registration(&self) -> &RegistrationService {
        &self.registration
    }

    /// True while the kubelet has us registered; for readiness.
    pub fn registered(&self) -> watch::Receiver<bool> {
        self.registration.registered()
    }

    fn serve_dra(&self) -> Result<Served, grpc::SocketError> {
        let (stop, stopping) = watch::channel(false);
        let dra = DraService::new(self.driver.clone());
        let health = HealthService::new(self.driver.clone(), stopping);
        let router = tonic::transport::Server::builder()
            .add_service(dra.v1_server())
            .add_service(dra.v1beta1_server())
            .add_service(health.v1_server())
            .add_service(health.v1alpha1_server());
        Served::start("DRA", &self.paths.dra_socket, router, stop)
    }

    fn serve_registration(&self) -> Result<Served, grpc::SocketError> {
        let (stop, _) = watch::channel(false);
        let router = tonic::transport::Server::builder().add_service(self.registration.server());
        Served::start(
            "registration",
            &self.paths.registration_socket,
            router,
            stop,
        )
    }

    /// Serves both sockets until `shutdown` turns true (or its sender is dropped), then removes
    /// them. Fails only if a socket cannot be created at start; later failures are logged and
    /// retried every [`POLL`].
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) -> Result<(), ServeError> {
        self.remove_stale_registration().await;
        let mut dra = Some(self.serve_dra()?);
        let mut reg = None;
        if let Err(e) = self.restore(&mut dra, &mut reg).await {
            if let Some(d) = dra.take() {
                d.stop().await;
            }
            return Err(e.into());
        }
        tracing::info!(
            driver = %self.driver_name,
            dra = %self.paths.dra_socket.display(),
            registration = %self.paths.registration_socket.display(),
            "DRA plugin serving"
        );
        let mut last_error: Option<String> = None;
        loop {
            if *shutdown.borrow() {
                break;
            }
            if dra.as_mut().is_some_and(Served::gone) {
                tracing::info!(socket = %self.paths.dra_socket.display(), "DRA socket gone; serving it again");
                // Registration first: it must never answer while the DRA socket does not. A new
                // DRA socket also needs a new registration so the kubelet re-dials it.
                if let Some(s) = reg.take() {
                    s.stop().await;
                }
                if let Some(s) = dra.take() {
                    s.stop().await;
                }
            }
            if reg.as_mut().is_some_and(Served::gone) {
                tracing::info!(
                    socket = %self.paths.registration_socket.display(),
                    "registration socket gone (kubelet cleanup?); serving it again"
                );
                if let Some(s) = reg.take() {
                    s.stop().await;
                }
            }
            if dra.is_none() || reg.is_none() {
                let result = self.restore(&mut dra, &mut reg).await;
                match result {
                    Ok(()) => last_error = None,
                    Err(e) => {
                        let msg = e.to_string();
                        if last_error.as_ref() != Some(&msg) {
                            tracing::error!(driver = %self.driver_name, error = %msg, "cannot serve DRA plugin socket; retrying");
                        }
                        last_error = Some(msg);
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                changed = shutdown.changed() => if changed.is_err() { break },
            }
        }
        if let Some(s) = reg.take() {
            s.stop().await;
        }
        self.registration.reset();
        if let Some(s) = dra.take() {
            s.stop().await;
        }
        tracing::info!(driver = %self.driver_name, "DRA plugin stopped; sockets removed");
        Ok(())
    }

    /// Serves whichever socket is missing: the DRA one first, then the registration one, and
    /// that only once the DRA socket accepts connections.
    async fn restore(
        &self,
        dra: &mut Option<Served>,
        reg: &mut Option<Served>,
    ) -> Result<(), grpc::SocketError> {
        if dra.is_none() {
            *dra = Some(self.serve_dra()?);
        }
        if reg.is_none() {
            if !accepts(&self.paths.dra_socket).await {
                // Not yet (or no longer): the next poll tries again.
                return Ok(());
            }
            self.registration.reset();
            *reg = Some(self.serve_registration()?);
        }
        Ok(())
    }

    /// A registration socket that nobody answers on is a dead agent's (SIGKILL leaves its
    /// files): removed at once, so the kubelet never finds one while our DRA socket is not up.
    /// One that answers belongs to a live agent and is left alone.
    async fn remove_stale_registration(&self) {
        let path = &self.paths.registration_socket;
        if file_id(path).is_some() && !accepts(path).await {
            tracing::info!(socket = %path.display(), "removing the registration socket a previous agent left behind");
            remove_socket(path, "registration");
        }
    }
}

/// Serves the DRA plugin of `driver_name` under `kubelet_root` until `shutdown` turns true; see
/// the module documentation for the socket layout.
pub async fn serve(
    kubelet_root: &Path,
    driver_name: &str,
    driver: Arc<dyn DraDriver>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    DraServer::new(kubelet_root, driver_name, driver)?
        .run(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names() {
        assert!(valid_driver_name("gpu.nvidia.com"));
        assert!(valid_driver_name("gpu.gpuplane.io"));
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "Gpu.nvidia.com",
            "-a.com",
            "a..b",
            "a_b",
        ] {
            assert!(!valid_driver_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn layout() {
        let p = DraPaths::new(Path::new("/var/lib/kubelet"), "gpu.nvidia.com").unwrap();
        assert_eq!(
            p.dra_socket,
            Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
        );
        assert_eq!(
            p.registration_socket,
            Path::new("/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock")
        );
        let rel = DraPaths::new(Path::new("kubelet"), "gpu.nvidia.com").unwrap();
        assert!(rel.dra_socket.is_absolute());
    }
}
