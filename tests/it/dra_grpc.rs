//! The DRA gRPC shell end to end over real unix sockets in a temp dir: plugin registration,
//! NodePrepareResources / NodeUnprepareResources over v1 and v1beta1, the device health stream,
//! socket re-creation and shutdown, all driven through the kubelet DRA double against a fake
//! `DraDriver` (the real core is tested on its own).

use gpuplane_node::dra::core::{PrepareError, UnprepareError};
use gpuplane_node::dra::fetch::FetchError;
use gpuplane_node::dra::server::{DraPaths, DraServer};
use gpuplane_node::dra::service::RawClaim;
use gpuplane_node::dra::{
    ClaimRef, ClaimUid, DeviceHealthReport, DeviceHealthState, DraDriver, PreparedDevice,
};
use gpuplane_node::proto::dra_health_v1::HealthStatus;
use gpuplane_node::proto::pluginregistration_v1 as reg_pb;
use gpuplane_testkit::doubles::kubelet_dra::{
    DraVersion, HealthVersion, KubeletDraDouble, KubeletDraOptions,
};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(10);
const DRIVER: &str = "gpu.nvidia.com";
// Claim UIDs are checked at the gRPC edge (lower-case hex and dashes), so these are too.
const OK_UID: &str = "0001";
const FAILING_UID: &str = "00b0-0e";
const SHARED_UID: &str = "05a0-ed";

/// Records every call; prepares every claim except `FAILING_UID`.
struct FakeDriver {
    calls: Mutex<Vec<(&'static str, Vec<ClaimRef>)>>,
    health: Mutex<Vec<DeviceHealthReport>>,
    /// How often the device health was read (by the health streams).
    health_reads: AtomicU64,
    changes: watch::Sender<u64>,
}

impl FakeDriver {
    fn new() -> Arc<FakeDriver> {
        let report = |device: &str| DeviceHealthReport {
            pool: "node-a".into(),
            device: device.into(),
            health: DeviceHealthState::Healthy,
            message: String::new(),
        };
        Arc::new(FakeDriver {
            calls: Mutex::new(Vec::new()),
            health: Mutex::new(vec![report("gpu-0"), report("gpu-1")]),
            health_reads: AtomicU64::new(0),
            changes: watch::channel(0).0,
        })
    }

    fn calls(&self) -> Vec<(&'static str, Vec<ClaimRef>)> {
        self.calls.lock().unwrap().clone()
    }

    fn set_health(&self, device: &str, health: DeviceHealthState, message: &str) {
        for r in self
            .health
            .lock()
            .unwrap()
            .iter_mut()
            .filter(|r| r.device == device)
        {
            r.health = health;
            r.message = message.into();
        }
        self.changes.send_modify(|g| *g += 1);
    }
}

fn device_for(uid: &str) -> PreparedDevice {
    PreparedDevice {
        requests: vec!["gpu".into()],
        pool: "node-a".into(),
        device: "gpu-0".into(),
        cdi_ids: vec![format!("k8s.gpu.nvidia.com/claim={uid}")],
        share_id: (uid == SHARED_UID).then(|| "share-7".to_string()),
    }
}

#[async_trait::async_trait]
impl DraDriver for FakeDriver {
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<Vec<PreparedDevice>, PrepareError>> {
        self.calls.lock().unwrap().push(("prepare", claims.clone()));
        claims
            .into_iter()
            .map(|c| {
                let r = if c.uid == FAILING_UID {
                    Err(PrepareError::Fetch {
                        cause: Box::new(FetchError::NotFound {
                            namespace: c.namespace.to_string(),
                            name: c.name.to_string(),
                        }),
                    })
                } else {
                    Ok(vec![device_for(&c.uid)])
                };
                (c.uid, r)
            })
            .collect()
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<ClaimUid, Result<(), UnprepareError>> {
        self.calls
            .lock()
            .unwrap()
            .push(("unprepare", claims.clone()));
        claims
            .into_iter()
            .map(|c| {
                let r = if c.uid == FAILING_UID {
                    Err(UnprepareError::Worker("checkpoint busy".into()))
                } else {
                    Ok(())
                };
                (c.uid, r)
            })
            .collect()
    }

    fn device_health(&self) -> Vec<DeviceHealthReport> {
        self.health_reads.fetch_add(1, Ordering::SeqCst);
        self.health.lock().unwrap().clone()
    }

    fn health_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

struct Harness {
    dir: tempfile::TempDir,
    driver: Arc<FakeDriver>,
    paths: DraPaths,
    registered: watch::Receiver<bool>,
    stop: watch::Sender<bool>,
    server: JoinHandle<Result<(), gpuplane_node::dra::server::ServeError>>,
}

fn start() -> Harness {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    let driver = FakeDriver::new();
    let as_driver: Arc<dyn DraDriver> = driver.clone();
    let server = DraServer::new(&dir.path().join("kubelet"), DRIVER, as_driver).unwrap();
    let paths = server.paths().clone();
    let registered = server.registered();
    let (stop, stopping) = watch::channel(false);
    let server = tokio::spawn(server.run(stopping));
    Harness {
        dir,
        driver,
        paths,
        registered,
        stop,
        server,
    }
}

impl Harness {
    fn kubelet_root(&self) -> std::path::PathBuf {
        self.dir.path().join("kubelet")
    }

    async fn shutdown(self) {
        self.stop.send(true).unwrap();
        let result = tokio::time::timeout(Duration::from_secs(3), self.server).await;
        result
            .expect("DRA server did not stop within 3 s")
            .unwrap()
            .unwrap();
        assert!(!self.paths.dra_socket.exists(), "DRA socket left behind");
        assert!(
            !self.paths.registration_socket.exists(),
            "registration socket left behind"
        );
    }
}

/// A claim as the kubelet sends it, unchecked (some of these are malformed on purpose).
fn claim(ns: &str, uid: &str, name: &str) -> RawClaim {
    RawClaim {
        namespace: ns.into(),
        uid: uid.into(),
        name: name.into(),
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

async fn wait_true(rx: &mut watch::Receiver<bool>, what: &str) {
    tokio::time::timeout(WAIT, rx.wait_for(|r| *r))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_with_the_kubelet() {
    let mut h = start();
    let mut kubelet = KubeletDraDouble::start(&h.kubelet_root(), KubeletDraOptions::default());
    let view = kubelet.wait_registered(DRIVER, WAIT).await.unwrap();

    let root = h.kubelet_root();
    assert_eq!(
        h.paths.dra_socket,
        root.join("plugins/gpu.nvidia.com/dra.sock")
    );
    assert_eq!(
        h.paths.registration_socket,
        root.join("plugins_registry/gpu.nvidia.com-reg.sock")
    );
    assert_eq!(
        view.info,
        reg_pb::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: DRIVER.into(),
            endpoint: h.paths.dra_socket.to_string_lossy().into_owned(),
            supported_versions: vec![
                "v1.DRAPlugin".into(),
                "v1beta1.DRAPlugin".into(),
                "v1.DRAResourceHealth".into(),
                "v1alpha1.DRAResourceHealth".into()
            ],
        }
    );
    assert!(Path::new(&view.info.endpoint).is_absolute());
    assert_eq!(view.version, DraVersion::V1);
    // A 1.37 kubelet picks health v1 when both are offered.
    assert_eq!(view.health, Some(HealthVersion::V1));
    assert_eq!(mode(&h.paths.dra_socket), 0o600);
    assert_eq!(mode(&h.paths.registration_socket), 0o600);

    // NotifyRegistrationStatus reached the plugin.
    wait_true(&mut h.registered, "the plugin to record its registration").await;
    assert_eq!(kubelet.registered_drivers(), vec![DRIVER.to_string()]);

    // A kubelet restart forgets us and re-discovers the socket that is still there.
    kubelet.restart().await;
    kubelet.wait_registered(DRIVER, WAIT).await.unwrap();
    let events = kubelet.registrations();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        events
            .iter()
            .all(|e| e.driver == DRIVER && e.outcome == Ok(DraVersion::V1)),
        "{events:?}"
    );

    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusal_is_recorded_by_the_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let driver: Arc<dyn DraDriver> = FakeDriver::new();
    let server = DraServer::new(&dir.path().join("kubelet"), DRIVER, driver).unwrap();
    let registration = server.registration().clone();
    let (stop, stopping) = watch::channel(false);
    let task = tokio::spawn(server.run(stopping));
    let sock = dir
        .path()
        .join("kubelet/plugins_registry/gpu.nvidia.com-reg.sock");
    let channel = loop {
        match gpuplane_node::grpc::connect(&sock).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut client = reg_pb::registration_client::RegistrationClient::new(channel);
    client
        .notify_registration_status(reg_pb::RegistrationStatus {
            plugin_registered: false,
            error: "driver name taken".into(),
        })
        .await
        .unwrap();
    assert_eq!(
        registration.last_error().as_deref(),
        Some("driver name taken")
    );
    assert!(!*registration.registered().borrow());
    client
        .notify_registration_status(reg_pb::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(registration.last_error(), None);
    assert!(*registration.registered().borrow());
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(3), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

fn batch() -> Vec<RawClaim> {
    vec![
        claim("team-a", OK_UID, "train"),
        claim("team-a", FAILING_UID, "gone"),
        claim("team-b", SHARED_UID, "infer"),
        claim("team-b", "uid-no-name", ""),
        claim("", "uid-no-ns", "orphan"),
    ]
}

async fn prepare_and_unprepare(options: KubeletDraOptions, version: DraVersion) {
    let h = start();
    let kubelet = KubeletDraDouble::start(&h.kubelet_root(), options);
    let view = kubelet.wait_registered(DRIVER, WAIT).await.unwrap();
    assert_eq!(view.version, version);

    let claims = batch();
    let prepared = kubelet.prepare(DRIVER, &claims).await.unwrap();
    let uids: Vec<&str> = prepared.keys().map(String::as_str).collect();
    assert_eq!(
        uids,
        vec![OK_UID, FAILING_UID, SHARED_UID, "uid-no-name", "uid-no-ns"]
    );
    assert_eq!(prepared[OK_UID], Ok(vec![device_for(OK_UID)]));
    // The driver's typed error, made the kubelet's text at the gRPC edge.
    assert_eq!(
        prepared[FAILING_UID],
        Err(format!(
            "claim team-a/gone ({FAILING_UID}): ResourceClaim team-a/gone not found"
        ))
    );
    assert_eq!(
        prepared["uid-no-name"],
        Err("invalid claim: empty name".to_string())
    );
    assert_eq!(
        prepared["uid-no-ns"],
        Err("invalid claim: empty namespace".to_string())
    );
    let shared = prepared[SHARED_UID].as_ref().unwrap();
    let want_share = match version {
        DraVersion::V1 => Some("share-7".to_string()),
        DraVersion::V1beta1 => None,
    };
    assert_eq!(shared[0].share_id, want_share);
    assert_eq!(
        shared[0].cdi_ids,
        vec![format!("k8s.gpu.nvidia.com/claim={SHARED_UID}")]
    );

    let unprepared = kubelet.unprepare(DRIVER, &claims).await.unwrap();
    assert_eq!(unprepared.len(), claims.len());
    assert_eq!(unprepared[OK_UID], Ok(()));
    assert_eq!(unprepared[SHARED_UID], Ok(()));
    assert_eq!(
        unprepared[FAILING_UID],
        Err(format!(
            "claim team-a/gone ({FAILING_UID}): the file-writing job failed: checkpoint busy"
        ))
    );
    assert!(unprepared["uid-no-name"].is_err());
    assert!(unprepared["uid-no-ns"].is_err());

    // Malformed claims never reach the driver.
    let good = vec![
        ClaimRef::parse("team-a", OK_UID, "train").unwrap(),
        ClaimRef::parse("team-a", FAILING_UID, "gone").unwrap(),
        ClaimRef::parse("team-b", SHARED_UID, "infer").unwrap(),
    ];
    let calls = h.driver.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    for (op, (got_op, got)) in ["prepare", "unprepare"].iter().zip(&calls) {
        assert_eq!(op, got_op);
        let mut got = got.clone();
        got.sort();
        let mut want = good.clone();
        want.sort();
        assert_eq!(got, want);
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_and_unprepare_v1() {
    prepare_and_unprepare(KubeletDraOptions::default(), DraVersion::V1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_and_unprepare_v1beta1() {
    prepare_and_unprepare(KubeletDraOptions::v1beta1_only(), DraVersion::V1beta1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_stream_follows_the_driver() {
    let h = start();
    let kubelet = KubeletDraDouble::start(&h.kubelet_root(), KubeletDraOptions::default());
    kubelet.wait_registered(DRIVER, WAIT).await.unwrap();
    kubelet.watch_health(DRIVER).unwrap();

    let first = kubelet
        .wait_health(DRIVER, WAIT, |v| v.updates >= 1)
        .await
        .unwrap();
    assert!(first.open);
    assert_eq!(first.version, Some(HealthVersion::V1));
    assert_eq!(first.devices.len(), 2);
    assert_eq!(first.health("node-a", "gpu-0"), Some(HealthStatus::Healthy));
    assert_eq!(first.health("node-a", "gpu-1"), Some(HealthStatus::Healthy));
    assert!(
        first
            .devices
            .iter()
            .all(|d| d.last_updated_time > 1_700_000_000),
        "{:?}",
        first.devices
    );

    h.driver
        .set_health("gpu-1", DeviceHealthState::Unhealthy, "critical Xid 79");
    let after = kubelet
        .wait_health(DRIVER, WAIT, |v| {
            v.health("node-a", "gpu-1") == Some(HealthStatus::Unhealthy)
        })
        .await
        .unwrap();
    assert_eq!(after.health("node-a", "gpu-0"), Some(HealthStatus::Healthy));
    assert_eq!(after.updates, 2);

    // A tick that changes nothing sends nothing: once the stream has read the health after
    // the tick, the next change is the third update, not the fourth.
    let reads = h.driver.health_reads.load(Ordering::SeqCst);
    h.driver.changes.send_modify(|g| *g += 1);
    let deadline = tokio::time::Instant::now() + WAIT;
    while h.driver.health_reads.load(Ordering::SeqCst) == reads {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream never read the health after the tick"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    h.driver
        .set_health("gpu-0", DeviceHealthState::Unhealthy, "critical Xid 48");
    let after = kubelet
        .wait_health(DRIVER, WAIT, |v| {
            v.health("node-a", "gpu-0") == Some(HealthStatus::Unhealthy)
        })
        .await
        .unwrap();
    assert_eq!(after.updates, 3);

    // Shutdown ends the open stream and still returns promptly.
    h.shutdown().await;
    kubelet
        .wait_health(DRIVER, WAIT, |v| !v.open)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_older_than_1_37_follows_health_over_v1alpha1() {
    let h = start();
    let kubelet =
        KubeletDraDouble::start(&h.kubelet_root(), KubeletDraOptions::v1alpha1_health_only());
    let view = kubelet.wait_registered(DRIVER, WAIT).await.unwrap();
    assert_eq!(view.health, Some(HealthVersion::V1alpha1));
    kubelet.watch_health(DRIVER).unwrap();
    let first = kubelet
        .wait_health(DRIVER, WAIT, |v| v.updates >= 1)
        .await
        .unwrap();
    assert_eq!(first.version, Some(HealthVersion::V1alpha1));
    assert_eq!(first.health("node-a", "gpu-0"), Some(HealthStatus::Healthy));

    h.driver
        .set_health("gpu-0", DeviceHealthState::Unhealthy, "critical Xid 48");
    let after = kubelet
        .wait_health(DRIVER, WAIT, |v| {
            v.health("node-a", "gpu-0") == Some(HealthStatus::Unhealthy)
        })
        .await
        .unwrap();
    let gpu0 = after
        .devices
        .iter()
        .find(|d| {
            d.device
                .as_ref()
                .is_some_and(|id| id.device_name == "gpu-0")
        })
        .unwrap();
    assert_eq!(gpu0.message, "critical Xid 48");
    assert!(gpu0.health_check_timeout_seconds > 0);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_socket_is_recreated() {
    let h = start();
    let kubelet = KubeletDraDouble::start(&h.kubelet_root(), KubeletDraOptions::default());
    kubelet.wait_registered(DRIVER, WAIT).await.unwrap();

    std::fs::remove_file(&h.paths.registration_socket).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        if h.paths.registration_socket.exists() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "registration socket not re-created within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(mode(&h.paths.registration_socket), 0o600);

    // The kubelet sees the new socket and registers the driver again.
    kubelet
        .wait_until(WAIT, "a second registration", |k| {
            k.registrations().len() >= 2
        })
        .await
        .unwrap();
    kubelet.wait_registered(DRIVER, WAIT).await.unwrap();
    let prepared = kubelet
        .prepare(DRIVER, &[claim("team-a", OK_UID, "train")])
        .await
        .unwrap();
    assert!(prepared[OK_UID].is_ok());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_removes_sockets_with_a_health_stream_open() {
    let h = start();
    let kubelet = KubeletDraDouble::start(&h.kubelet_root(), KubeletDraOptions::default());
    kubelet.wait_registered(DRIVER, WAIT).await.unwrap();
    kubelet.watch_health(DRIVER).unwrap();
    kubelet
        .wait_health(DRIVER, WAIT, |v| v.open && v.updates >= 1)
        .await
        .unwrap();
    assert!(h.paths.dra_socket.exists() && h.paths.registration_socket.exists());
    // shutdown() asserts both sockets are gone and the server returned within 3 s.
    h.shutdown().await;
    kubelet
        .wait_until(WAIT, "deregistration", |k| {
            k.registered_drivers().is_empty()
        })
        .await
        .unwrap();
}
