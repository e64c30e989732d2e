//! The GPU-hours ledger's flags: the controller's (`--owner-label`, `--gpu-hours-interval`,
//! `--gpu-hours-lag`, `--prometheus-url`) and `gpuplane report`'s.

use clap::Args;
use gpuplane_cluster::controller::hours::{parse_duration, By, HoursSettings};
use gpuplane_cluster::controller::meter::{HoursOptions, ReportQuery};
use gpuplane_cluster::controller::prometheus::{Access, Credentials, Prometheus};
use std::path::PathBuf;
use std::time::Duration;

/// The controller's ledger flags.
#[derive(Args)]
pub struct HoursArgs {
    /// A pod label key whose values are tenants of the GPU-hours ledger (repeatable), e.g.
    /// team, cost-center, model.
    #[arg(long = "owner-label", value_name = "KEY")]
    owner_labels: Vec<String>,
    /// How often the leader writes the GPU-hours book.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    gpu_hours_interval: Duration,
    /// How far the book's watermark trails the clock (covers a pod's start reaching the
    /// controller late).
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = parse_duration)]
    gpu_hours_lag: Duration,
    /// A Prometheus that scrapes the node agents (http(s)://HOST:PORT[/PATH]): the ledger
    /// books busy GPU-hours and peak GPU memory from their telemetry series. Unset: not
    /// measured.
    #[arg(long, value_name = "URL")]
    prometheus_url: Option<String>,
    /// PEM CA certificates an https --prometheus-url's certificate must chain to (default:
    /// the system bundle, /etc/ssl/certs/ca-certificates.crt).
    #[arg(long, value_name = "FILE", requires = "prometheus_url")]
    prometheus_ca_file: Option<PathBuf>,
    /// A file holding a bearer token sent to --prometheus-url, read at each query (e.g. the
    /// controller's ServiceAccount token, for a Thanos querier behind an authenticating proxy).
    #[arg(long, value_name = "FILE", requires = "prometheus_url")]
    prometheus_bearer_token_file: Option<PathBuf>,
    /// A file holding the user name for basic auth to --prometheus-url (with
    /// --prometheus-password-file), read at each query: e.g. the `username` key of a
    /// kubernetes.io/basic-auth Secret mounted in the pod.
    #[arg(
        long,
        value_name = "FILE",
        requires_all = ["prometheus_url", "prometheus_password_file"],
        conflicts_with = "prometheus_bearer_token_file"
    )]
    prometheus_username_file: Option<PathBuf>,
    /// A file holding the password for basic auth to --prometheus-url, read at each query.
    #[arg(long, value_name = "FILE", requires = "prometheus_username_file")]
    prometheus_password_file: Option<PathBuf>,
    /// A header sent with every query, `NAME: VALUE` (repeatable), e.g. a Grafana Mimir or
    /// Cortex tenant: "X-Scope-OrgID: team-a".
    #[arg(
        long = "prometheus-header",
        value_name = "HEADER",
        requires = "prometheus_url"
    )]
    prometheus_headers: Vec<String>,
}

impl HoursArgs {
    /// The ledger's options; fails on a bad --prometheus-url, CA file or header.
    pub fn options(self, namespace: &str) -> anyhow::Result<HoursOptions> {
        let basic = self
            .prometheus_username_file
            .zip(self.prometheus_password_file)
            .map(|(username_file, password_file)| Credentials::Basic {
                username_file,
                password_file,
            });
        let access = Access {
            ca_file: self.prometheus_ca_file,
            credentials: basic.or(self
                .prometheus_bearer_token_file
                .map(Credentials::BearerTokenFile)),
            headers: self.prometheus_headers,
        };
        let prometheus = self
            .prometheus_url
            .map(|url| Prometheus::new(&url, &access))
            .transpose()?;
        Ok(HoursOptions {
            settings: HoursSettings {
                owner_labels: self.owner_labels,
                lag: self.gpu_hours_lag,
                ..HoursSettings::default()
            },
            interval: self.gpu_hours_interval,
            namespace: namespace.into(),
            prometheus,
        })
    }
}

/// `gpuplane report`.
#[derive(Args)]
pub struct ReportArgs {
    /// Kubeconfig for API access (default: in-cluster, then KUBECONFIG, then ~/.kube/config).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The controller's namespace, where the book (ConfigMap gpuplane-gpu-hours) is kept.
    #[arg(long, value_name = "NS", default_value = "gpuplane-system")]
    controller_namespace: String,
    /// Only this namespace's tenants.
    #[arg(short = 'n', long, value_name = "NS")]
    namespace: Option<String>,
    /// First UTC day counted (YYYY-MM-DD or an RFC 3339 time; default: the current month's
    /// first day).
    #[arg(long, value_name = "DAY")]
    since: Option<String>,
    /// First UTC day not counted (default: up to the book's watermark).
    #[arg(long, value_name = "DAY")]
    until: Option<String>,
    /// Sum by namespace, quota, or an owner label key the controller books (--owner-label).
    #[arg(long, value_name = "namespace|quota|KEY", default_value = "namespace")]
    by: String,
}

impl ReportArgs {
    pub fn query(&self) -> ReportQuery {
        ReportQuery {
            controller_namespace: self.controller_namespace.clone(),
            by: By::parse(&self.by),
            namespace: self.namespace.clone(),
            since: self.since.clone(),
            until: self.until.clone(),
        }
    }
}
