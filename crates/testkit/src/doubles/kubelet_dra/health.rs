//! The health stream: `NodeWatchResources` on the health version picked at registration,
//! followed until it ends, its latest list kept as v1 messages whatever the version.

use super::{lock, HealthVersion, Inner, Plugin};
use gpuplane_node::proto::dra_health_v1 as health_pb;
use gpuplane_node::proto::dra_health_v1alpha1 as health_v1alpha1;
use std::sync::Arc;
use tonic::transport::Channel;
use tonic::Status;

pub(super) fn start_health(inner: &Arc<Inner>, driver: &str, plugin: &mut Plugin) {
    plugin.stop_health();
    let Some(version) = plugin.view.health else {
        return;
    };
    let task_inner = inner.clone();
    let name = driver.to_string();
    let channel = plugin.channel.clone();
    plugin.health_task = Some(tokio::spawn(async move {
        if let Err(e) = follow_health(&task_inner, &name, version, channel).await {
            tracing::debug!(driver = %name, error = %e, "kubelet DRA double: health stream ended");
        }
        if let Some(h) = lock(&task_inner.health).get_mut(&name) {
            h.open = false;
        }
        task_inner.bump();
    }));
}

/// Opens the stream on `version` and follows it until it ends.
async fn follow_health(
    inner: &Arc<Inner>,
    driver: &str,
    version: HealthVersion,
    channel: Channel,
) -> Result<(), Status> {
    match version {
        HealthVersion::V1 => {
            let mut client =
                health_pb::dra_resource_health_client::DraResourceHealthClient::new(channel);
            let stream = client
                .node_watch_resources(health_pb::NodeWatchResourcesRequest {})
                .await?
                .into_inner();
            follow_stream(inner, driver, version, stream, |m| m.devices).await
        }
        HealthVersion::V1alpha1 => {
            let mut client =
                health_v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel);
            let stream = client
                .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
                .await?
                .into_inner();
            follow_stream(inner, driver, version, stream, |m| {
                m.devices.into_iter().map(v1_from_v1alpha1).collect()
            })
            .await
        }
    }
}

/// Keeps the latest list of an open stream, whatever its version.
async fn follow_stream<M>(
    inner: &Arc<Inner>,
    driver: &str,
    version: HealthVersion,
    mut stream: tonic::Streaming<M>,
    devices: impl Fn(M) -> Vec<health_pb::DeviceHealth>,
) -> Result<(), Status> {
    {
        let mut health = lock(&inner.health);
        let view = health.entry(driver.to_string()).or_default();
        view.open = true;
        view.version = Some(version);
    }
    inner.bump();
    while let Some(msg) = stream.message().await? {
        let mut health = lock(&inner.health);
        let view = health.entry(driver.to_string()).or_default();
        view.devices = devices(msg);
        view.updates += 1;
        view.open = true;
        drop(health);
        inner.bump();
    }
    Ok(())
}

/// A v1alpha1 device health as the v1 message with the same fields.
fn v1_from_v1alpha1(d: health_v1alpha1::DeviceHealth) -> health_pb::DeviceHealth {
    health_pb::DeviceHealth {
        device: d.device.map(|id| health_pb::DeviceIdentifier {
            pool_name: id.pool_name,
            device_name: id.device_name,
        }),
        // Same enum numbers in both packages.
        health: d.health,
        last_updated_time: d.last_updated_time,
        health_check_timeout_seconds: d.health_check_timeout_seconds,
        message: d.message,
    }
}
