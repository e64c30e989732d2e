//! The published devices, as every part of `gpuplane controller` reads them (I/O shell): one
//! watch-fed store of ResourceSlices, one of DeviceClasses, and the [`DeviceCatalog`] built
//! from them, rebuilt at most once per change however many readers ask.
//!
//! The admission webhook, the quota loop and the explainer share one: at 1,000 nodes each copy
//! of the slices, and each catalog (a CEL evaluation per device and class to build), is tens
//! of MiB and seconds of CPU.

use crate::quota::{CatalogSettings, DeviceCatalog};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The shared stores and catalog; the watches stop when it is dropped.
pub struct Devices {
    slices: Store<ResourceSlice>,
    classes: Store<DeviceClass>,
    /// Counts slice and class events: readers wait on it, and the catalog is rebuilt when it
    /// moved.
    changes: Arc<watch::Sender<u64>>,
    settings: CatalogSettings,
    catalog: Mutex<Option<(u64, Arc<DeviceCatalog>)>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Devices {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Devices {
    /// Starts the two watches; `failed` hears of every watch error (the stores keep their last
    /// state meanwhile).
    pub fn start(
        client: &kube::Client,
        settings: CatalogSettings,
        failed: impl Fn(&'static str, &watcher::Error) + Clone + Send + 'static,
    ) -> Arc<Devices> {
        let (changes, _) = watch::channel(0u64);
        let changes = Arc::new(changes);
        let bump = |changes: &Arc<watch::Sender<u64>>| {
            let changes = changes.clone();
            move || changes.send_modify(|g| *g += 1)
        };
        let (f1, f2) = (failed.clone(), failed);
        let (slices, feed1) = crate::reflect::reflected(
            Api::<ResourceSlice>::all(client.clone()),
            watcher::Config::default(),
            "resourceslices",
            bump(&changes),
            move |e| f1("resourceslices", e),
        );
        let (classes, feed2) = crate::reflect::reflected(
            Api::<DeviceClass>::all(client.clone()),
            watcher::Config::default(),
            "deviceclasses",
            bump(&changes),
            move |e| f2("deviceclasses", e),
        );
        Arc::new(Devices {
            slices,
            classes,
            changes,
            settings,
            catalog: Mutex::new(None),
            tasks: vec![tokio::spawn(feed1), tokio::spawn(feed2)],
        })
    }

    /// Waits until both stores were listed once; the store not listed yet otherwise (its
    /// watch ended).
    pub async fn ready(&self) -> Result<(), &'static str> {
        let (s, c) = tokio::join!(
            self.slices.wait_until_ready(),
            self.classes.wait_until_ready()
        );
        s.map_err(|_| "resourceslices")?;
        c.map_err(|_| "deviceclasses")
    }

    /// Every ResourceSlice, as last seen.
    pub fn slices(&self) -> Vec<Arc<ResourceSlice>> {
        self.slices.state()
    }

    /// A receiver that wakes on every slice or class change.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The catalog of the stores as they are, rebuilt only when a slice or class changed
    /// since it was last built.
    pub fn catalog(&self) -> Arc<DeviceCatalog> {
        // Read before the stores: a change landing during the build moves it again, so the
        // next reader rebuilds.
        let generation = *self.changes.borrow();
        let mut cache = self.catalog.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((g, c)) = cache.as_ref() {
            if *g == generation {
                return c.clone();
            }
        }
        let (slices, classes) = (self.slices.state(), self.classes.state());
        let c = Arc::new(DeviceCatalog::from_shared(
            &slices,
            &classes,
            self.settings.clone(),
        ));
        *cache = Some((generation, c.clone()));
        c
    }
}
