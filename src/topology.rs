//! Topology scoring (work in progress).
