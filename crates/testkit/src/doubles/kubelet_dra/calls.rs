//! The DRA manager's calls: NodePrepareResources and NodeUnprepareResources over the version
//! negotiated at registration, with the kubelet's call timeout, failing as the kubelet does
//! when a claim is left out of the answer.

use super::{DraVersion, KubeletDraDouble};
use gpuplane_node::dra::service::RawClaim;
use gpuplane_node::dra::{ClaimRef, PrepareResult, PreparedDevice};
use gpuplane_node::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tonic::{Request, Status};

impl KubeletDraDouble {
    /// NodePrepareResources for `claims` of `driver`, over the negotiated version.
    pub async fn prepare(
        &self,
        driver: &str,
        claims: &[impl WireClaim],
    ) -> Result<BTreeMap<String, PrepareResult>, Status> {
        let (version, channel) = self.connection(driver)?;
        let timeout = self.inner.options.call_timeout;
        let answers: HashMap<String, PrepareResult> = match version {
            DraVersion::V1 => {
                let claims = claims.iter().map(|c| v1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1::NodePrepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodePrepareResources",
                    client.node_prepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| {
                        let result = if r.error.is_empty() {
                            Ok(r.devices.into_iter().map(from_v1).collect())
                        } else {
                            Err(r.error)
                        };
                        (uid, result)
                    })
                    .collect()
            }
            DraVersion::V1beta1 => {
                let claims = claims.iter().map(|c| v1beta1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1beta1::NodePrepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodePrepareResources",
                    client.node_prepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| {
                        let result = if r.error.is_empty() {
                            Ok(r.devices.into_iter().map(from_v1beta1).collect())
                        } else {
                            Err(r.error)
                        };
                        (uid, result)
                    })
                    .collect()
            }
        };
        every_claim("NodePrepareResources", claims, answers)
    }

    /// NodeUnprepareResources for `claims` of `driver`, over the negotiated version.
    pub async fn unprepare(
        &self,
        driver: &str,
        claims: &[impl WireClaim],
    ) -> Result<BTreeMap<String, Result<(), String>>, Status> {
        let (version, channel) = self.connection(driver)?;
        let timeout = self.inner.options.call_timeout;
        let verdict = |error: String| if error.is_empty() { Ok(()) } else { Err(error) };
        let answers: HashMap<String, Result<(), String>> = match version {
            DraVersion::V1 => {
                let claims = claims.iter().map(|c| v1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1::NodeUnprepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodeUnprepareResources",
                    client.node_unprepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| (uid, verdict(r.error)))
                    .collect()
            }
            DraVersion::V1beta1 => {
                let claims = claims.iter().map(|c| v1beta1::Claim {
                    namespace: c.namespace().to_string(),
                    uid: c.uid().to_string(),
                    name: c.name().to_string(),
                });
                let mut req = Request::new(v1beta1::NodeUnprepareResourcesRequest {
                    claims: claims.collect(),
                });
                req.set_timeout(timeout);
                let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);
                let resp = bounded(
                    timeout,
                    "NodeUnprepareResources",
                    client.node_unprepare_resources(req),
                )
                .await?;
                resp.claims
                    .into_iter()
                    .map(|(uid, r)| (uid, verdict(r.error)))
                    .collect()
            }
        };
        every_claim("NodeUnprepareResources", claims, answers)
    }
}

async fn bounded<T>(
    timeout: Duration,
    call: &str,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, Status> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result.map(tonic::Response::into_inner),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "{call} did not answer within {timeout:?}"
        ))),
    }
}

/// A claim as the kubelet puts it on the wire: three strings nobody has checked yet. Tests send
/// checked claims ([`ClaimRef`]) and hostile ones ([`RawClaim`]) alike.
pub trait WireClaim {
    fn namespace(&self) -> &str;
    fn uid(&self) -> &str;
    fn name(&self) -> &str;
}

impl WireClaim for ClaimRef {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn uid(&self) -> &str {
        &self.uid
    }
    fn name(&self) -> &str {
        &self.name
    }
}

impl WireClaim for RawClaim {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn uid(&self) -> &str {
        &self.uid
    }
    fn name(&self) -> &str {
        &self.name
    }
}

/// As the kubelet: a claim missing from the answer fails the call; extra entries are ignored.
fn every_claim<T>(
    call: &str,
    claims: &[impl WireClaim],
    mut answers: HashMap<String, T>,
) -> Result<BTreeMap<String, T>, Status> {
    let mut out = BTreeMap::new();
    let mut missing = Vec::new();
    for c in claims {
        match answers.remove(c.uid()) {
            Some(a) => {
                out.insert(c.uid().to_string(), a);
            }
            None if out.contains_key(c.uid()) => {}
            None => missing.push(c.uid().to_string()),
        }
    }
    if !missing.is_empty() {
        return Err(Status::internal(format!(
            "{call} left out {} claims: {missing:?}",
            missing.len()
        )));
    }
    Ok(out)
}

fn from_v1(d: v1::Device) -> PreparedDevice {
    PreparedDevice {
        requests: d.request_names,
        pool: d.pool_name,
        device: d.device_name,
        cdi_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

fn from_v1beta1(d: v1beta1::Device) -> PreparedDevice {
    PreparedDevice {
        requests: d.request_names,
        pool: d.pool_name,
        device: d.device_name,
        cdi_ids: d.cdi_device_ids,
        share_id: None,
    }
}
