//! [`MemoryClaims`]: a [`ClaimFetcher`] over ResourceClaims held in memory, for tests that
//! drive the DRA core without an API server. The product reads claims over the API server
//! (`gpuplane_node::dra::fetch::KubeClaims`); this double lives in the test kit so the shell
//! ships none.

use gpuplane_node::dra::fetch::{ClaimFetcher, FetchError};
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// [`ClaimFetcher`] over claims held in memory.
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
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[tokio::test]
    async fn claims_are_found_until_removed() {
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
