//! Dynamic MIG (pure): which GPUs gpuplane partitions on demand, and the partitionable devices
//! (KEP-4815) they are published as. Filled in by the dynamic-MIG work.
