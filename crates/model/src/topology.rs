//! Topology-aware device choice: the pure core of the device plugin's `GetPreferredAllocation`.
//!
//! [`TopologyModel`] turns an inventory's GPU-to-GPU topology into a dense matrix of pair scores
//! once, when the inventory changes; [`preferred`] then picks which of the available GPUs a
//! request should get. Everything here is synchronous computation over plain data (no NVML, no
//! gRPC), so the kubelet's frequent calls are answered from memory in microseconds instead of the
//! seconds a fresh NVML walk plus exhaustive search takes on NVLink machines.

mod exact;
mod greedy;
mod pool;

use crate::inventory::{Inventory, Link, PathLevel};
use exact::Exact;
use greedy::heuristic;
use pool::{Bits, Pool};

/// Weight of one NVLink lane in a pair score.
///
/// It exceeds the largest possible sum of path bonuses over any set ([`MAX_DEVICES`] choose 2
/// pairs times the largest bonus, 5), so comparing set scores compares total NVLink lanes first
/// and total path bonus second.
pub const NVLINK_WEIGHT: u64 = 1 << 16;

/// Most GPUs a model covers (the width of the bitmasks); higher indices are not modelled.
pub const MAX_DEVICES: usize = 128;

/// Largest pool of free candidates (available minus must-include) for which [`preferred`] is
/// guaranteed to return the optimum of its objective; larger pools usually get it too.
pub const EXACT_CANDIDATES: usize = 16;

/// NVLink lane counts are clamped to this, so that no score sum can overflow.
const MAX_NVLINKS: u32 = 1 << 16;

/// Bonus for the PCIe/system path between two GPUs: nearer is higher.
///
/// `SameBoard` 5, `SingleSwitch` 4, `MultipleSwitches` 3, `HostBridge` 2, `NumaNode` 1,
/// `System` 0.
pub fn path_bonus(level: PathLevel) -> u64 {
    match level {
        PathLevel::SameBoard => 5,
        PathLevel::SingleSwitch => 4,
        PathLevel::MultipleSwitches => 3,
        PathLevel::HostBridge => 2,
        PathLevel::NumaNode => 1,
        PathLevel::System => 0,
    }
}

/// Pairwise affinity of a node's GPUs, precomputed for [`preferred`].
///
/// The pair score of GPUs `a != b` is `nvlinks(a, b) * NVLINK_WEIGHT + path_bonus(level(a, b))`:
/// more NVLink lanes always win, and among equal lanes the nearer PCIe/system path wins. With an
/// NVSwitch fabric every pair gets the fabric's lanes (the smaller of the two GPUs' widest links),
/// as the fabric connects all GPUs to all. A pair with no [`Link`] has no NVLinks and the `System`
/// path (or `NumaNode` when the inventory puts both GPUs on the same NUMA node). The score of a
/// set is the sum of its pair scores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyModel {
    n: usize,
    /// `n * n`, row-major, symmetric, zero diagonal.
    scores: Vec<u64>,
}

impl TopologyModel {
    /// Builds the model of an inventory: GPU indices `0..=max index` (at most [`MAX_DEVICES`]).
    pub fn new(inventory: &Inventory) -> Self {
        let n = inventory
            .gpus
            .iter()
            .map(|g| g.index as usize + 1)
            .chain(
                inventory
                    .topology
                    .links
                    .iter()
                    .map(|l| l.from.max(l.to) as usize + 1),
            )
            .max()
            .unwrap_or(0);
        let mut numa: Vec<Option<u32>> = vec![None; n.min(MAX_DEVICES)];
        for g in &inventory.gpus {
            if let Some(slot) = numa.get_mut(g.index as usize) {
                *slot = g.numa_node;
            }
        }
        Self::build(
            n,
            inventory.topology.nvswitch,
            &inventory.topology.links,
            |a, b| match (numa[a], numa[b]) {
                (Some(x), Some(y)) if x == y => PathLevel::NumaNode,
                _ => PathLevel::System,
            },
        )
    }

    /// Builds a model of `n` GPUs from links alone; a pair without a link gets the `System` path.
    /// Links naming an index at or above `n` (or [`MAX_DEVICES`]) are ignored. For tests and
    /// benches (synthetic machines); the product builds from an inventory ([`Self::new`]).
    #[doc(hidden)]
    pub fn from_parts(n: usize, nvswitch: bool, links: &[Link]) -> Self {
        Self::build(n, nvswitch, links, |_, _| PathLevel::System)
    }

    fn build(
        n: usize,
        nvswitch: bool,
        links: &[Link],
        default_level: impl Fn(usize, usize) -> PathLevel,
    ) -> Self {
        let n = n.min(MAX_DEVICES);
        let mut lanes = vec![0u32; n * n];
        let mut levels: Vec<Option<PathLevel>> = vec![None; n * n];
        for l in links {
            let (a, b) = (l.from as usize, l.to as usize);
            if a >= n || b >= n || a == b {
                continue;
            }
            let nv = l.nvlinks.min(MAX_NVLINKS);
            lanes[a * n + b] = nv;
            lanes[b * n + a] = nv;
            levels[a * n + b] = Some(l.level);
            levels[b * n + a] = Some(l.level);
        }
        if nvswitch {
            let widest: Vec<u32> = (0..n)
                .map(|a| lanes[a * n..(a + 1) * n].iter().copied().max().unwrap_or(0))
                .collect();
            for a in 0..n {
                for b in 0..n {
                    if a != b {
                        let fabric = widest[a].min(widest[b]);
                        lanes[a * n + b] = lanes[a * n + b].max(fabric);
                    }
                }
            }
        }
        let mut scores = vec![0u64; n * n];
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    let level = levels[a * n + b].unwrap_or_else(|| default_level(a, b));
                    scores[a * n + b] =
                        u64::from(lanes[a * n + b]) * NVLINK_WEIGHT + path_bonus(level);
                }
            }
        }
        TopologyModel { n, scores }
    }

    /// Number of GPU indices the model covers (`0..len()`).
    pub fn len(&self) -> usize {
        self.n
    }

    /// True when the model covers no GPU.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Score of the pair `(a, b)`; 0 when `a == b` or either is outside the model.
    pub fn pair_score(&self, a: u32, b: u32) -> u64 {
        let (a, b) = (a as usize, b as usize);
        if a < self.n && b < self.n {
            self.scores[a * self.n + b]
        } else {
            0
        }
    }

    /// Score of a set: the sum of its pair scores (duplicates and unknown indices add nothing).
    pub fn set_score(&self, devices: &[u32]) -> u64 {
        let mask = devices
            .iter()
            .filter(|&&d| (d as usize) < self.n)
            .fold(0u128, |m, &d| m | (1u128 << d));
        self.mask_score(mask)
    }

    #[inline]
    fn pair(&self, a: usize, b: usize) -> u64 {
        self.scores[a * self.n + b]
    }

    /// Pair scores of `a` with every GPU.
    #[inline]
    fn row(&self, a: usize) -> &[u64] {
        &self.scores[a * self.n..(a + 1) * self.n]
    }

    fn mask_score(&self, mask: u128) -> u64 {
        let mut total = 0;
        let mut rest = mask;
        for a in Bits(mask) {
            rest &= !(1u128 << a);
            total += Bits(rest).map(|b| self.pair(a, b)).sum::<u64>();
        }
        total
    }
}

/// Why no preferred allocation could be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreferError {
    /// The request asked for zero devices.
    #[error("allocation size is 0; request at least one device")]
    ZeroSize,
    /// The request asked for more devices than are available.
    #[error("allocation size {size} exceeds the {available} available devices; request at most {available} or wait for devices to free up")]
    SizeExceedsAvailable { size: usize, available: usize },
    /// The must-include devices alone exceed the allocation size.
    #[error("{must_include} must-include devices do not fit an allocation of {size}; request at least {must_include} devices or name fewer must-include devices")]
    MustIncludeExceedsSize { must_include: usize, size: usize },
    /// A must-include device is not in the available list.
    #[error(
        "must-include device {index} is not available; name only available devices as must-include"
    )]
    MustIncludeNotAvailable { index: u32 },
    /// A device appears more than once in the must-include list.
    #[error("must-include device {index} is listed twice; list each device once")]
    DuplicateMustInclude { index: u32 },
    /// A device appears more than once in the available list.
    #[error("available device {index} is listed twice; list each device once")]
    DuplicateAvailable { index: u32 },
    /// A device index lies outside the topology model.
    #[error("device {index} is outside the topology model of {devices} GPUs; rebuild the model from the current inventory")]
    UnknownDevice { index: u32, devices: usize },
}

/// A preferred allocation with the numbers behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preference {
    /// The chosen GPU indices, ascending.
    pub devices: Vec<u32>,
    /// Set score of `devices`.
    pub score: u64,
    /// Set score of the available devices left over.
    pub remaining_score: u64,
    /// True when the search proved `devices` optimal; false when it ran out of budget and
    /// `devices` is the best set found by greedy construction, local improvement and the partial
    /// search (never the case with at most [`EXACT_CANDIDATES`] free candidates).
    pub exact: bool,
}

/// Picks `size` of the `available` GPUs, including every `must_include` one; indices ascending.
///
/// Objective, with `A` the available set and `S` ranging over the `size`-subsets of `A` that
/// contain `must_include`:
/// 1. maximise `score(S)`, the sum of [`TopologyModel::pair_score`] over pairs in `S`;
/// 2. then maximise `score(A \ S)`, so that what stays free keeps its best groups intact for
///    later requests (for a fixed `score(S)` this is the same as minimising the sum of pair
///    scores between `S` and `A \ S`);
/// 3. then take the lexicographically smallest ascending index list.
///
/// The answer is this optimum whenever there are at most [`EXACT_CANDIDATES`] available devices
/// outside `must_include` (more generally whenever an unpruned search tree is small enough to
/// walk), and whenever the branch and bound finishes within its budget ([`preference`] reports
/// which). Otherwise, in practice only on pools of dozens of GPUs with irregular topology, it is
/// the best set that greedy construction from every seed, pairwise-swap improvement and the
/// partial search found.
pub fn preferred(
    model: &TopologyModel,
    available: &[u32],
    must_include: &[u32],
    size: usize,
) -> Result<Vec<u32>, PreferError> {
    preference(model, available, must_include, size).map(|p| p.devices)
}

/// [`preferred`] with the scores of the choice and whether it is proven optimal.
pub fn preference(
    model: &TopologyModel,
    available: &[u32],
    must_include: &[u32],
    size: usize,
) -> Result<Preference, PreferError> {
    let mut avail = 0u128;
    for &d in available {
        if d as usize >= model.n {
            return Err(PreferError::UnknownDevice {
                index: d,
                devices: model.n,
            });
        }
        let bit = 1u128 << d;
        if avail & bit != 0 {
            return Err(PreferError::DuplicateAvailable { index: d });
        }
        avail |= bit;
    }
    if size == 0 {
        return Err(PreferError::ZeroSize);
    }
    if size > available.len() {
        return Err(PreferError::SizeExceedsAvailable {
            size,
            available: available.len(),
        });
    }
    let mut must = 0u128;
    for &d in must_include {
        if d as usize >= model.n || avail & (1u128 << d) == 0 {
            return Err(PreferError::MustIncludeNotAvailable { index: d });
        }
        let bit = 1u128 << d;
        if must & bit != 0 {
            return Err(PreferError::DuplicateMustInclude { index: d });
        }
        must |= bit;
    }
    if must_include.len() > size {
        return Err(PreferError::MustIncludeExceedsSize {
            must_include: must_include.len(),
            size,
        });
    }

    let pool = Pool::new(model, avail);
    let (best, exact) = if size == available.len() {
        (pool.pick(avail), true)
    } else if size == must_include.len() {
        (pool.pick(must), true)
    } else {
        let incumbent = heuristic(&pool, must, size);
        let mut search = Exact::new(&pool, must, size, incumbent);
        search.run();
        (search.best, !search.aborted)
    };
    let total_tot: u64 = Bits(avail).map(|x| pool.tot[x]).sum();
    // score(A) = score(S) + score(A \ S) + cross(S, A \ S); cross = tot(S) - 2 score(S).
    let remaining_score = total_tot / 2 + best.score - best.tot;
    Ok(Preference {
        devices: Bits(best.mask).map(|i| i as u32).collect(),
        score: best.score,
        remaining_score,
        exact,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{DeviceUuid, Gpu, MigMode, Topology};
    use std::cmp::Reverse;

    fn link(from: u32, to: u32, nvlinks: u32, level: PathLevel) -> Link {
        Link {
            from,
            to,
            nvlinks,
            level,
        }
    }

    fn gpu(index: u32, numa_node: Option<u32>) -> Gpu {
        Gpu {
            index,
            minor: index,
            uuid: DeviceUuid::parse(format!("GPU-{index:08x}-0000-0000-0000-000000000000"))
                .unwrap(),
            product_name: "Test GPU".into(),
            brand: "Nvidia".into(),
            architecture: "Hopper".into(),
            cuda_compute_capability: "9.0".into(),
            memory_mib: 81920,
            pci_bus_id: format!("00000000:{:02X}:00.0", index + 0x10),
            numa_node,
            mig: MigMode::default(),
            mig_devices: Vec::new(),
        }
    }

    /// An inventory of `n` GPUs, NUMA node `i / (n / 2)`, with every pair's link given by `f`.
    fn inventory(n: u32, nvswitch: bool, f: impl Fn(u32, u32) -> (u32, PathLevel)) -> Inventory {
        let mut links = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                let (nvlinks, level) = f(a, b);
                links.push(link(a, b, nvlinks, level));
            }
        }
        Inventory {
            driver_version: "550.90.07".into(),
            cuda_driver_version: "12.4".into(),
            gpus: (0..n).map(|i| gpu(i, Some(i / (n / 2).max(1)))).collect(),
            topology: Topology { nvswitch, links },
        }
    }

    const DGX1_NVLINKS: &[(u32, u32, u32)] = &[
        (0, 1, 1),
        (0, 2, 1),
        (0, 3, 2),
        (0, 4, 2),
        (1, 2, 2),
        (1, 3, 1),
        (1, 5, 2),
        (2, 3, 2),
        (2, 6, 1),
        (3, 7, 1),
        (4, 5, 1),
        (4, 6, 1),
        (4, 7, 2),
        (5, 6, 2),
        (5, 7, 1),
        (6, 7, 2),
    ];

    /// DGX-1 V100: hybrid cube-mesh NVLink, PCIe switch per GPU pair, two sockets.
    fn dgx1() -> Inventory {
        inventory(8, false, |a, b| {
            let nvlinks = DGX1_NVLINKS
                .iter()
                .find(|&&(x, y, _)| (x, y) == (a, b))
                .map_or(0, |&(_, _, n)| n);
            let level = if a / 2 == b / 2 {
                PathLevel::SingleSwitch
            } else if a / 4 == b / 4 {
                PathLevel::NumaNode
            } else {
                PathLevel::System
            };
            (nvlinks, level)
        })
    }

    /// HGX H100-style: 8 GPUs on an NVSwitch fabric (18 lanes each), NUMA halves.
    fn nvswitch8() -> Inventory {
        inventory(8, true, |a, b| {
            let level = if a / 4 == b / 4 {
                PathLevel::NumaNode
            } else {
                PathLevel::System
            };
            (18, level)
        })
    }

    /// 4x L4 on PCIe: two per switch, one switch per socket.
    fn l4x4() -> Inventory {
        inventory(4, false, |a, b| {
            let level = if a / 2 == b / 2 {
                PathLevel::SingleSwitch
            } else {
                PathLevel::System
            };
            (0, level)
        })
    }

    /// 64 GPUs: 8 NVSwitch islands of 8 (18 lanes inside), NUMA node per 16, sockets beyond.
    fn islands64() -> TopologyModel {
        let mut links = Vec::new();
        for a in 0..64u32 {
            for b in a + 1..64 {
                let nvlinks = if a / 8 == b / 8 { 18 } else { 0 };
                let level = if a / 16 == b / 16 {
                    PathLevel::NumaNode
                } else {
                    PathLevel::System
                };
                links.push(link(a, b, nvlinks, level));
            }
        }
        TopologyModel::from_parts(64, false, &links)
    }

    /// 16 GPUs: two NVSwitch islands of 8, PCIe switch per pair, NUMA node per island.
    fn islands16() -> TopologyModel {
        let mut links = Vec::new();
        for a in 0..16u32 {
            for b in a + 1..16 {
                let nvlinks = if a / 8 == b / 8 { 18 } else { 0 };
                let level = if a / 2 == b / 2 {
                    PathLevel::SingleSwitch
                } else if a / 8 == b / 8 {
                    PathLevel::NumaNode
                } else {
                    PathLevel::System
                };
                links.push(link(a, b, nvlinks, level));
            }
        }
        TopologyModel::from_parts(16, false, &links)
    }

    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn shuffle<T>(&mut self, v: &mut [T]) {
            for i in (1..v.len()).rev() {
                let j = self.below(i + 1);
                v.swap(i, j);
            }
        }
    }

    const LEVELS: [PathLevel; 6] = [
        PathLevel::SameBoard,
        PathLevel::SingleSwitch,
        PathLevel::MultipleSwitches,
        PathLevel::HostBridge,
        PathLevel::NumaNode,
        PathLevel::System,
    ];

    /// Random lanes (0-3, mostly 0) and random path levels on every pair.
    fn random_model(rng: &mut XorShift, n: u32) -> TopologyModel {
        let mut links = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                let nvlinks = (rng.below(8) as u32).saturating_sub(4);
                links.push(link(a, b, nvlinks, LEVELS[rng.below(6)]));
            }
        }
        TopologyModel::from_parts(n as usize, false, &links)
    }

    /// The documented objective by enumeration: every `size`-subset of `available` containing
    /// `must_include`; max score, then max remaining score, then smallest ascending list.
    fn brute_force(
        model: &TopologyModel,
        available: &[u32],
        must_include: &[u32],
        size: usize,
    ) -> Vec<u32> {
        let mut avail = available.to_vec();
        avail.sort_unstable();
        let mut best: Option<(u64, u64, Vec<u32>)> = None;
        for bits in 0u64..(1 << avail.len()) {
            if bits.count_ones() as usize != size {
                continue;
            }
            let (mut chosen, mut rest) = (Vec::new(), Vec::new());
            for (i, &d) in avail.iter().enumerate() {
                if bits & (1 << i) != 0 {
                    chosen.push(d);
                } else {
                    rest.push(d);
                }
            }
            if !must_include.iter().all(|m| chosen.contains(m)) {
                continue;
            }
            let score = pairs_sum(model, &chosen);
            let remaining = pairs_sum(model, &rest);
            let better = match &best {
                None => true,
                Some((s, r, v)) => (score, remaining, Reverse(&chosen)) > (*s, *r, Reverse(v)),
            };
            if better {
                best = Some((score, remaining, chosen));
            }
        }
        best.map(|(_, _, v)| v).unwrap_or_default()
    }

    fn pairs_sum(model: &TopologyModel, set: &[u32]) -> u64 {
        let mut total = 0;
        for (i, &a) in set.iter().enumerate() {
            for &b in &set[i + 1..] {
                total += model.pair_score(a, b);
            }
        }
        total
    }

    fn all(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    fn check_against_brute_force(
        model: &TopologyModel,
        available: &[u32],
        must_include: &[u32],
        size: usize,
    ) {
        let got = preference(model, available, must_include, size).unwrap();
        let want = brute_force(model, available, must_include, size);
        assert_eq!(
            got.devices, want,
            "available {available:?}, must_include {must_include:?}, size {size}"
        );
        if available.len() - must_include.len() <= EXACT_CANDIDATES {
            assert!(got.exact, "search over at most 16 candidates must finish");
        }
        assert_eq!(got.score, pairs_sum(model, &got.devices));
        let rest: Vec<u32> = available
            .iter()
            .copied()
            .filter(|d| !got.devices.contains(d))
            .collect();
        assert_eq!(got.remaining_score, pairs_sum(model, &rest));
    }

    /// Random available subset, size and must-include set.
    fn random_request(rng: &mut XorShift, n: u32) -> (Vec<u32>, Vec<u32>, usize) {
        let mut devices = all(n);
        rng.shuffle(&mut devices);
        let available: Vec<u32> = devices[..1 + rng.below(n as usize)].to_vec();
        let size = 1 + rng.below(available.len());
        let must_count = match rng.below(3) {
            0 => 0,
            _ => rng.below(size + 1).min(2),
        };
        let must_include = available[..must_count].to_vec();
        (available, must_include, size)
    }

    #[test]
    fn dgx1_four_gpu_request_with_everything_free_returns_the_first_nvlink_quad() {
        let model = TopologyModel::new(&dgx1());
        assert_eq!(
            preferred(&model, &all(8), &[], 4).unwrap(),
            vec![0, 1, 2, 3]
        );
    }

    #[test]
    fn dgx1_two_gpu_request_returns_a_two_nvlink_pair_behind_one_switch() {
        let model = TopologyModel::new(&dgx1());
        let got = preferred(&model, &all(8), &[], 2).unwrap();
        assert_eq!(got, vec![2, 3]);
        assert_eq!(model.pair_score(2, 3), 2 * NVLINK_WEIGHT + 4);
    }

    #[test]
    fn dgx1_two_gpu_request_with_gpu_3_busy_takes_the_other_double_linked_switch_pair() {
        let model = TopologyModel::new(&dgx1());
        let got = preferred(&model, &[0, 1, 2, 4, 5, 6, 7], &[], 2).unwrap();
        assert_eq!(got, vec![6, 7]);
    }

    #[test]
    fn dgx1_four_gpu_request_after_one_half_is_taken_returns_the_other_half() {
        let model = TopologyModel::new(&dgx1());
        let got = preferred(&model, &[1, 4, 5, 6, 7], &[], 4).unwrap();
        assert_eq!(got, vec![4, 5, 6, 7]);
    }

    #[test]
    fn nvswitch_box_four_gpu_request_stays_in_one_numa_half() {
        let model = TopologyModel::new(&nvswitch8());
        assert_eq!(
            preferred(&model, &all(8), &[], 4).unwrap(),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            preferred(&model, &[0, 2, 4, 5, 6, 7], &[], 4).unwrap(),
            vec![4, 5, 6, 7]
        );
    }

    #[test]
    fn nvswitch_box_honours_must_include() {
        let model = TopologyModel::new(&nvswitch8());
        assert_eq!(
            preferred(&model, &all(8), &[5], 4).unwrap(),
            vec![4, 5, 6, 7]
        );
        assert_eq!(preferred(&model, &all(8), &[6, 1], 2).unwrap(), vec![1, 6]);
        assert_eq!(
            preferred(&model, &all(8), &[0], 5).unwrap(),
            vec![0, 1, 2, 3, 4]
        );
    }

    #[test]
    fn nvswitch_box_two_gpu_request_leaves_whole_halves_free_when_it_can() {
        let model = TopologyModel::new(&nvswitch8());
        // 0 and 1 are free only in the first half; taking them keeps 4-7 intact.
        let got = preferred(&model, &[0, 1, 4, 5, 6, 7], &[], 2).unwrap();
        assert_eq!(got, vec![0, 1]);
    }

    #[test]
    fn nvswitch_fabric_gives_every_pair_the_fabric_lanes() {
        let mut inv = nvswitch8();
        inv.topology.links.retain(|l| l.from == 0);
        let model = TopologyModel::new(&inv);
        assert_eq!(model.pair_score(3, 6), 18 * NVLINK_WEIGHT);
        // Missing pair on the same NUMA node falls back to the NumaNode path.
        assert_eq!(model.pair_score(5, 6), 18 * NVLINK_WEIGHT + 1);
    }

    #[test]
    fn l4_box_two_gpu_request_returns_a_same_switch_pair() {
        let model = TopologyModel::new(&l4x4());
        assert_eq!(preferred(&model, &all(4), &[], 2).unwrap(), vec![0, 1]);
        assert_eq!(preferred(&model, &[1, 2, 3], &[], 2).unwrap(), vec![2, 3]);
    }

    #[test]
    fn l4_box_single_gpu_request_takes_the_lone_gpu_and_keeps_the_switch_pair() {
        let model = TopologyModel::new(&l4x4());
        assert_eq!(preferred(&model, &[1, 2, 3], &[], 1).unwrap(), vec![1]);
    }

    #[test]
    fn brute_force_agrees_on_every_size_with_everything_available() {
        for inv in [dgx1(), nvswitch8(), l4x4()] {
            let model = TopologyModel::new(&inv);
            let n = inv.gpus.len() as u32;
            for size in 1..=n as usize {
                check_against_brute_force(&model, &all(n), &[], size);
            }
        }
        let model = islands16();
        for size in 1..=16 {
            check_against_brute_force(&model, &all(16), &[], size);
        }
    }

    #[test]
    fn brute_force_agrees_on_random_requests() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        for inv in [dgx1(), nvswitch8(), l4x4()] {
            let model = TopologyModel::new(&inv);
            let n = inv.gpus.len() as u32;
            for _ in 0..150 {
                let (available, must_include, size) = random_request(&mut rng, n);
                check_against_brute_force(&model, &available, &must_include, size);
            }
        }
        let model = islands16();
        for _ in 0..100 {
            let (available, must_include, size) = random_request(&mut rng, 16);
            check_against_brute_force(&model, &available, &must_include, size);
        }
    }

    #[test]
    fn brute_force_agrees_on_random_topologies_of_up_to_sixteen_gpus() {
        let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
        for round in 0..60 {
            let n = 2 + (round % 15) as u32;
            let model = random_model(&mut rng, n);
            for _ in 0..5 {
                let (available, must_include, size) = random_request(&mut rng, n);
                check_against_brute_force(&model, &available, &must_include, size);
            }
        }
        let model = random_model(&mut rng, 16);
        for size in 1..=16 {
            check_against_brute_force(&model, &all(16), &[], size);
        }
    }

    #[test]
    fn bundled_simulation_profiles_agree_with_brute_force() {
        for name in crate::sim::bundled_names() {
            let inv = crate::sim::load(name).unwrap();
            let model = TopologyModel::new(&inv);
            let devices: Vec<u32> = inv.gpus.iter().map(|g| g.index).collect();
            for size in 1..=devices.len() {
                check_against_brute_force(&model, &devices, &[], size);
            }
        }
    }

    #[test]
    fn must_include_not_available_is_an_error() {
        let model = TopologyModel::new(&nvswitch8());
        let err = preferred(&model, &[0, 1, 2], &[3], 2).unwrap_err();
        assert_eq!(err, PreferError::MustIncludeNotAvailable { index: 3 });
        assert!(err.to_string().contains("name only available devices"));
    }

    #[test]
    fn size_larger_than_available_is_an_error() {
        let model = TopologyModel::new(&nvswitch8());
        assert_eq!(
            preferred(&model, &[0, 1, 2], &[], 4).unwrap_err(),
            PreferError::SizeExceedsAvailable {
                size: 4,
                available: 3
            }
        );
    }

    #[test]
    fn size_zero_is_an_error() {
        let model = TopologyModel::new(&nvswitch8());
        assert_eq!(
            preferred(&model, &[0, 1], &[], 0).unwrap_err(),
            PreferError::ZeroSize
        );
    }

    #[test]
    fn must_include_larger_than_size_or_repeated_is_an_error() {
        let model = TopologyModel::new(&nvswitch8());
        assert_eq!(
            preferred(&model, &all(8), &[0, 1, 2], 2).unwrap_err(),
            PreferError::MustIncludeExceedsSize {
                must_include: 3,
                size: 2
            }
        );
        assert_eq!(
            preferred(&model, &all(8), &[1, 1], 3).unwrap_err(),
            PreferError::DuplicateMustInclude { index: 1 }
        );
    }

    #[test]
    fn unknown_or_repeated_available_devices_are_errors() {
        let model = TopologyModel::new(&nvswitch8());
        assert_eq!(
            preferred(&model, &[0, 8], &[], 1).unwrap_err(),
            PreferError::UnknownDevice {
                index: 8,
                devices: 8
            }
        );
        assert_eq!(
            preferred(&model, &[0, 2, 2], &[], 1).unwrap_err(),
            PreferError::DuplicateAvailable { index: 2 }
        );
    }

    #[test]
    fn sixty_four_gpus_small_requests_stay_inside_one_island() {
        let model = islands64();
        let mut rng = XorShift(0xdead_beef_cafe_f00d);
        for size in 1..=8 {
            let got = preferred(&model, &all(64), &[], size).unwrap();
            assert_eq!(got, (0..size as u32).collect::<Vec<_>>());
        }
        for _ in 0..40 {
            let size = 1 + rng.below(8);
            let must = rng.below(64) as u32;
            let got = preferred(&model, &all(64), &[must], size).unwrap();
            assert_eq!(got.len(), size);
            assert!(got.contains(&must));
            assert!(
                got.iter().all(|d| d / 8 == must / 8),
                "{got:?} leaves island of {must}"
            );
        }
    }

    #[test]
    fn sixty_four_gpus_fill_a_partly_used_island_before_breaking_a_whole_one() {
        let model = islands64();
        // Island 2 (16-23) has 16-19 in use; island 5 (40-47) has 40-45 in use.
        let available: Vec<u32> = (0..64)
            .filter(|d| !(16..20).contains(d) && !(40..46).contains(d))
            .collect();
        assert_eq!(
            preferred(&model, &available, &[], 4).unwrap(),
            vec![20, 21, 22, 23]
        );
        assert_eq!(preferred(&model, &available, &[], 2).unwrap(), vec![46, 47]);
        // Whole islands tie on score; island 4 shares its NUMA node with the already broken
        // island 5, so taking it costs the remaining pool the least.
        assert_eq!(
            preferred(&model, &available, &[], 8).unwrap(),
            (32..40).collect::<Vec<_>>()
        );
    }

    #[test]
    fn sixty_four_gpus_return_valid_sets_of_every_size() {
        let model = islands64();
        let mut rng = XorShift(0x0123_4567_89ab_cdef);
        for _ in 0..30 {
            let (available, must_include, size) = random_request(&mut rng, 64);
            let got = preferred(&model, &available, &must_include, size).unwrap();
            assert_eq!(got.len(), size);
            assert!(got.windows(2).all(|w| w[0] < w[1]));
            assert!(got.iter().all(|d| available.contains(d)));
            assert!(must_include.iter().all(|d| got.contains(d)));
        }
    }

    #[test]
    fn sixty_four_gpus_agree_with_brute_force_where_subsets_can_be_enumerated() {
        let model = islands64();
        let mut rng = XorShift(0x1357_9bdf_2468_ace0);
        let random = random_model(&mut rng, 64);
        for model in [&model, &random] {
            for size in [1, 2, 62, 63, 64] {
                let got = preferred(model, &all(64), &[], size).unwrap();
                assert_eq!(got, brute_force_by_complement(model, 64, size));
            }
        }
    }

    /// Brute force for sizes within 2 of 0 or of `n`, by enumerating what is chosen or left.
    fn brute_force_by_complement(model: &TopologyModel, n: u32, size: usize) -> Vec<u32> {
        let k = size.min(n as usize - size);
        let mut subsets: Vec<Vec<u32>> = vec![vec![]];
        for _ in 0..k {
            subsets = subsets
                .into_iter()
                .flat_map(|s| {
                    let start = s.last().map_or(0, |&l| l + 1);
                    (start..n).map(move |d| {
                        let mut t = s.clone();
                        t.push(d);
                        t
                    })
                })
                .collect();
        }
        subsets
            .into_iter()
            .map(|s| {
                if k == size {
                    s
                } else {
                    (0..n).filter(|d| !s.contains(d)).collect()
                }
            })
            .max_by(|a, b| {
                let rest =
                    |s: &Vec<u32>| -> Vec<u32> { (0..n).filter(|d| !s.contains(d)).collect() };
                (pairs_sum(model, a), pairs_sum(model, &rest(a)), Reverse(a)).cmp(&(
                    pairs_sum(model, b),
                    pairs_sum(model, &rest(b)),
                    Reverse(b),
                ))
            })
            .unwrap_or_default()
    }

    /// Prints timings for the report: `cargo test --release --lib topology -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing report, not a check"]
    fn typical_request_timings_are_printed() {
        let mut rng = XorShift(0xfeed_face_dead_beef);
        let cases: Vec<(&str, TopologyModel, usize)> = vec![
            ("dgx1 4 of 8", TopologyModel::new(&dgx1()), 4),
            ("islands16 8 of 16", islands16(), 8),
            ("random16 8 of 16", random_model(&mut rng, 16), 8),
            ("islands64 8 of 64", islands64(), 8),
            ("islands64 32 of 64", islands64(), 32),
            ("random64 8 of 64", random_model(&mut rng, 64), 8),
            ("random64 32 of 64", random_model(&mut rng, 64), 32),
        ];
        for (name, model, size) in cases {
            let available = all(model.len() as u32);
            let runs = 200;
            let start = std::time::Instant::now();
            let mut last = None;
            for _ in 0..runs {
                last = Some(preference(&model, &available, &[], size).unwrap());
            }
            let per = start.elapsed() / runs;
            let p = last.unwrap();
            let pool = Pool::new(&model, (1u128 << available.len()) - 1);
            let start = std::time::Instant::now();
            for _ in 0..runs {
                std::hint::black_box(heuristic(&pool, 0, size));
            }
            let greedy = start.elapsed() / runs;
            let mut search = Exact::new(&pool, 0, size, heuristic(&pool, 0, size));
            search.run();
            eprintln!(
                "{name}: {per:?} per call ({greedy:?} heuristic, {} search units), exact {}, {:?}",
                search.work, p.exact, p.devices
            );
        }
    }
}
