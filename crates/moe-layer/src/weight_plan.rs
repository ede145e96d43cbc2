//! The bytes a layer's weights will take on one rank, from its configuration alone
//! ([`WeightBytes::planned`]): what a server checks against the device's free memory before it
//! loads anything. The rules are the loading code's (`experts` for which experts stay fp8 and
//! how shared experts join them, `router` for the gate's copies); a layer loaded for the same
//! target reports the same figures ([`crate::MoeLayer::weight_bytes`]).

use candle_core::DType;
use ep_kernels::gemm::fp8::{weight_scale_dims, FP8_BLOCK};

use crate::config::{MoeConfig, TopkMethod};
use crate::error::{Error, Result};
use crate::experts::{fp8_shapes_supported, shared_fp8_blocks};
use crate::layer::WeightBytes;

/// Where and from what a layer is to be loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightTarget {
    /// Ranks the routed experts are spread over.
    pub num_ranks: usize,
    /// Dtype of the float weights.
    pub dtype: DType,
    /// Loaded onto a CUDA device.
    pub cuda: bool,
    /// The checkpoint's experts are block-scaled fp8 (`weight` + `weight_scale_inv`): kept as
    /// fp8 on CUDA where the fp8 grouped GEMMs take their shapes, dequantized elsewhere.
    pub fp8_experts: bool,
    /// Redundant expert slots beyond the `n_routed_experts` (`MoeLayer::load_placed`): each
    /// rank holds `(E + r) / R` slots.
    pub redundant_experts: usize,
}

/// Bytes of a block-scaled e4m3 matrix `[n, k]`: its values and one f32 scale per 128 x 128
/// block (edge blocks included).
fn fp8_matrix_bytes(n: usize, k: usize) -> usize {
    let (sr, sc) = weight_scale_dims(n, k, FP8_BLOCK);
    n * k + 4 * sr * sc
}

/// Bytes of one SwiGLU expert of hidden size `h` and inner width `i` in block-scaled fp8.
fn fp8_expert_bytes(h: usize, i: usize) -> usize {
    2 * fp8_matrix_bytes(i, h) + fp8_matrix_bytes(h, i)
}

impl WeightBytes {
    /// The bytes a layer of `cfg` loaded for `target` holds on each rank.
    pub fn planned(cfg: &MoeConfig, target: WeightTarget) -> Result<Self> {
        cfg.validate()?;
        let (h, i, e) = (
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
        );
        let slots = e + target.redundant_experts;
        if target.num_ranks == 0 || slots % target.num_ranks != 0 {
            return Err(Error::invalid(
                "num_ranks",
                target.num_ranks,
                format!("must divide the {slots} expert slots (n_routed_experts + redundant)"),
            ));
        }
        let l = slots / target.num_ranks;
        let d = target.dtype.size_in_bytes();
        let fp8 = target.cuda && target.fp8_experts && fp8_shapes_supported(l, h, i);
        let routed = if fp8 {
            l * fp8_expert_bytes(h, i)
        } else {
            l * 3 * h * i * d
        };
        let shared = cfg.shared_intermediate_size().map_or(0, |i_s| {
            match shared_fp8_blocks(l, i, i_s).filter(|_| fp8) {
                Some(x) => x * fp8_expert_bytes(h, i),
                None => 3 * h * i_s * d,
            }
        });
        // The gate is kept in f32; on CUDA also as the bf16 it was stored in (the gate kernel's
        // copy, made where the f32 values are exact bf16s).
        let gate_copy = if target.cuda && target.dtype == DType::BF16 {
            2
        } else {
            0
        };
        let bias = if cfg.topk_method == TopkMethod::NoauxTc {
            4 * e
        } else {
            0
        };
        Ok(Self {
            routed,
            shared,
            router: e * h * (4 + gate_copy) + bias,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v3() -> MoeConfig {
        MoeConfig::from_json_str(
            r#"{"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8,
                "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc"}"#,
        )
        .unwrap()
    }

    #[test]
    fn fp8_experts_take_a_byte_a_weight_and_a_scale_a_block_on_cuda_only() {
        let cfg = v3();
        let target = WeightTarget {
            num_ranks: 8,
            dtype: DType::BF16,
            cuda: true,
            fp8_experts: true,
            redundant_experts: 0,
        };
        let w = WeightBytes::planned(&cfg, target).unwrap();
        // 32 local experts of 3 x 7168 x 2048 e4m3 values, 3 x 16 x 56 f32 scales each.
        assert_eq!(w.routed, 32 * (3 * 7168 * 2048 + 4 * 3 * 16 * 56));
        // The shared expert as one fp8 block beside the routed experts (no float copy).
        assert_eq!(w.shared, 3 * 7168 * 2048 + 4 * 3 * 16 * 56);
        assert_eq!(w.router, 256 * 7168 * 6 + 256 * 4);
        let cpu = WeightBytes::planned(
            &cfg,
            WeightTarget {
                cuda: false,
                dtype: DType::F32,
                ..target
            },
        )
        .unwrap();
        assert_eq!(cpu.routed, 32 * 3 * 7168 * 2048 * 4);
        assert_eq!(cpu.shared, 3 * 7168 * 2048 * 4);
        assert_eq!(cpu.router, 256 * 7168 * 4 + 256 * 4);
        let err = WeightBytes::planned(
            &cfg,
            WeightTarget {
                num_ranks: 3,
                ..target
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("256 expert slots"), "{err}");
        // 16 redundant slots over 8 ranks: 34 slots a rank.
        let redundant = WeightBytes::planned(
            &cfg,
            WeightTarget {
                redundant_experts: 16,
                ..target
            },
        )
        .unwrap();
        assert_eq!(redundant.routed, 34 * (3 * 7168 * 2048 + 4 * 3 * 16 * 56));
    }
}
