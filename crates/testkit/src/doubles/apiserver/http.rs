//! The HTTP side: accept loop (hyper 1, HTTP/1.1 and h2c), request log and faults, path
//! routing to the store, and `Status` error answers.

use super::faults::FaultAction;
use super::ops::{ListOptions, Sub};
use super::patch::PatchType;
use super::resources::{ApiError, ResourceInfo};
use super::selector::{FieldSelector, LabelSelector};
use super::store::Store;
use super::watch::{self, WatchSpec};
use super::{lock, Shared};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch as signal;

pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

const MAX_BODY: usize = 16 << 20;
/// Upstream's default `--min-request-timeout` for watches without `timeoutSeconds`.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    stop: signal::Receiver<bool>,
) {
    let mut stop_accept = stop.clone();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::debug!(error = %e, "apiserver double: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = stop_accept.changed() => return,
        };
        let shared = shared.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(handle(shared, req).await) }
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::trace!(error = %e, "apiserver double: connection ended");
                },
                _ = stop.changed() => {}
            }
        });
    }
}

fn full(bytes: Vec<u8>) -> Body {
    Full::new(Bytes::from(bytes)).boxed_unsync()
}

fn respond(code: u16, body: Body) -> Response<Body> {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn json_response(code: u16, v: &Value) -> Response<Body> {
    respond(code, full(serde_json::to_vec(v).unwrap_or_default()))
}

fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = json_response(e.code, &e.to_status());
    if let Some(secs) = e.retry_after {
        r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    r
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().as_str().to_string();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    lock(&shared.log).push(&method, &path_and_query);
    let content_type = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            let code = if e.is::<http_body_util::LengthLimitError>() {
                413
            } else {
                400
            };
            return error_response(&ApiError::new(
                code,
                format!("reading the request body: {e}"),
            ));
        }
    };
    let fault = lock(&shared.faults).fire(&method, &path_and_query);
    if let Some(FaultAction::Status { code, retry_after }) = fault {
        let mut e = ApiError::new(code, format!("injected fault on {method} {path_and_query}"));
        e.retry_after = retry_after;
        return error_response(&e);
    }
    let query = Query::parse(parts.uri.query().unwrap_or(""));
    let response = match route(
        &shared,
        &method,
        parts.uri.path(),
        &query,
        &content_type,
        &body,
    ) {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    if let Some(FaultAction::Delay(d)) = fault {
        tokio::time::sleep(d).await;
    }
    response
}

/// Decoded query parameters, in order.
pub(crate) struct Query(Vec<(String, String)>);

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Query {
    pub fn parse(q: &str) -> Query {
        Query(
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect(),
        )
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }

    fn list_options(&self) -> Result<ListOptions, ApiError> {
        let bad = |e: super::selector::SelectorError| ApiError::bad_request(e.0);
        Ok(ListOptions {
            labels: LabelSelector::parse(self.get("labelSelector").unwrap_or("")).map_err(bad)?,
            fields: FieldSelector::parse(self.get("fieldSelector").unwrap_or("")).map_err(bad)?,
            limit: match self.get("limit") {
                Some(l) => Some(
                    l.parse()
                        .map_err(|_| ApiError::bad_request(format!("invalid limit {l:?}")))?,
                ),
                None => None,
            },
            continue_token: self
                .get("continue")
                .filter(|c| !c.is_empty())
                .map(String::from),
        })
    }

    fn dry_run(&self) -> bool {
        self.get("dryRun") == Some("All")
    }
}

/// What a path addresses.
struct Target {
    info: ResourceInfo,
    /// Namespace from the path; None for cluster-scoped or all-namespaces.
    ns: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(store: &Store, path: &str) -> Result<Target, ApiError> {
    let segs: Vec<String> = path
        .trim_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(ApiError::no_such_path()),
    };
    let target = |info, ns: Option<&str>, tail: &[&str]| -> Result<Target, ApiError> {
        let (name, sub) = match tail {
            [] => (None, None),
            [n] => (Some(n.to_string()), None),
            [n, s] => (Some(n.to_string()), Some(s.to_string())),
            _ => return Err(ApiError::no_such_path()),
        };
        Ok(Target {
            info,
            ns: ns.map(String::from),
            name,
            sub,
        })
    };
    if let ["namespaces", ns, plural, tail @ ..] = rest {
        if let Some(info) = store
            .resource(group, version, plural)
            .filter(|i| i.namespaced)
        {
            return target(info, Some(ns), tail);
        }
    }
    match rest {
        [plural, tail @ ..] => {
            let info = store
                .resource(group, version, plural)
                .ok_or_else(ApiError::no_such_path)?;
            if info.namespaced && !tail.is_empty() {
                return Err(ApiError::no_such_path());
            }
            target(info, None, tail)
        }
        _ => Err(ApiError::no_such_path()),
    }
}

fn body_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("decoding the request body: {e}")))
}

/// A `DeleteOptions` body (may be empty) and whether it or the query asks for a dry run.
fn delete_options(body: &[u8], dry_run: bool) -> Result<(Value, bool), ApiError> {
    let options = if body.is_empty() {
        json!({})
    } else {
        body_json(body)?
    };
    let dry = dry_run
        || options["dryRun"]
            .as_array()
            .is_some_and(|d| d.iter().any(|x| x == "All"));
    Ok((options, dry))
}

fn not_allowed(method: &str) -> ApiError {
    ApiError::new(
        405,
        format!("the server does not allow this method on the requested resource: {method}"),
    )
}

fn route(
    shared: &Arc<Shared>,
    method: &str,
    path: &str,
    query: &Query,
    content_type: &str,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    if let Some(answer) = fixed_path(path) {
        return Ok(answer);
    }
    let mut store = lock(&shared.store);
    let t = parse_path(&store, path)?;
    match t.name.as_deref() {
        None if method == "GET" && query.flag("watch") => {
            let spec = watch_spec(&t, query)?;
            // The watch reads the store from its own task.
            drop(store);
            Ok(respond(200, watch::start(shared.clone(), spec)))
        }
        None => collection(&mut store, &t, method, query, body),
        Some(name) => {
            let request = ObjectRequest {
                method,
                query,
                content_type,
                body,
            };
            object(&mut store, &t, name, request)
        }
    }
}

/// The paths that name no resource: probes and `/version`.
fn fixed_path(path: &str) -> Option<Response<Body>> {
    match path {
        "/healthz" | "/readyz" | "/livez" => Some(respond(200, full(b"ok".to_vec()))),
        "/version" => Some(json_response(
            200,
            &json!({
                "major": "1", "minor": "34", "gitVersion": "v1.34.0-gpuplane-double",
                "gitCommit": "", "gitTreeState": "clean", "buildDate": "", "goVersion": "",
                "compiler": "", "platform": "linux/amd64",
            }),
        )),
        _ => None,
    }
}

/// A WATCH's parameters from its query, as the real API server reads them.
fn watch_spec(t: &Target, query: &Query) -> Result<WatchSpec, ApiError> {
    let rv = query.get("resourceVersion").unwrap_or("");
    let after = match rv {
        "" | "0" => None,
        v => Some(
            v.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version {v:?}")))?,
        ),
    };
    let send_initial = query.get("sendInitialEvents");
    let timeout = match query.get("timeoutSeconds").map(str::parse::<u64>) {
        Some(Ok(s)) => Duration::from_secs(s),
        Some(Err(_)) => return Err(ApiError::bad_request("invalid timeoutSeconds")),
        None => DEFAULT_WATCH_TIMEOUT,
    };
    Ok(WatchSpec {
        info: t.info.clone(),
        ns: t.ns.clone(),
        opts: query.list_options()?,
        after,
        initial: send_initial == Some("true") || (after.is_none() && send_initial != Some("false")),
        initial_end_bookmark: send_initial == Some("true"),
        bookmarks: query.flag("allowWatchBookmarks"),
        timeout,
    })
}

/// A request on a collection (a path without an object name), other than WATCH.
fn collection(
    store: &mut Store,
    t: &Target,
    method: &str,
    query: &Query,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let info = &t.info;
    let dry_run = query.dry_run();
    match method {
        "GET" => Ok(json_response(
            200,
            &store.api_list(info, t.ns.as_deref(), &query.list_options()?)?,
        )),
        "POST" if info.namespaced && t.ns.is_none() => Err(not_allowed(method)),
        "POST" => {
            // The namespace an object lives in: "" for cluster-scoped.
            let ns = t.ns.clone().unwrap_or_default();
            Ok(json_response(
                201,
                &store.api_create(info, &ns, body_json(body)?, dry_run)?,
            ))
        }
        "DELETE" => {
            let (options, dry) = delete_options(body, dry_run)?;
            let list = store.api_delete_collection(
                info,
                t.ns.as_deref(),
                &query.list_options()?,
                &options,
                dry,
            )?;
            Ok(json_response(200, &list))
        }
        _ => Err(not_allowed(method)),
    }
}

/// `pods/<name>/eviction` (policy/v1 Eviction): the pod is deleted with the Eviction's
/// `deleteOptions` (its preconditions hold), and the answer is a `Status` of Success, as the
/// API server gives where no PodDisruptionBudget covers the pod (the double has none).
fn evict(
    store: &mut Store,
    info: &ResourceInfo,
    ns: &str,
    name: &str,
    body: &[u8],
    dry_run: bool,
) -> Result<Response<Body>, ApiError> {
    let eviction = if body.is_empty() {
        json!({})
    } else {
        body_json(body)?
    };
    let options = match &eviction["deleteOptions"] {
        Value::Null => json!({}),
        o => o.clone(),
    };
    let (options, dry) =
        delete_options(&serde_json::to_vec(&options).unwrap_or_default(), dry_run)?;
    store.api_delete(info, ns, name, &options, dry)?;
    Ok(json_response(
        201,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
    ))
}

/// What [`object`] needs of a request besides its path.
struct ObjectRequest<'a> {
    method: &'a str,
    query: &'a Query,
    content_type: &'a str,
    body: &'a [u8],
}

/// A request on the object `name` (or its status subresource).
fn object(
    store: &mut Store,
    t: &Target,
    name: &str,
    r: ObjectRequest<'_>,
) -> Result<Response<Body>, ApiError> {
    let info = &t.info;
    let dry_run = r.query.dry_run();
    // The namespace an object lives in: "" for cluster-scoped.
    let ns = t.ns.clone().unwrap_or_default();
    let sub = match t.sub.as_deref() {
        None => Sub::Main,
        Some("status") if info.has_status => Sub::Status,
        Some("eviction") if info.plural == "pods" && r.method == "POST" => {
            return evict(store, info, &ns, name, r.body, dry_run);
        }
        Some(_) => return Err(ApiError::no_such_path()),
    };
    let created = |(v, created): (Value, bool)| json_response(if created { 201 } else { 200 }, &v);
    match r.method {
        "GET" => Ok(json_response(200, &store.api_get(info, &ns, name)?)),
        "PUT" => Ok(created(store.api_replace(
            info,
            &ns,
            name,
            body_json(r.body)?,
            sub,
            dry_run,
        )?)),
        "PATCH" => {
            let kind = patch_type(r.content_type)?;
            Ok(created(
                store.api_patch(info, &ns, name, kind, r.body, sub, dry_run)?,
            ))
        }
        "DELETE" if sub == Sub::Main => {
            let (options, dry) = delete_options(r.body, dry_run)?;
            Ok(json_response(
                200,
                &store.api_delete(info, &ns, name, &options, dry)?,
            ))
        }
        method => Err(not_allowed(method)),
    }
}

/// The patch type a `Content-Type` names; 415 for any other.
fn patch_type(content_type: &str) -> Result<PatchType, ApiError> {
    PatchType::from_content_type(content_type).ok_or_else(|| {
        ApiError::new(
            415,
            format!(
                "the body of the request was in an unknown format ({content_type:?}) - \
                 accepted media types include: application/json-patch+json, \
                 application/merge-patch+json, application/apply-patch+yaml"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_parameters_are_percent_decoded() {
        let q = Query::parse(
            "&watch=true&fieldSelector=spec.nodeName%3Dnode-a&labelSelector=a+in+%28b%2Cc%29&x",
        );
        assert_eq!(q.get("fieldSelector"), Some("spec.nodeName=node-a"));
        assert_eq!(q.get("labelSelector"), Some("a in (b,c)"));
        assert_eq!(q.get("x"), Some(""));
        assert!(q.flag("watch"));
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    #[test]
    fn paths_name_resource_namespace_object_and_subresource() {
        let store = Store::new();
        let t = parse_path(&store, "/api/v1/namespaces/a/pods/p/status").unwrap();
        assert_eq!(
            (
                t.info.plural.as_str(),
                t.ns.as_deref(),
                t.name.as_deref(),
                t.sub.as_deref()
            ),
            ("pods", Some("a"), Some("p"), Some("status"))
        );
        let t = parse_path(&store, "/api/v1/pods").unwrap();
        assert_eq!((t.ns, t.name), (None, None));
        let t = parse_path(&store, "/api/v1/namespaces/a").unwrap();
        assert_eq!(
            (t.info.plural.as_str(), t.name.as_deref()),
            ("namespaces", Some("a"))
        );
        let t = parse_path(&store, "/apis/resource.k8s.io/v1/resourceslices/s").unwrap();
        assert_eq!((t.ns, t.name.as_deref()), (None, Some("s")));
        assert!(parse_path(
            &store,
            "/apis/resource.k8s.io/v1/namespaces/a/resourceslices"
        )
        .is_err());
        assert!(parse_path(&store, "/apis/example.com/v1/widgets").is_err());
        assert!(parse_path(&store, "/api/v1/pods/p").is_err());
    }
}
