//! A kubelet double for the device plugin API: serves `v1beta1.Registration` on
//! `<root>/device-plugins/kubelet.sock` and drives registered plugins as the kubelet's device
//! manager does: dial the endpoint, read options, follow ListAndWatch, call
//! GetPreferredAllocation and Allocate. `admit` is the device manager's pod admission (pick from
//! the healthy unassigned devices, ask for a preference, Allocate, record the assignment) and
//! the recorded assignments are served on `<root>/pod-resources/kubelet.sock` through
//! `v1.PodResourcesLister`, as the kubelet does. `restart` does what a kubelet restart does to
//! plugins: it deletes every socket in `device-plugins/` and re-creates `kubelet.sock`.

use gpuplane_node::grpc;
use gpuplane_node::proto::deviceplugin_v1beta1 as pb;
use gpuplane_node::proto::podresources_v1 as pr;
use pb::device_plugin_client::DevicePluginClient;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Devices assigned to one container: (namespace, pod, container) -> resource -> device IDs.
pub type Assignments = BTreeMap<(String, String, String), BTreeMap<String, Vec<String>>>;

#[derive(Default)]
struct Inner {
    plugins: Mutex<BTreeMap<String, PluginView>>,
    assigned: Mutex<Assignments>,
    registrations: Mutex<Vec<pb::RegisterRequest>>,
    /// Every ListAndWatch message, in arrival order: (resource, its devices).
    answers: Mutex<Vec<(String, Vec<pb::Device>)>>,
    streams: Mutex<Vec<JoinHandle<()>>>,
    changed: Option<watch::Sender<u64>>,
    /// PodResources List requests received, counted before the answer is read.
    lists: AtomicU64,
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
    pod_resources: PathBuf,
    inner: Arc<Inner>,
    changes: watch::Receiver<u64>,
    server: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

struct PodResourcesService {
    inner: Arc<Inner>,
}

fn container_devices(resource: &str, ids: &[String]) -> pr::ContainerDevices {
    pr::ContainerDevices {
        resource_name: resource.to_string(),
        device_ids: ids.to_vec(),
        topology: None,
    }
}

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        // Counted first: a List counted after a change answers with it.
        self.inner.lists.fetch_add(1, Ordering::SeqCst);
        let assigned = lock(&self.inner.assigned).clone();
        let mut pods: BTreeMap<(String, String), Vec<pr::ContainerResources>> = BTreeMap::new();
        for ((ns, pod, container), by_resource) in assigned {
            pods.entry((ns, pod))
                .or_default()
                .push(pr::ContainerResources {
                    name: container,
                    devices: by_resource
                        .iter()
                        .map(|(r, ids)| container_devices(r, ids))
                        .collect(),
                    ..Default::default()
                });
        }
        let pod_resources = pods
            .into_iter()
            .map(|((namespace, name), containers)| pr::PodResources {
                name,
                namespace,
                containers,
            })
            .collect();
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources,
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        let plugins = lock(&self.inner.plugins).clone();
        let devices = plugins
            .iter()
            .map(|(r, v)| {
                container_devices(
                    r,
                    &v.devices
                        .iter()
                        .filter(|d| d.health == "Healthy")
                        .map(|d| d.id.clone())
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        Ok(Response::new(pr::AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        req: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        let req = req.into_inner();
        let all = self
            .list(Request::new(pr::ListPodResourcesRequest {}))
            .await?
            .into_inner();
        let pod = all
            .pod_resources
            .into_iter()
            .find(|p| p.name == req.pod_name && p.namespace == req.pod_namespace);
        match pod {
            Some(p) => Ok(Response::new(pr::GetPodResourcesResponse {
                pod_resources: Some(p),
            })),
            None => Err(Status::not_found(format!(
                "pod {}/{} not found",
                req.pod_namespace, req.pod_name
            ))),
        }
    }
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
        // As the kubelet refuses it (pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go:
        // a Go error, so gRPC code Unknown), before looking at anything else.
        if req.version != "v1beta1" {
            return Err(Status::unknown(format!(
                "requested API version {:?} is not supported by kubelet. Supported version is [\"v1beta1\"]",
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
        lock(&inner.answers).push((resource.to_string(), msg.devices.clone()));
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
            pod_resources: kubelet_root.join("pod-resources").join("kubelet.sock"),
            inner,
            changes,
            server: None,
        };
        k.serve()?;
        Ok(k)
    }

    fn serve(&mut self) -> Result<(), grpc::SocketError> {
        let listener = grpc::bind(&self.dir.join("kubelet.sock"))?;
        let pr_listener = grpc::bind(&self.pod_resources)?;
        let svc = pb::registration_server::RegistrationServer::new(RegistrationService {
            dir: self.dir.clone(),
            inner: self.inner.clone(),
        });
        let pr_svc =
            pr::pod_resources_lister_server::PodResourcesListerServer::new(PodResourcesService {
                inner: self.inner.clone(),
            });
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let (pr_stop, pr_stopped) = oneshot::channel::<()>();
            let pod_resources = tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(pr_svc)
                    .serve_with_incoming_shutdown(grpc::incoming(pr_listener), async {
                        let _ = pr_stopped.await;
                    }),
            );
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(grpc::incoming(listener), async {
                    let _ = stopped.await;
                })
                .await;
            let _ = pr_stop.send(());
            let _ = pod_resources.await;
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

    /// Every ListAndWatch message received so far (across plugins and restarts), in order.
    pub fn answers(&self) -> Vec<(String, Vec<pb::Device>)> {
        lock(&self.inner.answers).clone()
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

    /// Admits one container asking for `count` devices of `resource`, as the device manager
    /// does: healthy devices no other container is assigned, a preferred allocation, Allocate,
    /// then the assignment is recorded (and listed by PodResources). Returns the device IDs.
    pub async fn admit(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        resource: &str,
        count: usize,
    ) -> Result<(Vec<String>, pb::ContainerAllocateResponse), Status> {
        let view = self
            .plugin(resource)
            .ok_or_else(|| Status::not_found(format!("no plugin registered for {resource}")))?;
        let taken: std::collections::BTreeSet<String> = lock(&self.inner.assigned)
            .values()
            .filter_map(|m| m.get(resource))
            .flatten()
            .cloned()
            .collect();
        let available: Vec<String> = view
            .devices
            .iter()
            .filter(|d| d.health == "Healthy" && !taken.contains(&d.id))
            .map(|d| d.id.clone())
            .collect();
        if available.len() < count {
            return Err(Status::resource_exhausted(format!(
                "{count} {resource} requested, {} available",
                available.len()
            )));
        }
        let ids = match view
            .options
            .as_ref()
            .is_some_and(|o| o.get_preferred_allocation_available)
        {
            true => self.preferred(resource, &available, &[], count).await?,
            false => available[..count].to_vec(),
        };
        let grant = self.allocate(resource, &ids).await?;
        self.assign(namespace, pod, container, resource, &ids);
        Ok((ids, grant))
    }

    /// Records `ids` of `resource` as assigned to a container without any plugin of this
    /// double: what PodResources lists for pods another device plugin (NVIDIA's, or an
    /// earlier agent's) placed.
    pub fn assign(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        resource: &str,
        ids: &[String],
    ) {
        lock(&self.inner.assigned)
            .entry((
                namespace.to_string(),
                pod.to_string(),
                container.to_string(),
            ))
            .or_default()
            .insert(resource.to_string(), ids.to_vec());
    }

    /// The pod ended: its devices are no longer assigned (PodResources stops listing them).
    pub fn end_pod(&self, namespace: &str, pod: &str) {
        lock(&self.inner.assigned).retain(|(ns, p, _), _| !(ns == namespace && p == pod));
    }

    /// The devices assigned to containers now, as PodResources lists them.
    pub fn assignments(&self) -> Assignments {
        lock(&self.inner.assigned).clone()
    }

    /// How many PodResources List requests have arrived (across restarts). Read right after a
    /// change (`admit`, `end_pod`), a count `n` means: once it reaches `n + 2`, a List that
    /// saw the change has been answered and its caller has sent the next one. The agent lists
    /// in a loop, so by then it has applied that answer.
    pub fn pod_resources_lists(&self) -> u64 {
        self.inner.lists.load(Ordering::SeqCst)
    }

    /// The PodResources socket path.
    pub fn pod_resources_socket(&self) -> &Path {
        &self.pod_resources
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
