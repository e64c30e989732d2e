//! Quota preemption on real Kubernetes (issue 27, the seed's card): a Queue-mode GpuQuota of
//! 4 GPUs with `preemption.withinQuota: LowerPriority`, full with low-priority training (a
//! Deployment of 2 and a pod group of 2); a high-priority inference pod of 2 GPUs arrives and
//! exactly the pod group is evicted, whole, through the real Eviction API; the inference pod is
//! released only once the group's charge is gone, and runs. Then a PodDisruptionBudget that
//! forbids evicting training holds a second inference pod back (its eviction refused, never a
//! delete); once the budget goes, exactly one training pod is evicted, and the Deployment's
//! replacement waits at the gate with a reason. Last, cohort reclaim ([`cohort_reclaim`]).
//! The controller runs with the installed manifests' RBAC and admission policy. Skips like
//! tests/lab/real_cluster.rs.

use crate::cluster::{
    eventually, eventually_or, pod_events, refusals, sleeping_gpu_pod, start_controller,
    wait_controller_ready, wait_running, ClusterLab, LabAgent,
};
use gpuplane_model::quota::SCHEDULING_GATE;
use serde_json::Value;
use std::time::Instant;

const NS: &str = "ml";

/// A busybox pod `ns/name` that sleeps; as PID 1 it ignores SIGTERM, so it terminates only
/// when its grace period ends: long enough to watch what happens while a victim terminates.
fn pod(ns: &str, name: &str, gpus: u32, priority_class: &str, meta: &str, grace: u32) -> String {
    let spec = format!("  priorityClassName: {priority_class}\n");
    sleeping_gpu_pod(ns, name, gpus, meta, &spec).replace(
        "terminationGracePeriodSeconds: 1\n",
        &format!("terminationGracePeriodSeconds: {grace}\n"),
    )
}

const SETUP: &str = r#"apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: train-low}
value: 10
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {name: infer-high}
value: 1000
---
apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: team, namespace: ml}
spec:
  hard: {gpus: 4}
  mode: Queue
  preemption: {withinQuota: LowerPriority}
"#;

const TRAINING: &str = r#"apiVersion: apps/v1
kind: Deployment
metadata: {name: train, namespace: ml}
spec:
  replicas: 2
  selector: {matchLabels: {app: train}}
  template:
    metadata: {labels: {app: train}}
    spec:
      priorityClassName: train-low
      terminationGracePeriodSeconds: 1
      containers:
      - name: c
        image: lab.local/busybox:1
        imagePullPolicy: Never
        command: ["sleep", "3600"]
        resources:
          limits: {nvidia.com/gpu: 1}
"#;

const BUDGET: &str = r#"apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: train, namespace: ml}
spec:
  minAvailable: 2
  selector: {matchLabels: {app: train}}
"#;

fn get_pod(lab: &ClusterLab, name: &str) -> Option<Value> {
    lab.get_json(&["get", "pod", name, "-n", NS])
}

fn gated(p: &Value) -> bool {
    p["spec"]["schedulingGates"]
        .as_array()
        .is_some_and(|g| g.iter().any(|g| g["name"] == SCHEDULING_GATE))
}

const COHORT: &str = r#"apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-b}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-c}
---
apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: q, namespace: team-a}
spec:
  hard: {gpus: 2}
  cohort: research
  mode: Queue
  preemption: {reclaimWithinCohort: Any}
---
apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: q, namespace: team-b}
spec:
  hard: {gpus: 1}
  cohort: research
---
apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: q, namespace: team-c}
spec:
  hard: {gpus: 2}
  cohort: research
"#;

/// Cohort reclaim: team-b (hard 1) borrows 2 of its cohort's unused (team-a's 2 and team-c's 2
/// lie idle); team-a then needs 3, its own 2 and 1 borrowed, and the cohort has none left to
/// lend. Its `reclaimWithinCohort: Any` evicts exactly one of team-b's borrowed pods (the most
/// recently started), and the pod runs; team-b keeps its own GPU and one borrowed.
fn cohort_reclaim(lab: &ClusterLab) {
    lab.apply(COHORT);
    let started = |name: &str| {
        lab.get_json(&["get", "pod", name, "-n", "team-b"])
            .and_then(|p| p["status"]["startTime"].as_str().map(str::to_string))
    };
    for name in ["b-0", "b-1", "b-2"] {
        let yaml = pod("team-b", name, 1, "train-low", "", 1);
        loop {
            eventually(
                &format!("the webhook to admit {name} on the cohort's capacity"),
                || lab.create(&yaml, &[]).ok(),
            );
            wait_running(lab, "team-b", name);
            // Start times have whole seconds: b-2 must be the one most recently started, not
            // tied with b-1 (a tie is the controller's to break, not what this test checks).
            if name != "b-2" || started("b-2") != started("b-1") {
                break;
            }
            lab.kubectl_ok(&["delete", "pod", "-n", "team-b", name, "--wait=true"]);
        }
    }
    let created = Instant::now();
    let yaml = pod("team-a", "big", 3, "train-low", "", 1);
    eventually("the webhook to gate team-a/big", || {
        let p = lab.create(&yaml, &[]).ok()?;
        if gated(&p) {
            return Some(());
        }
        lab.kubectl_ok(&["delete", "pod", "-n", "team-a", "big", "--wait=true"]);
        None
    });
    let events = eventually_or(
        "one of team-b's pods to be preempted",
        || {
            let e = lab.get_json(&[
                "get",
                "events",
                "-n",
                "team-b",
                "--field-selector",
                "reason=QuotaPreempted",
            ])?;
            let items = e["items"].as_array()?.clone();
            (!items.is_empty()).then_some(items)
        },
        || lab.describe_pod_in("team-a", "big"),
    );
    wait_running(lab, "team-a", "big");
    let to_running = created.elapsed();
    assert_eq!(events.len(), 1, "exactly one borrowed pod: {events:?}");
    assert_eq!(
        events[0]["involvedObject"]["name"], "b-2",
        "the most recently started"
    );
    let message = events[0]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("to make room for pod team-a/big")
            && message.contains(
                "namespace team-b borrows capacity of its cohort that namespace team-a reclaims"
            ),
        "{message}"
    );
    for name in ["b-0", "b-1"] {
        let p = lab
            .get_json(&["get", "pod", name, "-n", "team-b"])
            .unwrap_or_default();
        assert!(
            p["status"]["phase"] == "Running" && p["metadata"]["deletionTimestamp"].is_null(),
            "{p}"
        );
    }
    eprintln!(
        "cohort reclaim: team-a/big created -> running in {:.1} s",
        to_running.as_secs_f64()
    );
}

/// The training Deployment's pods: (name, running, terminating, gated).
fn training(lab: &ClusterLab) -> Vec<(String, bool, bool, bool)> {
    let list = lab.get_json(&["get", "pods", "-n", NS, "-l", "app=train"]);
    let items = list.as_ref().and_then(|l| l["items"].as_array().cloned());
    items
        .unwrap_or_default()
        .iter()
        .map(|p| {
            (
                p["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                p["status"]["phase"] == "Running",
                !p["metadata"]["deletionTimestamp"].is_null(),
                gated(p),
            )
        })
        .collect()
}

fn preempted_events(lab: &ClusterLab) -> Vec<Value> {
    lab.get_json(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        "reason=QuotaPreempted",
    ])
    .and_then(|e| e["items"].as_array().cloned())
    .unwrap_or_default()
}

fn condition(p: &Value, type_: &str) -> Option<Value> {
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

/// What a failure needs: the pod described, the quota and the namespace's pods.
fn state(lab: &ClusterLab, pod: &str) -> String {
    let quota = lab.kubectl(&["get", "gpuquota", "team", "-n", NS, "-o", "yaml"]);
    let pods = lab.kubectl(&["get", "pods", "-n", NS, "-o", "wide"]);
    format!(
        "{}\n{}\n{}",
        lab.describe_pod_in(NS, pod),
        String::from_utf8_lossy(&quota.stdout),
        String::from_utf8_lossy(&pods.stdout)
    )
}

/// Creates `yaml` once the webhook gates it (its cache holds the Queue-mode quota).
fn create_gated(lab: &ClusterLab, name: &str, yaml: &str) {
    eventually(&format!("the webhook to gate pod {name}"), || {
        let p = lab.create(yaml, &[]).ok()?;
        if gated(&p) {
            return Some(());
        }
        lab.kubectl_ok(&["delete", "pod", "-n", NS, name, "--wait=true"]);
        None
    });
}

#[test]
fn a_high_priority_pod_evicts_exactly_enough_lower_priority_pods_through_the_eviction_api() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let _agent = LabAgent::start(&lab, &installed.agent, "1");
    let controller = start_controller(&lab, &installed, "1");
    wait_controller_ready(&lab);
    lab.kubectl_ok(&["create", "namespace", NS]);
    lab.apply(SETUP);

    training_fills_the_quota(&lab);
    let to_running = inference_evicts_the_pod_group(&lab);
    a_budget_blocks_the_eviction(&lab);
    without_the_budget_one_training_pod_goes(&lab);

    lab.kubectl_ok(&["delete", "namespace", NS, "--wait=true"]);
    cohort_reclaim(&lab);

    let log = controller.log_text();
    assert!(
        refusals(&log).is_empty(),
        "the controller was refused a call:\n{log}"
    );
    eprintln!(
        "preemption: inference pod created -> running in {:.1} s (its victims' grace period 20 s included)",
        to_running.as_secs_f64()
    );
}

/// Training fills the quota: the Deployment's 2 pods, then a pod group of 2 (started last).
fn training_fills_the_quota(lab: &ClusterLab) {
    create_gated(lab, "probe", &pod(NS, "probe", 1, "train-low", "", 1));
    lab.kubectl_ok(&["delete", "pod", "-n", NS, "probe", "--wait=true"]);
    lab.apply(TRAINING);
    eventually("both training pods to run", || {
        let t = training(lab);
        (t.len() == 2 && t.iter().all(|(_, running, ..)| *running)).then_some(())
    });
    let group = "  labels: {quota.gpuplane.dev/pod-group: sweep}\n  annotations: {quota.gpuplane.dev/pod-group-size: \"2\"}\n";
    for name in ["sweep-0", "sweep-1"] {
        lab.apply(&pod(NS, name, 1, "train-low", group, 20));
    }
    for name in ["sweep-0", "sweep-1"] {
        wait_running(lab, NS, name);
    }
}

/// Inference arrives: 2 GPUs at priority 1000. The group is the most recently started and
/// frees exactly 2: it goes whole; the Deployment's pods stay. How long the inference pod
/// took from created to running.
fn inference_evicts_the_pod_group(lab: &ClusterLab) -> std::time::Duration {
    let created = Instant::now();
    create_gated(lab, "infer", &pod(NS, "infer", 2, "infer-high", "", 1));
    let victims = eventually("the pod group to be evicted", || {
        let v: Vec<Value> = ["sweep-0", "sweep-1"]
            .iter()
            .filter_map(|n| get_pod(lab, n))
            .filter(|p| !p["metadata"]["deletionTimestamp"].is_null())
            // Our condition is written right after the eviction.
            .filter(|p| condition(p, "gpuplane.dev/Preempted").is_some())
            .collect();
        (v.len() == 2).then_some(v)
    });
    for v in &victims {
        let ours = condition(v, "gpuplane.dev/Preempted").unwrap_or_default();
        assert_eq!(ours["status"], "True", "{v}");
        let message = ours["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with("preempted with the rest of pod group sweep to make room for pod ml/infer (priority 1000)"),
            "{message}"
        );
        // Kubernetes' own mark of an Eviction API eviction.
        let target = condition(v, "DisruptionTarget").unwrap_or_default();
        assert_eq!(target["reason"], "EvictionByEvictionAPI", "{v}");
    }
    // While the group terminates its charge still counts: the inference pod stays gated.
    let p = get_pod(lab, "infer").unwrap_or_default();
    assert!(gated(&p), "released before its victims were gone: {p}");
    let note = condition(&p, "QuotaAdmitted").unwrap_or_default();
    let message = note["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("ml/sweep-0 (priority 10)")
            && message.contains("ml/sweep-1 (priority 10)"),
        "{note}"
    );
    wait_running(lab, NS, "infer");
    let to_running = created.elapsed();
    assert_eq!(preempted_events(lab).len(), 2);
    let t = training(lab);
    assert!(
        t.len() == 2
            && t.iter()
                .all(|(_, running, terminating, _)| *running && !terminating),
        "training was not touched: {t:?}"
    );
    to_running
}

/// A budget forbids evicting training: the next inference pod's eviction is refused, the
/// controller never deletes, and the pod waits.
fn a_budget_blocks_the_eviction(lab: &ClusterLab) {
    lab.apply(BUDGET);
    eventually("the budget to allow no disruption", || {
        let b = lab.get_json(&["get", "pdb", "train", "-n", NS])?;
        (b["status"]["disruptionsAllowed"] == 0 && b["status"]["currentHealthy"] == 2).then_some(())
    });
    create_gated(lab, "infer-2", &pod(NS, "infer-2", 1, "infer-high", "", 1));
    let refused = eventually_or(
        "the refused eviction to be told to infer-2",
        || {
            pod_events(lab, NS, "infer-2", "QuotaPreemptionBlocked")
                .into_iter()
                .next()
        },
        || state(lab, "infer-2"),
    );
    let message = refused["message"].as_str().unwrap_or_default();
    assert!(message.contains("disruption budget"), "{refused}");
    let t = training(lab);
    assert!(
        t.iter()
            .all(|(_, running, terminating, _)| *running && !terminating),
        "a budget-protected pod was evicted or deleted: {t:?}"
    );
    assert!(gated(&get_pod(lab, "infer-2").unwrap_or_default()));
}

/// The budget goes: exactly one training pod is evicted, infer-2 runs, and the Deployment's
/// replacement waits at the gate, told why.
fn without_the_budget_one_training_pod_goes(lab: &ClusterLab) {
    lab.kubectl_ok(&["delete", "pdb", "train", "-n", NS]);
    wait_running(lab, NS, "infer-2");
    let replacement = eventually_or(
        "the Deployment's replacement to wait gated with a reason",
        || {
            let (name, ..) = training(lab).into_iter().find(|(.., gated)| *gated)?;
            let p = get_pod(lab, &name)?;
            let c = condition(&p, "QuotaAdmitted")?;
            let told = c["message"].as_str()?.contains("no preemption");
            (c["status"] == "False" && told).then_some(c)
        },
        || state(lab, "infer-2"),
    );
    let message = replacement["message"].as_str().unwrap_or_default();
    assert!(message.contains("waiting for quota"), "{replacement}");
    assert!(message.contains("no preemption"), "{replacement}");
    assert_eq!(
        preempted_events(lab).len(),
        3,
        "the group's 2 and one training pod"
    );
    let running = training(lab).iter().filter(|(_, r, t, _)| *r && !t).count();
    assert_eq!(running, 1);
}
