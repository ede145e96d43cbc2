//! Typed launchers of the fp8 kernels, one module per kernel source: `fp8` (`fp8.cu`, the
//! per-token casts).

mod fp8;

pub use fp8::*;
