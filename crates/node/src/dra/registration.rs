//! `pluginregistration.Registration`: how the kubelet's plugin watcher learns about the driver.
//!
//! The kubelet finds our socket in `plugins_registry/`, calls `GetInfo` and learns the plugin
//! type (`DRAPlugin`), the driver name, the absolute path of the DRA socket and the gRPC services
//! behind it. It then reports the outcome with `NotifyRegistrationStatus`, which we record for
//! readiness and log when it is a refusal.
//!
//! How the kubelet reads `supported_versions` (pkg/kubelet/cm/dra/plugin): for the DRA plugin
//! service and, separately, for the health service it walks its *own* list, newest first, and
//! takes the first entry the plugin lists; our order does not decide. A 1.37 kubelet prefers
//! `v1.DRAResourceHealth` and falls back to `v1alpha1.DRAResourceHealth`; 1.34-1.36 kubelets
//! only know v1alpha1. It opens exactly one health stream, on the version it picked, and does
//! not fall back at run time (an UNIMPLEMENTED stream just stops health for the driver), so we
//! list only services the DRA socket really serves. We list newest first all the same, so that
//! the list reads as our preference to a person or a simpler client.

use crate::proto::pluginregistration_v1 as pb;
use pb::registration_server::{Registration, RegistrationServer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// The plugin type the kubelet routes to its DRA manager.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// `DRAPlugin` in package `k8s.io.kubelet.pkg.apis.dra.v1`, as the kubelet names it.
pub const V1_SERVICE: &str = "v1.DRAPlugin";
/// `DRAPlugin` in package `k8s.io.kubelet.pkg.apis.dra.v1beta1`.
pub const V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";
/// `DRAResourceHealth` in package `v1` (Kubernetes 1.37+).
pub const HEALTH_V1_SERVICE: &str = "v1.DRAResourceHealth";
/// `DRAResourceHealth` in package `v1alpha1`, superseded by v1; kubelets 1.34-1.36 only know it.
pub const HEALTH_V1ALPHA1_SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// The gRPC services the DRA socket serves: the DRA plugin versions, then the health versions,
/// each newest first.
pub fn supported_services() -> Vec<String> {
    [
        V1_SERVICE,
        V1BETA1_SERVICE,
        HEALTH_V1_SERVICE,
        HEALTH_V1ALPHA1_SERVICE,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[derive(Default)]
struct State {
    /// A watch, not a mutex: async code must not take std locks (tests/it/security.rs).
    last_error: watch::Sender<Option<String>>,
}

/// Answers the kubelet's plugin watcher for one driver and records its verdict.
#[derive(Clone)]
pub struct RegistrationService {
    driver_name: String,
    endpoint: PathBuf,
    registered: Arc<watch::Sender<bool>>,
    state: Arc<State>,
}

impl RegistrationService {
    /// `endpoint` is the DRA socket; the kubelet dials it as given, so it should be absolute.
    pub fn new(driver_name: &str, endpoint: &Path) -> Self {
        let (registered, _) = watch::channel(false);
        RegistrationService {
            driver_name: driver_name.to_string(),
            endpoint: endpoint.to_path_buf(),
            registered: Arc::new(registered),
            state: Arc::new(State::default()),
        }
    }

    /// What `GetInfo` answers.
    pub fn info(&self) -> pb::PluginInfo {
        pb::PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: supported_services(),
        }
    }

    /// True while the kubelet's last word was a successful registration; for readiness.
    pub fn registered(&self) -> watch::Receiver<bool> {
        self.registered.subscribe()
    }

    /// The error of the kubelet's last refusal, cleared by a successful registration.
    pub fn last_error(&self) -> Option<String> {
        self.state.last_error.borrow().clone()
    }

    /// Our registration socket was re-created: the kubelet forgot us until it registers again.
    pub fn reset(&self) {
        self.registered
            .send_if_modified(|r| std::mem::replace(r, false));
    }

    /// The gRPC server for this service.
    pub fn server(&self) -> RegistrationServer<RegistrationService> {
        RegistrationServer::new(self.clone())
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::PluginInfo>, Status> {
        Ok(Response::new(self.info()))
    }

    async fn notify_registration_status(
        &self,
        req: Request<pb::RegistrationStatus>,
    ) -> Result<Response<pb::RegistrationStatusResponse>, Status> {
        let status = req.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.driver_name, endpoint = %self.endpoint.display(), "registered with the kubelet");
            self.state.last_error.send_replace(None);
        } else {
            let error = if status.error.is_empty() {
                "no reason given".to_string()
            } else {
                status.error
            };
            tracing::error!(driver = %self.driver_name, error = %error, "the kubelet refused the DRA plugin registration");
            self.state.last_error.send_replace(Some(error));
        }
        self.registered.send_if_modified(|r| {
            std::mem::replace(r, status.plugin_registered) != status.plugin_registered
        });
        Ok(Response::new(pb::RegistrationStatusResponse {}))
    }
}
