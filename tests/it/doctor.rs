//! `gpuplane doctor` as an operator runs it: the binary against a node laid out in a temp dir
//! (the kubelet double's sockets, a CDI directory, a containerd config) and the real agent's
//! `/readyz`; and its containerd rules against the config shapes of containerd 1.7 and 2.x.

use crate::support::{self, eventually_async};
use gpuplane_node::doctor::{containerd_cdi, Status};
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

/// Runs `gpuplane doctor -o json` on the node under `root`; its exit success and checks by name.
async fn doctor(root: &Path, agent: std::net::SocketAddr) -> (bool, Vec<Value>) {
    let p = |d: &str| root.join(d).into_os_string();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpuplane"));
    cmd.args(["doctor", "--simulate", "pcie-l4x4", "-o", "json"])
        .arg("--kubelet-root")
        .arg(p("kubelet"))
        .arg("--cdi-root")
        .arg(p("cdi"))
        .arg("--containerd-config")
        .arg(p("config.toml"))
        .arg("--agent-addr")
        .arg(agent.to_string())
        .stdin(Stdio::null());
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    support::doctor_report(&out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_passes_on_a_ready_node_and_names_each_fault_with_its_fix() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let mut kubelet = KubeletDouble::start(&root.join("kubelet")).await.unwrap();
    std::fs::create_dir_all(root.join("kubelet/plugins_registry")).unwrap();
    std::fs::create_dir_all(root.join("cdi")).unwrap();
    std::fs::write(
        root.join("config.toml"),
        format!(
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\nenable_cdi = true\ncdi_spec_dirs = [\"/etc/cdi\", \"{}\"]\n",
            root.join("cdi").display()
        ),
    )
    .unwrap();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
    let mut agent = Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args(["node", "--node-name", "n1", "--simulate", "pcie-l4x4"])
        .args(["--metrics-addr", &addr.to_string(), "--kubelet-root"])
        .arg(root.join("kubelet"))
        .arg("--cdi-root")
        .arg(root.join("cdi"))
        .arg("--state-dir")
        .arg(root.join("state"))
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    kubelet
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 4)
        })
        .await
        .unwrap();
    // Off the runtime: a blocking GET would hold up the kubelet double on the same workers.
    eventually_async("the agent ready", WAIT, || async move {
        tokio::task::spawn_blocking(move || support::http_get(addr, "/readyz"))
            .await
            .unwrap()
            .is_some_and(|(code, _)| code == 200)
    })
    .await;

    let (passed, checks) = doctor(root, addr).await;
    for c in &checks {
        assert_eq!(c["status"], "ok", "{c:#}");
    }
    assert!(passed, "{checks:#?}");
    for name in support::DOCTOR_NODE_CHECKS {
        support::doctor_check(&checks, name);
    }
    // The versions come from the kubelet's refusal of a probe: nothing was registered.
    let apis = support::doctor_check(&checks, "kubelet-apis")["detail"]
        .as_str()
        .unwrap();
    assert!(
        apis.contains("PodResources v1") && apis.contains("registration v1beta1"),
        "{apis}"
    );
    kubelet
        .wait_for(WAIT, |p| {
            p.contains_key("nvidia.com/gpu") && !p.contains_key("gpuplane.dev/doctor-probe")
        })
        .await
        .unwrap();

    // The CDI directory goes and the agent stops: the doctor fails, naming both and the fix.
    std::fs::rename(root.join("cdi"), root.join("cdi.gone")).unwrap();
    agent.kill().unwrap();
    agent.wait().unwrap();
    let (passed, checks) = doctor(root, addr).await;
    assert!(!passed, "{checks:#?}");
    let cdi = support::doctor_check(&checks, "cdi");
    assert_eq!(cdi["status"], "fail");
    assert!(
        cdi["detail"].as_str().unwrap().contains("cdi is missing") && cdi["fix"] != "",
        "{cdi:#}"
    );
    let down = support::doctor_check(&checks, "agent");
    assert_eq!(down["status"], "fail");
    assert!(
        down["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("http://{addr}/readyz")),
        "{down:#}"
    );
    assert_eq!(support::doctor_check(&checks, "kubelet")["status"], "ok");
    kubelet.stop().await;
}

#[test]
fn containerd_configs_are_read_as_containerd_1_7_and_2_x_read_them() {
    let path = Path::new("/etc/containerd/config.toml");
    let root = Path::new("/var/run/cdi");
    let check = |text: &str| containerd_cdi(text, path, root);
    // 1.7 (version 2): CDI is off unless enabled.
    let off =
        check("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\nsandbox_image = \"p\"\n");
    assert_eq!(off.status, Status::Fail);
    assert!(off.fix.contains("enable_cdi = true") && off.fix.contains("io.containerd.grpc.v1.cri"));
    let on = check("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\nenable_cdi = true\n");
    assert_eq!(on.status, Status::Ok, "{on:?}");
    // 2.x (version 3): on by default, in the runtime plugin's section; off only when set so.
    assert_eq!(check("version = 3\n").status, Status::Ok);
    let off3 = check("version = 3\n[plugins.'io.containerd.cri.v1.runtime']\nenable_cdi = false\n");
    assert_eq!(off3.status, Status::Fail);
    assert!(
        off3.fix.contains("io.containerd.cri.v1.runtime"),
        "{off3:?}"
    );
    // Spec directories that leave out the agent's, and /run as /var/run.
    let elsewhere = check(
        "version = 3\n[plugins.'io.containerd.cri.v1.runtime']\ncdi_spec_dirs = [\"/etc/cdi\"]\n",
    );
    assert_eq!(elsewhere.status, Status::Fail);
    assert!(
        elsewhere.detail.contains("leaves out /var/run/cdi"),
        "{elsewhere:?}"
    );
    let run = check(
        "version = 3\n[plugins.'io.containerd.cri.v1.runtime']\ncdi_spec_dirs = [\"/run/cdi\"]\n",
    );
    assert_eq!(run.status, Status::Ok, "{run:?}");
    let broken = check("version = [\n");
    assert_eq!(broken.status, Status::Fail);
    assert!(broken.detail.contains("is not TOML"), "{broken:?}");
}

/// On NVML (the fake libnvidia-ml), the driver root and the device nodes are checked: an empty
/// root fails naming the library it lacks, and the missing nodes are named; with the library in
/// place the driver check passes.
#[test]
fn on_nvml_a_driver_root_without_the_library_and_missing_device_nodes_fail_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("driver")).unwrap();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    let run = || {
        let out = Command::new(env!("CARGO_BIN_EXE_gpuplane"))
            .args(["doctor", "-o", "json", "--nvml-lib"])
            .arg(support::built_fake())
            .env("GPUPLANE_FAKE_NVML_PROFILE", "pcie-l4x4")
            .arg("--driver-root")
            .arg(root.join("driver"))
            .arg("--dev-root")
            .arg(root.join("dev"))
            .arg("--proc-root")
            .arg(root.join("proc"))
            .arg("--kubelet-root")
            .arg(root.join("kubelet"))
            .output()
            .unwrap();
        support::doctor_report(&out)
    };
    let (passed, checks) = run();
    assert!(!passed);
    let version = gpuplane_model::sim::load("pcie-l4x4")
        .unwrap()
        .driver_version;
    let driver = support::doctor_check(&checks, "driver");
    assert_eq!(driver["status"], "fail", "{driver:#}");
    assert!(
        driver["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("no libnvidia-ml.so.{version}")),
        "{driver:#}"
    );
    let nodes = support::doctor_check(&checks, "device-nodes");
    assert_eq!(nodes["status"], "fail", "{nodes:#}");
    assert!(
        nodes["detail"].as_str().unwrap().contains("nvidia0"),
        "{nodes:#}"
    );
    assert_eq!(support::doctor_check(&checks, "mps")["status"], "warn");

    let lib = root.join("driver/usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join(format!("libnvidia-ml.so.{version}")), "").unwrap();
    let (_, checks) = run();
    assert_eq!(
        support::doctor_check(&checks, "driver")["status"],
        "ok",
        "{checks:#?}"
    );
}
