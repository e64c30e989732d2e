//! The published devices, as every part of `gpuplane controller` reads them (I/O shell): each
//! ResourceSlice read once into its devices ([`SliceDevices`]) as the watch delivers it, a
//! watch-fed store of DeviceClasses, and the [`DeviceCatalog`] assembled from both, at most
//! once per change however many readers ask.
//!
//! The admission webhook, the quota loop and the explainer share one: at 1,000 nodes each copy
//! of the slices, and each catalog (a CEL evaluation per device and class to build), is tens
//! of MiB and seconds of CPU.

use crate::quota::{CatalogSettings, DeviceCatalog, SliceDevices};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The shared stores and catalog; the watches stop when it is dropped.
pub struct Devices {
    /// Each ResourceSlice as the catalog reads it, by name. The slices themselves are not
    /// kept: at 1,000 nodes they were ~44 MiB, and a slice change rebuilt every device.
    slices: Arc<Mutex<SliceBook>>,
    /// True once the slices were listed; dropped when their watch ends.
    listed: watch::Receiver<bool>,
    classes: Store<DeviceClass>,
    /// Counts slice and class events: readers wait on it, and the catalog is rebuilt when it
    /// moved.
    changes: Arc<watch::Sender<u64>>,
    settings: CatalogSettings,
    catalog: Mutex<Option<(u64, Arc<DeviceCatalog>)>>,
    tasks: Vec<JoinHandle<()>>,
}

/// The slices, and a fresh listing while the watch lists again (it replaces them whole, so a
/// slice deleted while the watch was down goes too).
#[derive(Default)]
struct SliceBook {
    parts: BTreeMap<String, Arc<SliceDevices>>,
    relisting: Option<BTreeMap<String, Arc<SliceDevices>>>,
}

impl SliceBook {
    /// Applies one watch event; whether the slices as readers see them changed.
    fn apply(&mut self, ev: watcher::Event<ResourceSlice>, settings: &CatalogSettings) -> bool {
        let part = |s: &ResourceSlice| Arc::new(SliceDevices::new(s, settings));
        match ev {
            watcher::Event::Init => {
                self.relisting = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(s) => {
                let listing = self.relisting.get_or_insert_with(BTreeMap::new);
                listing.insert(s.name_any(), part(&s));
                false
            }
            watcher::Event::InitDone => {
                self.parts = self.relisting.take().unwrap_or_default();
                true
            }
            watcher::Event::Apply(s) => {
                self.parts.insert(s.name_any(), part(&s));
                true
            }
            watcher::Event::Delete(s) => self.parts.remove(&s.name_any()).is_some(),
        }
    }
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
        let slices = Arc::new(Mutex::new(SliceBook::default()));
        let (set_listed, listed) = watch::channel(false);
        let feed1 = {
            let (book, settings, bump) = (slices.clone(), settings.clone(), bump(&changes));
            let events = watcher(
                Api::<ResourceSlice>::all(client.clone()),
                watcher::Config::default().page_size(crate::reflect::LIST_PAGE),
            )
            .default_backoff();
            let apply = move |ev: watcher::Event<ResourceSlice>| {
                let done = matches!(ev, watcher::Event::InitDone);
                let changed = book
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .apply(ev, &settings);
                if done {
                    set_listed.send_replace(true);
                }
                if changed {
                    bump();
                }
            };
            crate::reflect::follow(events, "resourceslices", apply, move |e| {
                f1("resourceslices", e)
            })
        };
        let (classes, feed2) = crate::reflect::reflected(
            Api::<DeviceClass>::all(client.clone()),
            watcher::Config::default(),
            "deviceclasses",
            bump(&changes),
            move |e| f2("deviceclasses", e),
        );
        Arc::new(Devices {
            slices,
            listed,
            classes,
            changes,
            settings,
            catalog: Mutex::new(None),
            tasks: vec![tokio::spawn(feed1), tokio::spawn(feed2)],
        })
    }

    /// Waits until both were listed once; the one not listed yet otherwise (its watch ended).
    pub async fn ready(&self) -> Result<(), &'static str> {
        let mut listed = self.listed.clone();
        // The guard `wait_for` returns is not Send: dropped inside.
        let slices = async move { listed.wait_for(|l| *l).await.map(|_| ()) };
        let (s, c) = tokio::join!(slices, self.classes.wait_until_ready());
        s.map_err(|_| "resourceslices")?;
        c.map_err(|_| "deviceclasses")
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
        let parts: Vec<Arc<SliceDevices>> = {
            let book = self.slices.lock().unwrap_or_else(|p| p.into_inner());
            book.parts.values().cloned().collect()
        };
        let c = Arc::new(DeviceCatalog::from_parts(
            &parts,
            &self.classes.state(),
            self.settings.clone(),
        ));
        *cache = Some((generation, c.clone()));
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use watcher::Event;

    fn slice(name: &str) -> ResourceSlice {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": "gpu.gpuplane.dev", "nodeName": name, "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}]}
        }))
        .unwrap_or_else(|e| panic!("slice {name}: {e}"))
    }

    #[test]
    fn the_book_follows_the_watch_and_a_relist_replaces_it_whole() {
        let settings = CatalogSettings::default();
        let mut book = SliceBook::default();
        let mut apply = |ev| book.apply(ev, &settings);
        // (event, whether readers see a change)
        let steps = [
            (Event::Init, false),
            (Event::InitApply(slice("a")), false),
            (Event::InitApply(slice("b")), false),
            (Event::InitDone, true),
            (Event::Apply(slice("c")), true),
            (Event::Delete(slice("a")), true),
            (Event::Delete(slice("a")), false),
            // The watch lists again: b went meanwhile, d came.
            (Event::Init, false),
            (Event::InitApply(slice("c")), false),
            (Event::InitApply(slice("d")), false),
        ];
        for (i, (ev, changed)) in steps.into_iter().enumerate() {
            assert_eq!(apply(ev), changed, "step {i}");
        }
        let names = |b: &SliceBook| b.parts.keys().cloned().collect::<Vec<_>>();
        // Until the listing is done, readers see the slices as before.
        assert_eq!(names(&book), ["b", "c"]);
        assert!(book.apply(Event::InitDone, &settings));
        assert_eq!(names(&book), ["c", "d"]);
        let catalog = DeviceCatalog::from_parts(
            &book.parts.values().cloned().collect::<Vec<_>>(),
            &[] as &[DeviceClass],
            settings,
        );
        assert_eq!(catalog.devices().len(), 2);
    }
}
