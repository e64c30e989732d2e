//! The doctor's `kubelet-apis` check: that the kubelet serves the gRPC API versions the agent
//! speaks on its sockets, asked the way the agent asks, read-only: PodResources v1 `List`, and
//! the device plugin Registration service's versions (its refusal of a version it cannot take
//! names them; `registrar::kubelet_versions`). DRA has no kubelet-side service to ask: the
//! kubelet calls the plugin, and the agent's `/readyz` (the `agent` check) says whether it did.

use super::Check;
use crate::deviceplugin::registrar::kubelet_versions;
use crate::node::podresources::pods_listed;
use crate::paths::HostPaths;

/// The version of the device plugin API the agent registers with.
const DEVICE_PLUGIN_API: &str = "v1beta1";

pub(super) fn kubelet_apis(paths: &HostPaths) -> Check {
    const NAME: &str = "kubelet-apis";
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return Check::fail(NAME, format!("cannot start a runtime: {e}"), "rerun"),
    };
    let (pods, versions) = runtime.block_on(async {
        (
            pods_listed(&paths.pod_resources_socket()).await,
            kubelet_versions(&paths.device_plugins().join("kubelet.sock")).await,
        )
    });
    let pods = match pods {
        Ok(n) => n,
        Err(e) => {
            return Check::fail(
                NAME,
                format!(
                    "PodResources v1 on {}: {e}",
                    paths.pod_resources_socket().display()
                ),
                "the agent reads device-plugin holds through PodResources v1 (kubelet 1.20+); upgrade the kubelet or check its --root-dir",
            )
        }
    };
    match versions {
        Ok(v) if v.iter().any(|v| v == DEVICE_PLUGIN_API) => Check::ok(
            NAME,
            format!(
                "PodResources v1 ({pods} pods); device plugin registration {}",
                v.join(", ")
            ),
        ),
        Ok(v) => Check::fail(
            NAME,
            format!("the kubelet takes device plugin API {}, not {DEVICE_PLUGIN_API}", v.join(", ")),
            "run a kubelet that serves device plugin v1beta1 (every release since 1.10), or turn the agent's device plugin off (--device-plugin=false) and use DRA",
        ),
        Err(e) => Check::fail(
            NAME,
            format!(
                "device plugin registration on {}: {e}",
                paths.device_plugins().join("kubelet.sock").display()
            ),
            "check that the kubelet runs and serves its device plugin socket",
        ),
    }
}
