//! The exact half of [`super::preference`]: branch and bound over the free candidates,
//! within a work budget, starting from the greedy incumbent.

use super::pool::{lex_less, lowest_bits, Bits, Pick, Pool};

/// Work limit below which the exact search runs unbudgeted, in candidate visits (a search node
/// costs its number of candidates + 1).
///
/// A search over `m` candidates filling `r` slots has at most `C(m + 2, r + 1) - 1` nodes of at
/// most `m + 1` units each ([`tree_units`]). When that fits here the search always completes; for
/// `m = 16` it is at most 48 619 * 17 = 826 523 units, which is what makes [`super::EXACT_CANDIDATES`]
/// a guarantee. A few milliseconds at worst; pruning usually makes it microseconds.
const FULL_SEARCH_UNITS: u64 = 1 << 20;

/// Work budget of the exact search when the whole tree does not fit [`FULL_SEARCH_UNITS`]: about
/// half a millisecond, after which the best set found so far is returned.
const PARTIAL_SEARCH_UNITS: u64 = 1 << 15;

/// Branch and bound over include/exclude decisions on the free candidates.
///
/// Upper bound on the score added by `r` more of candidates `C` to the partial set `P`: for each
/// `x` in `C`, `v(x) = 2 * gain(x, P) + (sum of the r - 1 best pair scores from x to the other
/// root candidates)`; the added score is at most half the sum of the `r` largest `v`. Lower bound
/// on `tot(S)`: `tot(P)` plus the `r` smallest `tot` in `C`. A subtree is cut when its bounds
/// cannot beat the incumbent, ties included when even the subtree's lexicographically smallest
/// set does not sort before the incumbent.
pub(super) struct Exact<'p, 'a> {
    pool: &'p Pool<'a>,
    must: u128,
    size: usize,
    /// `gain[x]` = sum of `pair(x, p)` over `p` in the partial set.
    gain: Vec<u64>,
    /// Row `x` (stride `stride`): `prefix[k]` = sum of the `k` best pair scores from `x` to
    /// the other root candidates.
    prefix: Vec<u64>,
    stride: usize,
    /// Root candidates ascending by `(tot, index)`.
    by_tot: Vec<usize>,
    scratch: Vec<u64>,
    pub(super) best: Pick,
    /// Units spent so far; the timing test prints it.
    pub(super) work: u64,
    budget: u64,
    pub(super) aborted: bool,
}

/// Upper bound on the work units of an unpruned search choosing `r` of `m` candidates
/// (`(C(m + 2, r + 1) - 1) * (m + 1)`), saturating at `u64::MAX`.
fn tree_units(m: usize, r: usize) -> u64 {
    let (n, k) = (m as u64 + 2, r as u64 + 1);
    let k = k.min(n - k.min(n));
    let mut c: u64 = 1;
    for i in 1..=k {
        c = c * (n - k + i) / i;
        if c > 1 << 40 {
            return u64::MAX;
        }
    }
    (c - 1).saturating_mul(m as u64 + 1)
}

impl<'p, 'a> Exact<'p, 'a> {
    pub(super) fn new(pool: &'p Pool<'a>, must: u128, size: usize, incumbent: Pick) -> Self {
        let model = pool.model;
        let cands = pool.avail & !must;
        let m = cands.count_ones() as usize;
        let stride = m.max(1);
        let mut prefix = vec![0u64; model.n * stride];
        let mut row = Vec::with_capacity(m);
        for x in Bits(cands) {
            row.clear();
            row.extend(Bits(cands & !(1u128 << x)).map(|y| model.pair(x, y)));
            row.sort_unstable_by(|a, b| b.cmp(a));
            let mut acc = 0;
            for (k, v) in row.iter().enumerate() {
                acc += v;
                if k + 1 < stride {
                    prefix[x * stride + k + 1] = acc;
                }
            }
        }
        let mut by_tot: Vec<usize> = Bits(cands).collect();
        by_tot.sort_by_key(|&x| (pool.tot[x], x));
        let gain = (0..model.n)
            .map(|x| Bits(must).map(|p| model.pair(x, p)).sum())
            .collect();
        Exact {
            pool,
            must,
            size,
            gain,
            prefix,
            stride,
            by_tot,
            scratch: Vec::with_capacity(m),
            best: incumbent,
            work: 0,
            budget: if tree_units(m, size - must.count_ones() as usize) <= FULL_SEARCH_UNITS {
                u64::MAX
            } else {
                PARTIAL_SEARCH_UNITS
            },
            aborted: false,
        }
    }

    pub(super) fn run(&mut self) {
        let start = self.pool.pick(self.must);
        let cands = self.pool.avail & !self.must;
        let r = self.size - self.must.count_ones() as usize;
        self.dfs(cands, start, r);
    }

    fn dfs(&mut self, cands: u128, cur: Pick, r: usize) {
        if r == 0 {
            if cur.better_than(&self.best) {
                self.best = cur;
            }
            return;
        }
        let c = cands.count_ones() as usize;
        if c < r {
            return;
        }
        self.work += c as u64 + 1;
        if self.work > self.budget {
            self.aborted = true;
            return;
        }
        if c == r {
            let all = self.complete(cands, cur);
            if all.better_than(&self.best) {
                self.best = all;
            }
            return;
        }
        let Some(x) = self.branch(cands, cur, r) else {
            return;
        };
        let bit = 1u128 << x;
        let rest = cands & !bit;
        let model = self.pool.model;
        let row = model.row(x);
        for y in Bits(rest) {
            self.gain[y] += row[y];
        }
        let with = Pick {
            mask: cur.mask | bit,
            score: cur.score + self.gain[x],
            tot: cur.tot + self.pool.tot[x],
        };
        self.dfs(rest, with, r - 1);
        for y in Bits(rest) {
            self.gain[y] -= row[y];
        }
        if self.aborted {
            return;
        }
        self.dfs(rest, cur, r);
    }

    /// `cur` plus every candidate.
    fn complete(&self, cands: u128, cur: Pick) -> Pick {
        let model = self.pool.model;
        let mut score = cur.score;
        let mut rest = cands;
        for x in Bits(cands) {
            rest &= !(1u128 << x);
            score += self.gain[x] + Bits(rest).map(|y| model.pair(x, y)).sum::<u64>();
        }
        Pick {
            mask: cur.mask | cands,
            score,
            tot: cur.tot + Bits(cands).map(|x| self.pool.tot[x]).sum::<u64>(),
        }
    }

    /// The candidate to branch on (the one with the largest `v`, lowest index on ties) when some
    /// completion of `cur` with `r` of `cands` could beat the incumbent; `None` to cut.
    fn branch(&mut self, cands: u128, cur: Pick, r: usize) -> Option<usize> {
        self.scratch.clear();
        let mut pivot = (0, usize::MAX);
        for x in Bits(cands) {
            let v = 2 * self.gain[x] + self.prefix[x * self.stride + r - 1];
            if v > pivot.0 || pivot.1 == usize::MAX {
                pivot = (v, x);
            }
            self.scratch.push(v);
        }
        if r < self.scratch.len() {
            self.scratch.select_nth_unstable_by(r - 1, |a, b| b.cmp(a));
        }
        let upper = cur.score + self.scratch[..r].iter().sum::<u64>() / 2;
        let open = if upper != self.best.score {
            upper > self.best.score
        } else {
            let lower_tot = cur.tot
                + self
                    .by_tot
                    .iter()
                    .filter(|&&x| cands & (1u128 << x) != 0)
                    .take(r)
                    .map(|&x| self.pool.tot[x])
                    .sum::<u64>();
            if lower_tot != self.best.tot {
                lower_tot < self.best.tot
            } else {
                lex_less(cur.mask | lowest_bits(cands, r), self.best.mask)
            }
        };
        open.then_some(pivot.1)
    }
}
