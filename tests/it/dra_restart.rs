//! A restarted agent is ready before it says so: the registration socket answers only while the
//! DRA socket accepts. The real binary is SIGKILLed (some runs in the middle of a prepare) and
//! started again many times; the test plays the kubelet's plugin watcher, dialing the
//! registration socket as it does (percent-encoded path authority) and the DRA endpoint the
//! moment GetInfo answers, as the kubelet's registration handler does.

use crate::support;

use crate::support::{AgentProcess, DRIVER};
use gpuplane_node::proto::dra_v1;
use gpuplane_node::proto::pluginregistration_v1 as reg_pb;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::dial::{self, Authority};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A hang guard, never a timing assertion.
const WAIT: Duration = Duration::from_secs(30);
const RUNS: usize = 30;

/// GetInfo on the registration socket, once; the endpoint it names.
async fn get_info(socket: &Path) -> Option<PathBuf> {
    let call = async {
        let ch = dial::connect(socket, Authority::EncodedPath).await.ok()?;
        let info = reg_pb::registration_client::RegistrationClient::new(ch)
            .get_info(reg_pb::InfoRequest {})
            .await
            .ok()?
            .into_inner();
        Some(PathBuf::from(info.endpoint))
    };
    tokio::time::timeout(Duration::from_secs(2), call)
        .await
        .ok()
        .flatten()
}

/// NodePrepareResources of `claims` over a fresh connection, as the kubelet's DRA client
/// dials (`unix:` target, `localhost`).
async fn prepare(
    endpoint: &Path,
    claims: Vec<dra_v1::Claim>,
) -> Result<dra_v1::NodePrepareResourcesResponse, String> {
    let ch = dial::connect(endpoint, Authority::Localhost)
        .await
        .map_err(|e| e.to_string())?;
    dra_v1::dra_plugin_client::DraPluginClient::new(ch)
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest { claims })
        .await
        .map(|r| r.into_inner())
        .map_err(|s| format!("{s:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_socket_accepts_the_moment_a_restarted_agents_registration_answers() {
    let dir = tempfile::tempdir().unwrap();
    let api = ApiServerDouble::start().await.unwrap();
    support::lay_out_node(dir.path(), 4, &api.url());
    let kubelet = dir.path().join("kubelet");
    let registration = kubelet
        .join("plugins_registry")
        .join(format!("{DRIVER}-reg.sock"));
    let claim = support::put_claim(&api, "restart", &["gpu-1"]);
    let wire = dra_v1::Claim {
        namespace: claim.namespace.to_string(),
        uid: claim.uid.to_string(),
        name: claim.name.to_string(),
    };
    let mut refused = Vec::new();
    for run in 0..RUNS {
        let agent = AgentProcess::spawn(
            dir.path(),
            "",
            &["--simulate", "pcie-l4x4", "--device-plugin=false"],
            &[],
            &run.to_string(),
        );
        let deadline = tokio::time::Instant::now() + WAIT;
        let endpoint = loop {
            if let Some(e) = get_info(&registration).await {
                break e;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "run {run}: GetInfo never answered\n{}",
                agent.log_text()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        // The kubelet dials the endpoint right after GetInfo: it must accept now.
        if let Err(e) = prepare(&endpoint, Vec::new()).await {
            refused.push(format!("run {run}: {e}"));
        }
        if run % 2 == 1 {
            // Kill it in the middle of a prepare (whichever step it has reached).
            let endpoint = endpoint.clone();
            let wire = wire.clone();
            let call = tokio::spawn(async move { prepare(&endpoint, vec![wire]).await });
            tokio::time::sleep(Duration::from_millis(run as u64 % 7)).await;
            agent.kill();
            let _ = call.await;
        } else {
            agent.kill();
        }
    }
    assert!(
        refused.is_empty(),
        "the DRA socket refused a kubelet that had just been answered by the registration socket:\n{}",
        refused.join("\n")
    );
}
