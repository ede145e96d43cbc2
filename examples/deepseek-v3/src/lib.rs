//! A DeepSeek-V3-style model served with expert-parallel MoE (`moe-layer`) across processes
//! and nodes, on CPU or GPUs with the same commands.
//!
//! - [`config`]: `config.json` with DeepSeek-V3's field names, and the tiny preset;
//! - [`model`]: the decoder (embedding, dense and MoE layers, `lm_head`); [`attention`]: MLA
//!   over a batch of sequences of different lengths; [`batch`]: one step's batch layout;
//!   [`kv_cache`]: the slotted KV cache; [`rotary`]: decoupled RoPE with YaRN;
//! - [`checkpoint`]: the random-checkpoint generator and the embedded default checkpoint;
//! - [`loader`]: sharded safetensors loading (each rank reads only its experts), or random
//!   weights made on the device ([`init`]); [`format`]: the checkpoint's dtypes checked before
//!   any weight is read (block-scaled FP8 or plain floats); [`progress`]: progress on stderr;
//!   [`memory_plan`]: what a rank will hold, checked against its GPU before the load;
//! - [`tokenizer`]: byte-level BPE `tokenizer.json` and the chat template;
//! - [`dist`], [`engine`], [`scheduler`]: ranks, the step protocol, continuous batching;
//! - [`server`]: the OpenAI-compatible HTTP API; [`metrics`]: its Prometheus metrics;
//! - [`bench`]: the serving benchmark client; [`stats`]: latency summaries;
//! - [`launch`]: the torchrun-like launcher; [`app`]: the subcommands.

pub mod app;
pub mod attention;
pub mod batch;
pub mod bench;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod decode_graph;
pub mod dist;
pub mod engine;
pub mod eplb;
pub mod format;
pub mod init;
pub mod kv_cache;
pub mod launch;
pub mod loader;
pub mod memory_plan;
pub mod metrics;
pub mod model;
pub mod placements;
pub mod progress;
pub mod recovery;
pub mod rotary;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod stats;
pub mod tokenizer;
