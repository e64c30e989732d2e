//! Simulation profiles (work in progress).
