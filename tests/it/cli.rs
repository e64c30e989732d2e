//! The `gpuplane` binary as a user runs it: discover's outputs and errors, the node agent's
//! SIGTERM contract, and one agent per state directory.

use crate::support;

use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use gpuplane_testkit::doubles::kubelet_dra::{KubeletDraDouble, KubeletDraOptions};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

fn gpuplane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run gpuplane")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn discover_shows_the_dgx1_cube_mesh_matrix() {
    let out = gpuplane(&["discover", "--simulate", "dgx1-v100"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let row = |g: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(&format!("{g} ")))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .unwrap()
    };
    assert_eq!(
        row("GPU0"),
        ["GPU0", "X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS", "0"]
    );
    assert_eq!(
        row("GPU5"),
        ["GPU5", "SYS", "NV2", "SYS", "SYS", "NV1", "X", "NV2", "NV1", "1"]
    );
    assert!(stdout.contains("Tesla V100-SXM2-32GB"));
}

#[test]
fn discover_json_is_parseable_with_the_documented_fields() {
    let out = gpuplane(&["discover", "--simulate", "h100-mig-single", "-o", "json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["gpus"].as_array().unwrap().len(), 8);
    assert_eq!(v["gpus"][7]["numaNode"], 1);
    assert_eq!(v["gpus"][7]["migDevices"][6]["profile"], "1g.10gb");
    assert_eq!(v["topology"]["nvswitch"], true);
    assert_eq!(v["topology"]["links"].as_array().unwrap().len(), 28);
}

#[test]
fn a_bad_profile_file_names_the_file_the_field_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mine.yaml");
    let text_in = gpuplane_model::sim::bundled_text("a100-mig-mixed")
        .unwrap()
        .replacen("profile: 3g.20gb", "profile: 3g.99gb", 1);
    std::fs::write(&path, text_in).unwrap();
    let out = gpuplane(&["discover", "--simulate", path.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("mine.yaml")
            && err.contains("gpus[0].mig.devices[0].profile")
            && err.contains("3g.99gb"),
        "{err}"
    );
}

#[test]
fn a_missing_nvml_library_says_so_and_mentions_simulate() {
    let out = gpuplane(&["discover", "--nvml-lib", "/nonexistent/libnvidia-ml.so.1"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--simulate") && err.contains("/nonexistent/libnvidia-ml.so.1"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one clear sentence: {err}");
}

#[test]
fn an_unknown_output_format_is_refused() {
    let out = gpuplane(&["discover", "--simulate", "dgx-h100", "-o", "yaml"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("yaml") && err.contains("table") && err.contains("json"),
        "{err}"
    );
}

#[test]
fn explain_refuses_a_pod_without_its_namespace_and_an_unreadable_kubeconfig() {
    let out = gpuplane(&["explain", "pod", "train-0"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("expected NAMESPACE/NAME, e.g. team-a/train-0"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, "not: [a kubeconfig").unwrap();
    let kc = kubeconfig.to_str().unwrap();
    let out = gpuplane(&["explain", "namespace", "team-a", "--kubeconfig", kc]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("kubeconfig {kc}")),
        "names the file: {err}"
    );
    assert_eq!(text(&out.stdout), "", "no half answer on stdout");
}

#[test]
fn discover_through_the_fake_nvml_library_matches_the_simulation() {
    let lib = support::built_fake();
    for profile in ["dgx-a100", "a100-mig-mixed"] {
        let sim = gpuplane(&["discover", "--simulate", profile, "-o", "json"]);
        let nvml = Command::new(env!("CARGO_BIN_EXE_gpuplane"))
            .args([
                "discover",
                "-o",
                "json",
                "--nvml-lib",
                lib.to_str().unwrap(),
            ])
            .env("GPUPLANE_FAKE_NVML_PROFILE", profile)
            .output()
            .unwrap();
        assert!(nvml.status.success(), "{}", text(&nvml.stderr));
        let mut a: serde_json::Value = serde_json::from_slice(&sim.stdout).unwrap();
        let mut b: serde_json::Value = serde_json::from_slice(&nvml.stdout).unwrap();
        a["source"] = serde_json::Value::Null;
        b["source"] = serde_json::Value::Null;
        assert_eq!(a, b, "{profile}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_agent_stops_on_sigterm_removing_its_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kubelet");
    let mut kubelet = KubeletDouble::start(&root).await.unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args([
            "node",
            "--node-name",
            "n1",
            "--simulate",
            "pcie-l4x4",
            "--kubelet-root",
        ])
        .arg(&root)
        .arg("--cdi-root")
        .arg(dir.path().join("cdi"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--dev-root")
        .arg(dir.path().join("dev"))
        .spawn()
        .unwrap();
    kubelet
        .wait_for(Duration::from_secs(20), |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 4)
        })
        .await
        .unwrap();
    let socket = root.join("device-plugins/gpuplane-nvidia.com_gpu.sock");
    assert!(socket.exists());
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists(), "the agent must remove its socket");
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_agent_serves_metrics_healthz_and_readyz_with_real_meaning() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kubelet");
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args([
            "node",
            "--node-name",
            "n1",
            "--simulate",
            "pcie-l4x4",
            "--metrics-addr",
            &addr.to_string(),
            "--kubelet-root",
        ])
        .arg(&root)
        .arg("--cdi-root")
        .arg(dir.path().join("cdi"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    let get = |path: &'static str| async move {
        tokio::task::spawn_blocking(move || support::http_get(addr, path).unwrap_or_default())
            .await
            .unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while get("/healthz").await.0 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "healthz never answered 200"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // /healthz answers from the start; discovery (off the runtime) may still be under way.
    let (code, body) = loop {
        let (code, body) = get("/readyz").await;
        if !body.contains("devices not discovered yet") || std::time::Instant::now() > deadline {
            break (code, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code, 503, "not ready without a kubelet: {body}");
    assert!(body.contains("not every resource is registered"), "{body}");
    let mut kubelet = KubeletDouble::start(&root).await.unwrap();
    let view = kubelet
        .wait_for(Duration::from_secs(20), |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 4)
        })
        .await
        .unwrap();
    kubelet
        .allocate(
            "nvidia.com/gpu",
            &[view["nvidia.com/gpu"].devices[0].id.clone()],
        )
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while get("/readyz").await.0 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "readyz never turned 200 after registration"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, metrics) = get("/metrics").await;
    assert_eq!(code, 200);
    assert!(metrics.ends_with("\n# EOF\n"), "{metrics}");
    assert!(
        metrics.contains("gpuplane_devices{resource=\"nvidia.com/gpu\",health=\"healthy\"} 4"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "gpuplane_allocations_total{resource=\"nvidia.com/gpu\",outcome=\"granted\"} 1"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpuplane_ledger_handouts_total{api=\"device-plugin\"} 1"),
        "{metrics}"
    );
    assert_eq!(get("/nope").await.0, 404);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    kubelet.stop().await;
}

/// A file's identity: device, inode and modification time (a re-bound socket changes it).
fn identity(path: &Path) -> (u64, u64, i64, i64) {
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.dev(), m.ino(), m.mtime(), m.mtime_nsec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_on_the_same_state_dir_exits_at_once_and_a_sigkilled_one_leaves_no_lock() {
    const WAIT: Duration = Duration::from_secs(30);
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let api = ApiServerDouble::start().await.unwrap();
    let kubelet_root = root.join("kubelet");
    let kubelet = KubeletDouble::start(&kubelet_root).await.unwrap();
    let dra = KubeletDraDouble::start(&kubelet_root, KubeletDraOptions::default());
    support::lay_out_node(root, 4, &api.url());
    let source = ["--simulate", "pcie-l4x4"];

    let mut first = support::AgentProcess::spawn(root, "", &source, &[], "first");
    dra.wait_registered(support::DRIVER, WAIT)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", first.log_text()));
    kubelet
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 4)
        })
        .await
        .unwrap();
    let lock = root
        .join("state")
        .join(gpuplane_node::node::lock::FILE_NAME);
    assert_eq!(
        std::fs::read_to_string(&lock).unwrap(),
        format!("{}\n", first.pid())
    );
    let sockets = [
        kubelet_root.join(format!("plugins/{}/dra.sock", support::DRIVER)),
        kubelet_root.join(format!("plugins_registry/{}-reg.sock", support::DRIVER)),
        kubelet_root.join("device-plugins/gpuplane-nvidia.com_gpu.sock"),
    ];
    let before: Vec<_> = sockets.iter().map(|s| identity(s)).collect();
    let registrations = dra.registrations().len();
    let slots = || {
        gpuplane_node::dra::checkpoint::SLOTS
            .map(|slot| std::fs::read(root.join("state").join(slot)).ok())
    };
    let checkpoint = slots();

    // Same directories, same kubelet: refused before it binds or writes anything.
    let mut second = support::AgentProcess::spawn(root, "", &source, &[], "second");
    let status = second
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the second agent kept running:\n{}", second.log_text()));
    assert!(!status.success(), "{status:?}");
    let log = second.log_text();
    assert!(log.contains(&lock.display().to_string()), "{log}");
    assert!(log.contains(&format!("PID {}", first.pid())), "{log}");
    assert!(log.contains("--state-dir"), "{log}");

    // The first agent is undisturbed: running, its sockets the ones it bound, its files as
    // they were, and it still answers the kubelet.
    assert!(first.running(), "{}", first.log_text());
    let after: Vec<_> = sockets.iter().map(|s| identity(s)).collect();
    assert_eq!(before, after);
    assert_eq!(
        std::fs::read_to_string(&lock).unwrap(),
        format!("{}\n", first.pid())
    );
    assert_eq!(slots(), checkpoint);
    assert_eq!(dra.registrations().len(), registrations);
    dra.watch_health(support::DRIVER).unwrap();
    let health = dra
        .wait_health(support::DRIVER, WAIT, |h| h.updates >= 1)
        .await
        .unwrap();
    assert_eq!(health.devices.len(), 4);

    // SIGKILL: no chance to clean up, yet the kernel drops the lock with the process.
    let killed = first.pid();
    first.kill();
    assert_eq!(
        std::fs::read_to_string(&lock).unwrap(),
        format!("{killed}\n"),
        "a killed agent's PID stays in the file; the lock does not"
    );
    let mut third = support::AgentProcess::spawn(root, "", &source, &[], "third");
    dra.wait_until(WAIT, "the third agent to register", |k| {
        k.registrations().len() > registrations
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", third.log_text()));
    assert!(third.running(), "{}", third.log_text());
    assert_eq!(
        std::fs::read_to_string(&lock).unwrap(),
        format!("{}\n", third.pid())
    );
    third.kill();
}

/// `gpuplane node` that logs its start and then fails (DRA asked for, no API access).
fn node_without_api(extra: &[&str]) -> Output {
    let mut args = vec![
        "node",
        "--simulate",
        "pcie-l4x4",
        "--node-name",
        "node-a",
        "--dra=true",
        "--kubeconfig",
        "/nonexistent/kubeconfig",
    ];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args(&args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run gpuplane")
}

#[test]
fn log_format_json_writes_one_json_object_per_stderr_line_with_level_and_fields() {
    let out = node_without_api(&["--log-format", "json"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let start = lines
        .iter()
        .find(|l| l["fields"]["message"] == "gpuplane node starting")
        .unwrap_or_else(|| panic!("no start line: {stderr}"));
    assert_eq!(start["level"], "INFO");
    assert_eq!(start["fields"]["node"], "node-a");
    assert!(start["timestamp"].is_string(), "{start}");
    // The final error is a JSON line too, naming the cause.
    let last = lines.last().unwrap();
    assert_eq!(last["level"], "ERROR", "{last}");
    let error = last["fields"]["error"].as_str().unwrap();
    assert!(error.contains("--dra needs API access"), "{error}");
}

#[test]
fn logs_are_human_readable_text_by_default() {
    let out = node_without_api(&[]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("INFO") && l.contains("gpuplane node starting")),
        "{stderr}"
    );
    assert!(
        stderr.lines().all(|l| !l.trim_start().starts_with('{')),
        "{stderr}"
    );
    assert!(stderr.contains("error: --dra needs API access"), "{stderr}");
    // The flag is global: accepted before the subcommand too.
    let out = gpuplane(&[
        "--log-format",
        "json",
        "discover",
        "--simulate",
        "pcie-l4x4",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Each error prints its cause once (crates/model/src/report.rs): the message carries it and
/// it is not also a `source()` that `main`'s `{:#}` would print again.
#[test]
fn an_error_prints_its_cause_once() {
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let config = gpuplane(&[
        "node",
        "--node-name",
        "n1",
        "--simulate",
        "dgx-h100",
        "--config",
        "/nonexistent/gpuplane-config.yaml",
        "--state-dir",
        state_dir,
    ]);
    let profile = gpuplane(&[
        "discover",
        "--simulate",
        "/nonexistent/gpuplane-profile.yaml",
    ]);
    for (out, object) in [
        (
            config,
            "reading config file /nonexistent/gpuplane-config.yaml",
        ),
        (
            profile,
            "simulation profile `/nonexistent/gpuplane-profile.yaml`",
        ),
    ] {
        assert!(!out.status.success());
        let stderr = text(&out.stderr);
        let line = stderr
            .lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("no error line in {stderr}"));
        assert!(line.contains(object), "{line}");
        assert_eq!(
            line.matches("No such file or directory").count(),
            1,
            "the cause must print once: {line}"
        );
    }
}

/// Logs read by `kubectl logs` or a collector carry no terminal colour codes: stderr is not a
/// terminal here.
#[test]
fn logs_to_a_pipe_carry_no_ansi_escape_codes() {
    let out = node_without_api(&[]);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("gpuplane node starting"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "escape codes in {stderr:?}");
}

/// `--simulate-from-node-label`: the node's `gpuplane.dev/simulate` label picks the bundled
/// profile; a value that is not one stops the start, naming the node, the label and the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_label_picks_the_simulated_machine_and_a_bad_value_is_named() {
    let api = ApiServerDouble::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = support::write_kubeconfig(dir.path(), &api.url());
    for (name, profile) in [("l4-node", "pcie-l4x4"), ("odd-node", "dgx-9000")] {
        api.put_json(serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"gpuplane.dev/simulate": profile}}
        }))
        .unwrap();
    }
    let run = |node: &str| {
        let state = dir.path().join(node);
        Command::new(env!("CARGO_BIN_EXE_gpuplane"))
            .args(["node", "--simulate-from-node-label", "--node-name", node])
            .args(["--device-plugin=false", "--dra=false", "--kubeconfig"])
            .arg(&kubeconfig)
            .arg("--state-dir")
            .arg(&state)
            .arg("--kubelet-root")
            .arg(dir.path().join("kubelet"))
            .arg("--cdi-root")
            .arg(dir.path().join("cdi"))
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let bad = tokio::task::spawn_blocking({
        let child = run("odd-node");
        move || child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    assert!(!bad.status.success());
    let err = text(&bad.stderr);
    assert!(
        err.contains(
            "node odd-node: label gpuplane.dev/simulate=\"dgx-9000\" is not a bundled profile"
        ),
        "{err}"
    );
    // The good one serves (no API here but the label's): its start line names the profile.
    let mut good = run("l4-node");
    let stderr = good.stderr.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.contains("gpuplane node starting"))
    })
    .await
    .unwrap();
    let _ = good.kill();
    let _ = good.wait();
    let line = line.expect("the agent logged its start");
    assert!(line.contains("simulated (pcie-l4x4)"), "{line}");
}

/// The controller's Prometheus credentials and headers are checked before it starts: a header
/// that is not `NAME: VALUE`, or one the client sets itself, is named; basic auth needs both
/// files and excludes a bearer token.
#[test]
fn the_controllers_prometheus_flags_are_checked_and_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = support::write_kubeconfig(dir.path(), "https://127.0.0.1:1");
    let base = [
        "controller",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--tls-cert-file=/nonexistent/tls.crt",
        "--tls-key-file=/nonexistent/tls.key",
        "--prometheus-url=http://127.0.0.1:9",
    ];
    for (extra, says) in [
        (
            &["--prometheus-header=X-Scope-OrgID team-a"][..],
            "--prometheus-header \"X-Scope-OrgID team-a\": no ':'; write it as NAME: VALUE",
        ),
        (
            &["--prometheus-header=Authorization: Basic eA=="],
            "Authorization comes from --prometheus-bearer-token-file or --prometheus-username-file",
        ),
        (
            &["--prometheus-username-file=/run/u"],
            "--prometheus-password-file",
        ),
        (
            &[
                "--prometheus-username-file=/run/u",
                "--prometheus-password-file=/run/p",
                "--prometheus-bearer-token-file=/run/t",
            ],
            "cannot be used with",
        ),
    ] {
        let out = gpuplane(&[&base[..], extra].concat());
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{extra:?}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}
