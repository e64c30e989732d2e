//! Malformed and hostile request bodies get clean answers, and replaced certificate files are
//! served to new connections.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_hostile_bodies_get_clean_answers() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(&api, "q", json!({"hard": {"gpus": 1}})).await;
    let pki = Pki::new();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let addr = wh.addr();

    bodies_that_are_no_admission_review(&tls, addr).await;
    wrong_content_types_and_huge_bodies(&tls, addr).await;
    objects_it_cannot_decide(&tls, addr).await;
    wrong_methods_and_paths(&tls, addr).await;

    // After all that, a good request still gets a good answer.
    let resp = response(
        &post(
            &tls,
            addr,
            "/validate",
            &pod_review("u-ok", gpu_pod("ok", "nvidia.com/gpu", 1)),
        )
        .await,
    );
    assert_eq!(resp["allowed"], true, "{resp}");
    let m = wh.metrics.render();
    assert!(
        m.contains("gpuplane_webhook_rejected_bodies_total{code=\"413\"} 2"),
        "{m}"
    );
    wh.stop().await;
}

/// Bodies that are no AdmissionReview (not JSON, empty, nested too deep, without a uid or
/// request) get 400; fields a later Kubernetes adds change nothing.
async fn bodies_that_are_no_admission_review(tls: &Arc<rustls::ClientConfig>, addr: SocketAddr) {
    // Not JSON.
    let a = post(tls, addr, "/validate", b"{not json").await;
    assert_eq!(a.status, 400);
    assert!(
        a.text().contains("not a valid AdmissionReview"),
        "{}",
        a.text()
    );
    // Empty body.
    assert_eq!(post(tls, addr, "/validate", b"").await.status, 400);
    // Nested far deeper than a parser should follow.
    assert_eq!(
        post(tls, addr, "/validate", "[".repeat(100_000).as_bytes())
            .await
            .status,
        400
    );
    // Missing uid, empty uid, wrong apiVersion, no request.
    let mut r = review(
        "u",
        ("", "v1", "Pod"),
        "CREATE",
        gpu_pod("p", "nvidia.com/gpu", 1),
        None,
        "alice",
    );
    r["request"].as_object_mut().unwrap().remove("uid");
    let a = post(tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("uid"), "{}", a.text());
    r["request"]["uid"] = json!("");
    let a = post(tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await;
    assert_eq!(
        (a.status, a.text().trim()),
        (400, "the AdmissionReview request has an empty uid")
    );
    // Fields a later Kubernetes adds (envelope, request, userInfo, the object) change nothing:
    // the normal answer, here an admission within the quota.
    r["request"]["uid"] = json!("u");
    r["extraField"] = json!(true);
    r["request"]["extraField"] = json!(true);
    r["request"]["userInfo"]["extraField"] = json!({"a": 1});
    r["request"]["object"]["spec"]["extraField"] = json!([1]);
    // A dry run: decided, but it reserves nothing (the quota is for the checks below).
    r["request"]["dryRun"] = json!(true);
    let a = post(tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let answer: serde_json::Value = serde_json::from_str(&a.text()).unwrap();
    assert_eq!(answer["response"]["uid"], "u");
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    let a = post(
        tls,
        addr,
        "/validate",
        br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":null}"#,
    )
    .await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("admission.k8s.io/v1"));
    assert_eq!(
        post(
            tls,
            addr,
            "/mutate",
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#
        )
        .await
        .status,
        400
    );
}

/// A wrong content type gets 415, and a huge body (declared, or streamed without a length) 413.
async fn wrong_content_types_and_huge_bodies(tls: &Arc<rustls::ClientConfig>, addr: SocketAddr) {
    // Wrong content type.
    let body = pod_review("u", gpu_pod("p", "nvidia.com/gpu", 1));
    let head = format!("POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\nContent-Length: {}", body.len());
    let a = raw(tls, addr, head, body.clone()).await;
    assert_eq!(a.status, 415);
    let head = format!(
        "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}",
        body.len()
    );
    assert_eq!(raw(tls, addr, head, body.clone()).await.status, 415);

    // Huge bodies: declared, and streamed without a length.
    let head = "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 104857600".to_string();
    let a = raw(tls, addr, head, vec![b' '; 1024]).await;
    assert_eq!(a.status, 413);
    let mut chunked = Vec::new();
    for _ in 0..80 {
        chunked.extend_from_slice(format!("{:x}\r\n", 64 * 1024).as_bytes());
        chunked.extend_from_slice(&vec![b' '; 64 * 1024]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let head = "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked".to_string();
    let a = raw(tls, addr, head, chunked).await;
    assert_eq!(a.status, 413, "{}", a.text());
}

/// Objects the webhook cannot decide (a kind it does not handle, a Pod that is not one, a
/// fractional device quantity) get an AdmissionReview that denies, naming why.
async fn objects_it_cannot_decide(tls: &Arc<rustls::ClientConfig>, addr: SocketAddr) {
    // A kind this webhook does not handle: an AdmissionReview that denies, with the uid.
    let dep = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": NS}});
    let r = review(
        "u-dep",
        ("apps", "v1", "Deployment"),
        "CREATE",
        dep,
        None,
        "alice",
    );
    let resp = response(&post(tls, addr, "/validate", &serde_json::to_vec(&r).unwrap()).await);
    assert_eq!(
        (resp["uid"].as_str(), resp["allowed"].as_bool()),
        (Some("u-dep"), Some(false))
    );
    assert_eq!(resp["status"]["code"], 400);
    assert!(resp["status"]["message"]
        .as_str()
        .unwrap()
        .contains("Pods and ResourceClaims"));
    // A Pod object that is not a Pod.
    let bad = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": NS}, "spec": {"containers": "many"}});
    let resp = response(&post(tls, addr, "/validate", &pod_review("u-bad", bad)).await);
    assert_eq!(
        (resp["allowed"].as_bool(), resp["status"]["code"].as_u64()),
        (Some(false), Some(400))
    );
    assert!(resp["status"]["message"]
        .as_str()
        .unwrap()
        .starts_with("cannot decode the Pod"));
    // A quantity that is not a whole number of devices.
    let frac = gpu_pod("frac", "nvidia.com/gpu", 1);
    let mut frac = frac;
    frac["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = json!("500m");
    let resp = response(&post(tls, addr, "/validate", &pod_review("u-frac", frac)).await);
    assert_eq!(resp["allowed"], false);
    assert!(
        resp["status"]["message"]
            .as_str()
            .unwrap()
            .contains("not a whole"),
        "{resp}"
    );
}

/// A wrong method gets 405, a wrong path 404; /healthz answers ok.
async fn wrong_methods_and_paths(tls: &Arc<rustls::ClientConfig>, addr: SocketAddr) {
    // Wrong method and path.
    let a = raw(
        tls,
        addr,
        "GET /validate HTTP/1.1\r\nHost: localhost".into(),
        vec![],
    )
    .await;
    assert_eq!(a.status, 405);
    let a = raw(
        tls,
        addr,
        "GET /nope HTTP/1.1\r\nHost: localhost".into(),
        vec![],
    )
    .await;
    assert_eq!(a.status, 404);
    let a = raw(
        tls,
        addr,
        "GET /healthz HTTP/1.1\r\nHost: localhost".into(),
        vec![],
    )
    .await;
    assert_eq!((a.status, a.text().trim()), (200, "ok"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_certificate_files_are_served_to_new_connections() {
    let api = ApiServerDouble::start().await.unwrap();
    let pki = Pki::new();
    let first = std::fs::read_to_string(pki.cert_path()).unwrap();
    let wh = replica(&api, &pki).await;
    let tls = pki.client_config();
    let get = |tls: Arc<rustls::ClientConfig>, addr| async move {
        raw(
            &tls,
            addr,
            "GET /healthz HTTP/1.1\r\nHost: localhost".into(),
            vec![],
        )
        .await
    };
    let a = get(tls.clone(), wh.addr()).await;
    assert_eq!(a.status, 200);
    let first_der = CertificateDer::from_pem_slice(first.as_bytes());
    assert_eq!(a.peer_cert, first_der.unwrap().to_vec());

    let second = pki.issue();
    let b = get(tls.clone(), wh.addr()).await;
    assert_eq!(b.status, 200);
    assert_eq!(
        b.peer_cert, second,
        "a new connection sees the new certificate"
    );

    // A broken pair (a key that does not match) is not taken: the last good one stays.
    let other = KeyPair::generate().unwrap();
    std::fs::write(pki.key_path(), other.serialize_pem()).unwrap();
    let c = get(tls.clone(), wh.addr()).await;
    assert_eq!(c.peer_cert, second);
    let third = pki.issue();
    assert_eq!(get(tls, wh.addr()).await.peer_cert, third);
    wh.stop().await;
}
