//! The chart's ways to reach a Prometheus that wants credentials: basic auth from a
//! kubernetes.io/basic-auth Secret (mounted into the controller's pod, its keys handed over as
//! files the controller reads at each query) and extra headers such as a Mimir tenant's; a
//! bearer token and basic auth together are refused, as are headers that are not headers.

use super::*;

const SECRET: &str = "prometheus-auth";
const MOUNT: &str = "/etc/gpuplane/prometheus-auth";

#[test]
fn basic_auth_comes_from_a_mounted_secret_and_headers_reach_the_controller() {
    let Some(t) = tools() else { return };
    let o = t.render(
        NS,
        &[
            "--set",
            "controller.prometheusUrl=http://mimir-gateway.monitoring/prometheus",
            "--set",
            &format!("controller.prometheusBasicAuthSecret={SECRET}"),
            "--set",
            "controller.prometheusHeaders.X-Scope-OrgID=gpu-platform",
        ],
    );
    let deploy = find(&o, "Deployment", "gpuplane-controller");
    let args = args_of(deploy);
    for want in [
        format!("--prometheus-username-file={MOUNT}/username"),
        format!("--prometheus-password-file={MOUNT}/password"),
        "--prometheus-header=X-Scope-OrgID: gpu-platform".to_string(),
    ] {
        assert!(args.contains(&want), "{want} not in {args:?}");
    }
    let pod = &deploy["spec"]["template"]["spec"];
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "prometheus-auth", "secret": {"secretName": SECRET}})),
        "{pod}"
    );
    assert!(
        container(deploy)["volumeMounts"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "prometheus-auth", "mountPath": MOUNT, "readOnly": true})),
        "{pod}"
    );
    assert_binary_accepts("Deployment", args);
}

#[test]
fn a_bearer_token_with_basic_auth_and_a_bad_header_are_refused_naming_the_values() {
    let Some(t) = tools() else { return };
    let both = t
        .template(
            NS,
            &[
                "--set",
                &format!("controller.prometheusBasicAuthSecret={SECRET}"),
                "--set",
                "controller.prometheusBearerTokenFile=/var/run/secrets/kubernetes.io/serviceaccount/token",
            ],
        )
        .expect_err("basic auth and a bearer token at once were accepted");
    assert!(
        both.contains("controller.prometheusBasicAuthSecret and controller.prometheusBearerTokenFile: set one"),
        "{both}"
    );
    for (set, field) in [
        (
            "controller.prometheusBasicAuthSecret=Prometheus_Auth",
            "/controller/prometheusBasicAuthSecret",
        ),
        // Helm's validator names a bad property name, at an unrelated location.
        (
            "controller.prometheusHeaders.X\\ Tenant=a",
            "invalid propertyName 'X Tenant'",
        ),
        (
            "controller.prometheusHeaders.X-Scope-OrgID=",
            "/controller/prometheusHeaders",
        ),
    ] {
        let err = t
            .template(NS, &["--set", set])
            .expect_err(&format!("--set {set} was accepted"));
        assert!(
            err.contains(field),
            "--set {set}: {field} not named in {err}"
        );
    }
}
