//! Every gRPC server gpuplane runs on a unix socket answers whatever `:authority` a kubelet
//! client sends: `localhost` (device manager, DRA client), the percent-encoded socket path (the
//! plugin watcher: grpc-go with a bare path target), the raw path (grpc-java, older grpc-go), an
//! empty one and none. Driven against the real agent over its real sockets; the control case
//! shows that a tonic server without `gpuplane_node::grpc::incoming` resets the plugin watcher.

use crate::lab::{Agent, Lab, DRIVER};
use gpuplane_node::dra::registration::RegistrationService;
use gpuplane_node::proto::deviceplugin_v1beta1 as dp;
use gpuplane_node::proto::dra_v1;
use gpuplane_node::proto::pluginregistration_v1 as reg_pb;
use gpuplane_testkit::doubles::dial::{self, Authority};
use std::path::{Path, PathBuf};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

struct Node {
    lab: Lab,
    agent: Agent,
}

impl Node {
    fn registration_socket(&self) -> PathBuf {
        self.lab.dra_sockets().unwrap().registration_socket
    }
    fn dra_socket(&self) -> PathBuf {
        self.lab.dra_sockets().unwrap().dra_socket
    }
    fn dp_socket(&self) -> PathBuf {
        self.lab.device_plugin_socket("nvidia.com/gpu")
    }
}

async fn node() -> Node {
    let lab = Lab::new("pcie-l4x4").await;
    let agent = lab.start("");
    let n = Node { lab, agent };
    // The kubelet double registers the DRA plugin as the real plugin watcher dials.
    n.lab
        .dra
        .wait_registered(DRIVER, WAIT)
        .await
        .expect("the plugin watcher double registers the driver over the encoded-path authority");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !n.dp_socket().exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "device plugin socket"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    n
}

async fn registration_calls(socket: &Path, authority: Authority) -> reg_pb::PluginInfo {
    let ch = dial::connect(socket, authority).await.unwrap();
    let mut client = reg_pb::registration_client::RegistrationClient::new(ch);
    let info = client
        .get_info(reg_pb::InfoRequest {})
        .await
        .unwrap_or_else(|s| panic!("GetInfo with {authority:?}: {s:?}"))
        .into_inner();
    client
        .notify_registration_status(reg_pb::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap_or_else(|s| panic!("NotifyRegistrationStatus with {authority:?}: {s:?}"));
    info
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unix_socket_server_answers_all_four_authority_forms() {
    let n = node().await;
    for (i, authority) in Authority::ALL.into_iter().enumerate() {
        // Registration socket: what the plugin watcher calls.
        let info = registration_calls(&n.registration_socket(), authority).await;
        assert_eq!(info.name, DRIVER);
        assert_eq!(Path::new(&info.endpoint), n.dra_socket());

        // DRA socket: a real claim prepared and unprepared.
        let claim = n.lab.claim(&format!("claim-{i}"), &["gpu-0"]);
        let ch = dial::connect(&n.dra_socket(), authority).await.unwrap();
        let mut dra = dra_v1::dra_plugin_client::DraPluginClient::new(ch);
        let wire = dra_v1::Claim {
            namespace: claim.namespace.to_string(),
            uid: claim.uid.to_string(),
            name: claim.name.to_string(),
        };
        let prepared = dra
            .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: vec![wire.clone()],
            })
            .await
            .unwrap_or_else(|s| panic!("NodePrepareResources with {authority:?}: {s:?}"))
            .into_inner();
        let answer = &prepared.claims[claim.uid.as_str()];
        assert_eq!(answer.error, "", "{authority:?}");
        assert_eq!(answer.devices[0].device_name, "gpu-0");
        let unprepared = dra
            .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest { claims: vec![wire] })
            .await
            .unwrap_or_else(|s| panic!("NodeUnprepareResources with {authority:?}: {s:?}"))
            .into_inner();
        assert_eq!(
            unprepared.claims[claim.uid.as_str()].error,
            "",
            "{authority:?}"
        );

        // Device plugin socket: ListAndWatch's first list, then Allocate of one of its devices.
        let ch = dial::connect(&n.dp_socket(), authority).await.unwrap();
        let mut plugin = dp::device_plugin_client::DevicePluginClient::new(ch);
        let mut stream = plugin
            .list_and_watch(dp::Empty {})
            .await
            .unwrap_or_else(|s| panic!("ListAndWatch with {authority:?}: {s:?}"))
            .into_inner();
        let list = stream.message().await.unwrap().unwrap();
        assert_eq!(list.devices.len(), 4, "{authority:?}");
        // The last GPU: DRA keeps taking gpu-0, and the ledger keeps the two apart.
        let id = list.devices[3].id.clone();
        let allocated = plugin
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest {
                    devices_ids: vec![id],
                }],
            })
            .await
            .unwrap_or_else(|s| panic!("Allocate with {authority:?}: {s:?}"))
            .into_inner();
        assert_eq!(allocated.container_responses.len(), 1, "{authority:?}");
    }
    n.agent.stop().await;
}

/// The control: the same registration service on a plain tonic server (no
/// `gpuplane_node::grpc::incoming`) answers `localhost` and resets the plugin watcher's request, as
/// it did before the rewriter. If this starts passing, h2 learned to accept such authorities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_tonic_server_resets_the_plugin_watchers_request() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("x-reg.sock");
    let listener = gpuplane_node::grpc::bind(&socket).unwrap();
    let service = RegistrationService::new(DRIVER, &dir.path().join("dra.sock"));
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.server())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let call = |authority| {
        let socket = socket.clone();
        async move {
            let ch = dial::connect(&socket, authority).await.unwrap();
            reg_pb::registration_client::RegistrationClient::new(ch)
                .get_info(reg_pb::InfoRequest {})
                .await
        }
    };
    assert!(call(Authority::Localhost).await.is_ok());
    for authority in [Authority::EncodedPath, Authority::RawPath, Authority::Empty] {
        let err = call(authority).await.unwrap_err();
        assert!(
            format!("{err:?}").to_lowercase().contains("protocol"),
            "{authority:?}: expected a PROTOCOL_ERROR reset, got {err:?}"
        );
    }
    server.abort();
}
