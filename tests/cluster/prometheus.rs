//! A real Prometheus in the lab's network namespace, scraping the node agents and the
//! controller every second; its HTTP API answers the dashboard's queries and the controller's
//! busy GPU-hours reads. Two of them, as users run both: Debian's package (2.42, which
//! hack/test.sh installs) scraping the host-process agent and controller at fixed addresses,
//! and Prometheus 3 built from its Go module by hack/cluster/build.sh (Debian's leaves out
//! Kubernetes service discovery), finding the deployed pods through the API server.

use super::*;

/// Where it serves its HTTP API in the lab's network namespace when it scrapes fixed targets.
pub const PROMETHEUS_ADDR: &str = "127.0.0.1:9090";

/// The running server.
pub struct LabPrometheus {
    _process: LabProcess,
    addr: String,
    /// Served over TLS: the CA file its certificate chains to.
    ca: Option<PathBuf>,
    /// Asks for basic auth (`basic_auth_users`): the user and password.
    basic: Option<(String, String)>,
}

/// How it serves: plain HTTP with basic auth (as a Prometheus exposed beyond its namespace
/// is set up), or HTTPS with a certificate of a CA made for it.
#[derive(Clone, Copy, PartialEq)]
enum Serving {
    HttpBasicAuth,
    Https,
}

/// The user the basic-auth Prometheus knows, and its password.
const BASIC_AUTH: (&str, &str) = ("gpuplane", "lab: basic-auth password");

/// The host processes' addresses: the agent's and the controller's `--metrics-addr`.
/// `honor_labels`: the agents' own `namespace`/`pod` labels name the workload.
fn static_jobs() -> String {
    format!(
        "- job_name: gpuplane-node\n  honor_labels: true\n  static_configs: [{{targets: ['127.0.0.1:9400']}}]\n\
         - job_name: gpuplane-controller\n  honor_labels: true\n  static_configs: [{{targets: ['{CONTROLLER_METRICS_ADDR}']}}]\n"
    )
}

/// The pods annotated `prometheus.io/scrape: "true"`, found through the API server: the
/// `kubernetes-pods` job of the prometheus-community chart's default config (values.yaml of
/// charts/prometheus), the way most clusters scrape pods, with its `namespace` and `pod`
/// target labels under `honor_labels` (a series' own labels win; one without them gets the
/// scraped pod's).
fn pod_discovery_job(kubeconfig: &Path) -> String {
    format!(
        "- job_name: kubernetes-pods\n  honor_labels: true\n\
         \x20 kubernetes_sd_configs: [{{role: pod, kubeconfig_file: '{}'}}]\n\
         \x20 relabel_configs:\n\
         \x20 - {{source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape], action: keep, regex: 'true'}}\n\
         \x20 - {{source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_path], action: replace, target_label: __metrics_path__, regex: '(.+)'}}\n\
         \x20 - {{source_labels: [__address__, __meta_kubernetes_pod_annotation_prometheus_io_port], action: replace, regex: '([^:]+)(?::\\d+)?;(\\d+)', replacement: '$1:$2', target_label: __address__}}\n\
         \x20 - {{source_labels: [__meta_kubernetes_namespace], action: replace, target_label: namespace}}\n\
         \x20 - {{source_labels: [__meta_kubernetes_pod_name], action: replace, target_label: pod}}\n\
         \x20 - {{source_labels: [__meta_kubernetes_pod_node_name], action: replace, target_label: node}}\n",
        kubeconfig.display()
    )
}

impl LabPrometheus {
    /// Starts it scraping the host-process agent and controller (`None`, printed, when the
    /// binary is missing; a panic under `CI`) and waits until it is ready. It serves HTTPS
    /// (`--web.config.file`'s `tls_server_config`) with a certificate for 127.0.0.1 from a CA
    /// of its own, which [`LabPrometheus::controller_flags`] hands the controller.
    pub fn start(lab: &ClusterLab) -> Option<LabPrometheus> {
        let found = Command::new("sh")
            .args(["-c", "command -v prometheus"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            let why = "no prometheus binary (hack/test.sh installs Debian's package)";
            assert!(std::env::var_os("CI").is_none(), "{why}");
            eprintln!("skipping: {why}");
            return None;
        }
        Some(Self::start_with(
            lab,
            Path::new("prometheus"),
            (PROMETHEUS_ADDR, Serving::Https),
            &static_jobs(),
        ))
    }

    /// Starts it as a cluster's Prometheus outside the pod network: it finds the pods to
    /// scrape through the API server (their `prometheus.io/*` annotations) and serves on
    /// lab-node's IP, which pods reach (the controller's `--prometheus-url`), to clients with
    /// its basic-auth user and password ([`LabPrometheus::basic_auth_secret`]).
    pub fn discovering_pods(lab: &ClusterLab) -> LabPrometheus {
        let ip = &lab.nodes()[0].ip;
        let job = pod_discovery_job(&lab.admin_kubeconfig());
        Self::start_with(
            lab,
            &lab.bin.join("prometheus"),
            (&format!("{ip}:9090"), Serving::HttpBasicAuth),
            &job,
        )
    }

    fn start_with(
        lab: &ClusterLab,
        program: &Path,
        (addr, serving): (&str, Serving),
        jobs: &str,
    ) -> LabPrometheus {
        let dir = lab.work.join("prometheus");
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, basic, web) = match serving {
            Serving::Https => {
                let pki = gpuplane_testkit::demo::tls::DemoPki::issue(&dir).unwrap();
                let web = format!(
                    "tls_server_config:\n  cert_file: {}\n  key_file: {}\n",
                    pki.cert_file.display(),
                    pki.key_file.display()
                );
                let ca = dir.join("ca.pem");
                std::fs::write(&ca, &pki.ca_pem).unwrap();
                (Some(ca), None, web)
            }
            Serving::HttpBasicAuth => {
                let (user, password) = BASIC_AUTH;
                // The web config takes bcrypt hashes; the lowest cost keeps each request cheap.
                let hash = bcrypt::hash(password, 4).unwrap();
                let web = format!("basic_auth_users:\n  {user}: '{hash}'\n");
                (None, Some((user.to_string(), password.to_string())), web)
            }
        };
        std::fs::write(dir.join("web.yml"), web).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n{jobs}"
            ),
        )
        .unwrap();
        let mut cmd = lab.in_netns(program);
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg(format!(
                "--web.config.file={}",
                dir.join("web.yml").display()
            ));
        let process = LabProcess::spawn(lab, cmd, "prometheus");
        let prometheus = LabPrometheus {
            _process: process,
            addr: addr.to_string(),
            ca,
            basic,
        };
        eventually("Prometheus to be ready", || {
            let out = prometheus
                .curl(lab)
                .args(["-sf", &format!("{}/-/ready", prometheus.url())])
                .output()
                .unwrap();
            out.status.success().then_some(())
        });
        prometheus
    }

    /// The URL the controller's `--prometheus-url` takes.
    pub fn url(&self) -> String {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The controller's flags that point it here: the URL, and the CA file when it serves
    /// HTTPS.
    pub fn controller_flags(&self) -> Vec<String> {
        let mut flags = vec![format!("--prometheus-url={}", self.url())];
        flags.extend(
            self.ca
                .as_ref()
                .map(|ca| format!("--prometheus-ca-file={}", ca.display())),
        );
        flags
    }

    /// A kubernetes.io/basic-auth Secret `name` in `namespace` with this server's user and
    /// password, as its users would make one for the chart's
    /// `controller.prometheusBasicAuthSecret`.
    pub fn basic_auth_secret(&self, namespace: &str, name: &str) -> String {
        let (user, password) = self.basic.as_ref().expect("a basic-auth Prometheus");
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: {namespace}}}\n\
             type: kubernetes.io/basic-auth\nstringData: {{username: '{user}', password: '{password}'}}\n"
        )
    }

    /// curl in the lab's network, trusting this server's CA, with its user and password.
    fn curl(&self, lab: &ClusterLab) -> Command {
        let mut cmd = lab.in_netns("curl");
        if let Some(ca) = &self.ca {
            cmd.arg("--cacert").arg(ca);
        }
        if let Some((user, password)) = &self.basic {
            cmd.arg("--user").arg(format!("{user}:{password}"));
        }
        cmd
    }

    /// An instant query's answer (`data.result`); panics on an error answer, naming the query.
    pub fn query(&self, lab: &ClusterLab, expr: &str) -> Vec<Value> {
        let out = self
            .curl(lab)
            .args(["-s", "--data-urlencode", &format!("query={expr}")])
            .arg(format!("{}/api/v1/query", self.url()))
            .output()
            .unwrap();
        let answer: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("query {expr}: {e}: {:?}", out.stdout));
        assert_eq!(answer["status"], "success", "query {expr}: {answer}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}
