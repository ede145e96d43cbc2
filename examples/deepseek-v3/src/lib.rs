//! A DeepSeek-V3-style model served with expert-parallel MoE (`moe-layer`) across processes
//! and nodes, on CPU or GPUs with the same commands.
//!
//! - [`config`]: `config.json` with DeepSeek-V3's field names, and the tiny preset;
//! - [`model`]: MLA attention with decoupled RoPE and a KV cache, dense and MoE layers;
//! - [`checkpoint`]: the random-checkpoint generator and the embedded default checkpoint;
//! - [`loader`]: sharded safetensors loading (each rank reads only its experts);
//! - [`tokenizer`]: byte-level BPE `tokenizer.json` and the chat template;
//! - [`dist`], [`engine`], [`scheduler`]: ranks, the step protocol, continuous batching;
//! - [`server`]: the OpenAI-compatible HTTP API; [`launch`]: the torchrun-like launcher;
//! - [`app`]: the subcommands.

pub mod app;
pub mod checkpoint;
pub mod config;
pub mod dist;
pub mod engine;
pub mod launch;
pub mod loader;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod tokenizer;
