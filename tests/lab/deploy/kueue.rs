//! gpuplane beside Kueue (issue 41) on the three-node lab: the chart with `controller.kueue=true`
//! and Kueue installed from its own manifests (tests/cluster/kueue.rs), counting our DeviceClass
//! through `deviceClassMappings` (alpha gate `DynamicResourceAllocation`). Kueue governs; the
//! agents deliver the devices through both kubelet APIs; the controller stands down for Kueue's
//! pods, still governs the namespace's other pods through its GpuQuota, counts every pod's
//! GPU-hours, and gives one answer to "why Pending": Kueue's while Kueue holds a workload, the
//! cluster's (here Fragmentation, with its numbers) once Kueue said yes and the scheduler no.

use super::helm_install::helm_install;
use super::*;
use crate::cluster::{
    device_class_mapping, eventually_or, gpuplane_json, install_kueue, wait_running,
};
use gpuplane_cluster::controller::hours::{Book, By};
use gpuplane_cluster::controller::meter::{BOOK_KEY, BOOK_NAME};

const NS: &str = "ml";
/// The resource Kueue counts devices of DeviceClass gpu.gpuplane.dev under.
const DRA_GPUS: &str = "gpuplane.dev/dra-gpus";
const GATE: &str = "quota.gpuplane.dev/admission";

/// A Job `name` through LocalQueue `queue`: one pod holding 2 GPUs (`nvidia.com/gpu`, or through
/// a claim from template `two-gpus` when `claim`) that prints its environment and runs until
/// `/tmp/done` exists.
fn job(name: &str, queue: &str, claim: bool) -> String {
    let (claims, resources) = match claim {
        true => (
            "      resourceClaims: [{name: gpus, resourceClaimTemplateName: two-gpus}]\n",
            "          claims: [{name: gpus}]\n",
        ),
        false => ("", "          limits: {nvidia.com/gpu: 2}\n"),
    };
    format!(
        "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: {name}\n  namespace: {NS}\n  labels: {{kueue.x-k8s.io/queue-name: {queue}}}\n\
         spec:\n  backoffLimit: 0\n  template:\n    spec:\n      restartPolicy: Never\n      terminationGracePeriodSeconds: 1\n{claims}\
         \x20     containers:\n      - name: main\n        image: lab.local/busybox:1\n        imagePullPolicy: Never\n\
         \x20       command: [\"sh\", \"-c\", \"env; until [ -e /tmp/done ]; do sleep 1; done\"]\n        resources:\n{resources}"
    )
}

/// Kueue's objects: a ClusterQueue `name` with `quota` (resource, nominal quota) in the flavor
/// the install made, and a LocalQueue of the same name in [`NS`].
fn queues(lab: &ClusterLab, name: &str, quota: &[(&str, u32)]) {
    let covered: Vec<String> = quota.iter().map(|(r, _)| format!("\"{r}\"")).collect();
    let resources: Vec<String> = quota
        .iter()
        .map(|(r, n)| format!("{{name: \"{r}\", nominalQuota: {n}}}"))
        .collect();
    lab.apply(&format!(
        "apiVersion: kueue.x-k8s.io/v1beta2\nkind: ClusterQueue\nmetadata: {{name: {name}}}\nspec:\n  namespaceSelector: {{}}\n  resourceGroups:\n  - coveredResources: [{}]\n    flavors:\n    - name: default-flavor\n      resources: [{}]\n\
         ---\napiVersion: kueue.x-k8s.io/v1beta2\nkind: LocalQueue\nmetadata: {{name: {name}, namespace: {NS}}}\nspec: {{clusterQueue: {name}}}\n",
        covered.join(", "),
        resources.join(", ")
    ));
}

/// The pods of Job `name`.
fn job_pods(lab: &ClusterLab, name: &str) -> Vec<Value> {
    let selector = format!("batch.kubernetes.io/job-name={name}");
    lab.get_json(&["get", "pods", "-n", NS, "-l", &selector])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
}

/// Waits until Job `name`'s pod runs; its name.
fn running_pod(lab: &ClusterLab, name: &str) -> String {
    eventually_or(
        &format!("job {name}'s pod to run"),
        || {
            job_pods(lab, name)
                .into_iter()
                .find(|p| p["status"]["phase"] == "Running")
                .and_then(|p| p["metadata"]["name"].as_str().map(String::from))
        },
        || describe(lab),
    )
}

fn describe(lab: &ClusterLab) -> String {
    let out = lab.kubectl(&["describe", "jobs,pods,workloads", "-n", NS]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn gated_by_us(pod: &Value) -> bool {
    pod["spec"]["schedulingGates"]
        .as_array()
        .is_some_and(|g| g.iter().any(|g| g["name"] == GATE))
}

/// The explainer's gauge `gpuplane_pending_gpu_pods{reason}` on the leading controller replica
/// (the follower's is never set: the largest of the two).
fn pending_metric(lab: &ClusterLab, reason: &str) -> f64 {
    let mut most = 0.0f64;
    for (name, _) in controllers_ready(lab) {
        let path = format!("/api/v1/namespaces/{AGENT_NS}/pods/{name}:8080/proxy/metrics");
        let out = lab.kubectl(&["get", "--raw", &path]);
        let text = String::from_utf8_lossy(&out.stdout);
        for (labels, v) in
            gpuplane_testkit::metrics_text::series(&text, "gpuplane_pending_gpu_pods")
        {
            if labels.get("reason").map(String::as_str) == Some(reason) {
                most = most.max(v);
            }
        }
    }
    most
}

fn quota_status(lab: &ClusterLab) -> Value {
    lab.get_json(&["get", "gpuquota", "default", "-n", NS])
        .map(|q| q["status"].clone())
        .unwrap_or(Value::Null)
}

#[test]
fn kueue_governs_gpuplane_delivers_and_explains_with_one_answer() {
    let Some((lab, built)) = lab_with_image("1") else {
        return;
    };
    let home = lab.work.join("helm-home");
    let values = [
        "--set",
        "controller.kueue=true",
        "--set",
        "controller.ownerLabels={job-name}",
    ];
    helm_install(&lab, &home, &built.reference, &values);
    let mapping = device_class_mapping(DRA_GPUS, &["gpu.gpuplane.dev"]);
    install_kueue(&lab, &mapping, "DynamicResourceAllocation=true");
    lab.kubectl_ok(&["create", "namespace", NS]);
    // The namespace's own governor for pods that go around Kueue: 1 GPU, in Queue mode, so a
    // Kueue pod charged here would be held or refused.
    lab.apply(&format!(
        "apiVersion: quota.gpuplane.dev/v1alpha1\nkind: GpuQuota\nmetadata: {{name: default, namespace: {NS}}}\nspec:\n  hard: {{gpus: 1}}\n  mode: Queue\n"
    ));
    fragmentation_is_the_clusters_answer_once_kueue_admitted(&lab);
    three_jobs_under_four_gpus(&lab);
}

/// A Kueue-admitted 4-GPU pod that may use two nodes with 2 free GPUs each: Kueue's quota
/// said yes, the scheduler cannot place it, and the answer is Fragmentation with the numbers.
fn fragmentation_is_the_clusters_answer_once_kueue_admitted(lab: &ClusterLab) {
    queues(lab, "wide", &[("nvidia.com/gpu", 4)]);
    lab.kubectl_ok(&["create", "namespace", "fill"]);
    // lab-node (8 GPUs) and lab-node-3 (4) keep 2 free each.
    for (name, node, gpus) in [("fill-a", NODE, 6), ("fill-c", "lab-node-3", 2)] {
        let spec = format!("  nodeSelector: {{kubernetes.io/hostname: {node}}}\n");
        lab.create(
            &cluster::sleeping_gpu_pod("fill", name, gpus, "", &spec),
            &[],
        )
        .unwrap();
        wait_running(lab, "fill", name);
    }
    let meta = "  labels: {kueue.x-k8s.io/queue-name: wide}\n";
    let spec = format!(
        "  affinity:\n    nodeAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n        - matchExpressions:\n          - {{key: kubernetes.io/hostname, operator: In, values: [{NODE}, lab-node-3]}}\n"
    );
    lab.create(&cluster::sleeping_gpu_pod(NS, "wide", 4, meta, &spec), &[])
        .unwrap();
    let answer = eventually_or(
        "the admitted pod explained as Fragmentation",
        || {
            let a = gpuplane_json(
                lab,
                &["explain", "pod", &format!("{NS}/wide"), "-o", "json"],
            );
            (a["reason"] == "Fragmentation" && a["source"] == "controller").then_some(a)
        },
        || describe(lab),
    );
    let message = answer["message"].as_str().unwrap();
    for part in [
        "needs 4 nvidia.com/gpu",
        "at most 2 on one",
        &format!("{NODE} 2"),
        "lab-node-3 2",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    // Kueue admitted it (its gate is gone), and ours never held it.
    let pod = lab.get_json(&["get", "pod", "wide", "-n", NS]).unwrap();
    assert!(
        pod["spec"]["schedulingGates"]
            .as_array()
            .is_none_or(|g| g.is_empty()),
        "{pod}"
    );
    for name in ["fill-a", "fill-c"] {
        lab.kubectl_ok(&["delete", "pod", name, "-n", "fill", "--wait=false"]);
    }
    lab.kubectl_ok(&["delete", "pod", "wide", "-n", NS, "--wait=true"]);
}

/// A ClusterQueue of 4 GPUs (2 through each kubelet API) and three 2-GPU Jobs: two run, one on
/// each API; the third waits suspended with reason Kueue and Kueue's message; once the first
/// finishes, the third runs. No gate and no charge of ours on any, while a pod that goes around
/// Kueue is still governed by the GpuQuota; GPU-hours count all three.
fn three_jobs_under_four_gpus(lab: &ClusterLab) {
    queues(lab, "gpus", &[("nvidia.com/gpu", 2), (DRA_GPUS, 2)]);
    lab.apply(&format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: two-gpus, namespace: {NS}}}\nspec:\n  spec:\n    devices:\n      requests:\n      - name: gpus\n        exactly: {{deviceClassName: gpu.gpuplane.dev, count: 2}}\n"
    ));
    lab.apply(&job("train-1", "gpus", false));
    lab.apply(&job("train-2", "gpus", true));
    let first = running_pod(lab, "train-1");
    let second = running_pod(lab, "train-2");
    lab.apply(&job("train-3", "gpus", false));
    two_gpus_each(lab, [&first, &second]);
    third_is_kueues(lab);
    queued_pod_is_kueues(lab);
    the_namespace_is_shared(lab);
    // The first job finishes; Kueue admits the third, which runs.
    lab.kubectl_ok(&["exec", "-n", NS, &first, "--", "sh", "-c", ": > /tmp/done"]);
    running_pod(lab, "train-3");
    for name in ["train-1", "train-2", "train-3"] {
        for pod in job_pods(lab, name) {
            assert!(!gated_by_us(&pod), "{name}: {pod}");
        }
    }
    all_three_are_counted(lab);
}

/// Each pod got two GPUs from the agents (one job through each API).
fn two_gpus_each(lab: &ClusterLab, pods: [&str; 2]) {
    for pod in pods {
        let env = cluster::pod_env_in(lab, NS, pod);
        let gpus = env
            .iter()
            .find_map(|l| l.strip_prefix("NVIDIA_VISIBLE_DEVICES="))
            .unwrap_or_else(|| panic!("{pod} got no GPU: {env:?}"));
        assert_eq!(
            gpus.split(',').filter(|u| u.starts_with("GPU-")).count(),
            2,
            "{pod}: {gpus}"
        );
    }
}

/// The third job waits in Kueue, with Kueue's reason everywhere gpuplane answers.
fn third_is_kueues(lab: &ClusterLab) {
    let held = eventually_or(
        "train-3 explained as held by Kueue",
        || {
            let a = gpuplane_json(
                lab,
                &["explain", "job", &format!("{NS}/train-3"), "-o", "json"],
            );
            let a = a.as_array()?.first()?.clone();
            (a["reason"] == "Kueue" && a["message"].as_str()?.contains("insufficient")).then_some(a)
        },
        || describe(lab),
    );
    let message = held["message"].as_str().unwrap();
    for part in [
        "LocalQueue gpus (ClusterQueue gpus)",
        "nvidia.com/gpu",
        "1 GPU pod not created yet",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    let job3 = lab.get_json(&["get", "job", "train-3", "-n", NS]).unwrap();
    assert_eq!(job3["spec"]["suspend"], true, "{job3}");
    let listed = gpuplane_json(lab, &["explain", "namespace", NS, "-o", "json"]);
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["pod"] == "job/train-3" && a["reason"] == "Kueue"),
        "{listed}"
    );
    eventually(
        "the controller to count train-3's pod as waiting for Kueue",
        || pending_metric(lab, "Kueue") == 1.0,
    );
}

/// A plain pod through the full queue waits at Kueue's gate: the controller's condition on
/// it (what `kubectl describe` shows) gives Kueue's reason and words.
fn queued_pod_is_kueues(lab: &ClusterLab) {
    let meta = "  labels: {kueue.x-k8s.io/queue-name: gpus}\n";
    lab.create(&cluster::sleeping_gpu_pod(NS, "queued", 2, meta, ""), &[])
        .unwrap();
    let kept = eventually_or(
        "the held pod's condition to say Kueue",
        || {
            let a = gpuplane_json(
                lab,
                &["explain", "pod", &format!("{NS}/queued"), "-o", "json"],
            );
            // Kueue's words once it tried the Workload (the first answers precede that).
            let said = a["message"].as_str()?.contains("insufficient");
            (a["reason"] == "Kueue" && a["source"] == "controller" && said).then_some(a)
        },
        || describe(lab),
    );
    let message = kept["message"].as_str().unwrap();
    assert!(
        message.contains("(ClusterQueue gpus)") && message.contains("insufficient"),
        "{message}"
    );
    eventually("the metric to count both", || {
        pending_metric(lab, "Kueue") == 2.0
    });
}

/// A pod that goes around Kueue is the GpuQuota's: gated, then admitted within its 1 GPU;
/// Kueue's pods are not charged, and the quota says whose they are.
fn the_namespace_is_shared(lab: &ClusterLab) {
    lab.create(&cluster::sleeping_gpu_pod(NS, "own", 1, "", ""), &[])
        .unwrap();
    wait_running(lab, NS, "own");
    let status = eventually("the GpuQuota to count only its own pod", || {
        let s = quota_status(lab);
        let shared = s["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "KueueShared" && c["status"] == "True");
        (shared && s["used"]["gpus"] == "1").then_some(s)
    });
    assert!(
        status["reservations"]
            .as_array()
            .is_none_or(|r| r.iter().all(|r| r["name"] == "own")),
        "{status}"
    );
    let events = lab
        .get_json(&[
            "get",
            "events",
            "-n",
            NS,
            "--field-selector",
            "reason=KueueShared",
        ])
        .unwrap();
    assert!(
        !events["items"].as_array().unwrap().is_empty(),
        "no KueueShared Event"
    );
}

/// The ledger counts all three jobs, by the job-name owner label.
fn all_three_are_counted(lab: &ClusterLab) {
    eventually("GPU-hours for all three jobs", || {
        let cm = lab.get_json(&["get", "configmap", BOOK_NAME, "-n", AGENT_NS])?;
        let book = Book::from_json(cm["data"][BOOK_KEY].as_str()?).ok()?;
        let report = book.report(&By::Owner("job-name".into()), Some(NS), None, None);
        let counted = |job: &str| {
            report
                .rows
                .iter()
                .any(|r| r.tenant == job && r.gpu_seconds > 0.0)
        };
        ["train-1", "train-2", "train-3"]
            .iter()
            .all(|j| counted(j))
            .then_some(())
    });
}
