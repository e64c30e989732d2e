//! The real kube-apiserver calls the quota webhooks of the whole install: admission, Queue mode,
//! required owner labels, temporary raises, and the controller's writes narrowed to its own.

use super::*;

/// AdmissionReviews the controller answered on `/validate` and `/mutate` so far
/// (`gpuplane_webhook_decision_seconds_count`, one per request whatever the answer).
fn webhook_calls(lab: &ClusterLab) -> (u64, u64) {
    let text = controller_metrics(lab);
    let count = |webhook: &str| {
        let series = format!("gpuplane_webhook_decision_seconds_count{{webhook=\"{webhook}\"}}");
        text.lines()
            .filter_map(|l| l.strip_prefix(series.as_str()))
            .filter_map(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
            .sum()
    };
    (count("validate"), count("mutate"))
}

/// The namespace's `quota.gpuplane.dev/queue` label, if any.
fn queue_label(lab: &ClusterLab, ns: &str) -> Option<String> {
    lab.get_json(&["get", "namespace", ns])?["metadata"]["labels"]["quota.gpuplane.dev/queue"]
        .as_str()
        .map(String::from)
}

/// Applies `yaml` as the admin, which the API server must refuse with every one of `want` in
/// its words ([`ClusterLab::apply`] is the one that must succeed).
fn apply_refused(lab: &ClusterLab, yaml: &str, want: &[&str]) {
    let out = lab.kubectl_as(&lab.admin_kubeconfig(), &["apply", "-f", "-"], Some(yaml));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && want.iter().all(|w| err.contains(w)),
        "{want:?}: {err}"
    );
}

/// `requireLabels` on the real API server: a key that is no label key (by the pattern, or by
/// the CEL rule on its prefix's length) is refused by the CRD, naming the field; then a GPU pod
/// lacking the required labels, or carrying one empty, is refused by the webhook with our
/// message, and one carrying them is admitted (a server-side dry run: nothing is left). `ns`'s
/// quota is `default`, 2 devices all used, and is left as it was.
fn owner_labels_are_required_where_the_quota_says(lab: &ClusterLab, ns: &str) {
    let base = quota(ns, "devices", 2, "Reject");
    // Room for one more, so that past the labels the pod is admitted.
    let with = |keys: &str| {
        format!(
            "{}  requireLabels: {keys}\n",
            quota(ns, "devices", 3, "Reject")
        )
    };
    apply_refused(
        lab,
        &with(r#"["team name"]"#),
        &["spec.requireLabels[0]", "should match"],
    );
    apply_refused(
        lab,
        &with(&format!("[team, {}.io/team]", "a".repeat(251))),
        &[
            "spec.requireLabels[1]",
            "a label key's prefix (before the `/`) is at most 253 characters",
        ],
    );
    lab.apply(&with("[team, cost-center]"));
    let unowned = pod(ns, "unowned", 1);
    let labelled = |name: &str, labels: &str| {
        unowned.replace(
            "metadata: {name: unowned,",
            &format!("metadata: {{labels: {labels}, name: {name},"),
        )
    };
    let err = eventually("the webhook to require the labels", || {
        lab.create(&unowned, &["--dry-run=server"])
            .err()
            .filter(|e| e.contains("lacks the label(s)"))
    });
    assert!(
        err.contains(r#"admission webhook "quota.gpuplane.dev" denied the request"#)
            && err.contains(&format!(
                "pod {ns}/unowned is refused by GpuQuota {ns}/default: it lacks the label(s) \
                 team, cost-center that this quota requires on every GPU pod; add them to the \
                 pod (or its template)"
            )),
        "{err}"
    );
    let blank = labelled("blank", r#"{team: "", cost-center: "42"}"#);
    let err = lab.create(&blank, &["--dry-run=server"]).unwrap_err();
    assert!(
        err.contains("it lacks the label(s) team (empty) that this quota requires"),
        "{err}"
    );
    let owned = labelled("owned", r#"{team: vision, cost-center: "42"}"#);
    let admitted = lab.create(&owned, &["--dry-run=server"]);
    assert!(admitted.is_ok(), "a pod with its owners: {admitted:?}");
    lab.apply(&base);
    eventually("the webhook to drop the label requirement", || {
        lab.create(&unowned, &["--dry-run=server"])
            .err()
            .filter(|e| e.contains("requested 1, used 2 of 2"))
    });
}

/// `spec.temporary` on the real API server: the CRD refuses an expiry that is no time and a
/// raise of a dimension `hard` does not limit, naming the field; a raise admits a second pod
/// while it lasts; when it expires (on the clock, nobody editing anything) both pods keep
/// running, the next pod is refused against the base, and the quota says so in a condition
/// and one Event. Leaves no pod behind.
fn temporary_raises_hold_until_they_expire(lab: &ClusterLab, ns: &str) {
    let base = quota(ns, "devices", 1, "Reject");
    let raised = |expires: &str, hard: &str| {
        format!(
            "{base}  temporary:\n  - {{hard: {hard}, expires: \"{expires}\", reason: launch week}}\n"
        )
    };
    lab.kubectl_ok(&["create", "namespace", ns]);
    let gpu = "{devices: {nvidia.com/gpu: 1}}";
    apply_refused(
        lab,
        &raised("next friday", gpu),
        &["spec.temporary[0].expires", "date-time"],
    );
    apply_refused(
        lab,
        &raised("2030-01-01T00:00:00Z", "{gpuMemory: 80Gi}"),
        &["a raise may only add to a dimension spec.hard limits"],
    );
    let expires = k8s_openapi::jiff::Timestamp::now()
        .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(40))
        .unwrap();
    let expires = k8s_openapi::jiff::Timestamp::from_second(expires.as_second())
        .unwrap()
        .to_string();
    lab.apply(&raised(&expires, gpu));
    eventually("the webhook to see the raise", || {
        lab.create(&pod(ns, "r1", 2), &["--dry-run=server"]).ok()
    });
    for name in ["r1", "r2"] {
        lab.create(&pod(ns, name, 1), &[]).unwrap();
    }
    let condition = |status: &str| {
        let q = lab.get_json(&["get", "gpuquota", "default", "-n", ns])?;
        let c = q["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "TemporaryRaise" && c["status"] == status)?
            .clone();
        Some(c)
    };
    let c = eventually("the quota to show its raise in force", || condition("True"));
    assert_eq!(c["reason"], "InForce", "{c}");
    assert!(
        c["message"].as_str().is_some_and(|m| m.contains(&format!(
            "devices[nvidia.com/gpu] +1 until {expires} (launch week)"
        ))),
        "{c}"
    );
    let err = lab
        .create(&pod(ns, "r3", 1), &["--dry-run=server"])
        .unwrap_err();
    assert!(err.contains("used 2 of 2"), "within the raise, full: {err}");

    let c = eventually("the raise to expire", || condition("False"));
    assert_eq!(c["reason"], "Expired", "{c}");
    let err = lab
        .create(&pod(ns, "r3", 1), &["--dry-run=server"])
        .unwrap_err();
    assert!(
        err.contains("requested 1, used 2 of 1"),
        "the base again: {err}"
    );
    for name in ["r1", "r2"] {
        cluster::wait_running(lab, ns, name);
    }
    let events = eventually("the expiry Event on the quota", || {
        let list = lab.get_json(&[
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            "involvedObject.kind=GpuQuota,reason=TemporaryRaiseExpired",
        ])?;
        let items = list["items"].as_array()?.clone();
        (!items.is_empty()).then_some(items)
    });
    assert_eq!(events.len(), 1, "told once: {events:?}");
    assert!(
        events[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!(
                "temporary raise devices[nvidia.com/gpu] +1 (launch week) expired at {expires}"
            ))),
        "{}",
        events[0]
    );
    lab.kubectl_ok(&["delete", "pod", "--all", "-n", ns, "--wait=true"]);
}

/// A PATCH of `path` on the lab's API server as the account of `kubeconfig` (one of the
/// lab's token kubeconfigs), sent as is: kubectl would GET the object first, which the
/// controller's RBAC does not grant. Returns the HTTP status and the body.
fn patch_as(
    lab: &ClusterLab,
    kubeconfig: &Path,
    path: &str,
    kind: &str,
    body: &str,
) -> (u16, String) {
    let config = std::fs::read_to_string(kubeconfig).unwrap();
    let field = |key: &str| {
        let at = config.find(&format!("{key}: \"")).unwrap() + key.len() + 3;
        config[at..].split('"').next().unwrap().to_string()
    };
    let out = lab
        .in_netns("curl")
        .args(["-s", "-X", "PATCH", "-w", "\n%{http_code}", "--cacert"])
        .arg(field("certificate-authority"))
        .args(["-H", &format!("Authorization: Bearer {}", field("token"))])
        .args(["-H", &format!("Content-Type: application/{kind}+json")])
        .args(["--data-binary", body])
        .arg(format!("https://127.0.0.1:6443{path}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), body.to_string())
}

/// The controller's account (its token, as deployed) may write its own pod condition, and the
/// `gpuplane-controller-pods` admission policy refuses the rest RBAC's `patch pods` and
/// `patch pods/status` would allow: another condition, a label, an image.
fn controller_writes_are_narrowed_to_its_own(
    lab: &ClusterLab,
    installed: &cluster::Installed,
    ns: &str,
    pod: &str,
) {
    let condition = |ty: &str| {
        format!(
            r#"{{"status":{{"conditions":[{{"type":"{ty}","status":"False","reason":"Test","message":"written as the controller"}}]}}}}"#
        )
    };
    let at = format!("/api/v1/namespaces/{ns}/pods/{pod}");
    let status = format!("{at}/status");
    let patch =
        |path: &str, kind: &str, body: &str| patch_as(lab, &installed.controller, path, kind, body);
    let own = patch(
        &status,
        "strategic-merge-patch",
        &condition("gpuplane.dev/GPUsAvailable"),
    );
    assert_eq!(own.0, 200, "the controller's own condition: {}", own.1);
    let refused = [
        (
            patch(&status, "strategic-merge-patch", &condition("Ready")),
            "may change only its own conditions",
        ),
        (
            patch(
                &at,
                "merge-patch",
                r#"{"metadata":{"labels":{"stolen":"yes"}}}"#,
            ),
            "may not change a pod's labels",
        ),
        (
            patch(
                &at,
                "json-patch",
                r#"[{"op":"replace","path":"/spec/containers/0/image","value":"evil:latest"}]"#,
            ),
            "only by removing its",
        ),
    ];
    for ((code, body), why) in refused {
        assert!(
            code == 422
                && body.contains("ValidatingAdmissionPolicy 'gpuplane-controller-pods'")
                && body.contains(why),
            "expected a refusal saying {why:?}: {code} {body}"
        );
    }
    let now = pod_json(lab, ns, pod).unwrap();
    let conditions = now["status"]["conditions"].as_array().unwrap();
    let ready = conditions.iter().find(|c| c["type"] == "Ready").unwrap();
    assert_eq!(
        ready["status"], "True",
        "the kubelet's condition stands: {now}"
    );
    assert!(now["metadata"]["labels"].get("stolen").is_none());
}

#[test]
fn the_real_api_server_calls_the_quota_webhook_of_the_whole_install() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    // The whole kustomization is accepted (apply -k succeeded, the CRD is Established) and
    // the ValidatingAdmissionPolicy type-checks against the real schema.
    let installed = lab.install(true);
    the_install_is_accepted(&lab);

    let agent = LabAgent::start(&lab, &installed.agent, "1");
    let controller = start_controller(&lab, &installed, "1");
    cluster::wait_controller_ready(&lab);
    eventually("node lab-node to report nvidia.com/gpu: 8", || {
        let node = lab.get_json(&["get", "node", NODE])?;
        (node["status"]["allocatable"]["nvidia.com/gpu"] == "8").then_some(())
    });

    reject_mode_refuses_over_quota(&lab);
    controller_writes_are_narrowed_to_its_own(&lab, &installed, "team-a", "two");
    owner_labels_are_required_where_the_quota_says(&lab, "team-a");
    temporary_raises_hold_until_they_expire(&lab, "team-raise");

    queue_mode_gates_and_releases(&lab);
    let agent = a_dra_only_node_charges_no_claim_twice(&lab, &installed, agent);
    let controller_log = a_controller_outage_blocks_gpu_pods_only(&lab, controller);
    the_controller_is_refused_what_it_was_not_granted(&lab, &installed);
    assert!(
        refusals(&controller_log).is_empty(),
        "the controller was refused a call:\n{controller_log}"
    );
    let agent_log = agent.log_text();
    assert!(
        refusals(&agent_log).is_empty(),
        "the agent was refused a call:\n{agent_log}"
    );
    drop::<LabProcess>(agent);
}

/// The whole kustomization is accepted (apply -k succeeded, the CRD is Established), the
/// ValidatingAdmissionPolicies type-check against the real schema, and the webhooks are called
/// by URL on the lab's loopback.
fn the_install_is_accepted(lab: &ClusterLab) {
    for policy in [
        "gpuplane-node-resourceslices",
        "gpuplane-node-labels",
        "gpuplane-controller-namespaces",
        "gpuplane-controller-pods",
    ] {
        let vap = eventually(
            &format!("admission policy {policy} to be type-checked"),
            || {
                let vap = lab.get_json(&["get", "validatingadmissionpolicy", policy])?;
                vap["status"]["observedGeneration"].as_i64().map(|_| vap)
            },
        );
        assert!(
            vap["status"]["typeChecking"]["expressionWarnings"]
                .as_array()
                .is_none_or(|w| w.is_empty()),
            "{policy} has type warnings: {}",
            vap["status"]
        );
    }
    for kind in [
        "validatingwebhookconfiguration",
        "mutatingwebhookconfiguration",
    ] {
        let config = lab.get_json(&["get", kind, "gpuplane-quota"]).unwrap();
        for hook in config["webhooks"].as_array().unwrap() {
            let url = hook["clientConfig"]["url"].as_str().unwrap_or_default();
            assert!(url.starts_with("https://127.0.0.1:"), "{kind}: {hook}");
        }
    }
}

/// Reject mode: within quota is created and runs; over quota is refused by the real API
/// server with our reason, as kubectl prints it.
fn reject_mode_refuses_over_quota(lab: &ClusterLab) {
    // Reject mode: within quota is created and runs; over quota is refused by the real API
    // server with our reason, as kubectl prints it.
    namespace_with_quota(lab, "team-a", "devices", 2, "Reject");
    // Outside Queue mode the API server does not call the mutating gate webhook at all: the
    // namespace has no queue label, and the pod costs one validating call only.
    assert_eq!(queue_label(lab, "team-a"), None);
    let before = webhook_calls(lab);
    lab.create(&pod("team-a", "two", 2), &[]).unwrap();
    let after = webhook_calls(lab);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, 0),
        "(validating, mutating) calls for a GPU pod of a Reject-mode namespace"
    );
    let err = lab.create(&pod("team-a", "one-more", 1), &[]).unwrap_err();
    assert!(
        err.contains(r#"admission webhook "quota.gpuplane.dev" denied the request"#)
            && err.contains("requested 1, used 2 of 2 in GpuQuota team-a/default"),
        "kubectl's error: {err}"
    );
    cluster::wait_running(lab, "team-a", "two");
    assert!(pod_json(lab, "team-a", "one-more").is_none());
}

/// Queue mode: a GPU pod is created gated and released by the controller when it fits; the
/// next waits gated until the first is deleted.
fn queue_mode_gates_and_releases(lab: &ClusterLab) {
    // Queue mode: a GPU pod is created gated and released by the controller when it fits;
    // the next waits gated until the first is deleted.
    // The gate is called there because the controller labelled the namespace (the dry run
    // above already came back gated).
    namespace_with_quota(lab, "team-q", "devices", 1, "Queue");
    assert_eq!(queue_label(lab, "team-q").as_deref(), Some("true"));
    let before = webhook_calls(lab);
    let first = lab.create(&pod("team-q", "first", 1), &[]).unwrap();
    assert_eq!(gates(&first), [SCHEDULING_GATE], "created gated: {first}");
    let after = webhook_calls(lab);
    assert!(
        after.1 > before.1 && after.0 > before.0,
        "both webhooks called: {before:?} -> {after:?}"
    );
    cluster::wait_running(lab, "team-q", "first");
    let second = lab.create(&pod("team-q", "second", 1), &[]).unwrap();
    assert_eq!(gates(&second), [SCHEDULING_GATE]);
    eventually("the second pod to be queued in the GpuQuota status", || {
        let q = lab.get_json(&["get", "gpuquota", "default", "-n", "team-q"])?;
        let n = &q["status"]["queued"]["devices"]["nvidia.com/gpu"];
        (n == 1 || n == "1").then_some(())
    });
    let waiting = pod_json(lab, "team-q", "second").unwrap();
    assert_eq!(gates(&waiting), [SCHEDULING_GATE], "released over quota");
    assert_eq!(
        scheduled_reason(&waiting).as_deref(),
        Some("SchedulingGated")
    );
    // Only the controller may lift the gate: the admin's attempt is refused by the guard.
    let lift = lab.kubectl(&[
        "patch",
        "pod",
        "second",
        "-n",
        "team-q",
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/spec/schedulingGates"}]"#,
    ]);
    let err = String::from_utf8_lossy(&lift.stderr);
    assert!(
        !lift.status.success() && err.contains("gate-guard.quota.gpuplane.dev"),
        "{err}"
    );
    lab.kubectl_ok(&[
        "delete",
        "pod",
        "first",
        "-n",
        "team-q",
        "--wait=true",
        "--timeout=120s",
    ]);
    cluster::wait_running(lab, "team-q", "second");
    // The label removed by hand comes back.
    lab.kubectl_ok(&["label", "namespace", "team-q", "quota.gpuplane.dev/queue-"]);
    eventually("the queue label back on team-q", || {
        (queue_label(lab, "team-q")? == "true").then_some(())
    });
}

/// On a DRA-only node the scheduler serves nvidia.com/gpu through a claim it creates for the
/// pod, which is not charged again. `agent` stops for the label change; the agent started
/// again with the DRA API only.
fn a_dra_only_node_charges_no_claim_twice(
    lab: &ClusterLab,
    installed: &cluster::Installed,
    agent: LabProcess,
) -> LabProcess {
    // On a DRA-only node the scheduler serves nvidia.com/gpu through a claim it creates for
    // the pod; the pod was charged its GPU, so that claim is not charged again: a quota of
    // exactly one whole GPU (`gpus`, which both would count in) still runs a one-GPU pod.
    lab.kubectl_ok(&["delete", "pod", "--all", "-n", "team-a", "--wait=true"]);
    lab.kubectl_ok(&["delete", "pod", "--all", "-n", "team-q", "--wait=true"]);
    lab.kubectl_ok(&["label", "node", NODE, "gpuplane.dev/apis=dra"]);
    eventually("the agent to stop for the label change", || {
        agent.log_text().contains("changed; stopping").then_some(())
    });
    drop(agent);
    let agent = LabAgent::start(lab, &installed.agent, "dra");
    eventually(
        "the device plugin's nvidia.com/gpu to leave allocatable",
        || {
            let node = lab.get_json(&["get", "node", NODE])?;
            let n = &node["status"]["allocatable"]["nvidia.com/gpu"];
            (n.is_null() || n == "0").then_some(())
        },
    );
    namespace_with_quota(lab, "team-d", "gpus", 1, "Reject");
    lab.create(&pod("team-d", "via-dra", 1), &[]).unwrap();
    cluster::wait_running(lab, "team-d", "via-dra");
    let p = pod_json(lab, "team-d", "via-dra").unwrap();
    assert!(
        p["status"]["extendedResourceClaimStatus"]["resourceClaimName"].is_string(),
        "served through DRA: {}",
        p["status"]
    );
    agent
}

/// A controller outage blocks GPU pods only: pods without GPUs are never sent. The stopped
/// controller's log.
fn a_controller_outage_blocks_gpu_pods_only(lab: &ClusterLab, controller: LabProcess) -> String {
    // A controller outage blocks GPU pods only: pods without GPUs are never sent.
    let controller_log = controller.log_text();
    controller.stop();
    lab.create(&pod("team-a", "no-gpus", 0), &[]).unwrap();
    cluster::wait_running(lab, "team-a", "no-gpus");
    let err = lab
        .create(&pod("team-a", "gpu-while-down", 1), &[])
        .unwrap_err();
    assert!(
        err.contains(r#"failed calling webhook "quota.gpuplane.dev""#),
        "{err}"
    );
    controller_log
}

/// RBAC is exactly enough: the controller is refused what it was not granted, and its `patch
/// namespaces` covers one label only.
fn the_controller_is_refused_what_it_was_not_granted(
    lab: &ClusterLab,
    installed: &cluster::Installed,
) {
    // RBAC is exactly enough: the controller is refused what it was not granted, and neither
    // it nor the agent was refused anything over the run.
    let out = lab.kubectl_as(&installed.controller, &["get", "secrets", "-A"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("Forbidden"), "{err}");
    // Its `patch namespaces` covers one label only (the admission policy): another label, or
    // taking a namespace out of the webhooks' scope, is refused.
    // (A merge patch as the controller sends it, with its token: `kubectl label` and `kubectl
    // patch` GET first, which RBAC does not grant.)
    let kubeconfig = std::fs::read_to_string(&installed.controller).unwrap();
    let token = kubeconfig
        .split("token: \"")
        .nth(1)
        .and_then(|t| t.split('"').next())
        .unwrap();
    for label in ["team", "quota.gpuplane.dev/exempt"] {
        let patch = format!(r#"{{"metadata":{{"labels":{{"{label}":"true"}}}}}}"#);
        let out = lab
            .in_netns("curl")
            .args(["-sk", "-X", "PATCH", "-d", &patch])
            .args(["-H", "Content-Type: application/merge-patch+json"])
            .args(["-H", &format!("Authorization: Bearer {token}")])
            .arg("https://127.0.0.1:6443/api/v1/namespaces/team-a")
            .output()
            .unwrap();
        let answer: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        assert!(
            answer["code"] == 422
                && answer["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("gpuplane-controller-namespaces")
                        && m.contains("may change only the quota.gpuplane.dev/queue label")),
            "{label}: {answer}"
        );
    }
    let ns = lab.get_json(&["get", "namespace", "team-a"]).unwrap();
    assert!(ns["metadata"]["labels"]["team"].is_null(), "{ns}");
}
