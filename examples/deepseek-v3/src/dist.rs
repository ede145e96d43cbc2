//! This process's place in the job (from the launcher's environment variables), its device,
//! and the expert-parallel buffer shared by all MoE layers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use moe_layer::ep_runtime::{
    Buffer, BufferConfig, Membership, Store, StoreConfig, TcpTransport, Topology,
};

/// Who this process is: the variables `launch` (or torchrun) sets. With none set, a job of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank within the node (selects the GPU).
    pub local_rank: usize,
    /// Ranks per node.
    pub local_world_size: usize,
}

impl RankInfo {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`; a single rank when
    /// `WORLD_SIZE` is unset.
    pub fn from_env() -> Result<Self> {
        let var = |k: &str| -> Result<Option<usize>> {
            match std::env::var(k) {
                Ok(v) => Ok(Some(
                    v.trim()
                        .parse()
                        .with_context(|| format!("{k}={v:?} is not a number"))?,
                )),
                Err(_) => Ok(None),
            }
        };
        let world_size = var("WORLD_SIZE")?.unwrap_or(1);
        let rank = var("RANK")?.unwrap_or(0);
        let local_world_size = var("LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
        let local_rank = var("LOCAL_RANK")?.unwrap_or(rank % local_world_size.max(1));
        if world_size == 0 || rank >= world_size {
            bail!("RANK={rank} must be below WORLD_SIZE={world_size}");
        }
        if local_world_size == 0 || local_rank >= local_world_size {
            bail!("LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_world_size}");
        }
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
        })
    }
}

/// The device of this rank: `cuda:LOCAL_RANK` in a `cuda` build unless `cpu` is asked for,
/// else the CPU.
pub fn select_device(info: &RankInfo, cpu: bool) -> Result<Device> {
    if cpu {
        return Ok(Device::Cpu);
    }
    #[cfg(feature = "cuda")]
    {
        Device::new_cuda(info.local_rank)
            .with_context(|| format!("cannot open GPU {} (LOCAL_RANK)", info.local_rank))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = info;
        Ok(Device::Cpu)
    }
}

/// The job's communication: the EP buffer and, with several processes, the bootstrap store.
pub struct Dist {
    /// This rank.
    pub info: RankInfo,
    /// The buffer every MoE layer of this rank uses.
    pub buffer: Arc<Buffer>,
    store: Option<Arc<Store>>,
}

impl Dist {
    /// Joins the job: a one-rank group when alone, else the store at
    /// `MASTER_ADDR:MASTER_PORT` (hosted by rank 0) and a buffer over it.
    pub fn init(info: RankInfo, device: &Device, config: BufferConfig) -> Result<Self> {
        if info.world_size == 1 {
            // A group of one on this rank's device: a CUDA buffer on a GPU, so the MoE layers
            // run entirely on the device.
            let buffer = Buffer::single(device, config)
                .with_context(|| format!("cannot build the EP buffer on {device:?}"))?;
            return Ok(Self {
                info,
                buffer: Arc::new(buffer),
                store: None,
            });
        }
        let store_cfg = StoreConfig::from_env().context("bootstrap store configuration")?;
        let store = Store::connect(store_cfg).with_context(|| {
            format!(
                "rank {}: cannot join the bootstrap store (MASTER_ADDR/MASTER_PORT)",
                info.rank
            )
        })?;
        let topology = Topology::new(info.rank, info.world_size, info.local_world_size)?;
        let buffer = Buffer::from_store(&store, topology, config, device)
            .with_context(|| format!("rank {}: cannot build the EP buffer", info.rank))?;
        Ok(Self {
            info,
            buffer: Arc::new(buffer),
            store: Some(Arc::new(store)),
        })
    }

    /// This rank's part in agreeing on lost ranks with the others (a watcher thread that
    /// cancels the collectives when another rank opens an agreement); `None` in a job of one.
    pub fn membership(&self) -> Result<Option<Membership>> {
        let Some(store) = &self.store else {
            return Ok(None);
        };
        Membership::new(store.clone(), self.buffer.clone())
            .map(Some)
            .with_context(|| format!("rank {}: cannot watch the job's ranks", self.info.rank))
    }

    /// A TCP mesh of its own among the job's ranks, named `group` (a collective: every rank
    /// builds it), for traffic that must not wait in line with the steps' messages (e.g.
    /// expert weights moving while the steps go on); `None` in a job of one.
    pub fn side_transport(&self, group: &str) -> Result<Option<TcpTransport>> {
        let Some(store) = &self.store else {
            return Ok(None);
        };
        let timeout = self.buffer.config().timeout;
        TcpTransport::connect(store, group, timeout)
            .map(Some)
            .with_context(|| format!("rank {}: cannot build the {group} mesh", self.info.rank))
    }

    /// Gathers one small message from every rank (index = rank); a collective.
    pub fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if self.info.world_size == 1 {
            return Ok(vec![data.to_vec()]);
        }
        Ok(self.buffer.host_all_gather(data)?)
    }

    /// Ends the job cleanly: every rank but 0 reports that it has received everything, and rank
    /// 0 (which hosts the store and the other end of every connection) waits for all of them
    /// but the `lost` ones before it may exit.
    pub fn finish(&self, timeout: Duration, lost: usize) -> Result<()> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        if self.info.rank != 0 {
            store.add("deepseek-v3/finished", 1)?;
            return Ok(());
        }
        let start = Instant::now();
        let others = (self.info.world_size - 1 - lost) as i64;
        while store.add("deepseek-v3/finished", 0)? < others {
            if start.elapsed() > timeout {
                bail!("rank 0: other ranks did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}
