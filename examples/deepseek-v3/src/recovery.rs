//! Going on without a lost rank (docs/design.md, "Serving around a lost rank").
//!
//! When a step breaks off on any rank because a peer failed (its connection closed, or it did
//! not answer within the timeout), that rank opens an agreement ([`Membership::agree`]): the
//! others' collectives are cancelled at once, every survivor checks in, and rank 0 decides
//! which ranks are lost. Then every survivor rolls back the step rank 0 did not complete (a
//! rank that ran it undoes it: its sequences' caches and samplers as before), routes every MoE
//! layer around the lost ranks (each of their experts served by a replica on another rank:
//! [`moe_layer::MoeLayer::exclude_ranks`]), and the steps go on. Rank 0's scheduler fails the
//! sequences that lived on the lost ranks and runs the broken step again.
//!
//! It fails instead (the error names the ranks) when a lost rank held an expert with no replica
//! elsewhere (no redundant experts, or all of an expert's replicas lost), when rank 0 is lost
//! (it hosts the store and the front end), or when the step broke off for a reason of this
//! rank's own.
//!
//! [`Membership::agree`]: moe_layer::ep_runtime::Membership::agree

use anyhow::{Context, Result};
use moe_layer::ep_runtime;

use crate::engine::Cluster;

/// Ranks lost in a step, as every survivor agreed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankLoss {
    /// The ranks this step lost.
    pub newly_lost: Vec<usize>,
    /// Every rank lost so far, one flag per rank.
    pub lost: Vec<bool>,
    /// Why the step broke off, in words (this rank's view).
    pub cause: String,
}

/// The runtime error behind `e`, if any (through the layer's and candle's wrappers).
fn runtime_error(e: &anyhow::Error) -> Option<&ep_runtime::Error> {
    e.chain().find_map(|c| {
        if let Some(r) = c.downcast_ref::<ep_runtime::Error>() {
            return Some(r);
        }
        if let Some(moe_layer::Error::Runtime(r)) = c.downcast_ref::<moe_layer::Error>() {
            return Some(r);
        }
        let candle = c.downcast_ref::<candle_core::Error>()?;
        ep_runtime::Error::from_candle(candle).or_else(|| {
            match moe_layer::Error::from_candle(candle)? {
                moe_layer::Error::Runtime(r) => Some(r),
                _ => None,
            }
        })
    })
}

/// Whether a step broke off because of other ranks (a peer failed, or another rank opened an
/// agreement), not for a reason of this rank's own.
pub fn caused_by_peers(e: &anyhow::Error) -> bool {
    runtime_error(e).is_some_and(|r| {
        matches!(
            r,
            ep_runtime::Error::Cancelled { .. }
                | ep_runtime::Error::Timeout { .. }
                | ep_runtime::Error::PeerLost { .. }
                | ep_runtime::Error::RanksMasked { .. }
        )
    })
}

impl Cluster {
    /// After a step broke off with `cause`: agrees with the other survivors on the lost ranks,
    /// rolls back the step rank 0 did not complete and routes every MoE layer around the lost
    /// ranks (see the module docs). Errors (with `cause` in them) when this job cannot go on.
    pub(crate) fn recover(&mut self, cause: anyhow::Error) -> Result<RankLoss> {
        let rank = self.dist.info.rank;
        let Some(membership) = self.membership.as_mut() else {
            return Err(cause);
        };
        let own = !caused_by_peers(&cause);
        let why = crate::app::error_report(&cause);
        tracing::warn!("rank {rank}: a step broke off ({why}); agreeing on lost ranks");
        let agreement = match membership.agree() {
            Ok(a) => a,
            Err(e) => return Err(cause.context(format!("rank {rank}: {e}"))),
        };
        // Rank 0 says which step it completed last; a rank that ran a later one undoes it.
        let committed = self
            .dist
            .all_gather(&self.committed.to_le_bytes())
            .with_context(|| format!("rank {rank}: cannot resume the steps after: {why}"))?
            .first()
            .and_then(|b| b.as_slice().try_into().ok())
            .map(u64::from_le_bytes)
            .context("no step number from rank 0")?;
        if self.engine.roll_back(committed)? {
            tracing::info!("rank {rank}: rolled back the steps after step {committed}");
        }
        if own && agreement.newly_lost.is_empty() {
            // Nobody else failed: the failure is this rank's, which cannot go on.
            return Err(cause);
        }
        let lost_ranks: Vec<usize> = (0..agreement.lost.len())
            .filter(|&r| agreement.lost[r])
            .collect();
        if !agreement.newly_lost.is_empty() {
            for (i, layer) in self.engine.model_mut().moe_layers_mut() {
                if let Err(e) = layer.exclude_ranks(&agreement.lost) {
                    return Err(cause.context(format!(
                        "rank {rank}: cannot go on without ranks {lost_ranks:?}: MoE layer {i}: {e}"
                    )));
                }
            }
            if self.eplb.take().is_some() {
                tracing::warn!(
                    "rank {rank}: expert re-placement is off after losing ranks {lost_ranks:?}"
                );
            }
            tracing::warn!(
                "rank {rank}: going on without ranks {lost_ranks:?} (their experts served by \
                 their replicas)"
            );
        }
        Ok(RankLoss {
            newly_lost: agreement.newly_lost,
            lost: agreement.lost,
            cause: why,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_failures_are_told_from_a_rank_s_own_through_the_wrappers() {
        let lost = ep_runtime::Error::PeerLost {
            rank: 2,
            what: "all_gather".into(),
        };
        let wrapped: candle_core::Error = moe_layer::Error::Runtime(lost).into();
        let e = anyhow::Error::from(wrapped).context("rank 0: Decode step failed");
        assert!(caused_by_peers(&e));
        let cancelled = anyhow::Error::from(ep_runtime::Error::Cancelled {
            what: "combine".into(),
        });
        assert!(caused_by_peers(&cancelled));
        let own = anyhow::anyhow!("out of memory").context("rank 1: Prefill step failed");
        assert!(!caused_by_peers(&own));
    }
}
