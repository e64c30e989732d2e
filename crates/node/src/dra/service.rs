//! The kubelet's `DRAPlugin` gRPC service, v1 and v1beta1, over one [`DraDriver`].
//!
//! This file only adapts: it turns the kubelet's claims into [`ClaimRef`]s, rejects malformed
//! ones (empty uid, name or namespace) per claim, hands the rest to the driver, and turns the
//! per-claim answers back into protobuf. Failures are never a gRPC status: every claim UID the
//! kubelet asked about gets an entry, with the message in the claim's `error` field, so one bad
//! claim does not fail its neighbours. The driver's typed errors become that message here, and
//! only here ([`kubelet_error`]). Each failed claim is logged once, here, with its namespace,
//! name and uid.
//!
//! The driver runs on its own task: if the kubelet gives up on a call (its 45 s timeout), the
//! prepare or unprepare still finishes instead of being cancelled half way, and a panic in the
//! driver becomes a per-claim error instead of a broken call.

use super::{ClaimRef, ClaimUid, DraDriver, IdentityError, PrepareResult, PreparedDevice};
use crate::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// The kubelet API version a call came in on; for logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    V1,
    V1beta1,
}

impl Api {
    pub fn as_str(self) -> &'static str {
        match self {
            Api::V1 => "v1",
            Api::V1beta1 => "v1beta1",
        }
    }
}

/// Serves `v1.DRAPlugin` and `v1beta1.DRAPlugin` from one driver.
#[derive(Clone)]
pub struct DraService {
    driver: Arc<dyn DraDriver>,
}

/// A claim as it arrived, before validation.
#[derive(Debug, Clone)]
pub struct RawClaim {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

/// A request's claims, checked once at the edge: those for the driver, already parsed
/// ([`ClaimRef::parse`]), and the rest by uid with why.
#[derive(Debug, Default)]
pub struct Checked {
    pub accepted: Vec<ClaimRef>,
    /// Malformed requests (an empty field, one uid under two names): refused, whatever the
    /// operation.
    pub rejected: BTreeMap<String, (RawClaim, String)>,
    /// Well-formed but not a valid identity (a UID that is not a UUID's characters, a name
    /// that is not a DNS subdomain): no such claim can be prepared, so preparing it is
    /// refused and unpreparing it has nothing to do.
    pub invalid: BTreeMap<String, (RawClaim, IdentityError)>,
}

impl From<&ClaimRef> for RawClaim {
    fn from(c: &ClaimRef) -> Self {
        RawClaim {
            namespace: c.namespace.to_string(),
            uid: c.uid.to_string(),
            name: c.name.to_string(),
        }
    }
}

impl RawClaim {
    fn label(&self) -> String {
        format!("claim {}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// Splits the request into claims for the driver and per-claim refusals (keyed by uid).
/// A claim listed twice under the same identity is passed once; the same uid under two
/// different names is rejected.
pub fn validate(raw: Vec<RawClaim>) -> Checked {
    let mut accepted: BTreeMap<String, ClaimRef> = BTreeMap::new();
    let mut checked = Checked::default();
    for c in raw {
        if checked.rejected.contains_key(&c.uid) || checked.invalid.contains_key(&c.uid) {
            continue;
        }
        let missing: Vec<&str> = [
            ("uid", &c.uid),
            ("namespace", &c.namespace),
            ("name", &c.name),
        ]
        .into_iter()
        .filter(|(_, v)| v.is_empty())
        .map(|(what, _)| what)
        .collect();
        if !missing.is_empty() {
            accepted.remove(&c.uid);
            let msg = format!("invalid claim: empty {}", missing.join(", "));
            checked.rejected.insert(c.uid.clone(), (c, msg));
            continue;
        }
        let claim = match ClaimRef::parse(c.namespace.as_str(), c.uid.as_str(), c.name.as_str()) {
            Ok(claim) => claim,
            Err(e) => {
                accepted.remove(&c.uid);
                checked.invalid.insert(c.uid.clone(), (c, e));
                continue;
            }
        };
        match accepted.get(&c.uid) {
            Some(seen) if *seen != claim => {
                let msg = format!(
                    "invalid request: claim uid {} listed as both {}/{} and {}/{}",
                    c.uid, seen.namespace, seen.name, c.namespace, c.name
                );
                accepted.remove(&c.uid);
                checked.rejected.insert(c.uid.clone(), (c, msg));
            }
            Some(_) => {}
            None => {
                accepted.insert(c.uid.clone(), claim);
            }
        }
    }
    checked.accepted = accepted.into_values().collect();
    checked
}

/// The per-claim error the kubelet gets for a driver's error `e`:
/// `claim <namespace>/<name> (<uid>): <e>`.
pub fn kubelet_error(c: &ClaimRef, e: &impl Display) -> String {
    format!("claim {}/{} ({}): {e}", c.namespace, c.name, c.uid)
}

fn log_failure(api: Api, op: &str, namespace: &str, name: &str, uid: &str, error: &str) {
    tracing::warn!(
        api = api.as_str(),
        namespace,
        name,
        uid,
        error,
        "{op} failed for claim"
    );
}

impl DraService {
    pub fn new(driver: Arc<dyn DraDriver>) -> Self {
        DraService { driver }
    }

    /// The v1 gRPC server for this service.
    pub fn v1_server(&self) -> v1::dra_plugin_server::DraPluginServer<DraService> {
        v1::dra_plugin_server::DraPluginServer::new(self.clone())
    }

    /// The v1beta1 gRPC server for this service.
    pub fn v1beta1_server(&self) -> v1beta1::dra_plugin_server::DraPluginServer<DraService> {
        v1beta1::dra_plugin_server::DraPluginServer::new(self.clone())
    }

    /// Prepares the claims; every uid in `raw` gets an entry, failures are logged once.
    async fn prepare_claims(
        &self,
        api: Api,
        raw: Vec<RawClaim>,
    ) -> BTreeMap<String, PrepareResult> {
        let driver = self.driver.clone();
        answer(
            api,
            "NodePrepareResources",
            validate(raw),
            // No claim can be prepared under an identity that is not one.
            |c, e| Err(format!("{}: {e}", c.label())),
            move |claims| async move { driver.prepare(claims).await },
        )
        .await
    }

    /// Unprepares the claims; every uid in `raw` gets an entry, failures are logged once.
    async fn unprepare_claims(
        &self,
        api: Api,
        raw: Vec<RawClaim>,
    ) -> BTreeMap<String, Result<(), String>> {
        let driver = self.driver.clone();
        answer(
            api,
            "NodeUnprepareResources",
            validate(raw),
            // Nothing was ever prepared under an identity that is not one: nothing to undo.
            |c, e| {
                tracing::debug!(api = api.as_str(), claim = %c.label(), reason = %e, "nothing to unprepare: no such claim can be prepared");
                Ok(())
            },
            move |claims| async move { driver.unprepare(claims).await },
        )
        .await
    }
}

/// One kubelet call's answer, per claim uid: malformed claims are refused here, an invalid
/// identity is answered by `invalid`, and the rest are asked of the driver in a task of its own
/// (a panicking driver fails those claims, not the server), its errors made the kubelet's
/// strings ([`kubelet_error`]). Each failure is logged once.
async fn answer<T, E, F>(
    api: Api,
    op: &'static str,
    checked: Checked,
    invalid: impl Fn(&RawClaim, &IdentityError) -> Result<T, String>,
    ask: impl FnOnce(Vec<ClaimRef>) -> F,
) -> BTreeMap<String, Result<T, String>>
where
    T: Send + 'static,
    E: Display + Send + 'static,
    F: std::future::Future<Output = BTreeMap<ClaimUid, Result<T, E>>> + Send + 'static,
{
    let Checked {
        accepted: claims,
        rejected,
        invalid: bad,
    } = checked;
    let mut results = BTreeMap::new();
    for (uid, (c, e)) in bad {
        let result = invalid(&c, &e);
        if let Err(msg) = &result {
            log_failure(api, op, &c.namespace, &c.name, &uid, msg);
        }
        results.insert(uid, result);
    }
    for (uid, (c, msg)) in rejected {
        log_failure(api, op, &c.namespace, &c.name, &uid, &msg);
        results.insert(uid, Err(msg));
    }
    if claims.is_empty() {
        return results;
    }
    let mut answers = match tokio::spawn(ask(claims.clone())).await {
        Ok(answers) => answers,
        Err(e) => {
            tracing::error!(api = api.as_str(), error = %e, "DRA driver failed during {op}");
            BTreeMap::new()
        }
    };
    for c in claims {
        let result = match answers.remove(&c.uid) {
            Some(answer) => answer.map_err(|e| kubelet_error(&c, &e)),
            None => Err("internal error: the driver returned no result for this claim".to_string()),
        };
        match &result {
            Ok(_) => tracing::info!(
                api = api.as_str(),
                namespace = %c.namespace,
                name = %c.name,
                uid = %c.uid,
                "{op} done for claim"
            ),
            Err(msg) => log_failure(api, op, &c.namespace, &c.name, &c.uid, msg),
        }
        results.insert(c.uid.into(), result);
    }
    results
}

fn v1_device(d: PreparedDevice) -> v1::Device {
    v1::Device {
        request_names: d.requests,
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_ids,
        share_id: d.share_id,
    }
}

fn v1beta1_device(d: PreparedDevice) -> v1beta1::Device {
    if let Some(share) = &d.share_id {
        // v1beta1 has no share id; a kubelet speaking it predates consumable capacity.
        tracing::debug!(pool = %d.pool, device = %d.device, share_id = %share, "share id dropped on the v1beta1 API");
    }
    v1beta1::Device {
        request_names: d.requests,
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_ids,
    }
}

/// The kubelet's `DRAPlugin` service of one API version (`$v`, its generated module), which
/// calls are logged as `$api` and turn a prepared device into protobuf with `$device`: v1 and
/// v1beta1 differ only in the device's share id, so both are this one adapter.
macro_rules! dra_plugin_api {
    ($v:ident, $api:expr, $device:path) => {
        impl From<$v::Claim> for RawClaim {
            fn from(c: $v::Claim) -> Self {
                RawClaim {
                    namespace: c.namespace,
                    uid: c.uid,
                    name: c.name,
                }
            }
        }

        #[tonic::async_trait]
        impl $v::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                req: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let raw = req.into_inner().claims.into_iter().map(RawClaim::from);
                let claims: HashMap<String, $v::NodePrepareResourceResponse> = self
                    .prepare_claims($api, raw.collect())
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let resp = match result {
                            Ok(devices) => $v::NodePrepareResourceResponse {
                                devices: devices.into_iter().map($device).collect(),
                                error: String::new(),
                            },
                            Err(error) => $v::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error,
                            },
                        };
                        (uid, resp)
                    })
                    .collect();
                Ok(Response::new($v::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                req: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let raw = req.into_inner().claims.into_iter().map(RawClaim::from);
                let claims = self
                    .unprepare_claims($api, raw.collect())
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let error = result.err().unwrap_or_default();
                        (uid, $v::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($v::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_plugin_api!(v1, Api::V1, v1_device);
dra_plugin_api!(v1beta1, Api::V1beta1, v1beta1_device);

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(ns: &str, uid: &str, name: &str) -> RawClaim {
        RawClaim {
            namespace: ns.into(),
            uid: uid.into(),
            name: name.into(),
        }
    }

    #[test]
    fn validate_rejects_per_claim() {
        let Checked {
            accepted: ok,
            rejected: bad,
            invalid,
        } = validate(vec![
            raw("ns", "a", "one"),
            raw("", "b", "two"),
            raw("ns", "c", ""),
            raw("ns", "a", "one"),
            raw("ns", "d", "x"),
            raw("ns", "d", "y"),
            raw("ns", "", "z"),
        ]);
        assert!(invalid.is_empty());
        assert_eq!(ok, vec![ClaimRef::parse("ns", "a", "one").unwrap()]);
        assert_eq!(
            bad.keys().cloned().collect::<Vec<_>>(),
            vec!["", "b", "c", "d"]
        );
        assert_eq!(bad["b"].1, "invalid claim: empty namespace");
        assert_eq!(bad["c"].1, "invalid claim: empty name");
        assert!(bad["d"].1.contains("listed as both"), "{}", bad["d"].1);
        assert_eq!(bad[""].1, "invalid claim: empty uid");
    }

    #[test]
    fn validate_parses_identities_once() {
        let checked = validate(vec![
            raw("ns", "0b5c-12", "ok"),
            raw("ns", "../etc", "x"),
            raw("a/b", "0c", "x"),
            raw("ns", "0d", "Bad"),
        ]);
        assert_eq!(
            checked.accepted,
            vec![ClaimRef::parse("ns", "0b5c-12", "ok").unwrap()]
        );
        assert!(checked.rejected.is_empty());
        let why = |uid: &str| checked.invalid[uid].1.to_string();
        assert_eq!(
            why("../etc"),
            "claim UID `../etc` is not lower-case hex digits and dashes"
        );
        assert_eq!(why("0c"), "claim namespace `a/b` is not a DNS subdomain");
        assert_eq!(why("0d"), "claim name `Bad` is not a DNS subdomain");
    }

    #[test]
    fn the_kubelet_error_names_the_claim_then_the_cause() {
        let c = ClaimRef::parse("a", "0", "c").unwrap();
        let e = crate::dra::core::PrepareError::Worker("the job panicked".into());
        assert_eq!(
            kubelet_error(&c, &e),
            "claim a/c (0): the file-writing job failed: the job panicked"
        );
        assert_eq!(RawClaim::from(&c).label(), "claim a/c (0)");
    }

    #[test]
    fn v1beta1_drops_share_id() {
        let d = PreparedDevice {
            requests: vec!["gpu".into()],
            pool: "p".into(),
            device: "gpu-0".into(),
            cdi_ids: vec!["k8s.gpu.nvidia.com/claim=x".into()],
            share_id: Some("s".into()),
        };
        assert_eq!(v1_device(d.clone()).share_id.as_deref(), Some("s"));
        let b = v1beta1_device(d);
        assert_eq!(
            (b.pool_name.as_str(), b.device_name.as_str()),
            ("p", "gpu-0")
        );
    }
}
