//! A watch-fed store of one resource, indexed by namespace (pure: it applies
//! `kube::runtime::watcher` events handed to it and says which namespaces they touched).

use kube::runtime::watcher::Event;
use kube::ResourceExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Objects by namespace (`""` for cluster-scoped ones) and name.
#[derive(Debug)]
pub struct Cache<K> {
    objects: BTreeMap<String, BTreeMap<String, Arc<K>>>,
    /// Objects of a re-list in progress (`Init` .. `InitDone`).
    relisting: Option<Vec<K>>,
    /// Whether a first full list has arrived.
    ready: bool,
}

impl<K> Default for Cache<K> {
    fn default() -> Self {
        Cache {
            objects: BTreeMap::new(),
            relisting: None,
            ready: false,
        }
    }
}

impl<K: kube::Resource + Clone> Cache<K> {
    /// Applies one event; returns the namespaces whose objects changed.
    pub fn apply(&mut self, event: Event<K>) -> BTreeSet<String> {
        let mut touched = BTreeSet::new();
        match event {
            Event::Init => self.relisting = Some(Vec::new()),
            Event::InitApply(o) => match self.relisting.as_mut() {
                Some(buf) => buf.push(o),
                None => {
                    touched.insert(self.put(o));
                }
            },
            Event::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                touched.extend(self.objects.keys().cloned());
                self.objects.clear();
                for o in listed {
                    touched.insert(self.put(o));
                }
                self.ready = true;
            }
            Event::Apply(o) => {
                touched.insert(self.put(o));
            }
            Event::Delete(o) => {
                let ns = o.namespace().unwrap_or_default();
                if let Some(m) = self.objects.get_mut(&ns) {
                    m.remove(&o.name_any());
                    if m.is_empty() {
                        self.objects.remove(&ns);
                    }
                }
                touched.insert(ns);
            }
        }
        touched
    }

    fn put(&mut self, o: K) -> String {
        let ns = o.namespace().unwrap_or_default();
        self.objects
            .entry(ns.clone())
            .or_default()
            .insert(o.name_any(), Arc::new(o));
        ns
    }

    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// The objects of one namespace, by name.
    pub fn in_namespace(&self, namespace: &str) -> Vec<Arc<K>> {
        self.objects
            .get(namespace)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<K>> {
        self.objects.get(namespace)?.get(name).cloned()
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<K>> {
        self.objects.values().flat_map(|m| m.values())
    }

    pub fn namespaces(&self) -> impl Iterator<Item = &String> {
        self.objects.keys()
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
}
