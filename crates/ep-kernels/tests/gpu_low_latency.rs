//! GPU tests of the low-latency dispatch and combine against their host twins.
//!
//! One process drives every visible GPU (one rank each, peer access enabled), one host thread
//! per rank launching that rank's kernels concurrently. Expected outputs are computed with the
//! host twins (`send_slots`, `RecvLayout`, `fp8::quantize`, `combine`, `combine_per_rank`)
//! from all ranks' inputs; cases named `per_rank` dispatch with the top-k weights and combine
//! per rank ([`Reduction::PerRank`]);
//! every device output is poisoned before the op and compared bit for bit. Runs with all
//! visible GPUs, and also with 2 of them when there are more.
//!
//! With the `nvshmem` feature the binary then re-executes itself once per GPU (module
//! `nvshmem_world`): 2 nodes x 2 GPUs, 2 x 1 and one node of 4, buffers on NVSHMEM's heap and
//! ranks of other nodes reached through NVSHMEM puts; each child checks its own rank of the
//! round trips (both formats and reductions, no tokens, hot experts, DeepSeek-V3 size) and of
//! back-to-back ops, and the parent adds the children's counts to its own.
//!
//! Environment as the other GPU tests (`EP_TEST_SEED`, a name filter as first argument).

mod common;
#[cfg(feature = "nvshmem")]
mod nvshmem_world;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{compare, compare_bits, CaseResult, Runner, POISON_BYTE};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaViewMut};
use ep_kernels::fp8::quantize;
use ep_kernels::layout::ExpertPlacement;
use ep_kernels::low_latency::{
    clean_buffer_cuda, combine, combine_cuda, combine_per_rank, delay_cuda, dispatch_cuda,
    enable_peer_access, send_slots, LowLatencyBuffer, LowLatencyFormat, LowLatencyLayout,
    LowLatencyRecv, LowLatencyRecvMut, Phases, RecvLayout, RecvXMut, Reduction,
};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// Errors that may cross rank threads.
type TErr = Box<dyn std::error::Error + Send + Sync>;
type TResult<T> = Result<T, TErr>;

const TOPK: usize = 8;

// ------------------------------------------------------------------------------------------
// The world: one rank per GPU
// ------------------------------------------------------------------------------------------

struct Rank {
    stream: Arc<CudaStream>,
    buf: LowLatencyBuffer,
}

struct World {
    layout: LowLatencyLayout,
    placement: ExpertPlacement,
    /// The ranks this process drives: all of them (threads), or one (a child process of the
    /// NVSHMEM launches), rank `first` on.
    ranks: Vec<Rank>,
    first: usize,
}

impl World {
    fn new(num_ranks: usize, m: usize, h: usize, e: usize) -> TResult<Self> {
        let layout = LowLatencyLayout::new(m, h, num_ranks, e)?;
        let placement = ExpertPlacement::new(e, num_ranks, num_ranks)?;
        #[cfg(feature = "nvshmem")]
        if let Some(p) = nvshmem_world::proc() {
            return Self::one_process_rank(p, layout, placement);
        }
        let ctxs = (0..num_ranks)
            .map(CudaContext::new)
            .collect::<Result<Vec<_>, _>>()?;
        for ctx in &ctxs {
            // SAFETY: every slice of these tests is allocated, used and freed on the single
            // stream of its rank, so cudarc's cross-stream events are not needed (and would
            // break graph capture).
            unsafe { ctx.disable_event_tracking() };
        }
        for a in &ctxs {
            for b in &ctxs {
                enable_peer_access(a, b)?;
            }
        }
        let mut ranks = Vec::with_capacity(num_ranks);
        for (r, ctx) in ctxs.iter().enumerate() {
            let stream = ctx.new_stream()?;
            let buf = LowLatencyBuffer::new(&stream, layout, r)?;
            ranks.push(Rank { stream, buf });
        }
        let bases: Vec<u64> = ranks.iter().map(|r| r.buf.base_ptr()).collect();
        for rank in &mut ranks {
            let stream = rank.stream.clone();
            // SAFETY: `bases` are the ranks' buffers of this layout, peer-accessible in this
            // process, and live as long as the ranks.
            unsafe { rank.buf.connect(&stream, &bases) }?;
        }
        Ok(Self {
            layout,
            placement,
            ranks,
            first: 0,
        })
    }

    /// This process's rank of a multi-process world, its buffer on NVSHMEM's heap; ranks of
    /// other nodes are reached through NVSHMEM.
    #[cfg(feature = "nvshmem")]
    fn one_process_rank(
        p: &nvshmem_world::Proc,
        layout: LowLatencyLayout,
        placement: ExpertPlacement,
    ) -> TResult<Self> {
        if layout.num_ranks != p.world {
            return Err(format!(
                "a world of {} ranks in a launch of {}",
                layout.num_ranks, p.world
            )
            .into());
        }
        let ctx = CudaContext::new(p.rank)?;
        // SAFETY: as in `World::new`: one stream per rank.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let node = p.rank / p.gpus_per_node;
        let buf =
            LowLatencyBuffer::new_nvshmem(&stream, layout, &p.nv, |r| r / p.gpus_per_node == node)?;
        Ok(Self {
            layout: *buf.layout(),
            placement,
            ranks: vec![Rank { stream, buf }],
            first: p.rank,
        })
    }

    fn num_ranks(&self) -> usize {
        self.layout.num_ranks
    }

    /// The global ranks this process drives.
    fn local(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.ranks.len()
    }

    /// Runs `f(rank index, rank)` on one thread per rank, concurrently; all results.
    fn each<T: Send>(&self, f: impl Fn(usize, &Rank) -> TResult<T> + Sync) -> TResult<Vec<T>> {
        let f = &f;
        let results: Vec<TResult<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .enumerate()
                .map(|(i, rank)| s.spawn(move || f(self.first + i, rank)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("rank thread panicked".into()))
                })
                .collect()
        });
        results.into_iter().collect()
    }

    /// Sets the timeout of every rank.
    fn set_timeout(&mut self, timeout: Duration) {
        for r in &mut self.ranks {
            r.buf.set_timeout(timeout);
        }
    }

    /// Cleans every rank's buffer and marks all ranks active (no op may be in flight); across
    /// processes with an NVSHMEM barrier before and after.
    fn clean(&self) -> TResult<()> {
        for r in &self.ranks {
            r.stream.synchronize()?;
        }
        self.barrier()?;
        for r in &self.ranks {
            clean_buffer_cuda(&r.stream, &r.buf, true)?;
        }
        for r in &self.ranks {
            r.stream.synchronize()?;
        }
        self.barrier()
    }

    /// Waits for the other processes' ranks (nothing when this process drives them all).
    fn barrier(&self) -> TResult<()> {
        #[cfg(feature = "nvshmem")]
        if let Some(p) = nvshmem_world::proc() {
            p.nv.barrier_all()?;
        }
        Ok(())
    }
}

fn to_case(r: TResult<()>) -> CaseResult {
    r.map_err(|e| e.to_string().into())
}

// ------------------------------------------------------------------------------------------
// Inputs
// ------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Routing {
    /// Distinct experts per token, some `-1`.
    Random,
    /// Every token's first choice is expert 0 (the busiest region gets `R * T` rows).
    Hot,
    /// Experts may repeat within a token.
    Repeats,
}

#[derive(Clone)]
struct Inputs {
    t: usize,
    x: Vec<bf16>,
    topk: Vec<i64>,
    w: Vec<f32>,
}

fn random_x(rng: &mut StdRng, n: usize, h: usize) -> Vec<bf16> {
    let mut x = Vec::with_capacity(n * h);
    for _ in 0..n * h / 128 {
        // Each 128-group with its own magnitude; some all-zero groups (amax clamp).
        let zero = rng.random_bool(0.03);
        let mag = 10f32.powi(rng.random_range(-3..3));
        for _ in 0..128 {
            let v = if zero {
                0.0
            } else {
                rng.random_range(-4.0f32..4.0) * mag
            };
            x.push(bf16::from_f32(v));
        }
    }
    x
}

fn random_inputs(rng: &mut StdRng, t: usize, h: usize, e: usize, routing: Routing) -> Inputs {
    let mut topk = Vec::with_capacity(t * TOPK);
    for _ in 0..t {
        let mut row: Vec<i64> = Vec::with_capacity(TOPK);
        while row.len() < TOPK {
            let cand = rng.random_range(0..e as i64);
            match routing {
                Routing::Repeats => row.push(cand),
                _ => {
                    if !row.contains(&cand) {
                        row.push(cand);
                    }
                }
            }
        }
        if let Routing::Hot = routing {
            if let Some(pos) = row.iter().position(|&v| v == 0) {
                row.swap(0, pos);
            } else {
                row[0] = 0;
            }
        }
        for (k, v) in row.iter_mut().enumerate() {
            let keep_first = matches!(routing, Routing::Hot) && k == 0;
            if !keep_first && rng.random_bool(0.15) {
                *v = -1;
            }
        }
        topk.extend(row);
    }
    Inputs {
        t,
        x: random_x(rng, t, h),
        topk,
        w: (0..t * TOPK)
            .map(|_| rng.random_range(0.0f32..1.0))
            .collect(),
    }
}

// ------------------------------------------------------------------------------------------
// Device buffers of one rank and one op
// ------------------------------------------------------------------------------------------

struct Dev {
    x: CudaSlice<bf16>,
    topk: CudaSlice<i64>,
    w: CudaSlice<f32>,
    recv: LowLatencyRecv,
    /// Expert outputs for the combine, `[L, R*M, H]`.
    comb_x: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    /// How the combine reduces (per rank: the dispatch carries the weights).
    red: Reduction,
}

fn upload<T: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    data: &[T],
    dst: &mut CudaSlice<T>,
) -> TResult<()> {
    if !data.is_empty() {
        let mut view = dst.slice_mut(0..data.len());
        stream.memcpy_htod(data, &mut view)?;
    }
    Ok(())
}

fn poison_bytes<T>(stream: &Arc<CudaStream>, mut dst: CudaViewMut<'_, T>) -> TResult<()> {
    let bytes = dst.len() * std::mem::size_of::<T>();
    // SAFETY: u8 view of the whole view; every byte pattern is written as u8.
    let mut view = unsafe { dst.transmute_mut::<u8>(bytes) }.ok_or("transmute")?;
    stream.memcpy_htod(&vec![POISON_BYTE; bytes], &mut view)?;
    Ok(())
}

impl Dev {
    fn new(
        stream: &Arc<CudaStream>,
        layout: &LowLatencyLayout,
        format: LowLatencyFormat,
        inp: &Inputs,
        comb_x: Option<&[bf16]>,
        red: Reduction,
    ) -> TResult<Self> {
        let (m, h) = (layout.max_tokens_per_rank, layout.hidden);
        let rows = layout.num_local_experts() * layout.recv_rows_per_expert();
        let mut dev = Self {
            x: stream.alloc_zeros(m * h)?,
            topk: stream.alloc_zeros(m * TOPK)?,
            w: stream.alloc_zeros(m * TOPK)?,
            recv: LowLatencyRecv::alloc(stream, layout, format, true)?,
            comb_x: stream.alloc_zeros(rows * h)?,
            out: stream.alloc_zeros(m * h)?,
            red,
        };
        dev.set_inputs(stream, inp)?;
        if let Some(c) = comb_x {
            upload(stream, c, &mut dev.comb_x)?;
        }
        dev.poison(stream)?;
        Ok(dev)
    }

    fn set_inputs(&mut self, stream: &Arc<CudaStream>, inp: &Inputs) -> TResult<()> {
        upload(stream, &inp.x, &mut self.x)?;
        upload(stream, &inp.topk, &mut self.topk)?;
        upload(stream, &inp.w, &mut self.w)
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) -> TResult<()> {
        let recv = LowLatencyRecvMut::from(&mut self.recv);
        match recv.recv_x {
            RecvXMut::Bf16(v) => poison_bytes(stream, v)?,
            RecvXMut::Fp8(v) => poison_bytes(stream, v)?,
        }
        if let Some(v) = recv.recv_x_scales {
            poison_bytes(stream, v)?;
        }
        poison_bytes(stream, recv.block)?;
        if let Some(r) = recv.ranks {
            poison_bytes(stream, r.rank_records)?;
        }
        poison_bytes(stream, self.out.as_view_mut())
    }

    fn dispatch(
        &mut self,
        rank: &Rank,
        t: usize,
        format: LowLatencyFormat,
        phases: Phases,
    ) -> TResult<()> {
        let (h, s) = (rank.buf.layout().hidden, &rank.stream);
        let w = self.w.slice(0..t * TOPK);
        dispatch_cuda(
            s,
            &rank.buf,
            &self.x.slice(0..t * h),
            &self.topk.slice(0..t * TOPK),
            (self.red == Reduction::PerRank).then_some(&w),
            t,
            TOPK,
            format,
            phases,
            &mut self.recv,
        )?;
        Ok(())
    }

    /// Combine of `comb_x`, or of the bf16 `recv_x` itself with `round_trip`.
    fn combine(&mut self, rank: &Rank, t: usize, phases: Phases, round_trip: bool) -> TResult<()> {
        let (h, s) = (rank.buf.layout().hidden, &rank.stream);
        let mut out = self.out.slice_mut(0..t * h);
        if round_trip {
            let x = self.recv.recv_x_bf16()?;
            combine_cuda(
                s,
                &rank.buf,
                &x,
                &self.recv,
                &self.topk.slice(0..t * TOPK),
                &self.w.slice(0..t * TOPK),
                t,
                TOPK,
                phases,
                self.red,
                &mut out,
            )?;
        } else {
            combine_cuda(
                s,
                &rank.buf,
                &self.comb_x,
                &self.recv,
                &self.topk.slice(0..t * TOPK),
                &self.w.slice(0..t * TOPK),
                t,
                TOPK,
                phases,
                self.red,
                &mut out,
            )?;
        }
        Ok(())
    }

    fn download(&self, stream: &Arc<CudaStream>, t: usize, h: usize) -> TResult<Got> {
        Ok(Got {
            recv_x: stream.clone_dtoh(&self.recv.recv_x_bytes())?,
            scales: match self.recv.recv_x_scales() {
                Some(s) => stream.clone_dtoh(&s)?,
                None => Vec::new(),
            },
            count: stream.clone_dtoh(&self.recv.recv_count())?,
            src_info: stream.clone_dtoh(&self.recv.recv_src_info())?,
            src_topk: stream.clone_dtoh(&self.recv.recv_src_topk())?,
            range: stream.clone_dtoh(&self.recv.recv_layout_range())?,
            out: if t == 0 {
                Vec::new()
            } else {
                stream.clone_dtoh(&self.out.slice(0..t * h))?
            },
        })
    }
}

/// Device outputs of one rank, on the host.
struct Got {
    recv_x: Vec<u8>,
    scales: Vec<f32>,
    count: Vec<i32>,
    src_info: Vec<i32>,
    src_topk: Vec<i32>,
    range: Vec<i32>,
    out: Vec<bf16>,
}

// ------------------------------------------------------------------------------------------
// Expected outputs from the host twins
// ------------------------------------------------------------------------------------------

struct Expected {
    /// Per receiving rank: its packed layout.
    layouts: Vec<RecvLayout>,
    /// Per source: send slots.
    slots: Vec<Vec<i32>>,
}

fn expected_layouts(world: &World, inputs: &[Inputs], active: &[Vec<bool>]) -> TResult<Expected> {
    let (r_n, l_n) = (world.num_ranks(), world.layout.num_local_experts());
    let mut slots = Vec::new();
    let mut counts = Vec::new();
    for inp in inputs {
        let (s, c) = send_slots(&inp.topk, inp.t, TOPK, &world.placement)?;
        slots.push(s);
        counts.push(c);
    }
    let layouts = (0..r_n)
        .map(|q| {
            let mut c = vec![0i32; l_n * r_n];
            for l in 0..l_n {
                for s in 0..r_n {
                    if active[q][s] {
                        c[l * r_n + s] = counts[s][q * l_n + l];
                    }
                }
            }
            RecvLayout::from_counts(c, r_n)
        })
        .collect();
    Ok(Expected { layouts, slots })
}

/// Checks the dispatch outputs of receiving rank `q`.
fn check_dispatch(
    world: &World,
    q: usize,
    inputs: &[Inputs],
    exp: &Expected,
    active: &[bool],
    format: LowLatencyFormat,
    got: &Got,
) -> CaseResult {
    let lay = &world.layout;
    let (r_n, l_n, m, h) = (
        world.num_ranks(),
        lay.num_local_experts(),
        lay.max_tokens_per_rank,
        lay.hidden,
    );
    let rows = r_n * m;
    let bpc = format.bytes_per_channel();
    let groups = h / 128;
    let layout = &exp.layouts[q];
    compare(
        &format!("rank {q} recv_count"),
        &got.count,
        &layout.recv_count,
    )?;
    let mut range = Vec::with_capacity(l_n * r_n * 2);
    for i in 0..l_n * r_n {
        range.push(layout.offsets[i]);
        range.push(layout.counts[i]);
    }
    compare(&format!("rank {q} recv_layout_range"), &got.range, &range)?;

    // Start from the poisoned outputs and write what the twins say.
    let mut want_x = vec![POISON_BYTE; l_n * rows * h * bpc];
    let mut want_scales =
        vec![f32::from_bits(u32::from_ne_bytes([POISON_BYTE; 4])); l_n * rows * groups];
    // src_info is `-1` past the counts (written by the kernel, over the poison); the other
    // outputs keep the poison there.
    let mut want_info = vec![-1i32; l_n * rows];
    let mut want_topk = vec![i32::from_ne_bytes([POISON_BYTE; 4]); l_n * rows];
    for (s, inp) in inputs.iter().enumerate() {
        if !active[s] {
            continue;
        }
        let fp8 = if format.is_fp8() {
            Some(quantize(&inp.x, inp.t, h, format.scale_format())?)
        } else {
            None
        };
        for t in 0..inp.t {
            for k in 0..TOPK {
                let e = inp.topk[t * TOPK + k];
                if e < 0 || world.placement.rank_of(e as usize) != q {
                    continue;
                }
                let l = e as usize % l_n;
                let p = layout.packed_row(l, s, exp.slots[s][t * TOPK + k] as usize);
                let row = l * rows + p;
                want_info[row] = t as i32;
                want_topk[row] = k as i32;
                let dst = &mut want_x[row * h * bpc..(row + 1) * h * bpc];
                match &fp8 {
                    Some((qx, sc)) => {
                        for (d, v) in dst.iter_mut().zip(&qx[t * h..(t + 1) * h]) {
                            *d = v.to_bits();
                        }
                        want_scales[row * groups..(row + 1) * groups]
                            .copy_from_slice(&sc[t * groups..(t + 1) * groups]);
                    }
                    None => {
                        for (c, v) in inp.x[t * h..(t + 1) * h].iter().enumerate() {
                            dst[2 * c..2 * c + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                        }
                    }
                }
            }
        }
    }
    compare(
        &format!("rank {q} recv_src_info"),
        &got.src_info,
        &want_info,
    )?;
    compare(
        &format!("rank {q} recv_src_topk"),
        &got.src_topk,
        &want_topk,
    )?;
    compare(&format!("rank {q} recv_x"), &got.recv_x, &want_x)?;
    if format.is_fp8() {
        compare_bits(
            &format!("rank {q} recv_x_scales"),
            &got.scales,
            &want_scales,
            f32::to_bits,
        )?;
    }
    Ok(())
}

/// The combine's host twin for `red`.
#[allow(clippy::too_many_arguments)]
fn twin_combine<'a>(
    red: Reduction,
    topk: &[i64],
    w: &[f32],
    t: usize,
    h: usize,
    placement: &ExpertPlacement,
    active: &[bool],
    row: impl FnMut(usize, usize) -> &'a [bf16],
) -> TResult<Vec<bf16>> {
    Ok(match red {
        Reduction::PerExpert => combine(topk, w, t, TOPK, h, placement, active, row)?,
        Reduction::PerRank => combine_per_rank(topk, w, t, TOPK, h, placement, active, row)?,
    })
}

/// Checks the combine output of home rank `hr`; `row(q, l, p)` is expert rank `q`'s output
/// row `p` of local expert `l`.
#[allow(clippy::too_many_arguments)]
fn check_combine<'a>(
    world: &World,
    hr: usize,
    inputs: &[Inputs],
    exp: &Expected,
    active: &[bool],
    red: Reduction,
    got: &Got,
    row: impl Fn(usize, usize, usize) -> &'a [bf16],
) -> CaseResult {
    let l_n = world.layout.num_local_experts();
    let h = world.layout.hidden;
    let inp = &inputs[hr];
    let want = twin_combine(
        red,
        &inp.topk,
        &inp.w,
        inp.t,
        h,
        &world.placement,
        active,
        |t, k| {
            let e = inp.topk[t * TOPK + k] as usize;
            let q = world.placement.rank_of(e);
            let l = e % l_n;
            let p = exp.layouts[q].packed_row(l, hr, exp.slots[hr][t * TOPK + k] as usize);
            row(q, l, p)
        },
    )
    .map_err(|e| e.to_string())?;
    compare_bits(
        &format!("rank {hr} combine out"),
        &got.out,
        &want,
        bf16::to_bits,
    )
}

// ------------------------------------------------------------------------------------------
// Cases
// ------------------------------------------------------------------------------------------

fn random_e(rng: &mut StdRng, r: usize) -> usize {
    // A multiple of R in [16, 64], at least TOPK.
    let choices: Vec<usize> = (16..=64).filter(|e| e % r == 0).collect();
    choices[rng.random_range(0..choices.len())]
}

/// The mask mirror the last receive launch wrote equals the device mask (call after a
/// synchronisation that follows a launch with a receive phase).
fn check_mirror(rank: &Rank) -> TResult<()> {
    let device = rank.buf.active_ranks(&rank.stream)?;
    let mirror = rank.buf.active_ranks_mirror();
    if mirror != device {
        return Err(format!("mask mirror {mirror:?} != device mask {device:?}").into());
    }
    Ok(())
}

/// One dispatch + combine (both phases in one launch each) on every rank, checked.
#[allow(clippy::too_many_arguments)]
fn round_trip(
    rng: &mut StdRng,
    r_n: usize,
    m: usize,
    h: usize,
    e: usize,
    tokens: &dyn Fn(&mut StdRng) -> usize,
    routing: Routing,
    format: LowLatencyFormat,
    red: Reduction,
) -> TResult<()> {
    let world = World::new(r_n, m, h, e)?;
    let rows = world.layout.num_local_experts() * world.layout.recv_rows_per_expert();
    let inputs: Vec<Inputs> = (0..r_n)
        .map(|_| {
            let t = tokens(rng);
            random_inputs(rng, t, h, e, routing)
        })
        .collect();
    let comb_x: Vec<Vec<bf16>> = (0..r_n).map(|_| random_x(rng, rows, h)).collect();
    let gots = world.each(|r, rank| {
        let inp = &inputs[r];
        let mut dev = Dev::new(
            &rank.stream,
            &world.layout,
            format,
            inp,
            Some(&comb_x[r]),
            red,
        )?;
        dev.dispatch(rank, inp.t, format, Phases::Both)?;
        dev.combine(rank, inp.t, Phases::Both, false)?;
        rank.stream.synchronize()?;
        rank.buf.check_active_ranks(&rank.stream, "low_latency")?;
        check_mirror(rank)?;
        dev.download(&rank.stream, inp.t, h)
    })?;
    let active = vec![vec![true; r_n]; r_n];
    let exp = expected_layouts(&world, &inputs, &active)?;
    for (q, got) in world.local().zip(&gots) {
        check_dispatch(&world, q, &inputs, &exp, &active[q], format, got)
            .map_err(|e| e.to_string())?;
        check_combine(
            &world,
            q,
            &inputs,
            &exp,
            &active[q],
            red,
            got,
            |qq, l, p| {
                let at = (l * world.layout.recv_rows_per_expert() + p) * h;
                &comb_x[qq][at..at + h]
            },
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `iters` dispatch (bf16) + combine (of the received rows themselves) ops back to back on
/// every rank, no host synchronisation between them, op `i` reducing as `reds[i % len]`;
/// every op checked afterwards.
fn many_ops(rng: &mut StdRng, r_n: usize, iters: usize, reds: &[Reduction]) -> TResult<()> {
    let (m, h) = (32, 256);
    let e = random_e(rng, r_n);
    let world = World::new(r_n, m, h, e)?;
    let fmt = LowLatencyFormat::Bf16;
    let inputs: Vec<Vec<Inputs>> = (0..iters)
        .map(|_| {
            (0..r_n)
                .map(|_| {
                    let t = rng.random_range(0..=m);
                    random_inputs(rng, t, h, e, Routing::Random)
                })
                .collect()
        })
        .collect();
    let gots: Vec<Vec<Got>> = world.each(|r, rank| {
        let mut devs = Vec::with_capacity(iters);
        for (i, it) in inputs.iter().enumerate() {
            let red = reds[i % reds.len()];
            devs.push(Dev::new(
                &rank.stream,
                &world.layout,
                fmt,
                &it[r],
                None,
                red,
            )?);
        }
        rank.stream.synchronize()?;
        for (dev, it) in devs.iter_mut().zip(&inputs) {
            dev.dispatch(rank, it[r].t, fmt, Phases::Both)?;
            dev.combine(rank, it[r].t, Phases::Both, true)?;
        }
        rank.stream.synchronize()?;
        rank.buf.check_active_ranks(&rank.stream, "low_latency")?;
        devs.iter()
            .zip(&inputs)
            .map(|(d, it)| d.download(&rank.stream, it[r].t, h))
            .collect()
    })?;
    let active = vec![true; r_n];
    for (i, it) in inputs.iter().enumerate() {
        let exp = expected_layouts(&world, it, &vec![active.clone(); r_n])?;
        for (q, rank_gots) in world.local().zip(&gots) {
            let got = &rank_gots[i];
            check_dispatch(&world, q, it, &exp, &active, fmt, got)
                .map_err(|e| format!("op {i}: {e}"))?;
            // The expert output of (t, k) is the token's own row, returned by the round trip.
            let inp = &it[q];
            let want = twin_combine(
                reds[i % reds.len()],
                &inp.topk,
                &inp.w,
                inp.t,
                h,
                &world.placement,
                &active,
                |t, _| &inp.x[t * h..(t + 1) * h],
            )?;
            compare_bits(
                &format!("rank {q} combine out"),
                &got.out,
                &want,
                bf16::to_bits,
            )
            .map_err(|e| format!("op {i}: {e}"))?;
        }
    }
    Ok(())
}

/// Dispatch + combine captured in a CUDA graph per rank, replayed with new inputs.
fn graph_replay(rng: &mut StdRng, r_n: usize, replays: usize, red: Reduction) -> TResult<()> {
    let (m, h) = (64, 512);
    let e = random_e(rng, r_n);
    let world = World::new(r_n, m, h, e)?;
    let fmt = LowLatencyFormat::Bf16;
    // Fixed token counts per rank (captured); fresh data each replay.
    let ts: Vec<usize> = (0..r_n).map(|_| rng.random_range(1..=m)).collect();
    let rounds: Vec<Vec<Inputs>> = (0..=replays)
        .map(|_| {
            (0..r_n)
                .map(|r| random_inputs(rng, ts[r], h, e, Routing::Random))
                .collect()
        })
        .collect();
    let gots: Vec<Vec<Got>> = world.each(|r, rank| {
        let s = &rank.stream;
        let mut dev = Dev::new(s, &world.layout, fmt, &rounds[0][r], None, red)?;
        // Warm-up op (loads the module, sets attributes) outside the capture.
        dev.dispatch(rank, ts[r], fmt, Phases::Both)?;
        dev.combine(rank, ts[r], Phases::Both, true)?;
        s.synchronize()?;
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        dev.dispatch(rank, ts[r], fmt, Phases::Both)?;
        dev.combine(rank, ts[r], Phases::Both, true)?;
        let graph = s
            .end_capture(CUgraphInstantiate_flags(0))?
            .ok_or("empty graph")?;
        let mut out = Vec::new();
        for round in rounds.iter().skip(1) {
            dev.set_inputs(s, &round[r])?;
            dev.poison(s)?;
            graph.launch()?;
            s.synchronize()?;
            out.push(dev.download(s, ts[r], h)?);
        }
        rank.buf.check_active_ranks(s, "low_latency")?;
        Ok(out)
    })?;
    let active = vec![true; r_n];
    for (i, round) in rounds.iter().skip(1).enumerate() {
        let exp = expected_layouts(&world, round, &vec![active.clone(); r_n])?;
        for (q, rank_gots) in world.local().zip(&gots) {
            let got = &rank_gots[i];
            check_dispatch(&world, q, round, &exp, &active, fmt, got)
                .map_err(|e| format!("replay {i}: {e}"))?;
            let inp = &round[q];
            let want = twin_combine(
                red,
                &inp.topk,
                &inp.w,
                inp.t,
                h,
                &world.placement,
                &active,
                |t, _| &inp.x[t * h..(t + 1) * h],
            )?;
            compare_bits(
                &format!("replay {i} rank {q} combine out"),
                &got.out,
                &want,
                bf16::to_bits,
            )
            .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Two micro-batches with send / receive hooks interleaved and other work in between:
/// D-send(a), D-send(b), work, D-recv(a), D-recv(b), C-send(a), C-send(b), work, C-recv(a),
/// C-recv(b).
fn split_phases(
    rng: &mut StdRng,
    r_n: usize,
    format: LowLatencyFormat,
    red: Reduction,
) -> TResult<()> {
    let (m, h) = (48, 384);
    let e = random_e(rng, r_n);
    let world = World::new(r_n, m, h, e)?;
    let rows = world.layout.num_local_experts() * world.layout.recv_rows_per_expert();
    let batches: Vec<Vec<Inputs>> = (0..2)
        .map(|_| {
            (0..r_n)
                .map(|_| {
                    let t = rng.random_range(0..=m);
                    random_inputs(rng, t, h, e, Routing::Random)
                })
                .collect()
        })
        .collect();
    let comb: Vec<Vec<Vec<bf16>>> = (0..2)
        .map(|_| (0..r_n).map(|_| random_x(rng, rows, h)).collect())
        .collect();
    let gots: Vec<Vec<Got>> = world.each(|r, rank| {
        let s = &rank.stream;
        let (l, c) = (&world.layout, &comb);
        let mut a = Dev::new(s, l, format, &batches[0][r], Some(&c[0][r]), red)?;
        let mut b = Dev::new(s, l, format, &batches[1][r], Some(&c[1][r]), red)?;
        let (ta, tb) = (batches[0][r].t, batches[1][r].t);
        let work = Duration::from_micros(50);
        a.dispatch(rank, ta, format, Phases::Send)?;
        b.dispatch(rank, tb, format, Phases::Send)?;
        delay_cuda(s, work)?;
        a.dispatch(rank, ta, format, Phases::Recv)?;
        b.dispatch(rank, tb, format, Phases::Recv)?;
        a.combine(rank, ta, Phases::Send, false)?;
        b.combine(rank, tb, Phases::Send, false)?;
        delay_cuda(s, work)?;
        a.combine(rank, ta, Phases::Recv, false)?;
        b.combine(rank, tb, Phases::Recv, false)?;
        s.synchronize()?;
        rank.buf.check_active_ranks(s, "low_latency")?;
        Ok(vec![a.download(s, ta, h)?, b.download(s, tb, h)?])
    })?;
    let active = vec![true; r_n];
    for (i, batch) in batches.iter().enumerate() {
        let exp = expected_layouts(&world, batch, &vec![active.clone(); r_n])?;
        for (q, rank_gots) in world.local().zip(&gots) {
            let got = &rank_gots[i];
            check_dispatch(&world, q, batch, &exp, &active, format, got)
                .map_err(|e| format!("batch {i}: {e}"))?;
            check_combine(&world, q, batch, &exp, &active, red, got, |qq, l, p| {
                let at = (l * world.layout.recv_rows_per_expert() + p) * h;
                &comb[i][qq][at..at + h]
            })
            .map_err(|e| format!("batch {i}: {e}"))?;
        }
    }
    Ok(())
}

/// Rank `absent` never launches (or is masked on purpose, with `masked`); the others complete,
/// treat it as inactive, and match the twins with that mask. Then a clean and a full op.
fn absent_rank(rng: &mut StdRng, r_n: usize, masked: bool, red: Reduction) -> TResult<()> {
    let (m, h) = (32, 256);
    let e = random_e(rng, r_n);
    let mut world = World::new(r_n, m, h, e)?;
    let absent = r_n - 1;
    let mut mask = vec![true; r_n];
    mask[absent] = false;
    let timeout = if masked {
        Duration::from_secs(10)
    } else {
        Duration::from_millis(100)
    };
    world.set_timeout(timeout);
    if masked {
        for rank in &world.ranks {
            rank.buf.set_active_ranks(&rank.stream, &mask)?;
        }
    }
    let rows = world.layout.num_local_experts() * world.layout.recv_rows_per_expert();
    let fmt = LowLatencyFormat::Fp8;
    let inputs: Vec<Inputs> = (0..r_n)
        .map(|_| random_inputs(rng, m, h, e, Routing::Random))
        .collect();
    let comb_x: Vec<Vec<bf16>> = (0..r_n).map(|_| random_x(rng, rows, h)).collect();
    let start = Instant::now();
    let gots = world.each(|r, rank| {
        if r == absent {
            return Ok(None);
        }
        let s = &rank.stream;
        let mut dev = Dev::new(s, &world.layout, fmt, &inputs[r], Some(&comb_x[r]), red)?;
        s.synchronize()?;
        let t0 = Instant::now();
        dev.dispatch(rank, inputs[r].t, fmt, Phases::Both)?;
        dev.combine(rank, inputs[r].t, Phases::Both, false)?;
        s.synchronize()?;
        let took = t0.elapsed();
        let seen = rank.buf.active_ranks(s)?;
        check_mirror(rank)?;
        match rank.buf.check_active_ranks(s, "low_latency") {
            Err(ep_kernels::Error::PeerTimeout { rank: bad, .. }) if bad == absent => {}
            other => {
                return Err(format!(
                    "rank {r}: expected a timeout naming rank {absent}, got {other:?}"
                )
                .into())
            }
        }
        Ok(Some((dev.download(s, inputs[r].t, h)?, seen, took)))
    })?;
    let elapsed = start.elapsed();
    let exp = expected_layouts(&world, &inputs, &vec![mask.clone(); r_n])?;
    for (q, g) in world.local().zip(&gots) {
        let Some((got, seen, took)) = g else { continue };
        compare(&format!("rank {q} active mask"), seen, &mask).map_err(|e| e.to_string())?;
        if masked && *took > Duration::from_secs(2) {
            return Err(format!(
                "rank {q}: masked op took {took:?}: it waited for the masked rank"
            )
            .into());
        }
        check_dispatch(&world, q, &inputs, &exp, &mask, fmt, got).map_err(|e| e.to_string())?;
        check_combine(&world, q, &inputs, &exp, &mask, red, got, |qq, l, p| {
            let at = (l * world.layout.recv_rows_per_expert() + p) * h;
            &comb_x[qq][at..at + h]
        })
        .map_err(|e| e.to_string())?;
    }
    println!("    absent rank {absent} (masked: {masked}): others done in {elapsed:?}");

    // Recovery: clean every buffer (all active again), then a full op with every rank.
    world.set_timeout(Duration::from_secs(10));
    world.clean()?;
    let gots = world.each(|r, rank| {
        let s = &rank.stream;
        let mut dev = Dev::new(s, &world.layout, fmt, &inputs[r], Some(&comb_x[r]), red)?;
        dev.dispatch(rank, inputs[r].t, fmt, Phases::Both)?;
        dev.combine(rank, inputs[r].t, Phases::Both, false)?;
        s.synchronize()?;
        rank.buf.check_active_ranks(s, "low_latency")?;
        dev.download(s, inputs[r].t, h)
    })?;
    let all = vec![true; r_n];
    let exp = expected_layouts(&world, &inputs, &vec![all.clone(); r_n])?;
    for (q, got) in world.local().zip(&gots) {
        check_dispatch(&world, q, &inputs, &exp, &all, fmt, got)
            .map_err(|e| format!("after clean: {e}"))?;
        check_combine(&world, q, &inputs, &exp, &all, red, got, |qq, l, p| {
            let at = (l * world.layout.recv_rows_per_expert() + p) * h;
            &comb_x[qq][at..at + h]
        })
        .map_err(|e| format!("after clean: {e}"))?;
    }
    Ok(())
}

/// Both reductions, with the suffix of their case names.
const BOTH: [(&str, Reduction); 2] = [
    ("", Reduction::PerExpert),
    ("/per_rank", Reduction::PerRank),
];

/// The reductions a format's round trips run with: both for bf16 and fp8, per expert for
/// UE8M0 scales (the dispatch is the same as fp8's; the combine does not see the format).
fn reductions(fmt: LowLatencyFormat) -> &'static [(&'static str, Reduction)] {
    if fmt == LowLatencyFormat::Fp8Ue8m0 {
        &BOTH[..1]
    } else {
        &BOTH
    }
}

fn main() {
    #[cfg(feature = "nvshmem")]
    if let Some((world, gpn)) = nvshmem_world::child_spec() {
        let mut runner = Runner::from_env("gpu_low_latency (NVSHMEM child)");
        match nvshmem_world::init_child(world, gpn) {
            Ok(()) => nvshmem_cases(&mut runner, world, gpn),
            Err(e) => runner.case(&format!("nvshmem/{world}x{gpn}/init"), |_| Err(e.into())),
        }
        runner.finish();
    }
    let mut runner = Runner::from_env("gpu_low_latency");
    let gpus = match CudaContext::device_count() {
        Ok(n) if n > 0 => n as usize,
        other => gpu_test_suite::skip(&format!("no CUDA device ({other:?})")),
    };
    let mut sizes = vec![gpus];
    if gpus > 2 {
        sizes.push(2);
    }
    // One rank (what a single-GPU decode runs) on every machine.
    if gpus > 1 {
        sizes.push(1);
    }
    let formats = [
        ("bf16", LowLatencyFormat::Bf16),
        ("fp8", LowLatencyFormat::Fp8),
        ("fp8_ue8m0", LowLatencyFormat::Fp8Ue8m0),
    ];
    for &r_n in &sizes {
        for (fname, fmt) in formats {
            for (rname, routing) in [
                ("random", Routing::Random),
                ("hot_expert", Routing::Hot),
                ("repeats", Routing::Repeats),
            ] {
                for &(pname, red) in reductions(fmt) {
                    round_trip_case(
                        &mut runner,
                        &format!("r{r_n}/round_trip/{fname}/{rname}{pname}"),
                        r_n,
                        (64, 256, None),
                        &|g| g.random_range(0..=64),
                        routing,
                        fmt,
                        red,
                    );
                }
            }
            for &(pname, red) in reductions(fmt) {
                round_trip_case(
                    &mut runner,
                    &format!("r{r_n}/round_trip/{fname}/no_tokens{pname}"),
                    r_n,
                    (16, 128, None),
                    &|_| 0,
                    Routing::Random,
                    fmt,
                    red,
                );
                round_trip_case(
                    &mut runner,
                    &format!("r{r_n}/round_trip/{fname}/full_hot{pname}"),
                    r_n,
                    (40, 640, None),
                    &|_| 40,
                    Routing::Hot,
                    fmt,
                    red,
                );
            }
        }
        for (pname, red) in BOTH {
            // Rows of exactly two combine copy chunks (4096 bf16 = 2 x 4 KiB).
            size_cases(&mut runner, &format!("r{r_n}"), r_n, pname, red);
            runner.case(&format!("r{r_n}/cuda_graph_replay{pname}"), |rng| {
                to_case(graph_replay(rng, r_n, 5, red))
            });
            for (fname, fmt) in [
                ("bf16", LowLatencyFormat::Bf16),
                ("fp8", LowLatencyFormat::Fp8),
            ] {
                runner.case(&format!("r{r_n}/split_phases/{fname}{pname}"), |rng| {
                    to_case(split_phases(rng, r_n, fmt, red))
                });
            }
            if r_n >= 2 {
                absent_cases(&mut runner, &format!("r{r_n}"), r_n, pname, red);
            }
        }
        runner.case(&format!("r{r_n}/many_ops_50"), |rng| {
            to_case(many_ops(rng, r_n, 50, &[Reduction::PerExpert]))
        });
        // Per-rank and per-expert ops alternating on one buffer.
        runner.case(&format!("r{r_n}/many_ops_50/alternating_per_rank"), |rng| {
            to_case(many_ops(
                rng,
                r_n,
                50,
                &[Reduction::PerRank, Reduction::PerExpert],
            ))
        });
    }
    #[cfg(feature = "nvshmem")]
    nvshmem_world::run_launches(&mut runner, gpus);
    runner.finish();
}

/// Registers a round trip of `r_n` ranks: `(m, h, experts)` (`None`: a random multiple of
/// `r_n`, drawn first), tokens per rank from `tokens`.
#[allow(clippy::too_many_arguments)]
fn round_trip_case(
    runner: &mut Runner,
    name: &str,
    r_n: usize,
    (m, h, experts): (usize, usize, Option<usize>),
    tokens: &dyn Fn(&mut StdRng) -> usize,
    routing: Routing,
    fmt: LowLatencyFormat,
    red: Reduction,
) {
    runner.case(name, |rng| {
        let e = experts.unwrap_or_else(|| random_e(rng, r_n));
        to_case(round_trip(rng, r_n, m, h, e, tokens, routing, fmt, red))
    });
}

/// Round trips with rows of exactly two combine copy chunks (4096 bf16 = 2 x 4 KiB) and at
/// DeepSeek-V3 size, named `{p}/round_trip/...{pname}`.
fn size_cases(runner: &mut Runner, p: &str, r_n: usize, pname: &str, red: Reduction) {
    round_trip_case(
        runner,
        &format!("{p}/round_trip/bf16/two_chunk_rows{pname}"),
        r_n,
        (24, 4096, None),
        &|g| g.random_range(0..=24),
        Routing::Random,
        LowLatencyFormat::Bf16,
        red,
    );
    let e = if 288 % r_n == 0 { 288 } else { 256 * r_n };
    round_trip_case(
        runner,
        &format!("{p}/round_trip/fp8/deepseek_size{pname}"),
        r_n,
        (128, 7168, Some(e)),
        &|_| 128,
        Routing::Random,
        LowLatencyFormat::Fp8,
        red,
    );
}

/// The last rank never launching, then masked on purpose (at least 2 ranks).
fn absent_cases(runner: &mut Runner, p: &str, r_n: usize, pname: &str, red: Reduction) {
    runner.case(&format!("{p}/rank_never_launches{pname}"), |rng| {
        to_case(absent_rank(rng, r_n, false, red))
    });
    runner.case(&format!("{p}/rank_masked_on_purpose{pname}"), |rng| {
        to_case(absent_rank(rng, r_n, true, red))
    });
}

/// The cases of a child of the NVSHMEM launches (the same list in every child).
#[cfg(feature = "nvshmem")]
fn nvshmem_cases(runner: &mut Runner, r_n: usize, gpn: usize) {
    let p = format!("nvshmem/{r_n}x{gpn}");
    for (fname, fmt) in [
        ("bf16", LowLatencyFormat::Bf16),
        ("fp8", LowLatencyFormat::Fp8),
    ] {
        for (rname, routing) in [("random", Routing::Random), ("hot_expert", Routing::Hot)] {
            for &(pname, red) in reductions(fmt) {
                round_trip_case(
                    runner,
                    &format!("{p}/round_trip/{fname}/{rname}{pname}"),
                    r_n,
                    (64, 256, None),
                    &|g| g.random_range(0..=64),
                    routing,
                    fmt,
                    red,
                );
            }
        }
    }
    for (pname, red) in BOTH {
        round_trip_case(
            runner,
            &format!("{p}/round_trip/bf16/no_tokens{pname}"),
            r_n,
            (16, 128, None),
            &|_| 0,
            Routing::Random,
            LowLatencyFormat::Bf16,
            red,
        );
        size_cases(runner, &p, r_n, pname, red);
    }
    for (pname, red) in BOTH {
        absent_cases(runner, &p, r_n, pname, red);
    }
    runner.case(&format!("{p}/many_ops_30/alternating_per_rank"), |rng| {
        to_case(many_ops(
            rng,
            r_n,
            30,
            &[Reduction::PerRank, Reduction::PerExpert],
        ))
    });
}
