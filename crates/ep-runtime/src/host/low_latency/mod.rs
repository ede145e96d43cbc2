//! Low-latency mode on the host backend (see `crate::low_latency` for the layout and the
//! masking rules).

mod combine;
mod dispatch;

pub(crate) use combine::LlCombineInput;
