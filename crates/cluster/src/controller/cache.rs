//! A watch-fed store of one resource, read by namespace: kube-runtime's reflector store (the
//! one the webhook's `cluster.rs` reads too) fed by the loop itself, in its own task, so an
//! event and the namespaces it touched are seen together. The store keeps the objects (and a
//! re-list in progress out of sight until it is complete); beside it the loop keeps which
//! names each namespace holds, as it reads namespace by namespace.

use kube::runtime::reflector::{store::Writer, ObjectRef, Store};
use kube::runtime::watcher::Event;
use kube::ResourceExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Objects by namespace (`""` for cluster-scoped ones) and name.
pub struct Cache<K: kube::Resource<DynamicType = ()> + Clone + 'static> {
    writer: Writer<K>,
    store: Store<K>,
    /// Names of the stored objects, by namespace.
    names: BTreeMap<String, BTreeSet<String>>,
    /// Whether a first full list has arrived.
    ready: bool,
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Default for Cache<K> {
    fn default() -> Self {
        let writer = Writer::default();
        Cache {
            store: writer.as_reader(),
            writer,
            names: BTreeMap::new(),
            ready: false,
        }
    }
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Cache<K> {
    /// Applies one event; returns the namespaces whose objects changed.
    pub fn apply(&mut self, event: Event<K>) -> BTreeSet<String> {
        self.writer.apply_watcher_event(&event);
        let mut touched = BTreeSet::new();
        match event {
            Event::Init | Event::InitApply(_) => {}
            Event::InitDone => {
                touched.extend(std::mem::take(&mut self.names).into_keys());
                for o in self.store.state() {
                    touched.insert(self.index(&o));
                }
                self.ready = true;
            }
            Event::Apply(o) => {
                touched.insert(self.index(&o));
            }
            Event::Delete(o) => {
                let ns = o.namespace().unwrap_or_default();
                if let Some(m) = self.names.get_mut(&ns) {
                    m.remove(&o.name_any());
                    if m.is_empty() {
                        self.names.remove(&ns);
                    }
                }
                touched.insert(ns);
            }
        }
        touched
    }

    fn index(&mut self, o: &K) -> String {
        let ns = o.namespace().unwrap_or_default();
        self.names
            .entry(ns.clone())
            .or_default()
            .insert(o.name_any());
        ns
    }

    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// The objects of one namespace, by name.
    pub fn in_namespace(&self, namespace: &str) -> Vec<Arc<K>> {
        self.names
            .get(namespace)
            .into_iter()
            .flatten()
            .filter_map(|name| self.get(namespace, name))
            .collect()
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<K>> {
        let key = ObjectRef::new(name);
        let key = if namespace.is_empty() {
            key
        } else {
            key.within(namespace)
        };
        self.store.get(&key)
    }

    /// Every object, in no particular order.
    pub fn all(&self) -> impl Iterator<Item = Arc<K>> {
        self.store.state().into_iter()
    }

    pub fn namespaces(&self) -> impl Iterator<Item = &String> {
        self.names.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::ObjectMeta;

    fn pod(ns: &str, name: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    #[test]
    fn a_relist_replaces_the_contents_at_once_and_touches_old_and_new_namespaces() {
        let mut c = Cache::default();
        assert!(!c.is_ready());
        c.apply(Event::Init);
        c.apply(Event::InitApply(pod("a", "p1")));
        assert!(c.in_namespace("a").is_empty(), "visible before InitDone");
        let t = c.apply(Event::InitDone);
        assert!(c.is_ready());
        assert_eq!(t, ["a".to_string()].into());
        assert_eq!(
            c.apply(Event::Apply(pod("b", "p2"))),
            ["b".to_string()].into()
        );
        c.apply(Event::Init);
        c.apply(Event::InitApply(pod("c", "p3")));
        let t = c.apply(Event::InitDone);
        assert_eq!(t, ["a", "b", "c"].map(String::from).into());
        assert!(c.get("a", "p1").is_none() && c.get("c", "p3").is_some());
        c.apply(Event::Delete(pod("c", "p3")));
        assert_eq!(c.namespaces().count(), 0);
    }

    #[test]
    fn cluster_scoped_objects_are_read_under_the_empty_namespace() {
        use k8s_openapi::api::core::v1::Namespace;
        let ns = |name: &str| Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let mut c = Cache::default();
        c.apply(Event::Init);
        c.apply(Event::InitApply(ns("team-a")));
        assert_eq!(c.apply(Event::InitDone), [String::new()].into());
        assert!(c.get("", "team-a").is_some());
        assert_eq!(c.in_namespace("").len(), 1);
        assert_eq!(c.all().count(), 1);
    }
}
