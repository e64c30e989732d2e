//! The vocabulary both searches share: sets of GPUs as bitmasks, a candidate answer with
//! its scores, and the available pool with each member's affinity to the rest of it.

use super::TopologyModel;
use std::cmp::Reverse;

/// Set bits of a mask, lowest first.
#[derive(Clone, Copy)]
pub(super) struct Bits(pub(super) u128);

impl Iterator for Bits {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let i = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(i)
    }
}

/// True when the ascending index list of `a` sorts before that of `b` (same popcount).
#[inline]
pub(super) fn lex_less(a: u128, b: u128) -> bool {
    let diff = a ^ b;
    diff != 0 && a & diff & diff.wrapping_neg() != 0
}

/// The mask of the `r` lowest set bits of `mask`.
pub(super) fn lowest_bits(mask: u128, r: usize) -> u128 {
    Bits(mask).take(r).fold(0, |m, i| m | (1u128 << i))
}

/// A candidate answer: its mask, `score(S)` and `tot(S)` (sum of members' affinity to `A`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Pick {
    pub(super) mask: u128,
    pub(super) score: u64,
    pub(super) tot: u64,
}

impl Pick {
    /// Better by the documented objective: higher score, then lower tot, then lex smaller.
    pub(super) fn better_than(&self, other: &Pick) -> bool {
        (self.score, Reverse(self.tot)) > (other.score, Reverse(other.tot))
            || (self.score == other.score
                && self.tot == other.tot
                && lex_less(self.mask, other.mask))
    }
}

/// The available set and each member's total affinity to the rest of it.
pub(super) struct Pool<'a> {
    pub(super) model: &'a TopologyModel,
    pub(super) avail: u128,
    /// `tot[x]` = sum of `pair(x, y)` over available `y`; 0 outside the pool.
    pub(super) tot: Vec<u64>,
}

impl<'a> Pool<'a> {
    pub(super) fn new(model: &'a TopologyModel, avail: u128) -> Self {
        let mut tot = vec![0u64; model.n];
        for x in Bits(avail) {
            tot[x] = Bits(avail).map(|y| model.pair(x, y)).sum();
        }
        Pool { model, avail, tot }
    }

    pub(super) fn pick(&self, mask: u128) -> Pick {
        Pick {
            mask,
            score: self.model.mask_score(mask),
            tot: Bits(mask).map(|x| self.tot[x]).sum(),
        }
    }
}
