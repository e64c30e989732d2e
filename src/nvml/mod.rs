//! NVML device source (work in progress).
