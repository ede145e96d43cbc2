//! The gate: per-token expert choice and weights, DeepSeek-V3 grouped top-k (`noaux_tc`) or
//! plain softmax top-k.
//!
//! [`Router::forward`] computes the gate logits `x W^T` in f32, then `ep_kernels::routing`
//! scores them (sigmoid or softmax) and selects, with ties broken towards the lower expert
//! (and group) id so that every rank and every backend agrees. On CUDA that is two kernels
//! and nothing read back to the host: a bf16 cuBLAS GEMM with f32 output on the tensor cores
//! when `x` is bf16 and the gate weight is exactly bf16 (DeepSeek-V3's checkpoints) past
//! `routing::GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM` tokens, the gate kernel (`x` read in its own
//! dtype) below that, or up to `routing::GATE_KERNEL_MAX_TOKENS` tokens without the GEMM, else
//! a cuBLAS f32 matmul; then the routing kernel in its logits mode. On the CPU: a candle
//! matmul, then the routing host twin.
//! [`Router::scores`] returns the scores themselves, computed with candle ops.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use ep_kernels::routing::{self, GroupScore, Scoring, TopkInput, TopkSpec};

use crate::config::{MoeConfig, ScoringFunc, TopkMethod};
use crate::error::{Error, Result};

/// The routing of a batch of tokens.
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[T, K]` i64 global expert ids, best first (never `-1` from the router).
    pub topk_idx: Tensor,
    /// `[T, K]` f32 weights of the chosen experts.
    pub topk_weights: Tensor,
}

/// A MoE gate: a bias-free linear map `[E, H]` from hidden states to expert logits plus the
/// selection rule of the configuration.
#[derive(Clone, Debug)]
pub struct Router {
    /// `[E, H]` f32.
    weight: Tensor,
    /// `[E, H]` bf16 holding exactly the values of `weight`, when they all are bf16 values and
    /// `weight` is on a CUDA device (the tensor-core GEMM of the gate for many bf16 tokens).
    #[cfg(feature = "cuda")]
    weight_bf16: Option<Tensor>,
    /// `[E]` f32 selection bias (`noaux_tc` only), on the host and on the weight's device.
    bias: Option<(Vec<f32>, Tensor)>,
    scoring: ScoringFunc,
    spec: TopkSpec,
}

impl Router {
    /// Builds a router from the gate weight `[E, H]` (any float dtype, kept as f32) and, for
    /// `noaux_tc`, the `e_score_correction_bias` `[E]`; `None` there means no correction.
    /// A bias given with another top-k method is an error, as it would be silently ignored.
    pub fn new(weight: Tensor, bias: Option<Tensor>, cfg: &MoeConfig) -> Result<Self> {
        cfg.validate()?;
        let (e, h) = (cfg.n_routed_experts, cfg.hidden_size);
        if weight.dims() != [e, h] {
            return Err(Error::invalid(
                "weight",
                format!("shape {:?}", weight.dims()),
                format!("must be [n_routed_experts, hidden_size] = [{e}, {h}]"),
            ));
        }
        let bias = match bias {
            None => None,
            Some(b) => {
                if cfg.topk_method != TopkMethod::NoauxTc {
                    return Err(Error::invalid(
                        "bias",
                        format!("given with topk_method = {:?}", cfg.topk_method),
                        "only noaux_tc uses e_score_correction_bias",
                    ));
                }
                if b.dims() != [e] {
                    return Err(Error::invalid(
                        "bias",
                        format!("shape {:?}", b.dims()),
                        format!("must be [n_routed_experts] = [{e}]"),
                    ));
                }
                let host = b.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                let dev = Tensor::from_slice(&host, e, weight.device())?;
                Some((host, dev))
            }
        };
        let group_score = match cfg.topk_method {
            _ if cfg.n_group <= 1 => GroupScore::None,
            TopkMethod::Greedy => GroupScore::None,
            TopkMethod::NoauxTc => GroupScore::Top2Sum,
            TopkMethod::GroupLimitedGreedy => GroupScore::Max,
        };
        let spec = TopkSpec {
            num_experts: e,
            top_k: cfg.num_experts_per_tok,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            group_score,
            norm_topk_prob: cfg.norm_topk_prob,
            scaling: cfg.routed_scaling_factor as f32,
        };
        spec.check(false)?;
        let weight = weight.to_dtype(DType::F32)?.contiguous()?;
        #[cfg(feature = "cuda")]
        let weight_bf16 = if weight.device().is_cuda() {
            exact_bf16(&weight)?
        } else {
            None
        };
        Ok(Self {
            weight,
            #[cfg(feature = "cuda")]
            weight_bf16,
            bias,
            scoring: cfg.scoring_func,
            spec,
        })
    }

    /// Loads the gate from `vb` at the layer's `mlp.gate` prefix: `weight` `[E, H]` and, for
    /// `noaux_tc`, `e_score_correction_bias` `[E]` (read as f32 whatever `vb`'s dtype).
    pub fn load(vb: VarBuilder, cfg: &MoeConfig) -> Result<Self> {
        cfg.validate()?;
        let weight = vb.get((cfg.n_routed_experts, cfg.hidden_size), "weight")?;
        let bias = if cfg.topk_method == TopkMethod::NoauxTc {
            Some(vb.get_with_hints_dtype(
                cfg.n_routed_experts,
                "e_score_correction_bias",
                Default::default(),
                DType::F32,
            )?)
        } else {
            None
        };
        Self::new(weight, bias, cfg)
    }

    /// Number of routed experts `E`.
    pub fn num_experts(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Experts per token `K`.
    pub fn top_k(&self) -> usize {
        self.spec.top_k
    }

    /// The selection rule.
    pub fn spec(&self) -> &TopkSpec {
        &self.spec
    }

    /// Bytes of its weights (the f32 gate, its bf16 copy on CUDA, the bias).
    pub fn weight_bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        let bf16 = self
            .weight_bf16
            .as_ref()
            .map_or(0, crate::experts::tensor_bytes);
        #[cfg(not(feature = "cuda"))]
        let bf16 = 0;
        crate::experts::tensor_bytes(&self.weight)
            + bf16
            + self
                .bias
                .as_ref()
                .map_or(0, |(_, t)| crate::experts::tensor_bytes(t))
    }

    /// The gate weight `[E, H]` in f32.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The selection bias `[E]`, if any.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_ref().map(|(h, _)| h.as_slice())
    }

    /// Checks that `x` is `[T, H]`; returns `T`.
    fn check_x(&self, x: &Tensor) -> Result<usize> {
        let expected = || format!("must be [tokens, hidden_size = {}]", self.hidden_size());
        let (t, h) = x
            .dims2()
            .map_err(|_| Error::invalid("x", format!("shape {:?}", x.dims()), expected()))?;
        if h != self.hidden_size() {
            return Err(Error::invalid(
                "x",
                format!("shape {:?}", x.dims()),
                expected(),
            ));
        }
        Ok(t)
    }

    /// Gate logits `[T, E]` f32 of a checked `x` with candle ops (`x` converted to f32, then a
    /// matmul: cuBLAS on CUDA), on `x`'s device.
    fn matmul_logits(&self, x: &Tensor, t: usize) -> Result<Tensor> {
        if t == 0 {
            return Ok(Tensor::zeros(
                (0, self.num_experts()),
                DType::F32,
                x.device(),
            )?);
        }
        Ok(x.to_dtype(DType::F32)?
            .matmul(&self.weight.to_device(x.device())?.t()?)?)
    }

    /// How the logits become scores.
    fn scoring_fn(&self) -> Scoring {
        match self.scoring {
            ScoringFunc::Sigmoid => Scoring::Sigmoid,
            ScoringFunc::Softmax => Scoring::Softmax,
        }
    }

    /// Expert scores `[T, E]` f32 (sigmoid or softmax of `x @ W^T` computed in f32), on `x`'s device.
    pub fn scores(&self, x: &Tensor) -> Result<Tensor> {
        let t = self.check_x(x)?;
        let logits = self.matmul_logits(x, t)?;
        if t == 0 {
            return Ok(logits);
        }
        Ok(match self.scoring {
            ScoringFunc::Sigmoid => candle_nn::ops::sigmoid(&logits)?,
            ScoringFunc::Softmax => candle_nn::ops::softmax_last_dim(&logits)?,
        })
    }

    /// Routes `x` (`[T, H]`, any float dtype, CPU or CUDA): `topk_idx` `[T, K]` i64 and
    /// `topk_weights` `[T, K]` f32, both on `x`'s device. On CUDA nothing is read back to the
    /// host.
    pub fn forward(&self, x: &Tensor) -> Result<Routing> {
        let t = self.check_x(x)?;
        let input = TopkInput::Logits(self.scoring_fn());
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = x.device() {
            let gemm = self.weight_bf16.as_ref().filter(|w| {
                t > 0 && x.dtype() == DType::BF16 && w.device().same_device(x.device())
            });
            let logits = if t > 0 && routing::gate_uses_kernel(t, gemm.is_some()) {
                self.gate_cuda(cuda, x, t)?
            } else if let Some(w) = gemm {
                self.gate_gemm_cuda(cuda, x, w, t)?
            } else {
                self.matmul_logits(x, t)?
            };
            return self.select_cuda(cuda, &logits, input, t);
        }
        let logits = self.matmul_logits(x, t)?;
        self.select_host(&logits, input, t)
    }

    /// The selection of [`Router::forward`] from given `[T, E]` f32 scores.
    pub fn select(&self, scores: &Tensor) -> Result<Routing> {
        let (t, e) = scores.dims2()?;
        if e != self.num_experts() || scores.dtype() != DType::F32 {
            return Err(Error::invalid(
                "scores",
                format!("{:?} {:?}", scores.dtype(), scores.dims()),
                format!("must be f32 [T, {}]", self.num_experts()),
            ));
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = scores.device() {
            return self.select_cuda(cuda, scores, TopkInput::Scores, t);
        }
        self.select_host(scores, TopkInput::Scores, t)
    }

    /// The routing host twin on `[t, E]` f32 `values` (scores or logits, as `input` says);
    /// the result on `values`' device.
    fn select_host(&self, values: &Tensor, input: TopkInput, t: usize) -> Result<Routing> {
        let k = self.spec.top_k;
        let dev: &Device = values.device();
        let host: Vec<f32> = values.flatten_all()?.to_vec1()?;
        let mut idx = vec![0i64; t * k];
        let mut weights = vec![0f32; t * k];
        routing::route_topk(
            &host,
            input,
            self.bias.as_ref().map(|(h, _)| h.as_slice()),
            &self.spec,
            &mut idx,
            &mut weights,
        )?;
        Ok(Routing {
            topk_idx: Tensor::from_vec(idx, (t, k), dev)?,
            topk_weights: Tensor::from_vec(weights, (t, k), dev)?,
        })
    }

    /// Gate logits `[t, E]` f32 of a checked CUDA `x` (`t > 0`) with the gate kernel, `x` read
    /// in its own dtype (bf16, f16, f32; other dtypes are converted to f32 first).
    #[cfg(feature = "cuda")]
    fn gate_cuda(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        x: &Tensor,
        t: usize,
    ) -> Result<Tensor> {
        use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
        use half::{bf16, f16};
        let (e, h) = (self.num_experts(), self.hidden_size());
        let stream = dev.cuda_stream();
        let x = match x.dtype() {
            DType::BF16 | DType::F16 | DType::F32 => x.contiguous()?,
            _ => x.to_dtype(DType::F32)?.contiguous()?,
        };
        // The weight lives on the device it was built on: this is a clone of the handle, a
        // copy only if `x` is on another device.
        let weight = self.weight.to_device(x.device())?;
        let shape = routing::GateShape {
            num_experts: e,
            hidden: h,
        };
        let mut logits = alloc_uninit::<f32>(&stream, t * e)?;
        {
            let x_d = DeviceTensor::new("x", &x)?;
            let w_d = DeviceTensor::new("weight", &weight)?;
            let w = w_d.view::<f32>()?;
            let out = &mut logits.slice_mut(0..t * e);
            match x.dtype() {
                DType::BF16 => {
                    routing::gate_logits_cuda(&stream, &x_d.view::<bf16>()?, &w, shape, out)?
                }
                DType::F16 => {
                    routing::gate_logits_cuda(&stream, &x_d.view::<f16>()?, &w, shape, out)?
                }
                _ => routing::gate_logits_cuda(&stream, &x_d.view::<f32>()?, &w, shape, out)?,
            }
        }
        Ok(wrap(logits, (t, e), dev))
    }

    /// Gate logits `[t, E]` f32 of a checked bf16 CUDA `x` (`t > 0`) with the bf16 weight
    /// `w` (on `x`'s device) on the tensor cores: cuBLAS on candle's stream and handle.
    #[cfg(feature = "cuda")]
    fn gate_gemm_cuda(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        x: &Tensor,
        w: &Tensor,
        t: usize,
    ) -> Result<Tensor> {
        use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
        use half::bf16;
        let e = self.num_experts();
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        let x = x.contiguous()?;
        let shape = routing::GateShape {
            num_experts: e,
            hidden: self.hidden_size(),
        };
        let mut logits = alloc_uninit::<f32>(&stream, t * e)?;
        {
            let x_d = DeviceTensor::new("x", &x)?;
            let w_d = DeviceTensor::new("weight", w)?;
            routing::gate_logits_gemm_cuda(
                &stream,
                &blas,
                &x_d.view::<bf16>()?,
                &w_d.view::<bf16>()?,
                shape,
                &mut logits.slice_mut(0..t * e),
            )?;
        }
        Ok(wrap(logits, (t, e), dev))
    }

    /// The routing kernel on candle's stream, on `[t, E]` f32 `scores` (or logits, as `input`
    /// says).
    #[cfg(feature = "cuda")]
    fn select_cuda(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        scores: &Tensor,
        input: TopkInput,
        t: usize,
    ) -> Result<Routing> {
        use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
        let k = self.spec.top_k;
        let stream = dev.cuda_stream();
        let scores = scores.contiguous()?;
        let bias = match &self.bias {
            Some((_, b)) => Some(b.to_device(scores.device())?),
            None => None,
        };
        let mut idx = alloc_uninit::<i64>(&stream, t * k)?;
        let mut weights = alloc_uninit::<f32>(&stream, t * k)?;
        {
            let s_d = DeviceTensor::new("scores", &scores)?;
            let b_d = bias
                .as_ref()
                .map(|b| DeviceTensor::new("bias", b))
                .transpose()?;
            let b_v = b_d.as_ref().map(|b| b.view::<f32>()).transpose()?;
            routing::route_topk_cuda(
                &stream,
                &s_d.view::<f32>()?,
                input,
                b_v.as_ref()
                    .map(|b| b as &dyn candle_core::cuda_backend::cudarc::driver::DevicePtr<f32>),
                &self.spec,
                &mut idx.slice_mut(0..t * k),
                &mut weights.slice_mut(0..t * k),
            )?;
        }
        Ok(Routing {
            topk_idx: wrap(idx, (t, k), dev),
            topk_weights: wrap(weights, (t, k), dev),
        })
    }
}

/// `weight` (f32) as bf16 when every value of it is a bf16 value (converting loses nothing),
/// else `None`. Reads one scalar back: for construction, not the hot path.
#[cfg(feature = "cuda")]
fn exact_bf16(weight: &Tensor) -> Result<Option<Tensor>> {
    let w16 = weight.to_dtype(DType::BF16)?;
    let differs = w16
        .to_dtype(DType::F32)?
        .ne(weight)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok((differs == 0.0).then_some(w16))
}
