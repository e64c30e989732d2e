//! Keeps one plugin socket served and registered with the kubelet per offered resource.
//!
//! The kubelet may start after us, restart at any time (it then deletes every socket in
//! `device-plugins/` and re-creates `kubelet.sock`), and never tells a plugin it forgot it. So
//! this loop polls: the identity (inode) of `kubelet.sock`, the presence of our own sockets, and
//! the set of resources the plan offers; whatever is missing is served and registered again.
//! Resources that did not change keep their socket and registration across config reloads.

use super::service::{options, DevicePluginService};
use crate::cdi::node_spec::NodeSpec;
use crate::grpc;
use crate::proto::deviceplugin_v1beta1 as pb;
use crate::state::NodeState;
use gpuplane_model::inventory::ResourceName;
use gpuplane_model::report::chain;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How often the kubelet socket and our own sockets are checked. The kubelet must see us again
/// within a second of its restart.
pub const POLL: Duration = Duration::from_millis(200);

/// The kubelet's registration socket name inside `device-plugins/`.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// The socket file name for a resource, e.g. `gpuplane-nvidia.com_mig-1g.10gb.sock`.
pub fn socket_name(resource: &str) -> String {
    format!("gpuplane-{}.sock", resource.replace('/', "_"))
}

/// One resource's plugin: its socket's server, and whether the kubelet took the registration.
struct Plugin {
    served: grpc::Served,
    registered: bool,
    last_error: Option<String>,
}

/// Serves and registers every resource in the plan until `shutdown` turns true; then removes
/// its sockets.
pub async fn run(
    dir: PathBuf,
    state: Arc<NodeState>,
    node_spec: Arc<NodeSpec>,
    all_registered: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut changes = state.subscribe();
    let mut plugins = Plugins {
        kubelet_sock: dir.join(KUBELET_SOCKET),
        dir,
        state,
        node_spec,
        served: BTreeMap::new(),
        kubelet_id: None,
        waiting_logged: false,
    };
    loop {
        plugins.notice_kubelet();
        let wanted: Vec<ResourceName> = plugins
            .state
            .read()
            .plan
            .resources
            .iter()
            .map(|r| r.name.clone())
            .collect();
        plugins.stop_stale(&wanted).await;
        plugins.serve_missing(&wanted);
        plugins.register_unregistered().await;
        all_registered.store(plugins.all_registered(&wanted), Ordering::Relaxed);
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = changes.changed() => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            break;
        }
    }
    for (_, s) in std::mem::take(&mut plugins.served) {
        s.served.stop().await;
    }
}

/// What [`run`] keeps between polls.
struct Plugins {
    dir: PathBuf,
    kubelet_sock: PathBuf,
    state: Arc<NodeState>,
    node_spec: Arc<NodeSpec>,
    /// Per resource served, its socket and registration.
    served: BTreeMap<ResourceName, Plugin>,
    /// The identity (device, inode) of `kubelet.sock` when last seen; a new one is a new
    /// kubelet, which knows none of our registrations.
    kubelet_id: Option<grpc::served::FileId>,
    /// "waiting for the kubelet" is logged once per absence.
    waiting_logged: bool,
}

impl Plugins {
    /// Notices a kubelet restart (or its socket appearing or going): every resource is then
    /// registered again.
    fn notice_kubelet(&mut self) {
        // The same identity our own sockets are watched by (inode numbers alone are reused).
        let now_id = grpc::served::file_id(&self.kubelet_sock);
        if now_id != self.kubelet_id {
            if self.kubelet_id.is_some() || now_id.is_none() {
                tracing::info!(socket = %self.kubelet_sock.display(), "kubelet socket changed; registering again");
            }
            for s in self.served.values_mut() {
                s.registered = false;
            }
            self.kubelet_id = now_id;
        }
        if self.kubelet_id.is_none() && !self.waiting_logged {
            tracing::info!(socket = %self.kubelet_sock.display(), "waiting for the kubelet");
            self.waiting_logged = true;
        }
    }

    /// Stops the plugins of resources no longer offered, and those whose socket is gone (the
    /// kubelet deletes them at its start) or whose server ended; the latter are served again.
    async fn stop_stale(&mut self, wanted: &[ResourceName]) {
        let stale: Vec<ResourceName> = self
            .served
            .iter_mut()
            .filter_map(|(name, p)| {
                (!wanted.contains(name) || p.served.gone()).then(|| name.clone())
            })
            .collect();
        for name in stale {
            if let Some(s) = self.served.remove(&name) {
                if wanted.contains(&name) {
                    tracing::info!(resource = %name, "plugin socket gone (kubelet restart?); serving it again");
                } else {
                    tracing::info!(resource = %name, "resource no longer offered; stopping its plugin");
                }
                s.served.stop().await;
            }
        }
    }

    /// Serves every wanted resource not served yet; one that cannot be is tried again at the
    /// next poll.
    fn serve_missing(&mut self, wanted: &[ResourceName]) {
        for name in wanted {
            if !self.served.contains_key(name) {
                match serve(&self.dir, name, self.state.clone(), self.node_spec.clone()) {
                    Ok(s) => {
                        self.served.insert(name.clone(), s);
                    }
                    Err(e) => {
                        tracing::error!(resource = %name, error = %e, "cannot serve plugin socket")
                    }
                }
            }
        }
    }

    /// Registers every served resource the kubelet (if there is one) does not know yet; a
    /// failure is logged when it differs from the last one and retried at the next poll.
    async fn register_unregistered(&mut self) {
        if self.kubelet_id.is_none() {
            return;
        }
        self.waiting_logged = false;
        for (name, s) in self.served.iter_mut().filter(|(_, s)| !s.registered) {
            match register(&self.kubelet_sock, name, s.served.socket()).await {
                Ok(()) => {
                    tracing::info!(resource = %name, endpoint = %s.served.socket().display(), "registered with the kubelet");
                    s.registered = true;
                    s.last_error = None;
                }
                Err(e) => {
                    let msg = format!("{e:#}");
                    if s.last_error.as_ref() != Some(&msg) {
                        tracing::warn!(resource = %name, error = %msg, "registration with the kubelet failed; retrying");
                    }
                    s.last_error = Some(msg);
                }
            }
        }
    }

    /// Whether the kubelet knows every resource offered (readiness).
    fn all_registered(&self, wanted: &[ResourceName]) -> bool {
        self.kubelet_id.is_some()
            && self.served.len() == wanted.len()
            && self.served.values().all(|s| s.registered)
    }
}

fn serve(
    dir: &Path,
    resource: &ResourceName,
    state: Arc<NodeState>,
    node_spec: Arc<NodeSpec>,
) -> Result<Plugin, grpc::SocketError> {
    let (stop, stopping) = watch::channel(false);
    let service = pb::device_plugin_server::DevicePluginServer::new(DevicePluginService::new(
        resource.clone(),
        state,
        node_spec,
        stopping,
    ));
    let router = tonic::transport::Server::builder().add_service(service);
    let served = grpc::Served::start(
        "device plugin",
        &dir.join(socket_name(resource)),
        router,
        stop,
    )?;
    Ok(Plugin {
        served,
        registered: false,
        last_error: None,
    })
}

#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error(transparent)]
    Socket(#[from] grpc::SocketError),
    #[error("kubelet refused registration: {}", chain(.0))]
    Refused(tonic::Status),
    #[error("kubelet did not answer within {0:?}")]
    Timeout(Duration),
}

async fn register(kubelet_sock: &Path, resource: &str, socket: &Path) -> Result<(), RegisterError> {
    const TIMEOUT: Duration = Duration::from_secs(5);
    let call = async {
        let channel = grpc::connect(kubelet_sock).await?;
        let endpoint = socket
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        pb::registration_client::RegistrationClient::new(channel)
            .register(pb::RegisterRequest {
                version: "v1beta1".into(),
                endpoint,
                resource_name: resource.to_string(),
                options: Some(options()),
            })
            .await
            .map_err(RegisterError::Refused)?;
        Ok(())
    };
    tokio::time::timeout(TIMEOUT, call)
        .await
        .map_err(|_| RegisterError::Timeout(TIMEOUT))?
}

/// The device plugin API versions the kubelet at `kubelet_sock` takes, for `gpuplane doctor`:
/// asked with a version no kubelet takes, it refuses before anything else and names the ones it
/// does (`requested API version "…" is not supported by kubelet. Supported version is
/// ["v1beta1"]`, kubelet pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go), so the probe
/// registers nothing. `Err`: no answer, or an answer that names none.
pub async fn kubelet_versions(kubelet_sock: &Path) -> Result<Vec<String>, String> {
    const TIMEOUT: Duration = Duration::from_secs(5);
    let call = async {
        let channel = grpc::connect(kubelet_sock)
            .await
            .map_err(|e| e.to_string())?;
        let answer = pb::registration_client::RegistrationClient::new(channel)
            .register(pb::RegisterRequest {
                version: "gpuplane-doctor-probe".into(),
                endpoint: String::new(),
                resource_name: "gpuplane.dev/doctor-probe".into(),
                options: None,
            })
            .await;
        match answer {
            Ok(_) => Err("the kubelet took a registration of version gpuplane-doctor-probe".into()),
            Err(status) => supported_versions(status.message())
                .ok_or_else(|| format!("the kubelet answered: {}", status.message())),
        }
    };
    tokio::time::timeout(TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {TIMEOUT:?}"))?
}

/// The quoted versions after "Supported version" in the kubelet's refusal.
fn supported_versions(message: &str) -> Option<Vec<String>> {
    let (_, list) = message.split_once("Supported version")?;
    let versions: Vec<String> = list
        .split('"')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect();
    (!versions.is_empty()).then_some(versions)
}

#[cfg(test)]
mod probe_tests {
    use super::supported_versions;

    #[test]
    fn the_kubelets_refusal_names_its_versions() {
        let m = r#"requested API version "gpuplane-doctor-probe" is not supported by kubelet. Supported version is ["v1beta1"]"#;
        assert_eq!(supported_versions(m), Some(vec!["v1beta1".to_string()]));
        assert_eq!(supported_versions("connection reset"), None);
    }
}
