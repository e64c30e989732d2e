//! This replica's side of escrow: the fast path's state is the model's
//! [`gpuplane_model::quota::escrow::replica`] (pure, the clock passed in); here only what
//! needs the process: a holder name unique within it. The batch task in [`super::commit`]
//! does the writes.

pub(crate) use gpuplane_model::quota::escrow::replica::{EscrowDue, LocalEscrow};
pub use gpuplane_model::quota::escrow::replica::{FLUSH_INTERVAL, IDLE_RETURN};

/// A name for one committer's escrows: `identity` (already unique per process) and a
/// sequence number, so that webhooks sharing a process never share an escrow.
pub fn holder_name(identity: &str) -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{identity}#{n}")
}
