//! NVSHMEM for CUDA buffers across nodes (feature `nvshmem`): started over the buffer's own
//! [`Group`] (whose all-gather carries rank 0's unique id), once per process, and shared by
//! every later buffer of the same group shape.
//!
//! Protocol (every rank of the group, in the order it builds its buffers):
//! 1. one all-gather: rank 0 sends `[1] ++ id` (its new unique id, whose bootstrap listener
//!    lives in rank 0's process), every other rank `[1]`, or any rank `[0] ++ why` when it
//!    cannot join (no such device, NVSHMEM not loadable, a live instance of another shape);
//! 2. if any rank sent `[0]`, every rank fails with [`Error::PeerFailed`] naming the lowest
//!    such rank, before anyone enters NVSHMEM's init (whose bootstrap would wait without a
//!    limit of ours); the all-gather itself fails within the group's timeout, naming a rank
//!    that never arrives;
//! 3. every rank calls `Nvshmem::init(rank, world, id, device)`.
//!
//! NVSHMEM initialises at most once per process, so the instance is kept for the process's
//! life and reused by every later buffer whose group has the same rank and size (all ranks
//! reuse it together, since they build their buffers in the same order).

use crate::error::{Error, Result};
use crate::group::Group;
use crate::topology::Topology;
use nvshmem_sys::{Nvshmem, UniqueId};
use std::sync::{Arc, Mutex};

/// The process's NVSHMEM instance, once started by a buffer across nodes.
static LIVE: Mutex<Option<Arc<Nvshmem>>> = Mutex::new(None);

/// NVSHMEM with PE = `topo.rank` of `topo.num_ranks` on CUDA device `device`: the process's
/// live instance if it has that shape, else started over `group` (a collective).
pub(crate) fn nvshmem_for_group(
    group: &dyn Group,
    topo: Topology,
    device: usize,
) -> Result<Arc<Nvshmem>> {
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    let mine: Result<Option<Vec<u8>>> = match live.as_ref() {
        Some(nv) if nv.n_pes() == topo.num_ranks && nv.my_pe() == topo.rank => {
            if nv.device() == device {
                return Ok(nv.clone());
            }
            Err(Error::invalid(
                "device",
                device,
                format!("this process's NVSHMEM lives on device {}", nv.device()),
            ))
        }
        Some(nv) => Err(Error::Unsupported(format!(
            "this process's NVSHMEM is PE {} of {}; NVSHMEM starts once per process, so a \
             buffer across nodes for rank {} of {} cannot have its own",
            nv.my_pe(),
            nv.n_pes(),
            topo.rank,
            topo.num_ranks
        ))),
        None => check_device(device).and_then(|()| {
            (topo.rank == 0)
                .then(|| Ok(UniqueId::new()?.to_bytes().to_vec()))
                .transpose()
        }),
    };
    let payload = match &mine {
        Ok(id) => [&[1u8][..], id.as_deref().unwrap_or_default()].concat(),
        Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
    };
    let all = group.all_gather(&payload)?;
    let id = mine?;
    if let Some((rank, why)) = all.iter().enumerate().find(|(_, p)| p.first() != Some(&1)) {
        return Err(Error::PeerFailed {
            rank,
            what: "start NVSHMEM for a CUDA buffer across nodes".to_owned(),
            reason: String::from_utf8_lossy(why.get(1..).unwrap_or_default()).into_owned(),
        });
    }
    let id = match id {
        Some(id) => id,
        None => all[0][1..].to_vec(),
    };
    let id = UniqueId::from_bytes(&id).map_err(|e| Error::Protocol {
        rank: 0,
        what: format!("NVSHMEM unique id from the group's all-gather: {e}"),
    })?;
    let nv = Arc::new(Nvshmem::init(topo.rank, topo.num_ranks, &id, device)?);
    *live = Some(nv.clone());
    Ok(nv)
}

/// `device` is a visible CUDA device (what this rank can check alone).
fn check_device(device: usize) -> Result<()> {
    let count = nvshmem_sys::cuda_device_count()?;
    if device >= count {
        return Err(Error::invalid(
            "device",
            device,
            format!("must be < {count}, the number of visible CUDA devices"),
        ));
    }
    Ok(())
}
