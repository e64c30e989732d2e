//! Shares of one device: what an allocation of DRA consumable capacity (KEP-5075) costs, pure.
//!
//! A device published with `allowMultipleAllocations: true` is allocated in shares: each
//! allocation consumes part of its capacities, as [`super::capacity`] computes it the
//! scheduler's way. The scheduler applies those checks to every device, shared or not, so quota
//! does too once a request names capacities.
//!
//! A share costs `gpuMemory` = the `memory` it consumes and `gpus` = the `compute` it consumes
//! over the device's `compute` value, times the device's own share of a GPU (a whole GPU is 1,
//! a MIG `3g.40gb` 3/7): on a whole GPU `compute: "80"` of `"100"` is 0.8. A capacity the device
//! does not publish as consumable is charged whole, the most a share can take.

use super::capacity::{ConsumableCapacity, COMPUTE_CAPACITY, MEMORY_CAPACITY};
use super::catalog::{qualified_name, CatalogDevice, DeviceCatalog};
use super::ratio::Gpus;
use super::usage::{Charge, Dimension, Memory, UnknownCharge};
use crate::quantity::{Quantity, QuantityError};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;
use std::collections::BTreeMap;

/// Capacities by name as a request asks for them (`capacity.requests`) or an allocation result
/// consumed them (`consumedCapacity`), read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapacityAmounts(BTreeMap<String, Quantity>);

impl CapacityAmounts {
    /// Every value read; the first that is not a quantity is returned as (name, value, why).
    pub fn read(
        map: Option<&BTreeMap<String, ApiQuantity>>,
    ) -> Result<CapacityAmounts, (String, String, QuantityError)> {
        map.into_iter()
            .flatten()
            .map(|(k, v)| match Quantity::parse_trimmed(&v.0) {
                Ok(q) => Ok((k.clone(), q)),
                Err(e) => Err((k.clone(), v.0.clone(), e)),
            })
            .collect::<Result<_, _>>()
            .map(CapacityAmounts)
    }

    /// The values that read as quantities; the others are left out (charged as if not given).
    pub fn readable(map: Option<&BTreeMap<String, ApiQuantity>>) -> CapacityAmounts {
        CapacityAmounts(
            map.into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k.clone(), Quantity::parse_trimmed(&v.0).ok()?)))
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The amount of `driver`'s capacity `name` (written bare or with the driver's domain; the
    /// largest if both are).
    pub fn get(&self, driver: &str, name: &str) -> Option<&Quantity> {
        let want = (driver.to_string(), name.to_string());
        self.0
            .iter()
            .filter(|(k, _)| qualified_name(driver, k) == want)
            .map(|(_, q)| q)
            .max()
    }
}

/// What one allocation for a request asking `asked` costs on `d`: the whole device, or on a
/// multi-allocatable device the share it would consume. `None` when the scheduler could not
/// allocate it there (see the module docs).
pub fn allocation_charge(d: &CatalogDevice, asked: &CapacityAmounts) -> Option<Charge> {
    if asked.is_empty() && !d.multi_allocatable {
        return Some(DeviceCatalog::device_usage(d));
    }
    if asked.0.keys().any(|name| !d.has_capacity(name)) {
        return None;
    }
    // A capacity not readable as consumable constrains nothing here (the charge then errs high).
    let consume = |cap: &Option<ConsumableCapacity>, name: &str| match cap {
        Some(c) => c.consumed(asked.get(&d.driver, name)).map(Some),
        None => Some(None),
    };
    let memory = consume(&d.memory_capacity, MEMORY_CAPACITY)?;
    let compute = consume(&d.compute_capacity, COMPUTE_CAPACITY)?;
    Some(if d.multi_allocatable {
        share_charge(d, memory.as_ref(), compute.as_ref())
    } else {
        DeviceCatalog::device_usage(d)
    })
}

/// A share of `d` consuming `memory` and `compute`; what is not given is charged whole.
fn share_charge(
    d: &CatalogDevice,
    memory: Option<&Quantity>,
    compute: Option<&Quantity>,
) -> Charge {
    let whole = DeviceCatalog::device_usage(d);
    let total = d.compute_capacity.as_ref().map(|c| &c.value);
    let gpus = match (d.share, compute.zip(total)) {
        (Some(unit), Some((c, t))) => compute_share(unit, c, t),
        _ => None,
    };
    priced(&whole, memory.and_then(Memory::from_quantity), gpus)
}

/// `whole` with the given dimensions replaced (and their unknowns dropped).
fn priced(whole: &Charge, memory: Option<Memory>, gpus: Option<Gpus>) -> Charge {
    let mut c = whole.clone();
    if let Some(m) = memory {
        c.usage.gpu_memory = m;
        c.unknown.retain(|u| u.dimension != Dimension::GpuMemory);
    }
    if let Some(g) = gpus {
        c.usage.gpus = g;
        c.unknown.retain(|u| u.dimension != Dimension::Gpus);
    }
    c
}

/// `unit * consumed / total`, exactly; `None` when either is unreadable or `total` is zero.
pub fn compute_share(unit: Gpus, consumed: &Quantity, total: &Quantity) -> Option<Gpus> {
    // Thousandths, so fractional percentages stay exact.
    let milli = |q: &Quantity| q.milli_value().and_then(|v| u64::try_from(v).ok());
    unit.checked_mul_int(milli(consumed)?)
        .ok()?
        .checked_div_int(milli(total)?)
        .ok()
}

/// What an allocated share costs, from its result's `consumedCapacity`: on `device` (when it
/// is still published) as [`allocation_charge`] prices it; otherwise `compute` is read as a
/// percent of one whole GPU, and what is missing is unknown.
pub fn settled_share_charge(
    consumed: &CapacityAmounts,
    driver: &str,
    device: Option<&CatalogDevice>,
    what: &str,
) -> Charge {
    let memory = consumed.get(driver, MEMORY_CAPACITY);
    let compute = consumed.get(driver, COMPUTE_CAPACITY);
    if let Some(d) = device {
        return share_charge(d, memory, compute);
    }
    let hundred = Quantity::new(100, crate::quantity::Format::DecimalSI);
    let unknown = |dimension, name| UnknownCharge {
        dimension,
        why: format!("{what} is not published and its consumedCapacity has no {name}"),
    };
    let whole = Charge {
        usage: Default::default(),
        unknown: vec![
            unknown(Dimension::Gpus, COMPUTE_CAPACITY),
            unknown(Dimension::GpuMemory, MEMORY_CAPACITY),
        ],
    };
    priced(
        &whole,
        memory.and_then(Memory::from_quantity),
        compute.and_then(|c| compute_share(Gpus::ONE, c, &hundred)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_is_a_share_of_the_units_gpus() {
        let q = |s: &str| Quantity::parse(s).unwrap();
        assert_eq!(
            compute_share(Gpus::ONE, &q("80"), &q("100")),
            Gpus::new(4, 5)
        );
        assert_eq!(compute_share(Gpus::ONE, &q("80"), &q("0")), None);
    }
}
