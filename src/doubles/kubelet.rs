//! A kubelet double for the device plugin API: serves `v1beta1.Registration` on
//! `<root>/device-plugins/kubelet.sock` and drives registered plugins as the kubelet's device
//! manager does: dial the endpoint, read options, follow ListAndWatch, call
//! GetPreferredAllocation and Allocate. `restart` does what a kubelet restart does to plugins:
//! it deletes every socket in `device-plugins/` and re-creates `kubelet.sock`.

use crate::grpc;
use crate::proto::deviceplugin_v1beta1 as pb;
use pb::device_plugin_client::DevicePluginClient;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

/// What the double knows of one registered plugin.
#[derive(Debug, Clone)]
pub struct PluginView {
    pub endpoint: PathBuf,
    pub options: Option<pb::DevicePluginOptions>,
    /// The latest ListAndWatch list.
    pub devices: Vec<pb::Device>,
    /// How many ListAndWatch messages arrived.
    pub updates: u64,
}

impl PluginView {
    pub fn healthy(&self) -> usize {
        self.devices
            .iter()
            .filter(|d| d.health == "Healthy")
            .count()
    }
}

#[derive(Default)]
struct Inner {
    plugins: Mutex<BTreeMap<String, PluginView>>,
    registrations: Mutex<Vec<pb::RegisterRequest>>,
    streams: Mutex<Vec<JoinHandle<()>>>,
    changed: Option<watch::Sender<u64>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    fn bump(&self) {
        if let Some(c) = &self.changed {
            c.send_modify(|g| *g += 1);
        }
    }
}

pub struct KubeletDouble {
    dir: PathBuf,
    inner: Arc<Inner>,
    changes: watch::Receiver<u64>,
    server: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

struct RegistrationService {
    dir: PathBuf,
    inner: Arc<Inner>,
}

#[tonic::async_trait]
impl pb::registration_server::Registration for RegistrationService {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let req = req.into_inner();
        if req.version != "v1beta1" {
            return Err(Status::invalid_argument(format!(
                "unsupported device plugin API version {}",
                req.version
            )));
        }
        if req
            .resource_name
            .split_once('/')
            .is_none_or(|(d, n)| d.is_empty() || n.is_empty())
        {
            return Err(Status::invalid_argument(format!(
                "invalid extended resource name {}",
                req.resource_name
            )));
        }
        if req.endpoint.contains('/') {
            return Err(Status::invalid_argument(
                "endpoint must be a file name inside device-plugins/",
            ));
        }
        lock(&self.inner.registrations).push(req.clone());
        let endpoint = self.dir.join(&req.endpoint);
        let inner = self.inner.clone();
        let resource = req.resource_name.clone();
        // Like the kubelet, answer the registration first and dial the plugin afterwards.
        let task = tokio::spawn(async move {
            if let Err(e) = follow(&inner, &resource, &endpoint).await {
                tracing::debug!(%resource, error = %e, "kubelet double: plugin stream ended");
            }
            // As the kubelet does when a plugin disconnects: its devices stop being allocatable.
            if let Some(view) = lock(&inner.plugins).get_mut(&resource) {
                if view.endpoint == endpoint {
                    view.devices
                        .iter_mut()
                        .for_each(|d| d.health = "Unhealthy".into());
                }
            }
            inner.bump();
        });
        lock(&self.inner.streams).push(task);
        Ok(Response::new(pb::Empty {}))
    }
}

async fn follow(
    inner: &Arc<Inner>,
    resource: &str,
    endpoint: &Path,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut client = DevicePluginClient::new(grpc::connect(endpoint).await?);
    let options = client
        .get_device_plugin_options(pb::Empty {})
        .await?
        .into_inner();
    lock(&inner.plugins).insert(
        resource.to_string(),
        PluginView {
            endpoint: endpoint.to_path_buf(),
            options: Some(options),
            devices: Vec::new(),
            updates: 0,
        },
    );
    inner.bump();
    let mut stream = client.list_and_watch(pb::Empty {}).await?.into_inner();
    while let Some(msg) = stream.message().await? {
        if let Some(view) = lock(&inner.plugins).get_mut(resource) {
            view.devices = msg.devices;
            view.updates += 1;
        }
        inner.bump();
    }
    Ok(())
}

impl KubeletDouble {
    /// Starts serving registration under `kubelet_root/device-plugins/`.
    pub async fn start(kubelet_root: &Path) -> Result<KubeletDouble, grpc::SocketError> {
        let (tx, changes) = watch::channel(0);
        let inner = Arc::new(Inner {
            changed: Some(tx),
            ..Inner::default()
        });
        let mut k = KubeletDouble {
            dir: kubelet_root.join("device-plugins"),
            inner,
            changes,
            server: None,
        };
        k.serve()?;
        Ok(k)
    }

    fn serve(&mut self) -> Result<(), grpc::SocketError> {
        let listener = grpc::bind(&self.dir.join("kubelet.sock"))?;
        let svc = pb::registration_server::RegistrationServer::new(RegistrationService {
            dir: self.dir.clone(),
            inner: self.inner.clone(),
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await;
        });
        self.server = Some((stop, task));
        Ok(())
    }

    /// Stops serving and forgets every plugin (a kubelet that went away).
    pub async fn stop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            let _ = task.await;
        }
        for t in lock(&self.inner.streams).drain(..) {
            t.abort();
        }
        lock(&self.inner.plugins).clear();
        self.inner.bump();
    }

    /// A kubelet restart: stop, delete every socket in device-plugins/, serve a new kubelet.sock.
    pub async fn restart(&mut self) -> Result<(), grpc::SocketError> {
        self.stop().await;
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                if e.path().extension().is_some_and(|x| x == "sock") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        self.serve()
    }

    pub fn registrations(&self) -> Vec<pb::RegisterRequest> {
        lock(&self.inner.registrations).clone()
    }

    pub fn plugins(&self) -> BTreeMap<String, PluginView> {
        lock(&self.inner.plugins).clone()
    }

    pub fn plugin(&self, resource: &str) -> Option<PluginView> {
        lock(&self.inner.plugins).get(resource).cloned()
    }

    /// Waits until `check` holds for the registered plugins; on time-out returns what it saw.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        check: impl Fn(&BTreeMap<String, PluginView>) -> bool,
    ) -> Result<BTreeMap<String, PluginView>, String> {
        let mut changes = self.changes.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.plugins();
            if check(&now) {
                return Ok(now);
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                let seen: Vec<String> = now
                    .iter()
                    .map(|(r, v)| {
                        format!("{r}: {} devices, {} healthy", v.devices.len(), v.healthy())
                    })
                    .collect();
                return Err(format!(
                    "timed out after {timeout:?}; kubelet double sees [{}]",
                    seen.join("; ")
                ));
            }
        }
    }

    async fn client(
        &self,
        resource: &str,
    ) -> Result<DevicePluginClient<tonic::transport::Channel>, Status> {
        let view = self
            .plugin(resource)
            .ok_or_else(|| Status::not_found(format!("no plugin registered for {resource}")))?;
        let channel = grpc::connect(&view.endpoint)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(DevicePluginClient::new(channel))
    }

    /// Allocate for one container, as the kubelet does at admission.
    pub async fn allocate(
        &self,
        resource: &str,
        ids: &[String],
    ) -> Result<pb::ContainerAllocateResponse, Status> {
        let req = pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: ids.to_vec(),
            }],
        };
        let mut resp = self
            .client(resource)
            .await?
            .allocate(req)
            .await?
            .into_inner();
        resp.container_responses
            .pop()
            .ok_or_else(|| Status::internal("Allocate returned no container response"))
    }

    /// GetPreferredAllocation for one container.
    pub async fn preferred(
        &self,
        resource: &str,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, Status> {
        let req = pb::PreferredAllocationRequest {
            container_requests: vec![pb::ContainerPreferredAllocationRequest {
                available_device_i_ds: available.to_vec(),
                must_include_device_i_ds: must_include.to_vec(),
                allocation_size: i32::try_from(size)
                    .map_err(|_| Status::invalid_argument("size too large"))?,
            }],
        };
        let mut resp = self
            .client(resource)
            .await?
            .get_preferred_allocation(req)
            .await?
            .into_inner();
        Ok(resp
            .container_responses
            .pop()
            .map(|c| c.device_i_ds)
            .unwrap_or_default())
    }
}
