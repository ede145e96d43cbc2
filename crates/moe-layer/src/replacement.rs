//! Re-placing a layer's experts while it serves (`MoeLayer::replace_experts`): every rank
//! passes the same new [`Placement`] (e.g. `placement::place` on loads summed over the ranks);
//! the slots whose logical expert changes get its weights from a slot that holds it now (on
//! their own rank when one does, else over the buffer's host transport), written in place, and
//! the logical-to-physical map is rewritten in place. Nothing moves that stays: a placement
//! that keeps most experts where they are moves few bytes. Tensors keep their addresses, so
//! captured steps stay valid. Between two steps (a collective of every rank); or in two halves
//! ([`MoeLayer::prepare_replacement`], [`MoeLayer::finish_replacement`]) with the weights
//! delivered in between by the caller, while the layer keeps serving.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::layer::MoeLayer;
use crate::placement::Placement;

/// A slot whose logical expert changes, and the slot it takes the weights from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMove {
    /// The physical slot written.
    pub slot: usize,
    /// The logical expert it holds after the move.
    pub expert: usize,
    /// A slot that holds `expert` before the move.
    pub source: usize,
}

/// The moves that turn `old` into `new` (the same experts and slots) over `num_ranks` ranks
/// (slot `s` on rank `s / (P / num_ranks)`): every slot whose expert changes, filled from a
/// slot of the old placement on its own rank when there is one, else from replica
/// `slot mod count` (spreading the sends over an expert's replicas).
pub fn plan_moves(old: &Placement, new: &Placement, num_ranks: usize) -> Result<Vec<SlotMove>> {
    let p = old.num_physical();
    if new.num_physical() != p
        || new.log_to_phy.len() != old.log_to_phy.len()
        || num_ranks == 0
        || p % num_ranks != 0
    {
        return Err(Error::invalid(
            "placement",
            format!(
                "{} experts in {} slots after, {} in {p} before, over {num_ranks} ranks",
                new.log_to_phy.len(),
                new.num_physical(),
                old.log_to_phy.len()
            ),
            "a re-placement keeps the experts and slots, a multiple of the ranks",
        ));
    }
    let per_rank = p / num_ranks;
    let mut moves = Vec::new();
    for (slot, (&before, &after)) in old.phy_to_log.iter().zip(&new.phy_to_log).enumerate() {
        if before == after {
            continue;
        }
        let holders = old.log_to_phy.get(after).filter(|v| !v.is_empty());
        let Some(holders) = holders else {
            return Err(Error::invalid(
                "placement",
                format!("logical expert {after} in slot {slot}"),
                "is in no slot before the re-placement",
            ));
        };
        let source = holders
            .iter()
            .copied()
            .find(|&s| s / per_rank == slot / per_rank)
            .unwrap_or(holders[slot % holders.len()]);
        moves.push(SlotMove {
            slot,
            expert: after,
            source,
        });
    }
    Ok(moves)
}

/// What [`MoeLayer::replace_experts`] did on this rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replacement {
    /// Slots of the layer (all ranks) whose expert changed.
    pub moved_slots: usize,
    /// This rank's slots written.
    pub written: usize,
    /// Bytes this rank sent to other ranks, and received.
    pub bytes_sent: usize,
    /// Bytes received from other ranks.
    pub bytes_received: usize,
    /// Time this rank spent reading its sources and writing its slots (the exchange between
    /// them excluded when it ran apart: [`PreparedReplacement`]).
    pub elapsed: Duration,
}

/// A re-placement read out on this rank ([`MoeLayer::prepare_replacement`]): its moves, and
/// the weights this rank's slots give (to its own slots, and per destination rank), read
/// before any slot is written. The layer keeps serving with its current placement until
/// [`MoeLayer::finish_replacement`] writes the slots and the map.
#[derive(Debug)]
pub struct PreparedReplacement {
    placement: Placement,
    moves: Vec<SlotMove>,
    rank: usize,
    per_rank: usize,
    local: Vec<(usize, Vec<u8>)>,
    outgoing: Vec<Vec<(usize, Vec<u8>)>>,
    bytes_sent: usize,
    read_time: Duration,
}

impl PreparedReplacement {
    /// The messages for the other ranks (index = destination; `None`: nothing for it), to
    /// deliver by any transport ([`MoeLayer::replace_experts`]:
    /// the layer's buffer). Taken once.
    pub fn take_messages(&mut self) -> Vec<Option<Vec<u8>>> {
        std::mem::take(&mut self.outgoing)
            .into_iter()
            .map(|v| (!v.is_empty()).then(|| frame(&v)))
            .collect()
    }

    /// Slots of the layer (all ranks) whose expert changes.
    pub fn moved_slots(&self) -> usize {
        self.moves.len()
    }

    /// Bytes of the weights this rank sends.
    pub fn bytes_sent(&self) -> usize {
        self.bytes_sent
    }

    /// The placement it moves to.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }
}

impl MoeLayer {
    /// Re-places the layer's experts by `placement` (module docs): a collective over the
    /// layer's buffer, every rank passing the same placement between two steps. The layer must
    /// have been built with a placement ([`MoeLayer::load_placed`] or
    /// [`MoeLayer::with_placement`]); the new one keeps its experts and slots.
    pub fn replace_experts(&mut self, placement: Placement) -> Result<Replacement> {
        let Some(mut prepared) = self.prepare_replacement(placement)? else {
            return Ok(Replacement::default());
        };
        let incoming = self.buffer.host_exchange(prepared.take_messages())?;
        self.finish_replacement(prepared, incoming)
    }

    /// The first half of [`MoeLayer::replace_experts`] on this rank: the moves to `placement`
    /// and the weights this rank's slots give, read now (one device-to-host copy a source
    /// slot); `None` when the layer already has that placement. No message is sent: the
    /// caller delivers [`PreparedReplacement::take_messages`] to the other ranks (every rank
    /// preparing the same placement) and passes what it receives to
    /// [`MoeLayer::finish_replacement`], while the layer keeps serving meanwhile.
    pub fn prepare_replacement(&self, placement: Placement) -> Result<Option<PreparedReplacement>> {
        let start = Instant::now();
        let topo = self.buffer.topology();
        let map = self.expert_map.as_ref().ok_or_else(|| {
            Error::invalid(
                "placement",
                "a layer without one",
                "re-placement needs a layer built with a placement (load_placed, with_placement)",
            )
        })?;
        if map.placement() == &placement {
            return Ok(None);
        }
        let moves = plan_moves(map.placement(), &placement, topo.num_ranks)?;
        let per_rank = placement.num_physical() / topo.num_ranks;
        let me = topo.rank;
        // Every source read before the first write (a slot may send and be written).
        let mut local = Vec::new();
        let mut outgoing: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); topo.num_ranks];
        for m in moves.iter().filter(|m| m.source / per_rank == me) {
            let bytes = self.experts.slot_bytes(m.source - me * per_rank)?;
            if m.slot / per_rank == me {
                local.push((m.slot, bytes));
            } else {
                outgoing[m.slot / per_rank].push((m.slot, bytes));
            }
        }
        let bytes_sent = outgoing.iter().flatten().map(|(_, b)| b.len()).sum();
        tracing::debug!(
            rank = me,
            moves = moves.len(),
            local = local.len(),
            bytes_sent,
            "re-placement: sources read"
        );
        Ok(Some(PreparedReplacement {
            placement,
            moves,
            rank: me,
            per_rank,
            local,
            outgoing,
            bytes_sent,
            read_time: start.elapsed(),
        }))
    }

    /// The second half of [`MoeLayer::replace_experts`]: writes this rank's moved slots from
    /// `prepared` and `incoming` (what each rank sent this one, index = sender), in place,
    /// then the map. Every slot this rank must write needs its weights exactly once.
    pub fn finish_replacement(
        &mut self,
        prepared: PreparedReplacement,
        incoming: Vec<Option<Vec<u8>>>,
    ) -> Result<Replacement> {
        let start = Instant::now();
        let PreparedReplacement {
            placement,
            moves,
            rank: me,
            per_rank,
            local,
            bytes_sent,
            read_time,
            ..
        } = prepared;
        if self.expert_map.as_ref().map(|m| m.num_physical()) != Some(placement.num_physical())
            || self.buffer.topology().rank != me
        {
            return Err(Error::invalid(
                "re-placement",
                "prepared for another layer or rank",
                "finish it on the layer that prepared it",
            ));
        }
        let mut bytes_received = 0;
        // The received weights stay in their messages (written from there, no copy).
        let mut slots: Vec<(usize, &[u8])> =
            local.iter().map(|(s, b)| (*s, b.as_slice())).collect();
        for (from, msg) in incoming.iter().enumerate() {
            if let Some(msg) = msg.as_deref().filter(|_| from != me) {
                bytes_received += msg.len();
                slots.extend(unframe(msg).map_err(|e| {
                    Error::invalid("re-placement", format!("message of rank {from}"), e)
                })?);
            }
        }
        let mine: Vec<usize> = moves
            .iter()
            .map(|m| m.slot)
            .filter(|&s| s / per_rank == me)
            .collect();
        let mut got: Vec<usize> = slots.iter().map(|(s, _)| *s).collect();
        got.sort_unstable();
        if got != mine {
            return Err(Error::invalid(
                "re-placement",
                format!("weights for slots {got:?}"),
                format!("this rank needs slots {mine:?}, each once"),
            ));
        }
        // Checked before any slot is written: the lost ranks' slots stay out of the map.
        let placement = self.routed_around_masked(placement)?;
        for (slot, bytes) in &slots {
            self.experts.write_slot_bytes(slot - me * per_rank, bytes)?;
        }
        tracing::debug!(
            rank = me,
            written = slots.len(),
            bytes_received,
            "re-placement: slots written"
        );
        if let Some(map) = self.expert_map.as_mut() {
            map.set_placement(placement)?;
        }
        let written = slots.len();
        Ok(Replacement {
            moved_slots: moves.len(),
            written,
            bytes_sent,
            bytes_received,
            elapsed: read_time + start.elapsed(),
        })
    }
}

/// Slots and their weights as one message: for each, the slot and the length (u64 little
/// endian), then the bytes.
fn frame(slots: &[(usize, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(slots.iter().map(|(_, b)| b.len() + 16).sum());
    for (slot, bytes) in slots {
        out.extend((*slot as u64).to_le_bytes());
        out.extend((bytes.len() as u64).to_le_bytes());
        out.extend(bytes);
    }
    out
}

/// The slots and weights of a [`frame`]d message.
fn unframe(mut msg: &[u8]) -> std::result::Result<Vec<(usize, &[u8])>, String> {
    let mut out = Vec::new();
    let word = |b: &[u8]| -> usize {
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        u64::from_le_bytes(w) as usize
    };
    while !msg.is_empty() {
        if msg.len() < 16 {
            return Err(format!("a truncated header of {} bytes", msg.len()));
        }
        let (slot, len) = (word(&msg[..8]), word(&msg[8..16]));
        let rest = &msg[16..];
        if rest.len() < len {
            return Err(format!(
                "slot {slot}: {len} bytes announced, {} left",
                rest.len()
            ));
        }
        out.push((slot, &rest[..len]));
        msg = &rest[len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(phy_to_log: Vec<usize>, experts: usize) -> Placement {
        let mut log_to_phy = vec![Vec::new(); experts];
        let mut replica = Vec::new();
        for (s, &e) in phy_to_log.iter().enumerate() {
            replica.push(log_to_phy[e].len());
            log_to_phy[e].push(s);
        }
        Placement {
            phy_to_log,
            replica,
            log_to_phy,
        }
    }

    #[test]
    fn only_changed_slots_move_from_a_holder_on_their_rank_first() {
        // 4 experts in 6 slots over 2 ranks (slots 0-2, 3-5).
        let old = placement(vec![0, 1, 1, 2, 3, 1], 4);
        let new = placement(vec![0, 1, 2, 2, 3, 3], 4);
        let moves = plan_moves(&old, &new, 2).unwrap();
        assert_eq!(
            moves,
            vec![
                // Expert 2 lives on rank 1 only (slot 3): sent to rank 0.
                SlotMove {
                    slot: 2,
                    expert: 2,
                    source: 3
                },
                // Expert 3's slot 4 is on rank 1 itself.
                SlotMove {
                    slot: 5,
                    expert: 3,
                    source: 4
                },
            ]
        );
        assert!(plan_moves(&old, &old, 2).unwrap().is_empty());
        let err = plan_moves(&old, &placement(vec![0, 1, 2, 3], 4), 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("keeps the experts and slots"), "{err}");
    }

    #[test]
    fn framed_slots_come_back_and_truncation_is_named() {
        let slots = vec![(3, vec![1u8, 2, 3]), (7, Vec::new()), (0, vec![9; 40])];
        let msg = frame(&slots);
        let back: Vec<(usize, Vec<u8>)> = unframe(&msg)
            .unwrap()
            .into_iter()
            .map(|(s, b)| (s, b.to_vec()))
            .collect();
        assert_eq!(back, slots);
        let err = unframe(&msg[..msg.len() - 1]).unwrap_err();
        assert!(err.contains("slot 0: 40 bytes announced, 39 left"), "{err}");
    }
}
