//! Typed launchers of the routing kernels, one module per kernel source: `routing`
//! (`routing.cu`, the top-k router) and `gate` (`gate.cu`, the gate's logits for a few tokens).

mod gate;
mod routing;

pub use gate::*;
pub use routing::*;
