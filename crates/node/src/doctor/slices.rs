//! The doctor's `slices` check: the ResourceSlices the agent published for this node, as the
//! scheduler reads them (a field selector on `spec.nodeName`, per driver). Read-only.

use super::Check;
use gpuplane_model::report::chain;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};

/// This node's slices of `driver`, with how many devices they offer.
pub async fn slices(client: kube::Client, node: &str, driver: &str) -> Check {
    const NAME: &str = "slices";
    let api: Api<ResourceSlice> = Api::all(client);
    let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let listed = match api.list(&lp).await {
        Ok(l) => l,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("listing ResourceSlices of node {node}: {}", chain(&e)),
                "give the doctor API access that may list resourceslices (--kubeconfig; the agent's ServiceAccount may)",
            )
        }
    };
    let ours: Vec<&ResourceSlice> = listed
        .items
        .iter()
        .filter(|s| s.spec.driver == driver)
        .collect();
    let devices: usize = ours
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    if ours.is_empty() {
        return Check::fail(
            NAME,
            format!("no ResourceSlice of driver {driver} for node {node}"),
            "the agent publishes them once it is ready: see the `agent` check and the agent's log (its RBAC, the node-scoped admission policy, NODE_NAME, --driver-name)",
        );
    }
    Check::ok(
        NAME,
        format!(
            "{} ResourceSlice(s) of driver {driver} for node {node}: {devices} device(s)",
            ours.len()
        ),
    )
}
