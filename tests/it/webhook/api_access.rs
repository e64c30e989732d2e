//! The webhook's access to the API server: answering through an outage, failing to start
//! without access, the RBAC it needs and the webhook configurations it ships.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_api_server_away_it_answers_from_its_last_state_and_fails_closed() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(&api, "q", json!({"hard": {"gpus": 8}})).await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    api.inject(Fault::status("*", "/", 500));
    api.drop_watches();
    // No quota in that namespace (known from the cache): admitted.
    let mut other = gpu_pod("x", "nvidia.com/gpu", 1);
    other["metadata"]["namespace"] = json!("elsewhere");
    let r = response(&post(&tls, wh.addr(), "/validate", &pod_review("u1", other)).await);
    assert_eq!(r["allowed"], true, "{r}");
    // A pod that needs no GPU: admitted.
    let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("u2", cpu)).await)["allowed"],
        true
    );
    // A GPU pod under a quota: the reservation cannot be written, so it is denied.
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &pod_review("u3", gpu_pod("g", "nvidia.com/gpu", 1)),
        )
        .await,
    );
    assert_eq!(r["allowed"], false);
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .starts_with("cannot reserve GPU quota"),
        "{r}"
    );
    // Back again: admitted.
    api.clear_faults();
    let r = response(
        &post(
            &tls,
            wh.addr(),
            "/validate",
            &pod_review("u4", gpu_pod("g", "nvidia.com/gpu", 1)),
        )
        .await,
    );
    assert_eq!(r["allowed"], true, "{r}");
    wh.stop().await;
}

#[tokio::test]
async fn without_api_access_start_fails_with_a_clear_message() {
    let pki = Pki::new();
    let mut opts = WebhookOptions::new(pki.cert_path(), pki.key_path(), "gpuplane-system");
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(5);
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
    let err = webhook::start(client, opts.clone())
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("cannot list GpuQuotas"), "{err}");
    // And a missing certificate is named.
    opts.tls_cert_file = Path::new("/nonexistent/tls.crt").to_path_buf();
    let api = ApiServerDouble::start().await.unwrap();
    let err = webhook::start(api.client().unwrap(), opts)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("/nonexistent/tls.crt"), "{err}");
}

fn manifests(file: &str) -> Vec<Value> {
    let path = format!("{}/daemonset/controller/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// (verb, group, resource with subresource) of one logged request.
fn rbac_verb(method: &str, path_and_query: &str) -> (String, String, String) {
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts[0] {
        "api" => ("", &parts[2..]),
        _ => (parts[1], &parts[3..]),
    };
    let rest = if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
        &rest[2..]
    } else {
        rest
    };
    let resource = match rest {
        [r, _, sub] => format!("{r}/{sub}"),
        [r, ..] => r.to_string(),
        [] => String::new(),
    };
    let named = rest.len() >= 2;
    let verb = match method {
        "GET"
            if query
                .split('&')
                .any(|q| q == "watch=true" || q == "watch=1") =>
        {
            "watch"
        }
        "GET" if named => "get",
        "GET" => "list",
        "PUT" => "update",
        "POST" => "create",
        "PATCH" => "patch",
        "DELETE" if named => "delete",
        _ => "deletecollection",
    };
    (verb.to_string(), group.to_string(), resource)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_every_call_the_webhook_makes() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(&api, "default", json!({"hard": {"gpuMemory": "20Gi"}})).await;
    api.put_json(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}))
        .unwrap();
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let a = pod(
        "a",
        json!({"containers": [{"name": "c", "image": "x"}], "resourceClaims": [{"name": "g", "resourceClaimTemplateName": "one-gpu"}]}),
    );
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("u1", a)).await)["allowed"],
        true
    );
    let b = gpu_pod("b", "nvidia.com/mig-1g.10gb", 1);
    assert_eq!(
        response(&post(&tls, wh.addr(), "/validate", &pod_review("u2", b)).await)["allowed"],
        false
    );
    wh.stop().await;

    let rbac = manifests("rbac.yaml");
    let role = rbac.iter().find(|m| m["kind"] == "ClusterRole").unwrap();
    let allows = |verb: &str, group: &str, resource: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            let has = |k: &str, v: &str| r[k].as_array().unwrap().iter().any(|x| x == v);
            has("verbs", verb) && has("apiGroups", group) && has("resources", resource)
        })
    };
    let calls: std::collections::BTreeSet<_> = api
        .requests()
        .iter()
        .map(|(m, p)| rbac_verb(m, p))
        .collect();
    for (verb, group, resource) in &calls {
        assert!(
            allows(verb, group, resource),
            "rbac.yaml does not allow {verb} {group}/{resource}; calls: {calls:?}"
        );
    }
    // What the scenario must have exercised.
    for c in [
        ("update", "quota.gpuplane.dev", "gpuquotas/status"),
        ("get", "resource.k8s.io", "resourceclaimtemplates"),
        ("watch", "resource.k8s.io", "resourceslices"),
    ] {
        assert!(
            calls.contains(&(c.0.to_string(), c.1.to_string(), c.2.to_string())),
            "{c:?} not called: {calls:?}"
        );
    }
}

#[test]
fn webhook_configurations_fail_closed_and_spare_system_namespaces() {
    let hooks = manifests("webhooks.yaml");
    let service = &manifests("service.yaml")[0];
    let deployment = manifests("deployment.yaml")
        .into_iter()
        .find(|m| m["kind"] == "Deployment")
        .unwrap();
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "gpuplane-controller");
    let args: Vec<&str> = pod["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--webhook-addr=0.0.0.0:9443"));
    let mut kinds = Vec::new();
    for cfg in &hooks {
        kinds.push(cfg["kind"].as_str().unwrap().to_string());
        for w in cfg["webhooks"].as_array().unwrap() {
            let name = w["name"].as_str().unwrap();
            let excluded = &w["namespaceSelector"]["matchExpressions"][0];
            assert_eq!(
                (excluded["key"].as_str(), excluded["operator"].as_str()),
                (Some("kubernetes.io/metadata.name"), Some("NotIn")),
                "{name}"
            );
            let values = excluded["values"].as_array().unwrap();
            assert!(
                values.contains(&json!("kube-system"))
                    && values.contains(&json!("gpuplane-system")),
                "{name}"
            );
            assert_eq!(w["admissionReviewVersions"], json!(["v1"]));
            let svc = &w["clientConfig"]["service"];
            assert_eq!(
                (&svc["name"], &svc["namespace"]),
                (
                    &service["metadata"]["name"],
                    &service["metadata"]["namespace"]
                )
            );
            assert_eq!(svc["port"], service["spec"]["ports"][0]["port"]);
            if cfg["kind"] == "ValidatingWebhookConfiguration" {
                assert_eq!(w["failurePolicy"], "Fail", "{name}");
                assert_eq!(svc["path"], "/validate");
            } else {
                assert_eq!(svc["path"], "/mutate");
            }
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration"
        ]
    );
    let crd = &manifests("crd.yaml")[0];
    assert_eq!(
        crd["spec"]["versions"][0]["subresources"]["status"],
        json!({})
    );
}
