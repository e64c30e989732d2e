//! Admission on one replica: quota limits, required labels, Queue mode's gating, temporary
//! raises and how claims are charged.

use super::*;

/// A replica over `api` once it holds GpuQuota `name` of `spec`, with the PKI it serves from.
async fn replica_with_quota(
    api: &ApiServerDouble,
    name: &str,
    spec: Value,
) -> (RunningWebhook, Pki) {
    quota(api, name, spec).await;
    let pki = Pki::new();
    (replica(api, &pki).await, pki)
}

/// The validating webhook's answer to the creation of `pod`.
async fn validate_create(wh: &RunningWebhook, pki: &Pki, uid: &str, pod: Value) -> Value {
    let body = pod_review(uid, pod);
    response(&post(&pki.client_config(), wh.addr(), "/validate", &body).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_scenario_admits_15gi_and_denies_10gi_more_with_the_reason() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(
        &api,
        "default",
        json!({"hard": {"gpuMemory": "20Gi"}, "mode": "Reject"}),
    )
    .await;
    // Pod A gets its GPU through a claim template: class gpu.gpuplane.dev, whose only
    // published device has 15Gi.
    api.put_json(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}))
        .unwrap();
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();

    let a = pod(
        "pod-a",
        json!({"containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}),
    );
    let r = response(&post(&tls, wh.addr(), "/validate", &pod_review("uid-1", a)).await);
    assert_eq!(r["uid"], "uid-1");
    assert_eq!(r["allowed"], true, "{r}");

    // Pod B asks for a 1g.10gb MIG device through the device plugin: priced at 10Gi from
    // the slices.
    let b = gpu_pod("pod-b", "nvidia.com/mig-1g.10gb", 1);
    let r = response(&post(&tls, wh.addr(), "/validate", &pod_review("uid-2", b)).await);
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(r["status"]["code"], 403);
    assert_eq!(
        r["status"]["message"],
        "gpuMemory: requested 10Gi, used 15Gi of 20Gi in GpuQuota team-a/default"
    );

    // A CPU-only pod is not affected by a full quota.
    let cpu = pod(
        "cpu",
        json!({"containers": [{"name": "main", "image": "x", "resources": {"limits": {"cpu": "1"}}}]}),
    );
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("uid-3", cpu)).await)["allowed"],
        true
    );

    let q = stored_quota(&api, "default");
    let status = q.status.unwrap();
    assert_eq!(status.reservations.len(), 1);
    let r = &status.reservations[0];
    assert_eq!(
        (r.name.as_str(), r.uid.as_deref(), r.state),
        ("pod-a", Some("uid-pod-a"), ReservationState::Reserved)
    );
    assert_eq!(status.reserved.gpu_memory.to_string(), "15Gi");
    assert_eq!(status.reserved.gpus.to_string(), "1");

    // Metrics count what happened.
    let m = wh.metrics.render();
    assert!(
        m.contains("gpuplane_webhook_admissions_total{webhook=\"validate\",result=\"denied\"} 1"),
        "{m}"
    );
    wh.stop().await;
}

/// `spec.requireLabels`: a GPU pod lacking a required label, or carrying it empty, is refused
/// before anything is charged, naming the pod, the quota and each label; with them it is
/// admitted; a pod asking for no GPU is not the quota's business.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_pod_without_a_required_label_is_refused_naming_it() {
    let api = ApiServerDouble::start().await.unwrap();
    let (wh, pki) = replica_with_quota(
        &api,
        "default",
        json!({"hard": {"devices": {"nvidia.com/gpu": 2}}, "requireLabels": ["team", "example.com/cost-center"]}),
    )
    .await;
    let validate = |uid: &'static str, p: Value| validate_create(&wh, &pki, uid, p);
    let labelled = |name: &str, labels: Value| {
        let mut p = gpu_pod(name, "nvidia.com/gpu", 1);
        p["metadata"]["labels"] = labels;
        p
    };
    let r = validate("u1", gpu_pod("anonymous", "nvidia.com/gpu", 1)).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(r["status"]["code"], 403);
    assert_eq!(
        r["status"]["message"],
        format!(
            "pod {NS}/anonymous is refused by GpuQuota {NS}/default: it lacks the label(s) team, \
             example.com/cost-center that this quota requires on every GPU pod; add them to the \
             pod (or its template)"
        )
    );
    let r = validate(
        "u2",
        labelled(
            "blank",
            json!({"team": "", "example.com/cost-center": "42"}),
        ),
    )
    .await;
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(
        r["status"]["message"],
        format!(
            "pod {NS}/blank is refused by GpuQuota {NS}/default: it lacks the label(s) team \
             (empty) that this quota requires on every GPU pod (an empty value names no owner); \
             add them with a value to the pod (or its template)"
        )
    );
    // Refused before any reservation: nothing charged.
    assert!(stored_quota(&api, "default")
        .status
        .is_none_or(|s| s.reservations.is_empty()));
    let owned = labelled(
        "owned",
        json!({"team": "vision", "example.com/cost-center": "42"}),
    );
    let r = validate("u3", owned).await;
    assert_eq!(r["allowed"], true, "{r}");
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    let r = validate("u4", cpu).await;
    assert_eq!(r["allowed"], true, "{r}");
    wh.stop().await;
}

/// In Queue mode a GPU pod lacking an owner label is refused at admission, gate or no gate,
/// never queued; a key no pod can carry (an older CRD let it in) refuses every GPU pod naming
/// the key, and the webhook goes on answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_mode_refuses_an_unowned_pod_instead_of_queueing_it_and_names_a_bad_key() {
    let api = ApiServerDouble::start().await.unwrap();
    let spec = |keys: Value| json!({"hard": {"devices": {"nvidia.com/gpu": 1}}, "mode": "Queue", "requireLabels": keys});
    let (wh, pki) = replica_with_quota(&api, "q", spec(json!(["team"]))).await;
    let validate = |uid: &'static str, p: Value| validate_create(&wh, &pki, uid, p);
    // As the mutating webhook leaves it: gated.
    let gated = |name: &str, team: Option<&str>| {
        let mut p = gpu_pod(name, "nvidia.com/gpu", 4);
        p["spec"]["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
        if let Some(t) = team {
            p["metadata"]["labels"] = json!({"team": t});
        }
        p
    };
    let r = validate("u1", gated("unowned", None)).await;
    assert_eq!(r["allowed"], false, "{r}");
    assert_eq!(
        r["status"]["message"],
        format!(
            "pod {NS}/unowned is refused by GpuQuota {NS}/q: it lacks the label(s) team that \
             this quota requires on every GPU pod; add them to the pod (or its template)"
        )
    );
    assert!(stored_quota(&api, "q")
        .status
        .is_none_or(|s| s.reservations.is_empty()));
    let r = validate("u2", gated("owned", Some("vision"))).await;
    assert_eq!(r["allowed"], true, "{r}");
    let status = stored_quota(&api, "q").status.unwrap();
    assert_eq!(status.reservations.len(), 1);
    assert_eq!(status.reservations[0].name, "owned");
    assert_eq!(status.reservations[0].state, ReservationState::Queued);

    let mut q = serde_json::to_value(stored_quota(&api, "q")).unwrap();
    q["spec"] = spec(json!(["team", "team name"]));
    api.put_json(q).unwrap();
    let mut answer = Value::Null;
    for i in 0..100 {
        answer = validate("u3", gated("owned-too", Some("vision"))).await;
        let m = answer["status"]["message"].as_str().unwrap_or_default();
        if m.contains("team name") || i == 99 {
            break;
        }
        // The webhook's watch of the quota has not seen the edit yet.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(answer["allowed"], false, "{answer}");
    assert_eq!(
        answer["status"]["message"],
        format!(
            "pod {NS}/owned-too is refused by GpuQuota {NS}/q: its spec.requireLabels names \
             `team name`, which no pod can carry (a label key is an optional DNS-subdomain \
             prefix and `/`, then at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends); fix \
             the GpuQuota's requireLabels"
        )
    );
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    let r = validate("u4", cpu).await;
    assert_eq!(r["allowed"], true, "{r}");
    wh.stop().await;
}

/// A temporary raise is `hard` while it lasts and nothing once it expired; a quota with raises
/// decides every admission on its latest state (no escrow that could outlive a raise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_raise_admits_until_it_expires_and_never_after() {
    let api = ApiServerDouble::start().await.unwrap();
    let raises = |launch_expires: &str| {
        json!({"hard": {"devices": {"nvidia.com/gpu": 1}}, "temporary": [
            {"hard": {"devices": {"nvidia.com/gpu": 5}}, "expires": "2020-01-01T00:00:00Z", "reason": "old"},
            {"hard": {"devices": {"nvidia.com/gpu": 1}}, "expires": launch_expires, "reason": "launch"}]})
    };
    quota(&api, "default", raises("2999-01-01T00:00:00Z")).await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let validate = |uid: &'static str, name: &'static str| {
        let body = pod_review(uid, gpu_pod(name, "nvidia.com/gpu", 1));
        let tls = tls.clone();
        let addr = wh.addr();
        async move { response(&post(&tls, addr, "/validate", &body).await) }
    };
    for (uid, name) in [("u1", "a"), ("u2", "b")] {
        let r = validate(uid, name).await;
        assert_eq!(r["allowed"], true, "{name}: {r}");
    }
    let r = validate("u3", "c").await;
    assert_eq!(r["allowed"], false, "{r}");
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("devices[nvidia.com/gpu]: requested 1, used 2 of 2 in GpuQuota"),
        "the expired raise adds nothing, the live one adds 1: {r}"
    );
    let s = stored_quota(&api, "default").status.unwrap();
    assert!(
        s.escrows.is_empty(),
        "no escrow under a raise: {:?}",
        s.escrows
    );
    assert_eq!(s.reservations.len(), 2);

    // The launch raise runs out: the next admission sees the base of 1, with 2 held.
    let mut q = serde_json::to_value(stored_quota(&api, "default")).unwrap();
    q["spec"] = raises("2020-06-01T00:00:00Z");
    api.put_json(q).unwrap();
    let mut answer = Value::Null;
    for i in 0..100 {
        answer = validate("u4", "d").await;
        let m = answer["status"]["message"].as_str().unwrap_or_default();
        if m.contains("used 2 of 1 in GpuQuota") || i == 99 {
            break;
        }
        // The webhook's watch of the quota has not seen the edit yet.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(answer["allowed"], false, "{answer}");
    assert!(
        answer["status"]["message"]
            .as_str()
            .unwrap()
            .contains("devices[nvidia.com/gpu]: requested 1, used 2 of 1 in GpuQuota"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_mode_gates_gpu_pods_and_records_them_as_queued() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 1}}, "mode": "Queue"}),
    )
    .await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    // The mutating webhook adds the gate (a JSON patch), only to GPU pods.
    let p = gpu_pod("big", "nvidia.com/gpu", 4);
    let r = response(&post(&tls, wh.addr(), "/mutate", &pod_review("u1", p.clone())).await);
    assert_eq!(
        (r["allowed"].as_bool(), r["patchType"].as_str()),
        (Some(true), Some("JSONPatch"))
    );
    let patch = gpuplane_cluster::webhook::review::base64(
        serde_json::to_string(&json!([{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": SCHEDULING_GATE}]}])).unwrap().as_bytes(),
    );
    assert_eq!(r["patch"], patch);
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    let r = response(&post(&tls, wh.addr(), "/mutate", &pod_review("u2", cpu)).await);
    assert!(r.get("patch").is_none(), "{r}");
    // The gated pod (over the quota) is admitted and recorded as queued, not reserved.
    let mut gated = p;
    gated["spec"]["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &pod_review("u3", gated.clone()),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    let status = stored_quota(&api, "q").status.unwrap();
    assert_eq!(status.reservations[0].state, ReservationState::Queued);
    assert_eq!(status.queued.devices["nvidia.com/gpu"], 4);
    assert!(status.reserved.is_zero());
    // Only the controller removes the gate.
    let mut ungated = gated.clone();
    ungated["spec"]["schedulingGates"] = json!([]);
    let upd = |user: &str| {
        serde_json::to_vec(&review(
            "u4",
            ("", "v1", "Pod"),
            "UPDATE",
            ungated.clone(),
            Some(gated.clone()),
            user,
        ))
        .unwrap()
    };
    let r = response(&post(&tls, wh.addr(), "/validate", &upd("alice")).await);
    assert_eq!(r["allowed"], false);
    assert!(r["status"]["message"]
        .as_str()
        .unwrap()
        .contains("removed by the gpuplane controller"));
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &upd("system:serviceaccount:gpuplane-system:gpuplane-controller"),
        )
        .await,
    );
    assert_eq!(r["allowed"], true);
    wh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_claims_are_charged_and_template_claims_are_not_charged_twice() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(
        &api,
        "q",
        json!({"hard": {"gpus": "1/7", "devices": {"mig.gpuplane.dev": 1}}}),
    )
    .await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let claim = |name: &str, owned: bool| {
        let mut c = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "m", "exactly": {"deviceClassName": "mig.gpuplane.dev"}}]}}});
        if owned {
            c["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": "gpu"});
            c["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "x", "controller": true}]);
        }
        c
    };
    let send = |c: Value, user: &str| {
        serde_json::to_vec(&review(
            "u",
            ("resource.k8s.io", "v1", "ResourceClaim"),
            "CREATE",
            c,
            None,
            user,
        ))
        .unwrap()
    };
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(claim("c1", false), "alice"),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(claim("c2", false), "alice"),
        )
        .await,
    );
    assert_eq!(r["allowed"], false);
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("gpus: requested 1/7, used 1/7 of 1/7 in GpuQuota team-a/q"),
        "{msg}"
    );
    assert!(
        msg.contains("devices[mig.gpuplane.dev]: requested 1, used 1 of 1"),
        "{msg}"
    );
    // A claim made from a pod's template by the resourceclaim controller: charged via the pod.
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(
                claim("p-gpu-x", true),
                "system:serviceaccount:kube-system:resource-claim-controller",
            ),
        )
        .await,
    );
    assert_eq!(r["allowed"], true);
    // The same metadata from anyone else is charged like any claim.
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(claim("sneaky", true), "alice"),
        )
        .await,
    );
    assert_eq!(r["allowed"], false);
    // The claim the scheduler makes for a pod's nvidia.com/gpu served through DRA: the pod
    // was charged its nvidia.com/gpu, so the claim is not charged again; from anyone else, or
    // by the scheduler without the annotation, it is.
    let extended = |name: &str| {
        let mut c = claim(name, true);
        c["metadata"]["annotations"] =
            json!({"resource.kubernetes.io/extended-resource-claim": "true"});
        c
    };
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &send(extended("p-extended-resources-x"), "system:kube-scheduler"),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    for (c, user) in [
        (extended("sneaky-2"), "alice"),
        (claim("sneaky-3", true), "system:kube-scheduler"),
    ] {
        let r = response(&post(&tls, wh.addr(), "/validate", &send(c, user)).await);
        assert_eq!(r["allowed"], false, "{user}: {r}");
    }
    wh.stop().await;
}
