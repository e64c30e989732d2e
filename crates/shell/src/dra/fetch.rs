//! Reading ResourceClaims and writing this driver's part of their status: the one I/O claim
//! preparation needs ([`ClaimFetcher`]), over the API server ([`KubeClaims`]) or in memory
//! ([`MemoryClaims`], for the demo and tests).

use gpuplane_model::report::chain;
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::collections::BTreeMap;
use std::sync::Mutex;

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

/// [`ClaimFetcher`] over claims held in memory, for tests and simulations.
#[derive(Debug, Default)]
pub struct MemoryClaims {
    claims: Mutex<BTreeMap<(String, String), ResourceClaim>>,
}

impl MemoryClaims {
    pub fn new(claims: impl IntoIterator<Item = ResourceClaim>) -> Self {
        let out = MemoryClaims::default();
        for c in claims {
            out.insert(c);
        }
        out
    }

    /// Adds or replaces a claim (by its namespace and name).
    pub fn insert(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        self.lock().insert(key, claim);
    }

    pub fn remove(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
        self.lock()
            .remove(&(namespace.to_string(), name.to_string()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), ResourceClaim>> {
        // Every critical section is a single map operation: a poisoned map is still whole.
        self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait::async_trait]
impl ClaimFetcher for MemoryClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, FetchError> {
        self.lock()
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| FetchError::NotFound {
                namespace: namespace.to_string(),
                name: name.to_string(),
            })
    }

    /// Replaces the stored claim's `status.devices` (one driver per store).
    async fn set_device_status(
        &self,
        namespace: &str,
        name: &str,
        entries: Vec<serde_json::Value>,
    ) -> Result<(), FetchError> {
        let not_found = || FetchError::NotFound {
            namespace: namespace.to_string(),
            name: name.to_string(),
        };
        let devices = entries
            .into_iter()
            .map(serde_json::from_value)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| FetchError::BadStatus {
                namespace: namespace.to_string(),
                name: name.to_string(),
                why: e.to_string(),
            })?;
        let mut claims = self.lock();
        let claim = claims
            .get_mut(&(namespace.to_string(), name.to_string()))
            .ok_or_else(not_found)?;
        claim.status.get_or_insert_with(Default::default).devices = Some(devices);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim() -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "0b5c3f2e-1111-4222-8333-444455556666"},
            "spec": {"devices": {}}
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn memory_claims() {
        let c = claim();
        let m = MemoryClaims::new([c.clone()]);
        assert_eq!(m.get("ns", "c").await.unwrap(), c);
        assert!(matches!(
            m.get("ns", "d").await,
            Err(FetchError::NotFound { .. })
        ));
        m.remove("ns", "c");
        assert!(m.get("ns", "c").await.is_err());
    }
}
