//! A kube-apiserver double: a real HTTP server on 127.0.0.1 that the real `kube` client talks
//! to, following the API server's semantics for any resource in its table (see
//! `resources.rs`; more with [`ApiServerDouble::register`]).
//!
//! What it does as upstream does: one global resourceVersion; uid, creationTimestamp,
//! generation (bumped on desired-state changes) and generateName on create; GET/LIST with
//! label and field selectors, `limit`/`continue`; POST (409 AlreadyExists), PUT (409 Conflict on
//! a stale resourceVersion), PATCH (merge, JSON patch, strategic merge with keyed lists merged
//! by key; server-side apply as merge patch, apply creating), DELETE (preconditions; finalizers set deletionTimestamp and the
//! object goes when the last finalizer does), DELETE collection, the `status` subresource,
//! WATCH with bookmarks, `timeoutSeconds`, selector transitions and 410 Gone from a bounded
//! history, no-op updates that write nothing; errors as `Status` objects.
//!
//! On create, `status` of resources with a status subresource is dropped (pods get
//! `phase: Pending`), as upstream strategies do; seed a status with `put_json` or `/status`.
//!
//! What it leaves out: authn/authz, admission, defaulting and schema validation (bodies are
//! stored as sent, beyond metadata), namespaces need not exist, field ownership for apply,
//! garbage collection (propagation policies act as Background), and pods are deleted at once
//! (no kubelet to wait for).
//!
//! For tests: [`Fault`]s by method and path, [`ApiServerDouble::drop_watches`], a request log
//! with [`ApiServerDouble::count_writes`] and, as RBAC attributes, [`ApiServerDouble::api_calls`],
//! and direct store access (`get_json`, `put_json`, `list_json`) that skips HTTP but still
//! notifies watchers.

mod audit;
mod faults;
mod http;
mod ops;
mod patch;
mod resources;
pub mod selector;
mod store;
mod watch;

pub use audit::{ApiCall, ResourceCall};
pub use faults::{Fault, FaultAction, FaultId};
pub use resources::ResourceInfo;

use faults::{FaultBook, RequestLog};
use gpuplane_model::report::chain;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use store::Store;
use tokio::sync::watch as signal;
use tokio::task::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    #[error("apiserver double: binding 127.0.0.1:0: {}", chain(.0))]
    Bind(std::io::Error),
    #[error("apiserver double: building a kube client for {url}: {}", chain(.cause))]
    Client { url: String, cause: kube::Error },
    #[error("apiserver double: {0}")]
    Object(String),
}

/// State shared by the server tasks and the handle.
struct Shared {
    store: Mutex<Store>,
    faults: Mutex<FaultBook>,
    log: Mutex<RequestLog>,
    /// Bumped to end every open watch.
    drops: signal::Sender<u64>,
    bookmark_every: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running API server double. Dropping it stops the server (as `stop` does).
pub struct ApiServerDouble {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: signal::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl ApiServerDouble {
    /// Binds 127.0.0.1 on a free port and serves until stopped. Needs a tokio runtime.
    pub async fn start() -> Result<ApiServerDouble, ApiServerError> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(ApiServerError::Bind)?;
        let addr = listener.local_addr().map_err(ApiServerError::Bind)?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new()),
            faults: Mutex::new(FaultBook::default()),
            log: Mutex::new(RequestLog::default()),
            drops: signal::channel(0).0,
            bookmark_every: Duration::from_secs(10),
        });
        let (stop, stopped) = signal::channel(false);
        let task = tokio::spawn(http::serve(listener, shared.clone(), stopped));
        Ok(ApiServerDouble {
            shared,
            addr,
            stop,
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client config pointing at the double (no auth, no TLS, namespace `default`), for
    /// tests that tune it, e.g. `read_timeout`.
    pub fn config(&self) -> Result<kube::Config, ApiServerError> {
        let url = self.url();
        let uri = url
            .parse()
            .map_err(|e| ApiServerError::Object(format!("invalid URL {url}: {e}")))?;
        Ok(kube::Config::new(uri))
    }

    /// The real kube client, talking HTTP to the double.
    pub fn client(&self) -> Result<kube::Client, ApiServerError> {
        kube::Client::try_from(self.config()?).map_err(|source| ApiServerError::Client {
            url: self.url(),
            cause: source,
        })
    }

    /// Stops serving: the listener closes and open connections (watches included) end.
    pub async fn stop(mut self) {
        self.signal_stop();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    fn signal_stop(&self) {
        self.stop.send_replace(true);
        self.drop_watches();
    }

    /// Serves a further resource (e.g. a CRD), replacing one with the same group, version and
    /// plural.
    pub fn register(&self, info: ResourceInfo) {
        lock(&self.shared.store).register(info);
    }

    /// Arms a fault; it fires on matching requests until its count or time runs out or it is
    /// cleared.
    pub fn inject(&self, fault: Fault) -> FaultId {
        lock(&self.shared.faults).inject(fault)
    }

    pub fn clear_fault(&self, id: FaultId) {
        lock(&self.shared.faults).clear(id);
    }

    pub fn clear_faults(&self) {
        lock(&self.shared.faults).clear_all();
    }

    /// Ends every open watch now (the response ends cleanly, as when the API server closes a
    /// watch); clients re-watch from their last resourceVersion.
    pub fn drop_watches(&self) {
        self.shared.drops.send_modify(|g| *g += 1);
    }

    /// Ends every open watch and answers new ones 500 for `d`.
    pub fn fail_watches(&self, d: Duration) -> FaultId {
        let id = self.inject(Fault::status("GET", "watch=", 500).lasting(d));
        self.drop_watches();
        id
    }

    /// Forgets the event history (an etcd compaction): a watch or `continue` from an older
    /// resourceVersion gets 410 Gone and the client must list again.
    pub fn compact(&self) {
        lock(&self.shared.store).compact();
    }

    /// Keeps at most `n` events of history (default 10 000).
    pub fn set_history_limit(&self, n: usize) {
        lock(&self.shared.store).set_history_cap(n);
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    /// Every request so far as (method, path and query), oldest first.
    pub fn requests(&self) -> Vec<(String, String)> {
        lock(&self.shared.log).all()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.log).clear();
    }

    /// Requests with `method` (or `*`) whose path and query contain `path_contains`.
    pub fn count_requests(&self, method: &str, path_contains: &str) -> usize {
        self.requests()
            .iter()
            .filter(|(m, p)| {
                (method == "*" || m.eq_ignore_ascii_case(method)) && p.contains(path_contains)
            })
            .count()
    }

    /// POST, PUT, PATCH and DELETE requests so far (faulted ones included).
    pub fn count_writes(&self) -> usize {
        self.requests()
            .iter()
            .filter(|(m, _)| faults::is_write(m))
            .count()
    }

    /// One stored object; `api_version` is `v1` or `group/version`; `namespace` None for
    /// cluster-scoped resources.
    pub fn get_json(
        &self,
        api_version: &str,
        plural: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let store = lock(&self.shared.store);
        let info = resource(&store, api_version, plural)?;
        store.get(&info, namespace.unwrap_or(""), name).cloned()
    }

    /// Stored objects of a resource in key order, in one namespace or (None) all.
    pub fn list_json(
        &self,
        api_version: &str,
        plural: &str,
        namespace: Option<&str>,
    ) -> Vec<Value> {
        let store = lock(&self.shared.store);
        let Some(info) = resource(&store, api_version, plural) else {
            return Vec::new();
        };
        store
            .iter(&info, namespace)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Stores `object` (its `apiVersion` and `kind` pick the resource) bypassing validation and
    /// preconditions, at a new resourceVersion, notifying watchers; returns what was stored.
    pub fn put_json(&self, object: Value) -> Result<Value, ApiServerError> {
        lock(&self.shared.store)
            .raw_put(object)
            .map_err(ApiServerError::Object)
    }

    /// Removes an object outright (finalizers ignored), notifying watchers.
    pub fn delete_json(
        &self,
        api_version: &str,
        plural: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let mut store = lock(&self.shared.store);
        let info = resource(&store, api_version, plural)?;
        store.commit_delete(&info, namespace.unwrap_or(""), name)
    }
}

fn resource(store: &Store, api_version: &str, plural: &str) -> Option<ResourceInfo> {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    store.resource(group, version, plural)
}

impl Drop for ApiServerDouble {
    fn drop(&mut self) {
        self.signal_stop();
    }
}
