//! What the quota loop reads: the watched caches (pods, GpuQuotas, ResourceClaims and their
//! templates) and the published devices, with the catalog read from them when they change.

use super::Input;
use crate::controller::cache::Cache;
use crate::published::Devices;
use crate::quota::{DeviceCatalog, GpuQuota};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate};
use kube::runtime::watcher::Event;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The loop's view of the cluster, fed by its watches.
pub(super) struct Watched {
    pub(super) pods: Cache<Pod>,
    pub(super) quotas: Cache<GpuQuota>,
    pub(super) claims: Cache<ResourceClaim>,
    templates: Cache<ResourceClaimTemplate>,
    devices: Arc<Devices>,
    /// The catalog last read from `devices`.
    catalog: Arc<DeviceCatalog>,
    /// The devices changed since `catalog` was read.
    catalog_stale: bool,
}

impl Watched {
    /// A view of `devices`, its caches empty until their watches list.
    pub(super) fn new(devices: Arc<Devices>) -> Watched {
        Watched {
            pods: Cache::default(),
            quotas: Cache::default(),
            claims: Cache::default(),
            templates: Cache::default(),
            devices,
            catalog: Arc::new(DeviceCatalog::default()),
            catalog_stale: true,
        }
    }

    /// Every cache has listed once.
    pub(super) fn ready(&self) -> bool {
        self.pods.is_ready()
            && self.quotas.is_ready()
            && self.claims.is_ready()
            && self.templates.is_ready()
    }

    /// The namespaces with quotas or pods.
    pub(super) fn namespaces(&self) -> BTreeSet<String> {
        self.quotas
            .namespaces()
            .chain(self.pods.namespaces())
            .cloned()
            .collect()
    }

    /// Applies one input; returns the namespaces to reconcile because of it.
    pub(super) fn apply(&mut self, input: Input) -> BTreeSet<String> {
        match input {
            Input::Pod(e) => self.pods.apply(*e),
            Input::Claim(e) => self.claims.apply(*e),
            Input::Template(e) => self.templates.apply(*e),
            Input::Quota(e) => {
                let e = *e;
                let cohorts: Vec<String> = match &e {
                    Event::Apply(q) | Event::Delete(q) | Event::InitApply(q) => {
                        q.spec.cohort.iter().cloned().collect()
                    }
                    _ => Vec::new(),
                };
                let mut touched = self.quotas.apply(e);
                // Borrowing couples the namespaces of a cohort.
                for q in self.quotas.all() {
                    if q.spec.cohort.as_ref().is_some_and(|c| cohorts.contains(c)) {
                        touched.insert(q.metadata.namespace.clone().unwrap_or_default());
                    }
                }
                touched
            }
            Input::Devices => {
                self.catalog_stale = true;
                self.namespaces()
            }
        }
    }

    /// Reads the catalog again if the devices changed; whether it did (pods are priced again).
    pub(super) fn refresh_catalog(&mut self) -> bool {
        if !self.catalog_stale {
            return false;
        }
        self.catalog = self.devices.catalog();
        self.catalog_stale = false;
        true
    }

    pub(super) fn catalog(&self) -> &Arc<DeviceCatalog> {
        &self.catalog
    }

    /// A namespace's ResourceClaimTemplates by name: a pod's charge may come from them.
    pub(super) fn template_specs(&self, ns: &str) -> BTreeMap<String, ResourceClaimSpec> {
        self.templates
            .in_namespace(ns)
            .iter()
            .map(|t| {
                (
                    t.metadata.name.clone().unwrap_or_default(),
                    t.spec.spec.clone(),
                )
            })
            .collect()
    }
}
