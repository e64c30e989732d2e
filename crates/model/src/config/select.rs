//! The rule between the config's `sharing.consumableCapacity` and `dynamicMig` sections.

use super::{invalid, ConfigError};
use crate::gpu_select::GpuSelect;

/// A GPU is either shared whole (consumable capacity) or partitioned by dynamic MIG, never
/// both. Where both sections name the same GPU index, or the same model, explicitly, the file
/// contradicts itself and is refused. Any other overlap (`all` in either, an index in one and
/// a model in the other, the node label turning sharing on) is settled by the rule that
/// dynamic MIG wins: a GPU that takes part in it is published as partitionable devices, and
/// sharing only ever sees the others ([`crate::sharing::shared_units`] reads
/// [`crate::inventory::Inventory::dra_devices`], which leaves dynamic GPUs out).
pub fn check_shared_and_dynamic(
    path: &str,
    shares: Option<&crate::sharing::ShareConfig>,
    dynamic: &crate::dynamic_mig::DynamicMigConfig,
) -> Result<(), ConfigError> {
    let Some(shares) = shares else { return Ok(()) };
    let (field, both) = match (&shares.select, &dynamic.select) {
        (GpuSelect::Indices(a), GpuSelect::Indices(b)) => (
            "gpus",
            a.intersection(b)
                .map(|i| format!("GPU {i}"))
                .collect::<Vec<_>>(),
        ),
        (GpuSelect::Models(a), GpuSelect::Models(b)) => (
            "models",
            a.intersection(b).map(|m| format!("`{m}`")).collect(),
        ),
        _ => return Ok(()),
    };
    if both.is_empty() {
        return Ok(());
    }
    Err(invalid(
        path,
        &format!("{}.{field}", crate::dynamic_mig::SECTION),
        format!(
            "{} {} also in sharing.consumableCapacity.{field}: a GPU is shared whole or \
             partitioned by dynamic MIG, not both; remove it from one of the two lists",
            both.join(", "),
            if both.len() == 1 { "is" } else { "are" }
        ),
    ))
}
