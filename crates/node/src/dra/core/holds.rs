//! A claim's units in the allocation ledger: held when it is prepared (refused while another
//! consumer holds one), released when it is unprepared, each counted per API. Held in every
//! allocation mode: where DRA owns its GPUs alone (partitioned) the scheduler keeps claims
//! apart, but a stale allocation must still not get a held unit, shares must fit their unit,
//! and telemetry names each device's holder from the ledger.

use super::{claim_label, PrepareError};
use crate::dra::checkpoint::ShareEntry;
use crate::dra::ClaimRef;
use crate::inventory::DeviceUuid;
use crate::ledger::{Holder, ShareRefused, ShareRequest};
use crate::metrics::{self, ApiLabel};
use crate::state::NodeState;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use tracing::info;

/// The claims' holds in the node's allocation ledger.
pub(super) struct Holds {
    /// The node state whose ledger holds the claims' units and shares.
    state: Arc<NodeState>,
}

/// Holds a claim's shares, or refuses naming the device and the holders.
fn hold_shares(
    ledger: &mut crate::ledger::Ledger,
    c: &ClaimRef,
    who: &Holder,
    shares: &[ShareEntry],
) -> Result<(), PrepareError> {
    if shares.is_empty() {
        return Ok(());
    }
    let wanted: Vec<ShareRequest> = shares
        .iter()
        .map(|e| ShareRequest {
            unit: e.unit.clone(),
            share_id: e.share_id.clone(),
            share: e.share,
            capacity: e.capacity,
        })
        .collect();
    let m = metrics::node();
    match ledger.hold_shares(&wanted, who) {
        Ok(()) => {
            m.ledger_handouts.get_or_create(&ApiLabel::DRA).inc();
            let held: Vec<String> = wanted
                .iter()
                .map(|w| format!("{} ({})", w.unit, w.share))
                .collect();
            info!(claim = %claim_label(c), shares = ?held, "shares handed out to claim");
            Ok(())
        }
        Err(refused) => {
            m.ledger_refusals.get_or_create(&ApiLabel::DRA).inc();
            let unit = match &refused {
                ShareRefused::Held(h) => &h.unit,
                ShareRefused::Full { unit, .. } => unit,
            };
            let device = shares
                .iter()
                .find(|e| e.unit == *unit)
                .map_or_else(|| unit.to_string(), |e| e.device.clone());
            Err(PrepareError::ShareRefused {
                device,
                cause: Box::new(refused),
            })
        }
    }
}

impl Holds {
    pub(super) fn new(state: Arc<NodeState>) -> Holds {
        Holds { state }
    }

    /// Records the claim's units in the allocation ledger, refusing units another
    /// consumer holds. Under the checkpoint lock, so two prepares cannot race for a unit; the
    /// device plugin's Allocate holds under the state's write lock, which `update` takes too.
    pub(super) fn hold(
        &self,
        c: &ClaimRef,
        units: &BTreeMap<String, DeviceUuid>,
        shares: &[ShareEntry],
    ) -> Result<(), PrepareError> {
        let who = Holder::Claim {
            uid: c.uid.clone(),
            name: claim_label(c),
        };
        self.state.update_holds(|s| {
            if let Err(e) = hold_shares(&mut s.ledger, c, &who, shares) {
                return (Err(e), false);
            }
            if units.is_empty() {
                return (Ok(()), !shares.is_empty());
            }
            let list: Vec<DeviceUuid> = units.values().cloned().collect();
            match s.ledger.hold_all(&list, &who, Instant::now()) {
                Ok(()) => {
                    metrics::node()
                        .ledger_handouts
                        .get_or_create(&ApiLabel::DRA)
                        .inc();
                    info!(claim = %claim_label(c), units = ?list, "handed out to claim");
                    (Ok(()), true)
                }
                Err(held) => {
                    // All or nothing: the shares just held go too.
                    s.ledger.release_claim(&c.uid);
                    metrics::node()
                        .ledger_refusals
                        .get_or_create(&ApiLabel::DRA)
                        .inc();
                    let device = units
                        .iter()
                        .find(|(_, u)| **u == held.unit)
                        .map_or(held.unit.to_string(), |(d, _)| d.clone());
                    (
                        Err(PrepareError::Held {
                            device,
                            cause: Box::new(held),
                        }),
                        !shares.is_empty(),
                    )
                }
            }
        })
    }

    /// Gives back whatever the claim holds: its shares and its whole units.
    pub(super) fn release(&self, c: &ClaimRef) {
        let released = self.state.update_holds(|s| {
            let r = s.ledger.release_claim(&c.uid);
            let changed = !r.is_empty();
            (r, changed)
        });
        if !released.is_empty() {
            metrics::node()
                .ledger_releases
                .get_or_create(&ApiLabel::DRA)
                .inc();
            info!(claim = %claim_label(c), units = ?released, "released by claim");
        }
    }
}
