//! Shares of one device: DRA consumable capacity (KEP-5075), pure.
//!
//! A device published with `allowMultipleAllocations: true` is allocated in shares: each
//! allocation consumes part of its capacities. What it consumes is what the scheduler computes
//! (k8s.io/dynamic-resource-allocation, `calculateConsumedCapacity` and `violatesPolicy`): a
//! capacity the request names is rounded up by its `requestPolicy` (below `validRange.min` to
//! `min`, else to the next `min + k*step`; with `validValues` to the next listed value); one it
//! omits is consumed at the policy's `default`, or whole. A result above `max`, off the step grid,
//! not a listed value, or above the capacity's value cannot be allocated on that device, and
//! neither can a request naming a capacity the device does not publish. The scheduler applies
//! these checks to every device, shared or not, so quota does too once a request names
//! capacities.
//!
//! A share costs `gpuMemory` = the `memory` it consumes and `gpus` = the `compute` it consumes
//! over the device's `compute` value, times the device's own share of a GPU (a whole GPU is 1,
//! a MIG `3g.40gb` 3/7): on a whole GPU `compute: "80"` of `"100"` is 0.8. A capacity the device
//! does not publish as consumable is charged whole, the most a share can take.

use super::catalog::{qualified_name, CatalogDevice, DeviceCatalog};
use super::charge::{Charge, UnknownCharge};
use super::ratio::Gpus;
use super::usage::{Dimension, Memory};
use crate::quantity::{Quantity, QuantityError};
use k8s_openapi::api::resource::v1::DeviceCapacity;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;
use std::collections::BTreeMap;

/// The capacity a share's GPU memory is taken from.
pub const MEMORY_CAPACITY: &str = "memory";
/// The capacity a share's compute is taken from: percent of the unit's SMs (`"100"` whole).
pub const COMPUTE_CAPACITY: &str = "compute";

/// `requestPolicy.validRange` of a capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidRange {
    pub min: Quantity,
    pub max: Option<Quantity>,
    pub step: Option<Quantity>,
}

/// `requestPolicy` of a capacity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestPolicy {
    pub default: Option<Quantity>,
    pub valid_range: Option<ValidRange>,
    pub valid_values: Vec<Quantity>,
}

/// One published capacity as allocation reads it: its value and request policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumableCapacity {
    pub value: Quantity,
    pub policy: Option<RequestPolicy>,
}

impl ConsumableCapacity {
    /// `None` when a quantity in it does not parse (API validation rules that out); the caller
    /// then charges the capacity whole.
    pub fn from_api(c: &DeviceCapacity) -> Option<ConsumableCapacity> {
        let read = |q: &ApiQuantity| Quantity::parse_trimmed(&q.0).ok();
        let read_opt = |q: Option<&ApiQuantity>| q.map(|q| read(q).ok_or(())).transpose().ok();
        let policy = match &c.request_policy {
            None => None,
            Some(p) => Some(RequestPolicy {
                default: read_opt(p.default.as_ref())?,
                valid_range: match &p.valid_range {
                    None => None,
                    Some(r) => Some(ValidRange {
                        min: read(&r.min)?,
                        max: read_opt(r.max.as_ref())?,
                        step: read_opt(r.step.as_ref())?,
                    }),
                },
                valid_values: p
                    .valid_values
                    .iter()
                    .flatten()
                    .map(read)
                    .collect::<Option<_>>()?,
            }),
        };
        Some(ConsumableCapacity {
            value: read(&c.value)?,
            policy,
        })
    }

    /// What one allocation consumes of this capacity when the request asks `requested` (`None`:
    /// it does not name it); `None` when the device cannot grant that.
    pub fn consumed(&self, requested: Option<&Quantity>) -> Option<Quantity> {
        let c = match (requested, &self.policy) {
            (
                None,
                Some(RequestPolicy {
                    default: Some(d), ..
                }),
            ) => *d,
            (None, _) => self.value,
            (Some(r), None) => *r,
            (Some(r), Some(p)) => p.round_up(r)?,
        };
        let breaks_policy = self.policy.as_ref().is_some_and(|p| p.violated_by(&c));
        (!c.is_negative() && c <= self.value && !breaks_policy).then_some(c)
    }
}

impl RequestPolicy {
    /// `calculateConsumedCapacity`'s rounding; `None` where the grid cannot be computed.
    fn round_up(&self, r: &Quantity) -> Option<Quantity> {
        if let Some(range) = &self.valid_range {
            if *r < range.min {
                return Some(range.min);
            }
            return match &range.step {
                None => Some(*r),
                Some(step) => Grid::new(&range.min, step)?.round_up(r),
            };
        }
        // Past the largest valid value the request stays as asked, which then breaks the policy.
        Some(
            self.valid_values
                .iter()
                .find(|v| r <= v)
                .copied()
                .unwrap_or(*r),
        )
    }

    /// `violatesPolicy`: the default is always allowed.
    fn violated_by(&self, c: &Quantity) -> bool {
        if self.default.as_ref() == Some(c) {
            return false;
        }
        if let Some(range) = &self.valid_range {
            if range.max.is_some_and(|m| *c > m) {
                return true;
            }
            return match &range.step {
                None => false,
                Some(step) => Grid::new(&range.min, step).is_none_or(|g| !g.holds(c)),
            };
        }
        !self.valid_values.is_empty() && !self.valid_values.contains(c)
    }
}

/// The values `min + k*step`, counted in whole units when both are integers (the scheduler's
/// integer path) and in thousandths otherwise (its fractional path).
struct Grid {
    min: i64,
    step: i64,
    milli: bool,
    step_quantity: Quantity,
}

impl Grid {
    fn new(min: &Quantity, step: &Quantity) -> Option<Grid> {
        let milli = !(min.is_integer() && step.is_integer());
        let scaled = |q: &Quantity| if milli { q.milli_value() } else { q.value() };
        let g = Grid {
            min: scaled(min)?,
            step: scaled(step)?,
            milli,
            step_quantity: *step,
        };
        (g.step > 0).then_some(g)
    }

    /// `q` in the grid's unit, rounded up as the scheduler reads it (`Value()`/`MilliValue()`).
    fn scaled(&self, q: &Quantity) -> Option<i64> {
        if self.milli {
            q.milli_value()
        } else {
            q.value()
        }
    }

    /// The smallest grid value not below `r` (`r >= min`).
    fn round_up(&self, r: &Quantity) -> Option<Quantity> {
        let above = u64::try_from(self.scaled(r)?.checked_sub(self.min)?).ok()?;
        let steps = i64::try_from(above.div_ceil(self.step.unsigned_abs())).ok()?;
        let v = self.min.checked_add(steps.checked_mul(self.step)?)?;
        let format = self.step_quantity.format();
        Some(if self.milli {
            Quantity::new_milli(v, format)
        } else {
            Quantity::new(v, format)
        })
    }

    fn holds(&self, c: &Quantity) -> bool {
        self.scaled(c)
            .and_then(|v| v.checked_sub(self.min))
            .is_some_and(|d| d % self.step == 0)
    }
}

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

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    fn capacity(value: &str, policy: RequestPolicy) -> ConsumableCapacity {
        ConsumableCapacity {
            value: q(value),
            policy: Some(policy),
        }
    }

    #[test]
    fn valid_values_round_up_to_the_next_listed_value() {
        let c = capacity(
            "100",
            RequestPolicy {
                default: Some(q("100")),
                valid_range: None,
                valid_values: vec![q("25"), q("50"), q("100")],
            },
        );
        assert_eq!(c.consumed(Some(&q("30"))), Some(q("50")));
        assert_eq!(c.consumed(Some(&q("25"))), Some(q("25")));
        assert_eq!(c.consumed(None), Some(q("100")));
        assert_eq!(c.consumed(Some(&q("101"))), None);
    }

    #[test]
    fn a_fractional_step_is_counted_in_thousandths() {
        let c = capacity(
            "1",
            RequestPolicy {
                default: None,
                valid_range: Some(ValidRange {
                    min: q("0.1"),
                    max: Some(q("1")),
                    step: Some(q("0.25")),
                }),
                valid_values: vec![],
            },
        );
        assert_eq!(c.consumed(Some(&q("0.2"))), Some(q("0.35")));
        assert_eq!(c.consumed(Some(&q("0.05"))), Some(q("0.1")));
        // 1 is off the grid 0.1 + k x 0.25 and there is no default to fall back on.
        assert_eq!(c.consumed(None), None);
        assert_eq!(c.consumed(Some(&q("0.9"))), None);
    }

    #[test]
    fn no_policy_consumes_what_is_asked_within_the_value() {
        let c = ConsumableCapacity {
            value: q("80Gi"),
            policy: None,
        };
        assert_eq!(c.consumed(Some(&q("15Gi"))), Some(q("15Gi")));
        assert_eq!(c.consumed(None), Some(q("80Gi")));
        assert_eq!(c.consumed(Some(&q("81Gi"))), None);
        assert_eq!(c.consumed(Some(&q("-1"))), None);
        assert_eq!(
            compute_share(Gpus::ONE, &q("80"), &q("100")),
            Gpus::new(4, 5)
        );
        assert_eq!(compute_share(Gpus::ONE, &q("80"), &q("0")), None);
    }
}
