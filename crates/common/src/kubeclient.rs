//! How the agent and the controller get a `kube::Client`.
//!
//! With `--kubeconfig PATH`: that file (its current context). Without: the in-cluster config
//! (service account token and `KUBERNETES_SERVICE_HOST`/`PORT`, as in a pod), then the user's
//! kubeconfig (`KUBECONFIG` or `~/.kube/config`). This is `kube::Config::infer` with the two
//! sources swapped: an agent runs in a pod, so the pod's own identity wins over a kubeconfig
//! that happens to be mounted. Errors name every source tried and what to pass instead.

use gpuplane_model::report::chain;
use std::path::{Path, PathBuf};

/// The client every face gets; named here so the binary, which does not depend on kube,
/// can pass one around.
pub use kube::Client;

#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    #[error("loading kubeconfig {path}: {}", chain(.cause))]
    Kubeconfig {
        path: PathBuf,
        cause: kube::config::KubeconfigError,
    },
    #[error(
        "no Kubernetes API server configured: in-cluster config: {incluster}; kubeconfig \
         ({kubeconfig_source}): {kubeconfig}. Run in a pod with a service account, set \
         KUBECONFIG, or pass --kubeconfig PATH"
    )]
    NoConfig {
        incluster: kube::config::InClusterError,
        kubeconfig_source: String,
        kubeconfig: kube::config::KubeconfigError,
    },
    #[error("building a Kubernetes client from {from}: {}", chain(.cause))]
    Client { from: String, cause: kube::Error },
}

/// A client from `kubeconfig` if given, else in-cluster, else `KUBECONFIG`/`~/.kube/config`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, KubeClientError> {
    let (config, from) = config(kubeconfig).await?;
    build(config, from)
}

/// [`client`] without kube's own retry of 429, 503 and 504, for the controller: its loops
/// retry with their own backoff, and a 429 from the Eviction API is a PodDisruptionBudget
/// refusing, which the queue must hear at once to choose other victims, not after kube has
/// retried it in place (the server's `Retry-After` of 10 s, up to 15 times) with the loop
/// waiting.
pub async fn client_without_retry(
    kubeconfig: Option<&Path>,
) -> Result<kube::Client, KubeClientError> {
    let (mut config, from) = config(kubeconfig).await?;
    config.default_retry = false;
    build(config, from)
}

fn build(config: kube::Config, from: String) -> Result<kube::Client, KubeClientError> {
    kube::Client::try_from(config).map_err(|source| KubeClientError::Client {
        from,
        cause: source,
    })
}

/// The config `client` would use, and a description of where it came from.
pub async fn config(kubeconfig: Option<&Path>) -> Result<(kube::Config, String), KubeClientError> {
    let options = kube::config::KubeConfigOptions::default();
    if let Some(path) = kubeconfig {
        let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| {
            KubeClientError::Kubeconfig {
                path: path.to_path_buf(),
                cause: source,
            }
        })?;
        let config = kube::Config::from_custom_kubeconfig(kc, &options)
            .await
            .map_err(|source| KubeClientError::Kubeconfig {
                path: path.to_path_buf(),
                cause: source,
            })?;
        return Ok((config, format!("kubeconfig {}", path.display())));
    }
    let incluster = match kube::Config::incluster() {
        Ok(config) => return Ok((config, "the in-cluster service account".into())),
        Err(e) => e,
    };
    let kubeconfig_source = match std::env::var("KUBECONFIG") {
        Ok(v) if !v.is_empty() => format!("KUBECONFIG={v}"),
        _ => "~/.kube/config".into(),
    };
    match kube::Config::from_kubeconfig(&options).await {
        Ok(config) => Ok((config, kubeconfig_source)),
        Err(kubeconfig) => Err(KubeClientError::NoConfig {
            incluster,
            kubeconfig_source,
            kubeconfig,
        }),
    }
}

/// Whether a client can be had without flags: in a pod (`KUBERNETES_SERVICE_HOST`) or with
/// `KUBECONFIG` set. A bare `~/.kube/config` does not count, so a workstation does not turn on
/// cluster features by accident. The agent defaults `--dra` from this.
pub fn available_without_flags() -> bool {
    available_from(|k| std::env::var(k).ok())
}

fn available_from(env: impl Fn(&str) -> Option<String>) -> bool {
    ["KUBERNETES_SERVICE_HOST", "KUBECONFIG"]
        .iter()
        .any(|k| env(k).is_some_and(|v| !v.trim().is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_host_or_kubeconfig_makes_a_client_available() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(available_from(env(&[(
            "KUBERNETES_SERVICE_HOST",
            "10.0.0.1"
        )])));
        assert!(available_from(env(&[("KUBECONFIG", "/tmp/kc")])));
        assert!(!available_from(env(&[("KUBECONFIG", "")])));
        assert!(!available_from(env(&[("HOME", "/root")])));
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_file_is_named_in_the_error() {
        let err = client(Some(Path::new("/nonexistent/gpuplane-kubeconfig")))
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("/nonexistent/gpuplane-kubeconfig"), "{err}");
    }

    #[tokio::test]
    async fn a_kubeconfig_file_yields_a_client_for_its_server() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: k\n  cluster:\n    server: http://127.0.0.1:1\ncontexts:\n- name: c\n  context:\n    cluster: k\n    user: u\n    namespace: gpu\nusers:\n- name: u\n  user: {}\n",
        )
        .unwrap();
        let (config, from) = config(Some(&path)).await.unwrap();
        assert_eq!(config.cluster_url.to_string(), "http://127.0.0.1:1/");
        assert_eq!(config.default_namespace, "gpu");
        assert!(from.contains("config"));
        assert!(client(Some(&path)).await.is_ok());
    }
}
