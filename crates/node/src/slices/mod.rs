//! ResourceSlices: what this node offers to the DRA scheduler, and keeping the API server in
//! step. Rendering, validation and the write plan are pure (`gpuplane_model::slices`, all
//! re-exported here); [`publisher`] is the I/O shell: it lists this node's slices, writes only
//! what differs, deletes orphans, retries conflicts and transient failures, and re-syncs when
//! the desired slices change or someone (the kubelet at its start-up) deletes ours.

pub use gpuplane_model::slices::*;

pub mod publisher;

pub use publisher::{
    keep_published, LoopOptions, PublishError, RetryPolicy, SlicePublisher, SyncStats,
};
