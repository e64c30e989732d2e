//! `gpuplane doctor` on a cluster deployed from the chart (issue 40), the three ways an
//! operator runs it: in the agent's pod on lab-node-2 (`kubectl exec`, as
//! docs/troubleshooting.md says; the pod's mounts, NODE_NAME and ServiceAccount), against the
//! cluster from outside the node (`--api-only`: the agent's pod, the node's slices, a smoke pod
//! through each kubelet API), and as a tool on the node itself. It passes on the healthy node;
//! with the node's agent gone (its node label removed, so the DaemonSet leaves it) it names the
//! agent pod and what selects it, and with the node's CDI directory gone it names that too.

use super::helm_install::helm_install;
use super::*;
use crate::support;

/// The node the doctor examines, and the machine it simulates.
const NODE_2: &str = "lab-node-2";
const MACHINE: &str = "a100-mig-mixed";

/// `gpuplane doctor --api-only` for lab-node-2 from the lab's network, as cluster admin.
fn against_the_cluster(lab: &ClusterLab, extra: &[&str]) -> (bool, Vec<Value>) {
    let out = lab
        .in_netns(env!("CARGO_BIN_EXE_gpuplane"))
        .args(["doctor", "--api-only", "--node-name", NODE_2, "-o", "json"])
        .arg("--kubeconfig")
        .arg(lab.admin_kubeconfig())
        .args(extra)
        .output()
        .unwrap();
    support::doctor_report(&out)
}

#[test]
fn doctor_passes_in_the_agents_pod_and_against_the_cluster_and_names_a_missing_agent_and_cdi_dir() {
    let Some((lab, built)) = lab_with_image("1") else {
        return;
    };
    helm_install(&lab, &lab.work.join("helm-home"), &built.reference, &[]);

    // In the agent's pod: the node checks see the node through the pod's mounts.
    let agent = agent_pods(&lab)
        .into_iter()
        .find(|p| p.0 == NODE_2)
        .map(|p| p.1)
        .unwrap();
    let out = lab.kubectl(&[
        "exec",
        "-n",
        AGENT_NS,
        &agent,
        "--",
        "gpuplane",
        "doctor",
        "--simulate",
        MACHINE,
        "--agent-addr",
        "127.0.0.1:9400",
        "-o",
        "json",
    ]);
    let (ok, checks) = support::doctor_report(&out);
    assert!(ok, "{checks:#?}");
    // The agent answered its /readyz itself, so its pod is not asked after.
    assert!(
        checks.iter().all(|c| c["check"] != "agent-pod"),
        "{checks:#?}"
    );
    for name in ["kubelet", "kubelet-apis", "cdi", "agent", "slices"] {
        assert_eq!(
            support::doctor_check(&checks, name)["status"],
            "ok",
            "{checks:#?}"
        );
    }

    // Against the cluster: the agent's pod, the slices, a GPU through each API, nothing left.
    let smoke = ["--smoke", "--smoke-image", "lab.local/busybox:1"];
    let (ok, checks) = against_the_cluster(&lab, &smoke);
    assert!(ok, "{checks:#?}");
    let names: Vec<&str> = checks.iter().filter_map(|c| c["check"].as_str()).collect();
    assert_eq!(
        names,
        ["agent-pod", "slices", "smoke-device-plugin", "smoke-dra"]
    );
    assert!(support::doctor_check(&checks, "agent-pod")["detail"]
        .as_str()
        .is_some_and(|d| d.contains(&agent) && d.contains("Ready")));
    let left = lab.get_json(&["get", "pods", "-n", "default"]).unwrap();
    assert_eq!(left["items"].as_array().map(Vec::len), Some(0), "{left}");

    // The agent leaves the node: the DaemonSet selects nvidia.com/gpu.present=true.
    lab.kubectl_ok(&["label", "node", NODE_2, "nvidia.com/gpu.present-"]);
    eventually("lab-node-2's agent pod gone", || {
        agent_pods(&lab).iter().all(|p| p.0 != NODE_2).then_some(())
    });
    let (ok, checks) = against_the_cluster(&lab, &[]);
    assert!(!ok);
    let pod = support::doctor_check(&checks, "agent-pod");
    assert_eq!(pod["status"], "fail", "{pod}");
    assert!(
        pod["fix"]
            .as_str()
            .is_some_and(|f| f.contains("nvidia.com/gpu.present=true")),
        "{pod}"
    );

    // On the node itself, once it lost its CDI directory (containerd reads specs there).
    let node = lab.nodes().into_iter().find(|n| n.name == NODE_2).unwrap();
    let removed = lab
        .on(&node, "sh")
        .args(["-c", "umount /run/cdi && rmdir /run/cdi"])
        .status()
        .unwrap();
    assert!(removed.success());
    let out = lab
        .on(&node, env!("CARGO_BIN_EXE_gpuplane"))
        .args(["doctor", "--simulate", MACHINE, "-o", "json"])
        .arg("--containerd-config")
        .arg(node.dir.join("containerd.toml"))
        .args(["--node-name", NODE_2, "--kubeconfig"])
        .arg(lab.admin_kubeconfig())
        .output()
        .unwrap();
    let (ok, checks) = support::doctor_report(&out);
    assert!(!ok);
    let failed = support::doctor_failed(&checks);
    assert!(
        failed.contains(&"cdi".to_string()) && failed.contains(&"agent-pod".to_string()),
        "{checks:#?}"
    );
    assert!(support::doctor_check(&checks, "cdi")["fix"]
        .as_str()
        .is_some_and(|f| !f.is_empty()));
}
