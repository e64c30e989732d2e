//! The device plugin's decisions, pure: which resources the node offers ([`resources`]) and
//! the Allocate and preferred-allocation answers ([`allocate`]). The gRPC shell (service,
//! registrar) is the product's `deviceplugin`.

pub mod allocate;
pub mod resources;
