//! Reading ResourceClaims and writing this driver's part of their status: the one I/O claim
//! preparation needs ([`ClaimFetcher`]), over the API server ([`KubeClaims`]). The test kit
//! holds an in-memory one for tests (`gpuplane_testkit::doubles::claims::MemoryClaims`).

use gpuplane_model::report::chain;
use k8s_openapi::api::resource::v1::ResourceClaim;

/// Why a claim could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("ResourceClaim {namespace}/{name} not found")]
    NotFound { namespace: String, name: String },
    #[error("status.devices for ResourceClaim {namespace}/{name} do not decode: {why}")]
    BadStatus {
        namespace: String,
        name: String,
        why: String,
    },
    #[error("{doing} ResourceClaim {namespace}/{name} on the API server: {}", chain(.cause))]
    Api {
        /// `reading`, `writing the status of`.
        doing: &'static str,
        namespace: String,
        name: String,
        cause: kube::Error,
    },
}

/// Reads ResourceClaims, and writes the driver's part of their status.
#[async_trait::async_trait]
pub trait ClaimFetcher: Send + Sync + 'static {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, FetchError>;
    /// Sets this driver's `status.devices` entries of a claim to `entries` (rendered by
    /// [`super::status::device_statuses`]; none: ours are removed).
    async fn set_device_status(
        &self,
        namespace: &str,
        name: &str,
        entries: Vec<serde_json::Value>,
    ) -> Result<(), FetchError>;
}

/// [`ClaimFetcher`] over the API server.
#[derive(Clone)]
pub struct KubeClaims {
    pub client: kube::Client,
}

impl KubeClaims {
    pub fn new(client: kube::Client) -> Self {
        KubeClaims { client }
    }
}

impl FetchError {
    fn from_kube(
        doing: &'static str,
        namespace: &str,
        name: &str,
        source: kube::Error,
    ) -> FetchError {
        match source {
            kube::Error::Api(s) if s.is_not_found() => FetchError::NotFound {
                namespace: namespace.to_string(),
                name: name.to_string(),
            },
            source => FetchError::Api {
                doing,
                namespace: namespace.to_string(),
                name: name.to_string(),
                cause: source,
            },
        }
    }
}

#[async_trait::async_trait]
impl ClaimFetcher for KubeClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, FetchError> {
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.client.clone(), namespace);
        api.get(name)
            .await
            .map_err(|e| FetchError::from_kube("reading", namespace, name, e))
    }

    async fn set_device_status(
        &self,
        namespace: &str,
        name: &str,
        entries: Vec<serde_json::Value>,
    ) -> Result<(), FetchError> {
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.client.clone(), namespace);
        // Server-side apply: `status.devices` is a map list keyed by driver, pool and device, so
        // only the entries this field manager owns change.
        let params = kube::api::PatchParams::apply(super::status::FIELD_MANAGER).force();
        let body = super::status::apply_body(namespace, name, entries);
        api.patch_status(name, &params, &kube::api::Patch::Apply(body))
            .await
            .map(|_| ())
            .map_err(|e| FetchError::from_kube("writing the status of", namespace, name, e))
    }
}
