//! The `v1beta1.DevicePlugin` gRPC service for one resource: converts protobuf to the core's
//! types and back. Decisions live in `allocate`; this file only adapts. Before Allocate hands
//! out CDI names it checks that the node spec defining them is written (`NodeSpec::ready_for`,
//! which reads what the spec keeper published and does no I/O).

use super::allocate::{self, AllocateError};
use crate::cdi::node_spec::NodeSpec;
use crate::config::{AllocationMode, DeviceListStrategy};
use crate::health::Health;
use crate::inventory::{DeviceId, DeviceUuid, ResourceName};
use crate::metrics::{self, Allocation, AllocationLabels, ApiLabel};
use crate::proto::deviceplugin_v1beta1 as pb;
use crate::state::NodeState;
use pb::device_plugin_server::DevicePlugin;
use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// How long Allocate awaits the spec keeper's write for a changed inventory (a write and an
/// fsync; seconds mean the disk is stuck, and the refusal says to retry).
const NODE_SPEC_PATIENCE: Duration = Duration::from_secs(5);

/// Serves one resource name from the shared node state.
#[derive(Clone)]
pub struct DevicePluginService {
    resource: ResourceName,
    state: Arc<NodeState>,
    /// The node CDI spec, which defines the names Allocate hands out.
    node_spec: Arc<NodeSpec>,
    /// Turns true when this server stops; open ListAndWatch streams then end, which a graceful
    /// server shutdown waits for.
    stopping: watch::Receiver<bool>,
}

impl DevicePluginService {
    pub fn new(
        resource: ResourceName,
        state: Arc<NodeState>,
        node_spec: Arc<NodeSpec>,
        stopping: watch::Receiver<bool>,
    ) -> Self {
        DevicePluginService {
            resource,
            state,
            node_spec,
            stopping,
        }
    }

    /// A CDI name whose spec is not written makes the runtime fail the container after the
    /// kubelet admitted the pod; refusing here names the reason (missing or wrong device
    /// nodes, the same as NodePrepare gives) and a later Allocate succeeds once they are
    /// right. The inventory may change between this and the grant; the main loop then
    /// rewrites the spec for the new one.
    async fn ensure_node_spec(&self) -> Result<(), Status> {
        let inventory = {
            let s = self.state.read();
            if !s
                .config
                .device_list_strategy
                .contains(&DeviceListStrategy::CdiCri)
            {
                return Ok(());
            }
            s.inventory.clone()
        };
        self.node_spec
            .ready_for(&inventory, NODE_SPEC_PATIENCE)
            .await
            .map_err(|e| {
                tracing::warn!(resource = %self.resource, error = %e, "Allocate refused");
                Status::failed_precondition(format!("{}: {e}", self.resource))
            })
    }

    /// The device list ListAndWatch sends now; `None` once the resource is no longer offered.
    pub fn device_list(&self) -> Option<Vec<pb::Device>> {
        let snap = self.state.read();
        let plan = snap.plan.resource(&self.resource)?;
        // Units a DRA claim holds are withdrawn: reported Unhealthy until the claim is unprepared.
        let withdrawn = snap
            .ledger
            .blocked_for(&allocate::holder(&self.resource, &[]));
        Some(
            plan.devices
                .iter()
                .map(|d| pb::Device {
                    id: d.id.to_string(),
                    health: match snap.health.health(&d.unit) {
                        Health::Healthy if !withdrawn.contains(d.unit.as_str()) => HEALTHY.into(),
                        _ => UNHEALTHY.into(),
                    },
                    topology: d.numa_node.map(|n| pb::TopologyInfo {
                        nodes: vec![pb::NumaNode { id: i64::from(n) }],
                    }),
                })
                .collect(),
        )
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<DeviceStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let me = self.clone();
        // Holds too: a unit a DRA claim holds is withdrawn from the list.
        let mut changes = self.state.subscribe_holds();
        let mut stopping = self.stopping.clone();
        tokio::spawn(async move {
            let mut last: Option<Vec<pb::Device>> = None;
            loop {
                let Some(devices) = me.device_list() else {
                    tracing::info!(resource = %me.resource, "resource no longer offered; closing ListAndWatch");
                    return;
                };
                if last.as_ref() != Some(&devices) {
                    if tx
                        .send(Ok(pb::ListAndWatchResponse {
                            devices: devices.clone(),
                        }))
                        .await
                        .is_err()
                    {
                        return; // the kubelet hung up
                    }
                    last = Some(devices);
                }
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { return },
                    _ = tx.closed() => return,
                    _ = stopping.wait_for(|s| *s) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        let snap = self.state.read();
        let plan = snap
            .plan
            .resource(&self.resource)
            .ok_or_else(|| gone(&self.resource))?;
        let avoid: BTreeSet<DeviceUuid> = snap
            .ledger
            .blocked_for(&allocate::holder(&self.resource, &[]));
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let size = usize::try_from(c.allocation_size).map_err(|_| {
                Status::invalid_argument(format!(
                    "allocation size {} is negative",
                    c.allocation_size
                ))
            })?;
            // The kubelet's strings become device IDs here, once.
            let ids = allocate::parse_preferred_ids(
                plan,
                &c.available_device_i_ds,
                &c.must_include_device_i_ds,
            )
            .and_then(|(available, must)| {
                allocate::preferred(plan, &snap.model, &available, &must, size, &avoid)
            })
            .map_err(|e| Status::invalid_argument(format!("{}: {e}", self.resource)))?;
            // Which devices the topology scoring chose, and from what: the line to read when
            // someone asks why a pod got these GPUs.
            tracing::info!(resource = %self.resource, available = c.available_device_i_ds.len(), must_include = ?c.must_include_device_i_ds, size, preferred = ?ids, "preferred allocation");
            container_responses.push(pb::ContainerPreferredAllocationResponse {
                device_i_ds: ids.iter().map(DeviceId::to_string).collect(),
            });
        }
        Ok(Response::new(pb::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        req: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let requests = req.into_inner().container_requests;
        let resource = self.resource.as_str();
        let started = Instant::now();
        let mode = self.node_spec.mode();
        if let Err(status) = self.ensure_node_spec().await {
            count_allocation(resource, Allocation::Refused, started);
            return Err(status);
        }
        // Decide and hold under one write lock, so a concurrent NodePrepare cannot take the
        // same unit between the check and the hold.
        let container_responses = self.state.update_holds(|s| {
            let Some(plan) = s.plan.resource(resource) else {
                return (Err(gone(resource)), false);
            };
            let shared = s.config.allocation == AllocationMode::Shared;
            let mut out = Vec::new();
            let mut held = false;
            for c in &requests {
                // The kubelet's strings become device IDs here, once.
                let (health, cfg) = (&s.health, &s.config);
                let decided = allocate::parse_ids(plan, health, cfg, &c.devices_ids, mode)
                    .and_then(|ids| allocate::allocate(plan, health, cfg, &ids, mode).map(|g| (g, ids)));
                let (grant, ids) = match decided {
                    Ok(decided) => decided,
                    Err(e) => {
                        tracing::warn!(resource, devices = ?c.devices_ids, error = %e, "Allocate refused");
                        return (Err(refusal(&e)), held);
                    }
                };
                if shared {
                    match allocate::hold(plan, &mut s.ledger, &ids, Instant::now()) {
                        Ok((units, newly)) => {
                            held |= newly;
                            metrics::node().ledger_handouts.get_or_create(&ApiLabel::DEVICE_PLUGIN).inc();
                            tracing::info!(resource, devices = ?c.devices_ids, units = ?units, holder = "device plugin", "handed out");
                        }
                        Err(e) => {
                            metrics::node().ledger_refusals.get_or_create(&ApiLabel::DEVICE_PLUGIN).inc();
                            tracing::warn!(resource, devices = ?c.devices_ids, error = %e, "Allocate refused");
                            return (Err(refusal(&e)), held);
                        }
                    }
                } else {
                    tracing::info!(resource, devices = ?c.devices_ids, cdi = ?grant.cdi_devices, "Allocate granted");
                }
                out.push(pb::ContainerAllocateResponse {
                    envs: grant.envs.into_iter().collect(),
                    cdi_devices: grant.cdi_devices.into_iter().map(|name| pb::CdiDevice { name }).collect(),
                    ..Default::default()
                });
            }
            (Ok(out), held)
        });
        let outcome = if container_responses.is_ok() {
            Allocation::Granted
        } else {
            Allocation::Refused
        };
        count_allocation(resource, outcome, started);
        Ok(Response::new(pb::AllocateResponse {
            container_responses: container_responses?,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}

fn count_allocation(resource: &str, outcome: Allocation, started: Instant) {
    let m = metrics::node();
    m.allocations
        .get_or_create(&AllocationLabels {
            resource: resource.to_string(),
            outcome,
        })
        .inc();
    m.allocate_seconds.observe(started.elapsed().as_secs_f64());
}

/// What this plugin tells the kubelet it supports.
pub fn options() -> pb::DevicePluginOptions {
    pb::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

fn gone(resource: &str) -> Status {
    Status::unavailable(format!("{resource} is no longer offered by this node"))
}

fn refusal(e: &AllocateError) -> Status {
    match e {
        AllocateError::Held { .. } | AllocateError::Unhealthy { .. } => {
            Status::failed_precondition(e.to_string())
        }
        _ => Status::invalid_argument(e.to_string()),
    }
}
