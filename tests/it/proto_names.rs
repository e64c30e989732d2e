//! Checks that the generated kubelet bindings use the upstream gRPC names and wire format:
//! service names, full method paths on both the client and the server side, and field numbers.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use gpuplane_node::proto::{
    deviceplugin_v1beta1 as dp, dra_health_v1 as health_v1, dra_health_v1alpha1 as health, dra_v1,
    dra_v1beta1, pluginregistration_v1 as reg, podresources_v1 as podres,
};
use prost::Message;
use tonic::codegen::{http, Service};
use tonic::{Request, Response, Status};

#[test]
fn service_names_match_upstream() {
    assert_eq!(
        dp::registration_server::SERVICE_NAME,
        "v1beta1.Registration"
    );
    assert_eq!(
        dp::device_plugin_server::SERVICE_NAME,
        "v1beta1.DevicePlugin"
    );
    assert_eq!(
        reg::registration_server::SERVICE_NAME,
        "pluginregistration.Registration"
    );
    assert_eq!(
        dra_v1::dra_plugin_server::SERVICE_NAME,
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    );
    assert_eq!(
        dra_v1beta1::dra_plugin_server::SERVICE_NAME,
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    );
    assert_eq!(
        health_v1::dra_resource_health_server::SERVICE_NAME,
        "v1.DRAResourceHealth"
    );
    assert_eq!(
        health::dra_resource_health_server::SERVICE_NAME,
        "v1alpha1.DRAResourceHealth"
    );
    assert_eq!(
        podres::pod_resources_lister_server::SERVICE_NAME,
        "v1.PodResourcesLister"
    );
}

// ---------------------------------------------------------------------------------------------
// Client side: every generated client method must hit the upstream path.

/// A gRPC "transport" that records each request path and answers UNIMPLEMENTED.
#[derive(Clone, Default)]
struct PathRecorder(Arc<Mutex<Vec<String>>>);

impl PathRecorder {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl Service<http::Request<tonic::body::Body>> for PathRecorder {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        self.0.lock().unwrap().push(req.uri().path().to_owned());
        let resp = http::Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "12")
            .body(tonic::body::Body::empty())
            .unwrap();
        std::future::ready(Ok(resp))
    }
}

#[tokio::test]
async fn client_method_paths_match_upstream() {
    let rec = PathRecorder::default();

    let mut c = dp::registration_client::RegistrationClient::new(rec.clone());
    assert!(c.register(dp::RegisterRequest::default()).await.is_err());
    assert_eq!(rec.take(), ["/v1beta1.Registration/Register"]);

    let mut c = dp::device_plugin_client::DevicePluginClient::new(rec.clone());
    assert!(c.get_device_plugin_options(dp::Empty {}).await.is_err());
    assert!(c.list_and_watch(dp::Empty {}).await.is_err());
    assert!(c
        .get_preferred_allocation(dp::PreferredAllocationRequest::default())
        .await
        .is_err());
    assert!(c.allocate(dp::AllocateRequest::default()).await.is_err());
    assert!(c
        .pre_start_container(dp::PreStartContainerRequest::default())
        .await
        .is_err());
    assert_eq!(
        rec.take(),
        [
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            "/v1beta1.DevicePlugin/ListAndWatch",
            "/v1beta1.DevicePlugin/GetPreferredAllocation",
            "/v1beta1.DevicePlugin/Allocate",
            "/v1beta1.DevicePlugin/PreStartContainer",
        ]
    );

    let mut c = reg::registration_client::RegistrationClient::new(rec.clone());
    assert!(c.get_info(reg::InfoRequest {}).await.is_err());
    assert!(c
        .notify_registration_status(reg::RegistrationStatus::default())
        .await
        .is_err());
    assert_eq!(
        rec.take(),
        [
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus",
        ]
    );

    let mut c = dra_v1::dra_plugin_client::DraPluginClient::new(rec.clone());
    assert!(c
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest::default())
        .await
        .is_err());
    assert!(c
        .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest::default())
        .await
        .is_err());
    assert_eq!(
        rec.take(),
        [
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        ]
    );

    let mut c = dra_v1beta1::dra_plugin_client::DraPluginClient::new(rec.clone());
    assert!(c
        .node_prepare_resources(dra_v1beta1::NodePrepareResourcesRequest::default())
        .await
        .is_err());
    assert!(c
        .node_unprepare_resources(dra_v1beta1::NodeUnprepareResourcesRequest::default())
        .await
        .is_err());
    assert_eq!(
        rec.take(),
        [
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        ]
    );

    let mut c = health::dra_resource_health_client::DraResourceHealthClient::new(rec.clone());
    assert!(c
        .node_watch_resources(health::NodeWatchResourcesRequest {})
        .await
        .is_err());
    assert_eq!(
        rec.take(),
        ["/v1alpha1.DRAResourceHealth/NodeWatchResources"]
    );

    let mut c = health_v1::dra_resource_health_client::DraResourceHealthClient::new(rec.clone());
    assert!(c
        .node_watch_resources(health_v1::NodeWatchResourcesRequest {})
        .await
        .is_err());
    assert_eq!(rec.take(), ["/v1.DRAResourceHealth/NodeWatchResources"]);

    let mut c = podres::pod_resources_lister_client::PodResourcesListerClient::new(rec.clone());
    assert!(c.list(podres::ListPodResourcesRequest {}).await.is_err());
    assert!(c
        .get_allocatable_resources(podres::AllocatableResourcesRequest {})
        .await
        .is_err());
    assert!(c
        .get(podres::GetPodResourcesRequest::default())
        .await
        .is_err());
    assert_eq!(
        rec.take(),
        [
            "/v1.PodResourcesLister/List",
            "/v1.PodResourcesLister/GetAllocatableResources",
            "/v1.PodResourcesLister/Get",
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// Server side: every generated server must route the upstream path to the right trait method.

/// Implements every server trait; each method fails with FAILED_PRECONDITION and its own
/// method name as the message, so a response tells which method a path was routed to.
struct Fake;

fn routed<T>(method: &str) -> Result<Response<T>, Status> {
    Err(Status::failed_precondition(method))
}

type NoStream<T> = tokio_stream::Empty<Result<T, Status>>;

#[tonic::async_trait]
impl dp::registration_server::Registration for Fake {
    async fn register(
        &self,
        _: Request<dp::RegisterRequest>,
    ) -> Result<Response<dp::Empty>, Status> {
        routed("Register")
    }
}

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for Fake {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        routed("GetDevicePluginOptions")
    }
    type ListAndWatchStream = NoStream<dp::ListAndWatchResponse>;
    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        routed("ListAndWatch")
    }
    async fn get_preferred_allocation(
        &self,
        _: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        routed("GetPreferredAllocation")
    }
    async fn allocate(
        &self,
        _: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        routed("Allocate")
    }
    async fn pre_start_container(
        &self,
        _: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        routed("PreStartContainer")
    }
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Fake {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        routed("GetInfo")
    }
    async fn notify_registration_status(
        &self,
        _: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        routed("NotifyRegistrationStatus")
    }
}

#[tonic::async_trait]
impl dra_v1::dra_plugin_server::DraPlugin for Fake {
    async fn node_prepare_resources(
        &self,
        _: Request<dra_v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodePrepareResourcesResponse>, Status> {
        routed("NodePrepareResources")
    }
    async fn node_unprepare_resources(
        &self,
        _: Request<dra_v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodeUnprepareResourcesResponse>, Status> {
        routed("NodeUnprepareResources")
    }
}

#[tonic::async_trait]
impl dra_v1beta1::dra_plugin_server::DraPlugin for Fake {
    async fn node_prepare_resources(
        &self,
        _: Request<dra_v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra_v1beta1::NodePrepareResourcesResponse>, Status> {
        routed("NodePrepareResources")
    }
    async fn node_unprepare_resources(
        &self,
        _: Request<dra_v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra_v1beta1::NodeUnprepareResourcesResponse>, Status> {
        routed("NodeUnprepareResources")
    }
}

#[tonic::async_trait]
impl health::dra_resource_health_server::DraResourceHealth for Fake {
    type NodeWatchResourcesStream = NoStream<health::NodeWatchResourcesResponse>;
    async fn node_watch_resources(
        &self,
        _: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        routed("NodeWatchResources")
    }
}

#[tonic::async_trait]
impl health_v1::dra_resource_health_server::DraResourceHealth for Fake {
    type NodeWatchResourcesStream = NoStream<health_v1::NodeWatchResourcesResponse>;
    async fn node_watch_resources(
        &self,
        _: Request<health_v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        routed("NodeWatchResources")
    }
}

#[tonic::async_trait]
impl podres::pod_resources_lister_server::PodResourcesLister for Fake {
    async fn list(
        &self,
        _: Request<podres::ListPodResourcesRequest>,
    ) -> Result<Response<podres::ListPodResourcesResponse>, Status> {
        routed("List")
    }
    async fn get_allocatable_resources(
        &self,
        _: Request<podres::AllocatableResourcesRequest>,
    ) -> Result<Response<podres::AllocatableResourcesResponse>, Status> {
        routed("GetAllocatableResources")
    }
    async fn get(
        &self,
        _: Request<podres::GetPodResourcesRequest>,
    ) -> Result<Response<podres::GetPodResourcesResponse>, Status> {
        routed("Get")
    }
}

/// Sends one empty gRPC message to `path` on `server` and returns (grpc-status, grpc-message)
/// from the response headers.
async fn call_path<S>(server: &mut S, path: &str) -> (String, String)
where
    S: Service<
        http::Request<String>,
        Response = http::Response<tonic::body::Body>,
        Error = Infallible,
    >,
{
    // A gRPC frame: uncompressed flag (0) and a zero length; every request message here
    // decodes from zero bytes.
    let body = String::from("\0\0\0\0\0");
    let req = http::Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap();
    std::future::poll_fn(|cx| server.poll_ready(cx))
        .await
        .unwrap();
    let resp = server.call(req).await.unwrap();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    (header("grpc-status"), header("grpc-message"))
}

async fn assert_routes<S>(mut server: S, service: &str, methods: &[&str])
where
    S: Service<
        http::Request<String>,
        Response = http::Response<tonic::body::Body>,
        Error = Infallible,
    >,
{
    for method in methods {
        let path = format!("/{service}/{method}");
        // FAILED_PRECONDITION (9) with the method name: routed to the right trait method.
        assert_eq!(
            call_path(&mut server, &path).await,
            ("9".to_owned(), (*method).to_owned()),
            "{path}"
        );
    }
    // UNIMPLEMENTED (12) for a method the service does not have.
    let bogus = format!("/{service}/NoSuchMethod");
    assert_eq!(call_path(&mut server, &bogus).await.0, "12", "{bogus}");
}

#[tokio::test]
async fn server_routes_match_upstream() {
    assert_routes(
        dp::registration_server::RegistrationServer::new(Fake),
        "v1beta1.Registration",
        &["Register"],
    )
    .await;
    assert_routes(
        dp::device_plugin_server::DevicePluginServer::new(Fake),
        "v1beta1.DevicePlugin",
        &[
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    )
    .await;
    assert_routes(
        reg::registration_server::RegistrationServer::new(Fake),
        "pluginregistration.Registration",
        &["GetInfo", "NotifyRegistrationStatus"],
    )
    .await;
    assert_routes(
        dra_v1::dra_plugin_server::DraPluginServer::new(Fake),
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
        &["NodePrepareResources", "NodeUnprepareResources"],
    )
    .await;
    assert_routes(
        dra_v1beta1::dra_plugin_server::DraPluginServer::new(Fake),
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
        &["NodePrepareResources", "NodeUnprepareResources"],
    )
    .await;
    assert_routes(
        health::dra_resource_health_server::DraResourceHealthServer::new(Fake),
        "v1alpha1.DRAResourceHealth",
        &["NodeWatchResources"],
    )
    .await;
    assert_routes(
        health_v1::dra_resource_health_server::DraResourceHealthServer::new(Fake),
        "v1.DRAResourceHealth",
        &["NodeWatchResources"],
    )
    .await;
    assert_routes(
        podres::pod_resources_lister_server::PodResourcesListerServer::new(Fake),
        "v1.PodResourcesLister",
        &["List", "GetAllocatableResources", "Get"],
    )
    .await;
}

#[tokio::test]
async fn client_reaches_server_in_process() {
    // The generated server is itself a gRPC transport for the generated client.
    let mut client = dp::device_plugin_client::DevicePluginClient::new(
        dp::device_plugin_server::DevicePluginServer::new(Fake),
    );
    let err = client
        .allocate(dp::AllocateRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(err.message(), "Allocate");
}

// ---------------------------------------------------------------------------------------------
// Wire format.

#[test]
fn register_request_field_number() {
    let req = dp::RegisterRequest {
        version: "v1beta1".into(),
        ..Default::default()
    };
    // Field 1, wire type 2 (length-delimited) => tag 0x0a, then length 7.
    assert_eq!(
        req.encode_to_vec(),
        [0x0a, 0x07, b'v', b'1', b'b', b'e', b't', b'a', b'1']
    );
}

#[test]
fn allocate_response_round_trip() {
    let container = dp::ContainerAllocateResponse {
        envs: [("NVIDIA_VISIBLE_DEVICES".to_owned(), "void".to_owned())].into(),
        cdi_devices: vec![dp::CdiDevice {
            name: "nvidia.com/gpu=GPU-0".into(),
        }],
        ..Default::default()
    };
    let resp = dp::AllocateResponse {
        container_responses: vec![container],
    };
    let decoded = dp::AllocateResponse::decode(resp.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded, resp);
    assert_eq!(
        decoded.container_responses[0].cdi_devices[0].name,
        "nvidia.com/gpu=GPU-0"
    );

    // cdi_devices is field 5 of ContainerAllocateResponse: tag (5 << 3) | 2 = 0x2a.
    let only_cdi = dp::ContainerAllocateResponse {
        cdi_devices: vec![dp::CdiDevice { name: "a".into() }],
        ..Default::default()
    };
    assert_eq!(only_cdi.encode_to_vec(), [0x2a, 0x03, 0x0a, 0x01, b'a']);
}

#[test]
fn node_prepare_resources_response_round_trip() {
    let device = dra_v1::Device {
        request_names: vec!["gpu".into()],
        pool_name: "node-a".into(),
        device_name: "gpu-0".into(),
        cdi_device_ids: vec!["k8s.gpuplane.dev/gpu=gpu-0".into()],
        share_id: Some("share-1".into()),
    };
    let resp = dra_v1::NodePrepareResourcesResponse {
        claims: [(
            "claim-uid-1".to_owned(),
            dra_v1::NodePrepareResourceResponse {
                devices: vec![device],
                error: String::new(),
            },
        )]
        .into(),
    };
    let decoded =
        dra_v1::NodePrepareResourcesResponse::decode(resp.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded, resp);
    assert_eq!(
        decoded.claims["claim-uid-1"].devices[0].share_id.as_deref(),
        Some("share-1")
    );

    // share_id is a proto3 `optional` field 5: presence is encoded even for "".
    let empty_share = dra_v1::Device {
        share_id: Some(String::new()),
        ..Default::default()
    };
    assert_eq!(empty_share.encode_to_vec(), [0x2a, 0x00]);
    assert!(dra_v1::Device::default().encode_to_vec().is_empty());

    // v1 and v1beta1 messages are wire-compatible apart from share_id.
    let beta =
        dra_v1beta1::NodePrepareResourcesResponse::decode(resp.encode_to_vec().as_slice()).unwrap();
    assert_eq!(beta.claims["claim-uid-1"].devices[0].device_name, "gpu-0");
}

#[test]
fn other_field_numbers() {
    // Claim.uid is field 2.
    let claim = dra_v1::Claim {
        uid: "u".into(),
        ..Default::default()
    };
    assert_eq!(claim.encode_to_vec(), [0x12, 0x01, b'u']);

    // DeviceHealth.health is the HealthStatus enum in field 2; HEALTHY = 1.
    let dh = health::DeviceHealth {
        health: health::HealthStatus::Healthy as i32,
        ..Default::default()
    };
    assert_eq!(dh.encode_to_vec(), [0x10, 0x01]);
    assert_eq!(health::HealthStatus::Unhealthy as i32, 2);
    assert_eq!(health::HealthStatus::Unknown.as_str_name(), "UNKNOWN");

    // PluginInfo.supported_versions is field 4.
    let info = reg::PluginInfo {
        supported_versions: vec!["1".into()],
        ..Default::default()
    };
    assert_eq!(info.encode_to_vec(), [0x22, 0x01, b'1']);

    // ContainerResources.dynamic_resources is field 5; DynamicResource.claim_name is field 2.
    let cr = podres::ContainerResources {
        dynamic_resources: vec![podres::DynamicResource {
            claim_name: "c".into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    assert_eq!(cr.encode_to_vec(), [0x2a, 0x03, 0x12, 0x01, b'c']);
}

#[test]
fn dra_health_v1_is_wire_identical_to_v1alpha1() {
    // Every field set, so every field number and type is on the wire.
    let v1_msg = health_v1::NodeWatchResourcesResponse {
        devices: vec![health_v1::DeviceHealth {
            device: Some(health_v1::DeviceIdentifier {
                pool_name: "node-a".into(),
                device_name: "gpu-0".into(),
            }),
            health: health_v1::HealthStatus::Unhealthy as i32,
            last_updated_time: 1_800_000_000,
            health_check_timeout_seconds: 30,
            message: "critical Xid 79".into(),
        }],
    };
    let bytes = v1_msg.encode_to_vec();
    let alpha = health::NodeWatchResourcesResponse::decode(bytes.as_slice()).unwrap();
    assert_eq!(alpha.encode_to_vec(), bytes);
    let d = &alpha.devices[0];
    assert_eq!(d.device.as_ref().unwrap().device_name, "gpu-0");
    assert_eq!(d.health, health::HealthStatus::Unhealthy as i32);
    assert_eq!(d.last_updated_time, 1_800_000_000);
    assert_eq!(d.health_check_timeout_seconds, 30);
    assert_eq!(d.message, "critical Xid 79");

    // Field numbers as upstream: DeviceHealth{device=1, health=2, last_updated_time=3,
    // health_check_timeout_seconds=4, message=5}; DeviceIdentifier{pool_name=1, device_name=2}.
    let only = |dh: health_v1::DeviceHealth| dh.encode_to_vec();
    assert_eq!(
        only(health_v1::DeviceHealth {
            health: health_v1::HealthStatus::Healthy as i32,
            ..Default::default()
        }),
        [0x10, 0x01]
    );
    assert_eq!(
        only(health_v1::DeviceHealth {
            last_updated_time: 1,
            ..Default::default()
        }),
        [0x18, 0x01]
    );
    assert_eq!(
        only(health_v1::DeviceHealth {
            health_check_timeout_seconds: 1,
            ..Default::default()
        }),
        [0x20, 0x01]
    );
    assert_eq!(
        only(health_v1::DeviceHealth {
            message: "m".into(),
            ..Default::default()
        }),
        [0x2a, 0x01, b'm']
    );
    assert_eq!(
        only(health_v1::DeviceHealth {
            device: Some(health_v1::DeviceIdentifier {
                pool_name: "p".into(),
                device_name: "d".into(),
            }),
            ..Default::default()
        }),
        [0x0a, 0x06, 0x0a, 0x01, b'p', 0x12, 0x01, b'd']
    );
    assert_eq!(health_v1::HealthStatus::Unknown as i32, 0);
    assert_eq!(
        health_v1::HealthStatus::Unhealthy.as_str_name(),
        "UNHEALTHY"
    );
}
