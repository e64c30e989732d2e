//! A real Prometheus (Debian's `prometheus` package, which hack/test.sh installs) in the lab's
//! network namespace, scraping the node agent and the controller every second, as a cluster's
//! Prometheus scrapes their pods; its HTTP API answers the dashboard's queries and the
//! controller's busy GPU-hours reads.

use super::*;

/// Where it serves its HTTP API in the lab's network namespace.
pub const PROMETHEUS_ADDR: &str = "127.0.0.1:9090";

/// The running server.
pub struct LabPrometheus {
    _process: LabProcess,
}

impl LabPrometheus {
    /// Starts it (`None`, printed, when the binary is missing; a panic under `CI`) and waits
    /// until it is ready.
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
        let dir = lab.work.join("prometheus");
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        // honor_labels: the agents' own `namespace`/`pod` labels name the workload.
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 scrape_configs:\n\
                 - job_name: gpuplane-node\n  honor_labels: true\n  static_configs: [{{targets: ['127.0.0.1:9400']}}]\n\
                 - job_name: gpuplane-controller\n  honor_labels: true\n  static_configs: [{{targets: ['{CONTROLLER_METRICS_ADDR}']}}]\n"
            ),
        )
        .unwrap();
        let mut cmd = lab.in_netns("prometheus");
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={PROMETHEUS_ADDR}"));
        let process = LabProcess::spawn(lab, cmd, "prometheus");
        eventually("Prometheus to be ready", || {
            let out = lab
                .in_netns("curl")
                .args(["-sf", &format!("http://{PROMETHEUS_ADDR}/-/ready")])
                .output()
                .unwrap();
            out.status.success().then_some(())
        });
        Some(LabPrometheus { _process: process })
    }

    /// The URL the controller's `--prometheus-url` takes.
    pub fn url(&self) -> String {
        format!("http://{PROMETHEUS_ADDR}")
    }

    /// An instant query's answer (`data.result`); panics on an error answer, naming the query.
    pub fn query(&self, lab: &ClusterLab, expr: &str) -> Vec<Value> {
        let out = lab
            .in_netns("curl")
            .args(["-s", "--data-urlencode", &format!("query={expr}")])
            .arg(format!("http://{PROMETHEUS_ADDR}/api/v1/query"))
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
