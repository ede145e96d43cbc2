//! GPU tests of the intranode kernels (notify, dispatch, cached dispatch, combine) against
//! their host twins, on every visible GPU of one node (R = 2 and 4 where available, R = 1 on a
//! single GPU). One host thread per rank; outputs are poisoned before each launch.
//!
//! Run: `gpu_intranode [filter]`; `gpu_intranode small` is the case for compute-sanitizer.

#[path = "../benches/common/mod.rs"]
mod node;

mod common;

use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use ep_kernels::intranode::{
    self, buffer_size_hint, cached_notify_cuda, ce_combine_cuda, ce_dispatch_cuda, combine_cuda,
    dispatch_cuda, notify_dispatch_cuda, CeCombineArgs, CeConfig, CeDispatchArgs, CombineArgs,
    Config, CopyStreams, DispatchArgs, HostMappedI32, NotifyArgs, Payload, RecvPayload, RecvTopK,
    TopK,
};
use ep_kernels::layout::{get_dispatch_layout, ExpertPlacement};
use ep_kernels::{Error, FP8_GROUP};
use float8::F8E4M3;
use half::bf16;
use node::{BoxError, Node};
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::Rng;

use common::{compare, compare_bits, CaseResult, Poison, Runner};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Routing {
    /// K distinct random experts per token, each replaced by -1 with probability 0.1.
    Random,
    /// As `Random`, but no expert of this rank is ever chosen.
    EmptyRank(usize),
    /// Every token goes to expert 0 only.
    HotExpert,
}

#[derive(Debug, Clone)]
struct Case {
    tokens: Vec<usize>,
    hidden: usize,
    num_topk: usize,
    num_experts: usize,
    fp8: bool,
    with_topk: bool,
    /// Combine with a `[T, H]` bias per rank (the sum starts from it).
    bias: bool,
    cached: bool,
    routing: Routing,
    alignment: usize,
    dispatch: Config,
    combine: Config,
    /// `Some`: the copy-engine path instead of the rings.
    ce: Option<CeConfig>,
}

/// One rank's inputs and the host twins' outputs for it.
struct RankData {
    topk_idx: Vec<i64>,
    topk_weights: Vec<f32>,
    x_bf16: Vec<bf16>,
    x_fp8: Vec<F8E4M3>,
    x_scales: Vec<f32>,
    per_rank: Vec<i32>,
    per_expert: Vec<i32>,
    in_rank: Vec<u8>,
    // expected
    num_recv: usize,
    recv_per_expert: Vec<i32>,
    channel_prefix: Vec<i32>,
    send_head: Vec<i32>,
    recv_channel_offset: Vec<i32>,
    recv_x_bf16: Vec<bf16>,
    recv_x_fp8: Vec<F8E4M3>,
    recv_scales: Vec<f32>,
    recv_src_idx: Vec<i32>,
    recv_topk_idx: Vec<i64>,
    recv_topk_weights: Vec<f32>,
    combine_x: Vec<bf16>,
    /// `[T, H]` combine bias (empty without one).
    bias: Vec<bf16>,
    combined: Vec<bf16>,
    combined_weights: Vec<f32>,
}

/// What one rank's GPU produced.
#[derive(Default)]
struct RankOut {
    rank_prefix: Vec<i32>,
    channel_prefix: Vec<i32>,
    /// Copy-engine path: notify's `send_index` and the per-source counter words.
    send_index: Vec<i32>,
    recv_per_source: Vec<i32>,
    num_recv: i32,
    recv_per_expert: Vec<i32>,
    /// One per dispatch (fresh, then cached if asked).
    dispatches: Vec<DispatchOut>,
    combined: Vec<bf16>,
    combined_weights: Vec<f32>,
}

#[derive(Default)]
struct DispatchOut {
    recv_x_bf16: Vec<bf16>,
    recv_x_fp8: Vec<F8E4M3>,
    recv_scales: Vec<f32>,
    recv_src_idx: Vec<i32>,
    recv_topk_idx: Vec<i64>,
    recv_topk_weights: Vec<f32>,
    recv_channel_offset: Vec<i32>,
    send_head: Vec<i32>,
}

fn gen_topk(rng: &mut StdRng, case: &Case, r: usize, t: usize) -> Vec<i64> {
    let k = case.num_topk;
    let e = case.num_experts;
    let l = e / r;
    let mut out = vec![-1i64; t * k];
    for tok in 0..t {
        let row = &mut out[tok * k..(tok + 1) * k];
        match case.routing {
            Routing::HotExpert => row[0] = 0,
            Routing::Random | Routing::EmptyRank(_) => {
                let (pool, skip): (usize, Option<usize>) = match case.routing {
                    Routing::EmptyRank(x) => (e - l, Some(x)),
                    _ => (e, None),
                };
                for (slot, idx) in sample(rng, pool, k.min(pool)).into_iter().enumerate() {
                    let mut ex = idx;
                    if let Some(x) = skip {
                        if ex >= x * l {
                            ex += l;
                        }
                    }
                    row[slot] = if rng.random_bool(0.1) { -1 } else { ex as i64 };
                }
            }
        }
    }
    out
}

/// Builds inputs for every rank and the expected outputs from the host twins.
fn build(rng: &mut StdRng, case: &Case) -> Result<Vec<RankData>, BoxError> {
    let r = case.tokens.len();
    let (h, k, e) = (case.hidden, case.num_topk, case.num_experts);
    let placement = ExpertPlacement::new(e, r, r)?;
    let c = case.dispatch.num_channels();
    let mut data: Vec<RankData> = Vec::new();
    for (s, &t) in case.tokens.iter().enumerate() {
        let topk_idx = gen_topk(rng, case, r, t);
        let topk_weights: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        // Element 0 of every row encodes (source rank, token); the rest is random.
        let x_bf16: Vec<bf16> = (0..t * h)
            .map(|i| {
                if i % h == 0 {
                    bf16::from_bits(((s as u16) << 12) | (i / h) as u16 & 0xfff)
                } else {
                    bf16::from_bits(rng.random())
                }
            })
            .collect();
        let x_fp8: Vec<F8E4M3> = (0..t * h)
            .map(|i| {
                if i % h == 0 {
                    F8E4M3::from_bits(((s as u8) << 6) ^ (i / h) as u8)
                } else {
                    F8E4M3::from_bits(rng.random())
                }
            })
            .collect();
        let x_scales: Vec<f32> = (0..t * (h / FP8_GROUP))
            .map(|i| (s * 100_000 + i) as f32 + 0.5)
            .collect();
        let layout = get_dispatch_layout(&topk_idx, t, k, &placement)?;
        data.push(RankData {
            topk_idx,
            topk_weights,
            x_bf16,
            x_fp8,
            x_scales,
            per_rank: layout.num_tokens_per_rank.clone(),
            per_expert: layout.num_tokens_per_expert.clone(),
            in_rank: layout.is_token_in_rank.iter().map(|&b| b as u8).collect(),
            num_recv: 0,
            recv_per_expert: vec![],
            channel_prefix: intranode::channel_prefix_matrix(&layout.is_token_in_rank, t, r, c)?,
            send_head: vec![-1; t * r],
            recv_channel_offset: vec![0; r * c],
            recv_x_bf16: vec![],
            recv_x_fp8: vec![],
            recv_scales: vec![],
            recv_src_idx: vec![],
            recv_topk_idx: vec![],
            recv_topk_weights: vec![],
            combine_x: vec![],
            bias: if case.bias {
                (0..t * h)
                    .map(|_| bf16::from_f32(rng.random_range(-4.0f32..4.0)))
                    .collect()
            } else {
                vec![]
            },
            combined: vec![],
            combined_weights: vec![],
        });
    }
    let per_rank_all: Vec<i32> = data.iter().flat_map(|d| d.per_rank.clone()).collect();
    let per_expert_all: Vec<i32> = data.iter().flat_map(|d| d.per_expert.clone()).collect();
    let notified: Vec<_> = (0..r)
        .map(|d| {
            intranode::notify(
                d,
                &per_rank_all,
                &per_expert_all,
                &placement,
                case.alignment,
            )
        })
        .collect::<Result<_, _>>()?;
    let prefix = notified[0].rank_prefix_matrix.clone();
    for d in 0..r {
        let n = notified[d].num_recv_tokens;
        let rd = &mut data[d];
        rd.num_recv = n;
        rd.recv_per_expert = notified[d].num_recv_tokens_per_expert.clone();
        rd.recv_x_bf16 = vec![bf16::ZERO; n * h];
        rd.recv_x_fp8 = vec![F8E4M3::from_bits(0); n * h];
        rd.recv_scales = vec![0.0; n * (h / FP8_GROUP)];
        rd.recv_src_idx = vec![0; n];
        rd.recv_topk_idx = vec![0; n * k];
        rd.recv_topk_weights = vec![0.0; n * k];
        rd.combine_x = (0..n * h)
            .map(|_| bf16::from_f32(rng.random_range(-4.0f32..4.0)))
            .collect();
    }
    let mut slots_all = Vec::new();
    for s in 0..r {
        let t = case.tokens[s];
        let in_rank: Vec<bool> = data[s].in_rank.iter().map(|&b| b != 0).collect();
        let slots = intranode::send_slots(s, &in_rank, t, &prefix, r)?;
        // send_head: index among the channel's tokens bound to d.
        for ch in 0..c {
            let mut count = vec![0i32; r];
            for tok in intranode::channel_range(t, c, ch) {
                for d in 0..r {
                    if in_rank[tok * r + d] {
                        data[s].send_head[tok * r + d] = count[d];
                        count[d] += 1;
                    }
                }
            }
        }
        for d in 0..r {
            for ch in 0..c {
                let block = if s > 0 { prefix[(s - 1) * r + d] } else { 0 };
                let within = if ch > 0 {
                    data[s].channel_prefix[d * c + ch - 1]
                } else {
                    0
                };
                data[d].recv_channel_offset[s * c + ch] = block + within;
            }
        }
        for tok in 0..t {
            for d in 0..r {
                let slot = slots[tok * r + d];
                if slot < 0 {
                    continue;
                }
                let slot = slot as usize;
                let (src, dst) = (&data[s], tok);
                let xb = src.x_bf16[dst * h..(dst + 1) * h].to_vec();
                let xf = src.x_fp8[dst * h..(dst + 1) * h].to_vec();
                let sc = src.x_scales[dst * (h / FP8_GROUP)..(dst + 1) * (h / FP8_GROUP)].to_vec();
                let ti = src.topk_idx[tok * k..(tok + 1) * k].to_vec();
                let tw = src.topk_weights[tok * k..(tok + 1) * k].to_vec();
                let rd = &mut data[d];
                rd.recv_x_bf16[slot * h..(slot + 1) * h].copy_from_slice(&xb);
                rd.recv_x_fp8[slot * h..(slot + 1) * h].copy_from_slice(&xf);
                let ns = h / FP8_GROUP;
                rd.recv_scales[slot * ns..(slot + 1) * ns].copy_from_slice(&sc);
                rd.recv_src_idx[slot] = tok as i32;
                intranode::localize_topk(
                    &ti,
                    &tw,
                    d,
                    &placement,
                    &mut rd.recv_topk_idx[slot * k..(slot + 1) * k],
                    &mut rd.recv_topk_weights[slot * k..(slot + 1) * k],
                );
            }
        }
        slots_all.push(slots);
    }
    for (s, slots) in slots_all.iter().enumerate() {
        let t = case.tokens[s];
        let xs: Vec<&[bf16]> = data.iter().map(|d| d.combine_x.as_slice()).collect();
        let bias = case.bias.then_some(data[s].bias.as_slice());
        let combined = intranode::combine(slots, t, h, &xs, bias)?;
        let mut weights = vec![0f32; t * k];
        for tok in 0..t {
            for (d, dd) in data.iter().enumerate() {
                let slot = slots[tok * r + d];
                if slot >= 0 {
                    for kk in 0..k {
                        weights[tok * k + kk] += dd.recv_topk_weights[slot as usize * k + kk];
                    }
                }
            }
        }
        data[s].combined = combined;
        data[s].combined_weights = weights;
    }
    Ok(data)
}

fn poisoned<T: Poison + DeviceRepr>(
    stream: &std::sync::Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, BoxError> {
    Ok(stream.clone_htod(&vec![T::poison(); len.max(1)])?)
}

fn upload<T: DeviceRepr + Copy>(
    stream: &std::sync::Arc<CudaStream>,
    v: &[T],
    zero: T,
) -> Result<CudaSlice<T>, BoxError> {
    if v.is_empty() {
        return Ok(stream.clone_htod(&[zero])?);
    }
    Ok(stream.clone_htod(v)?)
}

fn download<T: DeviceRepr + Clone + Default>(
    stream: &std::sync::Arc<CudaStream>,
    v: &CudaSlice<T>,
    len: usize,
) -> Result<Vec<T>, BoxError> {
    let mut all = stream.clone_dtoh(v)?;
    all.truncate(len);
    Ok(all)
}

/// Runs one dispatch on `rank` with the given handle (prefix matrices on the device).
#[allow(clippy::too_many_arguments)]
fn run_dispatch(
    node: &Node,
    rank: usize,
    case: &Case,
    inputs: &Inputs,
    rank_prefix: &CudaSlice<i32>,
    channel_prefix: &CudaSlice<i32>,
    n: usize,
    ce_state: Option<(&CudaSlice<i32>, &[usize], &CopyStreams)>,
) -> Result<Recv, BoxError> {
    let stream = &node.streams[rank];
    let (h, k, r) = (case.hidden, case.num_topk, node.num_ranks());
    let t = case.tokens[rank];
    let c = case.dispatch.num_channels();
    let ns = h / FP8_GROUP;
    let mut recv = Recv {
        x_bf16: poisoned::<bf16>(stream, n * h)?,
        x_fp8: poisoned::<F8E4M3>(stream, n * h)?,
        scales: poisoned::<f32>(stream, n * ns)?,
        src_idx: poisoned::<i32>(stream, n)?,
        topk_idx: poisoned::<i64>(stream, n * k)?,
        topk_weights: poisoned::<f32>(stream, n * k)?,
        channel_offset: poisoned::<i32>(stream, r * c)?,
        send_head: poisoned::<i32>(stream, t * r)?,
    };
    let x = if case.fp8 {
        Payload::Fp8 {
            x: inputs.x_fp8.slice(0..t * h),
            scales: inputs.scales.slice(0..t * ns),
        }
    } else {
        Payload::Bf16(inputs.x_bf16.slice(0..t * h))
    };
    let recv_x = if case.fp8 {
        RecvPayload::Fp8 {
            x: recv.x_fp8.slice_mut(0..n * h),
            scales: recv.scales.slice_mut(0..n * ns),
        }
    } else {
        RecvPayload::Bf16(recv.x_bf16.slice_mut(0..n * h))
    };
    let (topk, recv_topk) = if case.with_topk {
        (
            Some(TopK {
                idx: inputs.topk_idx.slice(0..t * k),
                weights: inputs.topk_weights.slice(0..t * k),
            }),
            Some(RecvTopK {
                idx: recv.topk_idx.slice_mut(0..n * k),
                weights: recv.topk_weights.slice_mut(0..n * k),
            }),
        )
    } else {
        (None, None)
    };
    if let Some(ce) = &case.ce {
        let (send_index, per_source, copies) = ce_state.ok_or("copy-engine state missing")?;
        ce_dispatch_cuda(
            stream,
            copies,
            &node.peers[rank],
            ce,
            CeDispatchArgs {
                x,
                topk,
                num_experts: case.num_experts,
                send_index: send_index.slice(0..t * r),
                rank_prefix_matrix: rank_prefix.slice(0..r * r),
                recv_per_source: per_source,
                recv_x,
                recv_src_idx: recv.src_idx.slice_mut(0..n),
                recv_topk,
                hidden: h,
                num_topk: if case.with_topk { k } else { 0 },
            },
        )?;
        return Ok(recv);
    }
    dispatch_cuda(
        stream,
        &node.peers[rank],
        &case.dispatch,
        DispatchArgs {
            x,
            topk,
            num_experts: case.num_experts,
            is_token_in_rank: inputs.in_rank.slice(0..t * r),
            rank_prefix_matrix: rank_prefix.slice(0..r * r),
            channel_prefix_matrix: channel_prefix.slice(0..r * c),
            recv_x,
            recv_src_idx: recv.src_idx.slice_mut(0..n),
            recv_topk,
            recv_channel_offset: recv.channel_offset.slice_mut(0..r * c),
            send_head: recv.send_head.slice_mut(0..t * r),
            num_recv_tokens: n,
            hidden: h,
            num_topk: if case.with_topk { k } else { 0 },
            worst_case: false,
        },
    )?;
    Ok(recv)
}

struct Inputs {
    x_bf16: CudaSlice<bf16>,
    x_fp8: CudaSlice<F8E4M3>,
    scales: CudaSlice<f32>,
    topk_idx: CudaSlice<i64>,
    topk_weights: CudaSlice<f32>,
    in_rank: CudaSlice<u8>,
}

struct Recv {
    x_bf16: CudaSlice<bf16>,
    x_fp8: CudaSlice<F8E4M3>,
    scales: CudaSlice<f32>,
    src_idx: CudaSlice<i32>,
    topk_idx: CudaSlice<i64>,
    topk_weights: CudaSlice<f32>,
    channel_offset: CudaSlice<i32>,
    send_head: CudaSlice<i32>,
}

impl Recv {
    fn download(
        &self,
        stream: &std::sync::Arc<CudaStream>,
        case: &Case,
        n: usize,
        t: usize,
        r: usize,
    ) -> Result<DispatchOut, BoxError> {
        let (h, k) = (case.hidden, case.num_topk);
        let c = case.dispatch.num_channels();
        Ok(DispatchOut {
            recv_x_bf16: if case.fp8 {
                vec![]
            } else {
                download(stream, &self.x_bf16, n * h)?
            },
            recv_x_fp8: if case.fp8 {
                download(stream, &self.x_fp8, n * h)?
            } else {
                vec![]
            },
            recv_scales: if case.fp8 {
                download(stream, &self.scales, n * (h / FP8_GROUP))?
            } else {
                vec![]
            },
            recv_src_idx: download(stream, &self.src_idx, n)?,
            recv_topk_idx: if case.with_topk {
                download(stream, &self.topk_idx, n * k)?
            } else {
                vec![]
            },
            recv_topk_weights: if case.with_topk {
                download(stream, &self.topk_weights, n * k)?
            } else {
                vec![]
            },
            recv_channel_offset: download(stream, &self.channel_offset, r * c)?,
            send_head: download(stream, &self.send_head, t * r)?,
        })
    }
}

/// The whole op on one rank: notify, dispatch (twice if cached), cached notify, combine.
fn run_rank(
    node: &Node,
    rank: usize,
    case: &Case,
    d: &RankData,
    counters: &(HostMappedI32, HostMappedI32),
) -> Result<RankOut, BoxError> {
    let stream = &node.streams[rank];
    let (h, k, r, e) = (
        case.hidden,
        case.num_topk,
        node.num_ranks(),
        case.num_experts,
    );
    let t = case.tokens[rank];
    let c = case.dispatch.num_channels();
    let inputs = Inputs {
        x_bf16: upload(stream, &d.x_bf16, bf16::ZERO)?,
        x_fp8: upload(stream, &d.x_fp8, F8E4M3::from_bits(0))?,
        scales: upload(stream, &d.x_scales, 0.0)?,
        topk_idx: upload(stream, &d.topk_idx, 0)?,
        topk_weights: upload(stream, &d.topk_weights, 0.0)?,
        in_rank: upload(stream, &d.in_rank, 0)?,
    };
    let per_rank = upload(stream, &d.per_rank, 0)?;
    let per_expert = upload(stream, &d.per_expert, 0)?;
    let mut rank_prefix = poisoned::<i32>(stream, r * r)?;
    let mut channel_prefix = poisoned::<i32>(stream, r * c)?;
    let mut send_index = poisoned::<i32>(stream, t * r)?;
    let (recv_counter, expert_counter) = counters;
    notify_dispatch_cuda(
        stream,
        &node.peers[rank],
        &case.dispatch,
        NotifyArgs {
            num_tokens_per_rank: per_rank.slice(0..r),
            num_tokens_per_expert: per_expert.slice(0..e),
            is_token_in_rank: inputs.in_rank.slice(0..t * r),
            num_tokens: t,
            num_experts: e,
            expert_alignment: case.alignment,
            rank_prefix_matrix: rank_prefix.slice_mut(0..r * r),
            channel_prefix_matrix: channel_prefix.slice_mut(0..r * c),
            moe_recv_counter: Some(recv_counter),
            moe_recv_expert_counter: Some(expert_counter),
            send_index: case.ce.map(|_| send_index.slice_mut(0..t * r)),
        },
    )?;
    let timeout = Duration::from_secs(30);
    let n = recv_counter.poll_nonneg(0, timeout, rank, intranode::NOTIFY_KERNEL)? as usize;
    let l = e / r;
    let recv_per_expert: Vec<i32> = (0..l)
        .map(|i| expert_counter.poll_nonneg(i, timeout, rank, intranode::NOTIFY_KERNEL))
        .collect::<Result<_, _>>()?;
    let recv_per_source: Vec<i32> = (0..r).map(|s| recv_counter.get(1 + s)).collect();
    let per_source: Vec<usize> = recv_per_source.iter().map(|&v| v.max(0) as usize).collect();
    let copies = CopyStreams::new(&node.ctxs[rank], r)?;
    let ce_state = case
        .ce
        .map(|_| (&send_index, per_source.as_slice(), &copies));
    let mut out = RankOut {
        num_recv: n as i32,
        recv_per_expert,
        recv_per_source,
        ..Default::default()
    };
    let recv = run_dispatch(
        node,
        rank,
        case,
        &inputs,
        &rank_prefix,
        &channel_prefix,
        n,
        ce_state,
    )?;
    out.dispatches.push(recv.download(stream, case, n, t, r)?);
    let recv = if case.cached {
        cached_notify_cuda(stream, &node.peers[rank])?;
        let recv2 = run_dispatch(
            node,
            rank,
            case,
            &inputs,
            &rank_prefix,
            &channel_prefix,
            n,
            ce_state,
        )?;
        out.dispatches.push(recv2.download(stream, case, n, t, r)?);
        recv2
    } else {
        recv
    };
    // Combine: return this rank's combine rows and (if any) the received weights.
    let combine_x = upload(stream, &d.combine_x, bf16::ZERO)?;
    let bias = upload(stream, &d.bias, bf16::ZERO)?;
    let mut combined = poisoned::<bf16>(stream, t * h)?;
    let mut combined_w = poisoned::<f32>(stream, t * k)?;
    cached_notify_cuda(stream, &node.peers[rank])?;
    if let Some(ce) = &case.ce {
        ce_combine_cuda(
            stream,
            &copies,
            &node.peers[rank],
            ce,
            CeCombineArgs {
                x: combine_x.slice(0..n * h),
                topk_weights: case.with_topk.then(|| recv.topk_weights.slice(0..n * k)),
                rank_prefix_matrix: rank_prefix.slice(0..r * r),
                send_index: send_index.slice(0..t * r),
                recv_per_source: &per_source,
                bias: case.bias.then(|| bias.slice(0..t * h)),
                combined_x: combined.slice_mut(0..t * h),
                combined_topk_weights: if case.with_topk {
                    Some(combined_w.slice_mut(0..t * k))
                } else {
                    None
                },
                hidden: h,
                num_topk: if case.with_topk { k } else { 0 },
            },
        )?;
    } else {
        combine_cuda(
            stream,
            &node.peers[rank],
            &case.combine,
            CombineArgs {
                x: combine_x.slice(0..n * h),
                topk_weights: case.with_topk.then(|| recv.topk_weights.slice(0..n * k)),
                rank_prefix_matrix: rank_prefix.slice(0..r * r),
                recv_channel_offset: recv.channel_offset.slice(0..r * c),
                send_head: recv.send_head.slice(0..t * r),
                bias: case.bias.then(|| bias.slice(0..t * h)),
                combined_x: combined.slice_mut(0..t * h),
                combined_topk_weights: if case.with_topk {
                    Some(combined_w.slice_mut(0..t * k))
                } else {
                    None
                },
                num_recv_tokens: n,
                hidden: h,
                num_topk: if case.with_topk { k } else { 0 },
            },
        )?;
    }
    out.combined = download(stream, &combined, t * h)?;
    if case.ce.is_some() {
        out.send_index = download(stream, &send_index, t * r)?;
    }
    out.combined_weights = if case.with_topk {
        download(stream, &combined_w, t * k)?
    } else {
        vec![]
    };
    out.rank_prefix = download(stream, &rank_prefix, r * r)?;
    out.channel_prefix = download(stream, &channel_prefix, r * c)?;
    Ok(out)
}

fn boxed(e: BoxError) -> Box<dyn std::error::Error> {
    e
}

fn check_case(node: &mut Node, rng: &mut StdRng, case: &Case) -> CaseResult {
    let r = node.num_ranks();
    assert_eq!(case.tokens.len(), r);
    let data = build(rng, case).map_err(boxed)?;
    let l = case.num_experts / r;
    let counters: Vec<(HostMappedI32, HostMappedI32)> = (0..r)
        .map(|i| {
            Ok((
                HostMappedI32::new(&node.ctxs[i], 1 + r, -1)?,
                HostMappedI32::new(&node.ctxs[i], l, -1)?,
            ))
        })
        .collect::<Result<_, Error>>()?;
    let outs = node
        .per_rank(|rank| run_rank(node, rank, case, &data[rank], &counters[rank]))
        .map_err(boxed)?;
    node.sync_and_check().map_err(boxed)?;
    let prefix = intranode::notify(
        0,
        &data
            .iter()
            .flat_map(|d| d.per_rank.clone())
            .collect::<Vec<_>>(),
        &data
            .iter()
            .flat_map(|d| d.per_expert.clone())
            .collect::<Vec<_>>(),
        &ExpertPlacement::new(case.num_experts, r, r)?,
        case.alignment,
    )?
    .rank_prefix_matrix;
    for (rank, (o, d)) in outs.iter().zip(&data).enumerate() {
        let at = |w: &str| format!("rank {rank}: {w}");
        compare(&at("rank_prefix_matrix"), &o.rank_prefix, &prefix)?;
        compare(
            &at("channel_prefix_matrix"),
            &o.channel_prefix,
            &d.channel_prefix,
        )?;
        compare(&at("num_recv_tokens"), &[o.num_recv], &[d.num_recv as i32])?;
        let per_source: Vec<i32> = (0..r)
            .map(|s| {
                let hi = prefix[s * r + rank];
                let lo = if s > 0 { prefix[(s - 1) * r + rank] } else { 0 };
                hi - lo
            })
            .collect();
        compare(
            &at("recv per source (counter words)"),
            &o.recv_per_source,
            &per_source,
        )?;
        if case.ce.is_some() {
            let t = case.tokens[rank];
            let mut next = vec![0i32; r];
            let mut want = vec![-1i32; t * r];
            for tok in 0..t {
                for dst in 0..r {
                    if d.in_rank[tok * r + dst] != 0 {
                        want[tok * r + dst] = next[dst];
                        next[dst] += 1;
                    }
                }
            }
            compare(&at("send_index"), &o.send_index, &want)?;
        }
        compare(
            &at("num_recv_tokens_per_expert"),
            &o.recv_per_expert,
            &d.recv_per_expert,
        )?;
        for (i, dis) in o.dispatches.iter().enumerate() {
            let at = |w: &str| format!("rank {rank} dispatch {i}: {w}");
            if case.fp8 {
                compare_bits(&at("recv_x (fp8)"), &dis.recv_x_fp8, &d.recv_x_fp8, |v| {
                    v.to_bits()
                })?;
                compare_bits(
                    &at("recv_x_scales"),
                    &dis.recv_scales,
                    &d.recv_scales,
                    f32::to_bits,
                )?;
            } else {
                compare_bits(
                    &at("recv_x (bf16)"),
                    &dis.recv_x_bf16,
                    &d.recv_x_bf16,
                    |v| v.to_bits(),
                )?;
            }
            compare(&at("recv_src_idx"), &dis.recv_src_idx, &d.recv_src_idx)?;
            if case.with_topk {
                compare(&at("recv_topk_idx"), &dis.recv_topk_idx, &d.recv_topk_idx)?;
                compare_bits(
                    &at("recv_topk_weights"),
                    &dis.recv_topk_weights,
                    &d.recv_topk_weights,
                    f32::to_bits,
                )?;
            }
            if case.ce.is_none() {
                compare(
                    &at("recv_channel_offset"),
                    &dis.recv_channel_offset,
                    &d.recv_channel_offset,
                )?;
                compare(&at("send_head"), &dis.send_head, &d.send_head)?;
            }
        }
        compare_bits(&at("combined_x"), &o.combined, &d.combined, |v| v.to_bits())?;
        if case.with_topk {
            compare_bits(
                &at("combined_topk_weights"),
                &o.combined_weights,
                &d.combined_weights,
                f32::to_bits,
            )?;
        }
    }
    Ok(())
}

/// A cached copy-engine-path case of `tokens` tokens per rank with the given split.
fn ce_case(r: usize, tokens: usize, fp8: bool, ce: CeConfig) -> Case {
    let mut c = base_case(r);
    c.tokens = vec![tokens; r];
    c.cached = true;
    c.fp8 = fp8;
    c.ce = Some(ce);
    c
}

fn base_case(r: usize) -> Case {
    Case {
        tokens: vec![300; r],
        hidden: 256,
        num_topk: 8,
        num_experts: 32,
        fp8: false,
        with_topk: true,
        bias: false,
        cached: false,
        routing: Routing::Random,
        alignment: 4,
        dispatch: Config::dispatch_default(r),
        combine: Config::combine_default(r),
        ce: None,
    }
}

fn main() {
    let mut runner = Runner::from_env("gpu_intranode");
    let gpus = node::device_count();
    let sizes: Vec<usize> = match gpus {
        0 => vec![],
        1 => vec![1],
        2 | 3 => vec![2],
        _ => vec![2, 4],
    };
    if sizes.is_empty() {
        gpu_test_suite::skip("no CUDA device");
    }
    for &r in &sizes {
        let bytes = buffer_size_hint(7168, 8, r, &Config::new(48, 32, 256).expect("config"));
        let mut node = match Node::new(r, bytes) {
            Ok(n) => n,
            Err(e) => {
                runner.case(&format!("r{r}/setup"), |_| Err(e.to_string().into()));
                continue;
            }
        };
        let mut cases: Vec<(String, Case)> = Vec::new();
        let mut small = base_case(r);
        small.tokens = vec![40; r];
        small.hidden = 128;
        small.num_topk = 4;
        small.num_experts = 8 * r;
        small.dispatch = Config::new(4, 4, 32).expect("config");
        small.combine = Config::new(4, 4, 32).expect("config");
        cases.push(("small".into(), small));
        cases.push(("random-bf16".into(), base_case(r)));
        let mut c = base_case(r);
        c.fp8 = true;
        c.hidden = 512;
        cases.push(("random-fp8".into(), c));
        let mut c = base_case(r);
        c.cached = true;
        cases.push(("cached-bf16".into(), c));
        let mut c = base_case(r);
        c.cached = true;
        c.fp8 = true;
        c.hidden = 384;
        cases.push(("cached-fp8".into(), c));
        let mut c = base_case(r);
        c.tokens = (0..r)
            .map(|i| if i == r - 1 { 0 } else { 97 + i })
            .collect();
        c.hidden = 264;
        cases.push(("t0-and-odd-tokens".into(), c));
        if r > 1 {
            let mut c = base_case(r);
            c.routing = Routing::EmptyRank(r - 1);
            cases.push(("empty-destination".into(), c));
        }
        let mut c = base_case(r);
        c.routing = Routing::HotExpert;
        c.tokens = vec![500; r];
        cases.push(("hot-expert".into(), c));
        let mut c = base_case(r);
        c.with_topk = false;
        c.cached = true;
        cases.push(("no-topk".into(), c));
        // A combine bias (the layer's shared experts' output), with and without weights.
        let mut c = base_case(r);
        c.bias = true;
        c.cached = true;
        c.tokens = (0..r).map(|i| 211 + 37 * i).collect();
        cases.push(("bias".into(), c));
        let mut c = base_case(r);
        c.bias = true;
        c.with_topk = false;
        c.hidden = 7168;
        c.num_experts = 256;
        cases.push(("bias-deepseek-shape-no-topk".into(), c));
        // Rings much smaller than a channel's tokens: many wrap-arounds, tiny chunks.
        let mut c = base_case(r);
        c.tokens = vec![1000; r];
        c.dispatch = Config::new(4, 3, 8).expect("config");
        c.combine = Config::new(4, 2, 26).expect("config");
        cases.push(("ring-wrap".into(), c));
        let mut c = base_case(r);
        c.tokens = vec![333; r];
        c.hidden = 7168;
        c.num_experts = 256;
        cases.push(("deepseek-shape-bf16".into(), c.clone()));
        c.fp8 = true;
        cases.push(("deepseek-shape-fp8".into(), c));
        let mut c = base_case(r);
        c.tokens = vec![2000; r];
        c.dispatch = Config::new(48, 16, 128).expect("config");
        c.combine = Config::new(48, 8, 128).expect("config");
        cases.push(("many-channels".into(), c));
        // The copy-engine path on the same cases (default chunks, and tiny chunks so that
        // blocks span many of them).
        let ce_cases: Vec<(String, Case)> = cases
            .iter()
            .filter(|(n, _)| n != "ring-wrap" && n != "many-channels")
            .map(|(n, c)| {
                let mut c = c.clone();
                c.ce = Some(CeConfig::default());
                (format!("ce-{n}"), c)
            })
            .collect();
        cases.extend(ce_cases);
        let c = ce_case(
            r,
            1000,
            false,
            CeConfig {
                num_sms: 3,
                first_chunk_rows: 5,
                max_chunk_rows: 40,
                push_first_chunk_rows: 3,
                push_max_chunk_rows: 9,
                copy_engine_peers: 1,
                sm_blocks: 2,
                dispatch_push: true,
                own_rows_last: false,
                pack_local_warps: 8,
                pack_local_blocks: 0,
                copy_lanes: 1,
                local_copy_out: false,
                combine_push_warps: 12,
                combine_ce_tail_chunks: 2,
            },
        );
        cases.push(("ce-tiny-chunks-one-pass".into(), c));
        // The defaults but with one pack pass (each row read once, stored everywhere).
        let c = ce_case(
            r,
            1500,
            false,
            CeConfig {
                own_rows_last: false,
                copy_lanes: 1,
                ..CeConfig::dispatch_for(r, 24)
            },
        );
        cases.push(("ce-one-pass-one-lane".into(), c));
        // The combine with both roles in every block: one copy-engine home, none, and chunks of
        // a few rows (many push items per chunk boundary).
        for (name, copy_engine_peers, first, max) in [
            ("ce-combine-roles", 1, 256, 1024),
            ("ce-combine-roles-all-sm", 0, 768, 4096),
            ("ce-combine-roles-tiny-chunks", 1, 3, 20),
        ] {
            let ce = CeConfig {
                copy_engine_peers,
                first_chunk_rows: first,
                max_chunk_rows: max,
                combine_push_warps: 16,
                ..CeConfig::combine_for(r, 24)
            };
            cases.push((name.into(), ce_case(r, 1600, false, ce)));
        }
        // The copy engines also pushing the SM homes' last chunks: with both roles, with
        // separate push blocks, without a copy-engine home, and every chunk of every home.
        for (name, copy_engine_peers, push_warps, tail, first, max) in [
            ("ce-combine-tail1", 1, 5, 1, 768, 4096),
            ("ce-combine-tail2-separate", 1, 0, 2, 64, 256),
            ("ce-combine-tail-no-ce-home", 0, 5, 1, 256, 1024),
            ("ce-combine-tail-all-chunks", 1, 5, 32, 100, 300),
        ] {
            let ce = CeConfig {
                copy_engine_peers,
                first_chunk_rows: first,
                max_chunk_rows: max,
                combine_push_warps: push_warps,
                combine_ce_tail_chunks: tail,
                ..CeConfig::combine_for(r, 24)
            };
            cases.push((name.into(), ce_case(r, 1600, false, ce)));
        }
        // Every peer by copy engines (no SM home: no tail stream), and two copy-engine homes
        // with the SM homes' tail chunks on the first one's stream.
        for (name, copy_engine_peers, tail) in [
            ("ce-combine-all-engines-tail", r - 1, 1),
            ("ce-combine-two-engines-tail", 2.min(r - 1), 1),
        ] {
            let ce = CeConfig {
                copy_engine_peers,
                combine_ce_tail_chunks: tail,
                first_chunk_rows: 128,
                max_chunk_rows: 512,
                ..CeConfig::combine_for(r, 24)
            };
            cases.push((name.into(), ce_case(r, 1500, false, ce)));
        }
        // The fp8 dispatch's own defaults (whole local blocks, a quarter of the SMs pulling).
        cases.push((
            "ce-fp8-defaults".into(),
            ce_case(r, 1700, true, CeConfig::dispatch_fp8_for(r, 24)),
        ));
        // The pushed blocks in chunks of their own: small fixed ones (the defaults otherwise,
        // bf16 and fp8), tiny doubling ones, and copied out by SMs.
        for (name, push_first, push_max, fp8, local_copy_out) in [
            ("ce-push-chunks-256", 256, 256, false, true),
            ("ce-push-chunks-128-fp8", 128, 128, true, true),
            ("ce-push-chunks-tiny", 2, 11, false, true),
            ("ce-push-chunks-sm-copy-out", 64, 200, false, false),
        ] {
            let ce = CeConfig {
                push_first_chunk_rows: push_first,
                push_max_chunk_rows: push_max,
                local_copy_out,
                ..CeConfig::dispatch_for(r, 24)
            };
            cases.push((name.into(), ce_case(r, 1700, fp8, ce)));
        }
        // The pack's work queues: every warp starting on the pushes, or on the local stores.
        for (name, pack_local_blocks, pack_local_warps, fp8) in [
            ("ce-pack-all-warps-push-first", 0, 0, false),
            ("ce-pack-all-warps-local-first", 0, 24, true),
            ("ce-pack-local-blocks", 3, 2, false),
        ] {
            let ce = CeConfig {
                pack_local_blocks,
                pack_local_warps,
                ..CeConfig::dispatch_for(r, 24)
            };
            cases.push((name.into(), ce_case(r, 1700, fp8, ce)));
        }
        // Pushed rows copied out by the local copy engines (every peer pushed: none by
        // engines, and the default split).
        for (name, copy_engine_peers, fp8) in [
            ("ce-local-copy-out-all-sm", 0, false),
            ("ce-local-copy-out-fp8", 1, true),
        ] {
            let ce = CeConfig {
                copy_engine_peers,
                local_copy_out: true,
                ..CeConfig::dispatch_for(r, 24)
            };
            cases.push((name.into(), ce_case(r, 1500, fp8, ce)));
        }
        // Every peer by SM copies (one block), and every peer by copy engines.
        for (name, copy_engine_peers, sm_blocks, fp8, dispatch_push) in [
            ("ce-all-sm-one-block", 0, 1, false, true),
            ("ce-all-sm-fp8", 0, 8, true, true),
            ("ce-all-sm-pull", 0, 8, false, false),
            ("ce-all-sm-pull-fp8", 0, 3, true, false),
            ("ce-all-engines", r - 1, 8, false, true),
        ] {
            let ce = CeConfig {
                copy_engine_peers,
                sm_blocks,
                dispatch_push,
                ..CeConfig::dispatch_default()
            };
            cases.push((name.into(), ce_case(r, 1500, fp8, ce)));
        }
        let mut c = base_case(r);
        c.tokens = vec![2000; r];
        c.fp8 = true;
        c.ce = Some(CeConfig {
            num_sms: 1,
            first_chunk_rows: 1,
            max_chunk_rows: 1,
            push_first_chunk_rows: 0,
            push_max_chunk_rows: 0,
            copy_engine_peers: 1,
            sm_blocks: 3,
            dispatch_push: false,
            own_rows_last: true,
            pack_local_warps: 3,
            pack_local_blocks: 0,
            copy_lanes: 2,
            local_copy_out: false,
            combine_push_warps: 0,
            combine_ce_tail_chunks: 3,
        });
        cases.push(("ce-one-row-chunks".into(), c));
        for (name, case) in cases {
            runner.case(&format!("r{r}/{name}"), |rng| {
                check_case(&mut node, rng, &case)
            });
        }
        runner.case(&format!("r{r}/timeout"), |_| check_timeout(&mut node));
        runner.case(&format!("r{r}/after-timeout"), |rng| {
            check_case(&mut node, rng, &base_case(r))
        });
    }
    if let Some(&r) = sizes.first() {
        runner.case(&format!("r{r}/host-poll-timeout"), |_| {
            let ctx = cudarc::driver::CudaContext::new(0)?;
            let m = HostMappedI32::new(&ctx, 1, -1)?;
            match m.poll_nonneg(0, Duration::from_millis(20), 3, intranode::NOTIFY_KERNEL) {
                Err(Error::PeerTimeout { rank: 3, .. }) => Ok(()),
                other => Err(format!("expected PeerTimeout for rank 3, got {other:?}").into()),
            }
        });
        // The pushed blocks' chunking is checked like the general one.
        runner.case(&format!("r{r}/ce-push-chunks-checked"), |_| {
            let ce = CeConfig {
                push_first_chunk_rows: 600,
                push_max_chunk_rows: 512,
                ..CeConfig::dispatch_for(4, 24)
            };
            match ce.validate() {
                Err(Error::InvalidArgument {
                    arg: "push_first_chunk_rows",
                    value,
                    ..
                }) if value == "600" => Ok(()),
                other => Err(format!(
                    "expected InvalidArgument for push_first_chunk_rows = 600, got {other:?}"
                )
                .into()),
            }
        });
    }
    runner.finish();
}

/// Rank 0 alone enters a barrier: it must time out naming another rank, not hang; the node is
/// then reset. With one rank the barrier is with itself and must succeed.
fn check_timeout(node: &mut Node) -> CaseResult {
    let r = node.num_ranks();
    node.set_timeout(Duration::from_millis(200));
    cached_notify_cuda(&node.streams[0], &node.peers[0])?;
    let res = node.sync_and_check();
    node.set_timeout(intranode::DEFAULT_TIMEOUT);
    node.reset().map_err(boxed)?;
    match (r, res) {
        (1, Ok(())) => Ok(()),
        (_, Err(e)) => {
            let msg = e.to_string();
            if r > 1 && msg.contains("timed out waiting for rank") && !msg.contains("rank 0 ") {
                Ok(())
            } else {
                Err(format!("unexpected error: {msg}").into())
            }
        }
        (_, Ok(())) => Err("rank 0's lone barrier did not time out".into()),
    }
}
