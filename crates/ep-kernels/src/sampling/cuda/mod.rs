//! Launcher of greedy sampling's kernel (`argmax.cu`). Host twin: [`super::argmax_rows`].

mod argmax;

pub use argmax::{argmax_rows_bf16_cuda, argmax_rows_f32_cuda};
