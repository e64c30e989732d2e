//! MPS control daemons in pods of their own (`--mps-daemons=pods`): the DRA core creates one
//! pod per shared GPU from the agent's own pod, through the API server double, and waits until
//! the daemon it runs serves; a restarted core adopts the pod; the last share's unprepare
//! deletes it. The test kit's `PodRunner` runs each daemon pod as the kubelet would; the real
//! kubelet and containerd run them in tests/lab/deploy_mps.rs.

use crate::dra_shares::{alive, prepare, uid, unprepare, Env, NODE};

use gpuplane_node::cdi::Spec;
use gpuplane_node::dra::core::spec_stem;
use gpuplane_node::dra::ClaimUid;
use gpuplane_node::mps::pods::{MpsPods, PodSettings};
use gpuplane_node::mps::MpsHost;
use gpuplane_node::paths::HostPaths;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::pod_runner::PodRunner;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;

const NS: &str = "gpuplane-system";
const IMAGE: &str = "registry.example/gpuplane:test";

/// The agent's own pod, as the DaemonSet makes it.
fn agent_pod() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpuplane-node-x1", "namespace": NS, "uid": "agent-uid",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                "name": "gpuplane-node", "uid": "ds-uid", "controller": true,
                "blockOwnerDeletion": true}]},
        "spec": {"nodeName": NODE, "priorityClassName": "system-node-critical",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "agent", "image": IMAGE, "imagePullPolicy": "IfNotPresent"}]}
    })
}

/// The host path a claim's spec mounts at `container_path`.
fn mount_source(env: &Env, uid: &str, container_path: &str) -> Option<String> {
    let stem = spec_stem(&ClaimUid::parse(uid).unwrap());
    let spec: Spec =
        serde_json::from_slice(&std::fs::read(env.path(&format!("cdi/{stem}.json"))).unwrap())
            .unwrap();
    spec.devices
        .iter()
        .flat_map(|d| &d.container_edits.mounts)
        .find(|m| m.container_path == container_path)
        .map(|m| m.host_path.clone())
}

async fn pods_host(env: &Env, api: &ApiServerDouble) -> Arc<dyn MpsHost> {
    pods_host_with(env, api, None).await
}

/// [`pods_host`] with daemon pods setting compute modes through `nvml_lib`.
async fn pods_host_with(
    env: &Env,
    api: &ApiServerDouble,
    nvml_lib: Option<PathBuf>,
) -> Arc<dyn MpsHost> {
    let paths = HostPaths {
        proc_root: "/proc".into(),
        ..HostPaths::under(&env.path(""))
    };
    let settings = PodSettings {
        namespace: NS.into(),
        name: "gpuplane-node-x1".into(),
        nvml_lib,
    };
    let pods = MpsPods::new(api.client().unwrap(), NODE, &settings, &paths, None)
        .await
        .unwrap();
    Arc::new(pods)
}

/// The API server double holding the agent's own pod.
async fn api_with_agent_pod() -> Arc<ApiServerDouble> {
    let api = Arc::new(ApiServerDouble::start().await.unwrap());
    api.put_json(agent_pod()).unwrap();
    api
}

/// The node's daemon pods run by the test kit's pod runner with the gpuplane binary, their
/// processes also getting `host_env`.
fn pod_runner(api: &ApiServerDouble, host_env: Vec<(String, String)>) -> PodRunner {
    let program = std::path::Path::new(env!("CARGO_BIN_EXE_gpuplane"));
    PodRunner::start_with_env(api.client().unwrap(), NS, NODE, program, host_env)
}

fn daemon_pods(api: &ApiServerDouble) -> Vec<Value> {
    api.list_json("v1", "pods", Some(NS))
        .into_iter()
        .filter(|p| p["metadata"]["labels"]["app.kubernetes.io/name"] == "gpuplane-mps")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpus_daemon_runs_in_a_pod_of_its_own_that_a_restarted_agent_adopts() {
    let api = api_with_agent_pod().await;
    let env = Env::new(true);
    env.mps.set(pods_host(&env, &api).await).unwrap();
    let runner = pod_runner(&api, Vec::new());
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-0", Some(("s-a", "20Gi", "30")))],
        json!([]),
    );
    let b = env.add_claim(
        "b",
        &uid(2),
        &[("gpu-0", Some(("s-b", "40Gi", "50")))],
        json!([]),
    );
    let core = env.core();
    prepare(&core, &a).await.unwrap();
    prepare(&core, &b).await.unwrap();

    // One pod for the GPU, beside it, from the agent's build, owned by its DaemonSet.
    let pods = daemon_pods(&api);
    assert_eq!(pods.len(), 1, "{pods:#?}");
    let pod = &pods[0];
    assert_eq!(pod["spec"]["nodeName"], NODE);
    assert_eq!(pod["spec"]["containers"][0]["image"], IMAGE);
    assert_eq!(pod["spec"]["tolerations"][0]["key"], "nvidia.com/gpu");
    assert_eq!(pod["metadata"]["ownerReferences"][0]["uid"], "ds-uid");
    assert_eq!(
        pod["metadata"]["annotations"]["gpuplane.dev/mps-unit"],
        env.gpu(0).as_str()
    );
    assert_eq!(runner.started().len(), 1);

    // Both shares' containers reach it through the pipe directory and its /dev/shm.
    let shm =
        mount_source(&env, &uid(1), "/dev/shm").expect("the spec mounts the daemon's /dev/shm");
    assert!(shm.ends_with(&format!("mps/{}/shm", env.gpu(0))), "{shm}");
    assert_eq!(
        mount_source(&env, &uid(2), "/dev/shm").as_deref(),
        Some(shm.as_str())
    );
    let mut client_a = env.cuda_client(&uid(1), 0, &[("GPUPLANE_FAKE_MPS_SHM", &shm)]);
    assert_eq!(client_a.limits(), ("30.0".into(), "20480M".into()));
    // Without the daemon's /dev/shm a client cannot connect.
    let stray = tempfile::tempdir().unwrap();
    let mut no_shm = env.cuda_client(
        &uid(2),
        0,
        &[("GPUPLANE_FAKE_MPS_SHM", stray.path().to_str().unwrap())],
    );
    let status = no_shm.wait();
    assert!(
        !status.success(),
        "a client without the server's /dev/shm connected"
    );

    // A restarted agent adopts the pod: no new pod, no new daemon, the client still holds.
    drop(core);
    let core = env.core();
    core.restore_holds().await;
    prepare(&core, &a).await.unwrap();
    assert_eq!(daemon_pods(&api).len(), 1);
    assert_eq!(
        runner.started().len(),
        1,
        "the daemon pod was not started again"
    );
    assert!(
        client_a.running(),
        "the share lost its MPS server across the restart"
    );

    // The last share's unprepare deletes the pod, which stops the daemon; then its files go.
    unprepare(&core, &b).await;
    assert_eq!(daemon_pods(&api).len(), 1, "a share still runs on the GPU");
    unprepare(&core, &a).await;
    assert!(daemon_pods(&api).is_empty());
    assert!(!env.path(&format!("state/mps/{}", env.gpu(0))).exists());
    let ended = client_a.wait();
    assert!(
        !ended.success(),
        "a client whose server stopped should fail"
    );
}

/// What a crash leaves is put right at the next start: a daemon pod created for a share whose
/// prepare never reached the checkpoint is deleted, and a prepared share whose daemon pod is
/// gone (deleted by hand, say) gets a new one before any prepare is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_deletes_a_daemon_pod_no_share_needs_and_recreates_a_missing_one() {
    let api = api_with_agent_pod().await;
    let env = Env::new(true);
    let host = pods_host(&env, &api).await;
    env.mps.set(host.clone()).unwrap();
    let runner = pod_runner(&api, Vec::new());
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-0", Some(("s-a", "20Gi", "30")))],
        json!([]),
    );
    {
        let core = env.core();
        prepare(&core, &a).await.unwrap();
    }
    // As if the agent died between a daemon pod's creation and its share's checkpoint write.
    let stray = env.gpu(1);
    let h = host.clone();
    tokio::task::spawn_blocking(move || h.ensure(&stray, true))
        .await
        .unwrap()
        .unwrap();
    // And gpu-0's pod deleted while no agent ran.
    let gpu0 = gpuplane_model::mps_pod::pod_name(NODE, &env.gpu(0));
    api.delete_json("v1", "pods", Some(NS), &gpu0).unwrap();
    assert_eq!(daemon_pods(&api).len(), 1);

    let core = env.core();
    core.restore_holds().await;
    let pods = daemon_pods(&api);
    assert_eq!(pods.len(), 1, "{pods:#?}");
    assert_eq!(pods[0]["metadata"]["name"], gpu0.as_str());
    assert!(!env.path(&format!("state/mps/{}", env.gpu(1))).exists());
    // The share is answered from the checkpoint once its new daemon serves.
    prepare(&core, &a).await.unwrap();
    let shm = mount_source(&env, &uid(1), "/dev/shm").unwrap();
    let client = env.cuda_client(&uid(1), 0, &[("GPUPLANE_FAKE_MPS_SHM", &shm)]);
    assert_eq!(client.limits(), ("30.0".into(), "20480M".into()));
    assert_eq!(runner.started().iter().filter(|n| **n == gpu0).count(), 2);
    unprepare(&core, &a).await;
    assert!(daemon_pods(&api).is_empty());
}

/// The compute mode of `gpu` in the fake libnvidia-ml's state file (`Default` before any
/// change), as another process would read it back.
fn compute_mode(state: &std::path::Path, gpu: &str) -> String {
    let Ok(text) = std::fs::read_to_string(state) else {
        return "Default".into();
    };
    let v: Value = serde_json::from_str(&text).unwrap();
    v["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["uuid"] == gpu)
        .and_then(|g| g["computeMode"].as_str())
        .unwrap_or("Default")
        .to_string()
}

/// A GPU that MPS shares use is in `EXCLUSIVE_PROCESS` while its daemon pod serves (so only the
/// MPS server holds a context on it), through the real NVML backend in the daemon pod against
/// the fake libnvidia-ml; the mode it had is recorded beside the daemon and put back when the
/// last share's unprepare deletes the pod. Other GPUs are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_gpu_is_exclusive_to_its_mps_server_and_gets_its_mode_back() {
    let api = api_with_agent_pod().await;
    let env = Env::new(true);
    let lib = crate::support::built_fake().to_path_buf();
    env.mps
        .set(pods_host_with(&env, &api, Some(lib)).await)
        .unwrap();
    let state = env.path("nvml-state.json");
    let host_env = vec![
        (
            "GPUPLANE_FAKE_NVML_PROFILE".to_string(),
            "dgx-a100".to_string(),
        ),
        (
            "GPUPLANE_FAKE_NVML_STATE".to_string(),
            state.display().to_string(),
        ),
    ];
    let runner = pod_runner(&api, host_env);
    let (gpu0, gpu1) = (env.gpu(0), env.gpu(1));
    let a = env.add_claim(
        "a",
        &uid(1),
        &[("gpu-0", Some(("s-a", "20Gi", "30")))],
        json!([]),
    );
    let core = env.core();
    assert_eq!(compute_mode(&state, &gpu0), "Default");
    prepare(&core, &a).await.unwrap();
    assert_eq!(compute_mode(&state, &gpu0), "Exclusive_Process");
    assert_eq!(compute_mode(&state, &gpu1), "Default");
    let record = env.path(&format!("state/mps/{gpu0}/compute-mode.json"));
    let recorded: Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    assert_eq!(recorded["previous"], "Default");
    let pod = &daemon_pods(&api)[0];
    let args = pod["spec"]["containers"][0]["args"].to_string();
    assert!(args.contains("--nvml-lib="), "{args}");

    // The daemon's container killed (its process and the daemon it started, as the kernel
    // ends a container's cgroup) and started again: the new instance keeps the record of the
    // mode from before MPS, not the Exclusive_Process it finds.
    let name = pod["metadata"]["name"].as_str().unwrap();
    let wrapper = runner.pid(name).unwrap();
    let daemon = env.daemon_pid(0).unwrap();
    for pid in [wrapper, daemon] {
        std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }
    // Gone, and with them the lock that says "serving" (`kill` only sends the signal): a
    // prepare before that would find the old container still serving.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while alive(wrapper) || alive(daemon) {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed processes did not end"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // The kubelet's retry of the prepare waits for the restarted container's daemon.
    prepare(&core, &a).await.unwrap();
    assert_eq!(runner.started().len(), 2, "the container was started again");
    assert!(env.daemon_pid(0).is_some_and(|p| p != daemon));
    assert_eq!(compute_mode(&state, &gpu0), "Exclusive_Process");
    let recorded: Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    assert_eq!(recorded["previous"], "Default");

    unprepare(&core, &a).await;
    assert_eq!(compute_mode(&state, &gpu0), "Default");
    assert!(!record.exists());
}
