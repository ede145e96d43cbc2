//! Expert placement with redundant experts: DeepSeek's expert-parallel load balancer (EPLB),
//! written from its description. Given each logical expert's load (tokens routed to it over a
//! window) and `P >= E` physical expert slots over `G` GPUs in `N` nodes, it chooses which
//! experts get extra replicas and which GPU holds every replica, so that the GPUs' loads (a
//! replica taking an equal share of its expert's load) are as even as it can make them.
//!
//! Two policies, as DeepSeek's:
//! - **hierarchical** (when the `N` nodes divide the expert groups of group-limited routing):
//!   whole groups are packed onto nodes with balanced loads, so a token's experts stay within
//!   the nodes its groups chose; then each node replicates its own experts into its slots, and
//!   packs the replicas onto its GPUs;
//! - **global** (otherwise): the same with one group and one node.
//!
//! The two steps: *replication* gives the next extra slot to the expert of the highest load per
//! replica, until the slots are used; *balanced packing* places items, heaviest first, each
//! into the lightest pack that still has room, every pack taking the same number of items.
//! Ties go to the lower index (expert, pack), so the placement is a function of the loads.

use crate::error::{Error, Result};

/// The slots and machines a placement is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacementShape {
    /// Physical expert slots `P` over all GPUs (a multiple of `num_gpus`, at least the number
    /// of logical experts).
    pub num_physical: usize,
    /// Expert groups of group-limited routing (`n_group`; 1 without).
    pub num_groups: usize,
    /// Nodes `N` (GPUs within a node talk over NVLink).
    pub num_nodes: usize,
    /// GPUs `G` (ranks), a multiple of `num_nodes`.
    pub num_gpus: usize,
}

/// Where every replica of every logical expert lives, for one layer. Physical slot `s` is on
/// GPU `s / (P / G)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The logical expert of each physical slot, `[P]`.
    pub phy_to_log: Vec<usize>,
    /// Which replica of its expert each slot holds (0 for the first), `[P]`.
    pub replica: Vec<usize>,
    /// The slots of each logical expert, by replica, `[E][count]`.
    pub log_to_phy: Vec<Vec<usize>>,
}

impl Placement {
    /// The placement without redundant experts: expert `e` in slot `e` (what a layer of
    /// `E / R` fixed experts per rank holds).
    pub fn identity(num_experts: usize) -> Self {
        Self {
            phy_to_log: (0..num_experts).collect(),
            replica: vec![0; num_experts],
            log_to_phy: (0..num_experts).map(|e| vec![e]).collect(),
        }
    }

    /// Physical slots `P`.
    pub fn num_physical(&self) -> usize {
        self.phy_to_log.len()
    }

    /// The load each of `num_gpus` GPUs carries under `loads` (per logical expert), a replica
    /// taking an equal share of its expert's load.
    pub fn gpu_loads(&self, loads: &[f64], num_gpus: usize) -> Vec<f64> {
        let per_gpu = self.num_physical() / num_gpus.max(1);
        let mut out = vec![0.0; num_gpus];
        for (s, &e) in self.phy_to_log.iter().enumerate() {
            let share = loads[e] / self.log_to_phy[e].len() as f64;
            out[(s / per_gpu.max(1)).min(num_gpus - 1)] += share;
        }
        out
    }

    /// `max / mean` of [`Placement::gpu_loads`] (1 is perfectly even).
    pub fn imbalance(&self, loads: &[f64], num_gpus: usize) -> f64 {
        imbalance(&self.gpu_loads(loads, num_gpus))
    }

    /// This placement with no token routed to the slots of the GPUs marked `lost` (one flag
    /// per GPU): each logical expert keeps only its replicas on the other GPUs. The slots stay
    /// (`phy_to_log` unchanged): they hold their weights but take no token. Fails, naming the
    /// experts, when one would keep no replica.
    pub fn without_gpus(&self, lost: &[bool]) -> Result<Placement> {
        let (p, g) = (self.num_physical(), lost.len());
        if g == 0 || p % g != 0 {
            return Err(Error::invalid(
                "lost",
                format!("{g} GPU flags"),
                format!("one per GPU, dividing the {p} slots"),
            ));
        }
        let per_gpu = p / g;
        let log_to_phy: Vec<Vec<usize>> = self
            .log_to_phy
            .iter()
            .map(|v| v.iter().copied().filter(|&s| !lost[s / per_gpu]).collect())
            .collect();
        let orphans: Vec<usize> = (0..log_to_phy.len())
            .filter(|&x| log_to_phy[x].is_empty())
            .collect();
        if !orphans.is_empty() {
            let ranks: Vec<usize> = (0..g).filter(|&r| lost[r]).collect();
            return Err(Error::invalid(
                "lost ranks",
                format!("{ranks:?}"),
                format!(
                    "logical experts {orphans:?} have no replica on another rank (more \
                     redundant experts, or a placement that spreads replicas over ranks, \
                     would keep them)"
                ),
            ));
        }
        Ok(Placement {
            phy_to_log: self.phy_to_log.clone(),
            replica: self.replica.clone(),
            log_to_phy,
        })
    }

    /// This placement with the slots of each of `num_gpus` GPUs reordered so that as many as
    /// can keep the expert they hold in `current`: every GPU holds the same experts as before
    /// the reordering (the same balance), and a re-placement from `current` moves only the
    /// experts that change GPU. Unchanged when the slot counts differ.
    pub fn aligned_to(&self, current: &Placement, num_gpus: usize) -> Placement {
        let p = self.num_physical();
        if current.num_physical() != p || num_gpus == 0 || p % num_gpus != 0 {
            return self.clone();
        }
        let per_gpu = p / num_gpus;
        let mut phy_to_log = vec![0usize; p];
        let mut replica = vec![0usize; p];
        for g in 0..num_gpus {
            let slots = g * per_gpu..(g + 1) * per_gpu;
            // The GPU's (expert, replica) items, taken as slots claim them.
            let mut items: Vec<Option<(usize, usize)>> = slots
                .clone()
                .map(|s| Some((self.phy_to_log[s], self.replica[s])))
                .collect();
            let mut open = Vec::new();
            for s in slots.clone() {
                let keep = items
                    .iter()
                    .position(|it| it.is_some_and(|(x, _)| x == current.phy_to_log[s]));
                match keep.and_then(|i| items[i].take()) {
                    Some((x, r)) => (phy_to_log[s], replica[s]) = (x, r),
                    None => open.push(s),
                }
            }
            for (s, (x, r)) in open.into_iter().zip(items.into_iter().flatten()) {
                (phy_to_log[s], replica[s]) = (x, r);
            }
        }
        let mut log_to_phy = vec![Vec::new(); self.log_to_phy.len()];
        for (s, &x) in phy_to_log.iter().enumerate() {
            log_to_phy[x].push((replica[s], s));
        }
        Placement {
            phy_to_log,
            replica,
            log_to_phy: log_to_phy
                .into_iter()
                .map(|mut v| {
                    v.sort_unstable();
                    v.into_iter().map(|(_, s)| s).collect()
                })
                .collect(),
        }
    }
}

/// `max / mean` of `loads` (1 when all are zero).
pub fn imbalance(loads: &[f64]) -> f64 {
    let total: f64 = loads.iter().sum();
    if total <= 0.0 || loads.is_empty() {
        return 1.0;
    }
    let max = loads.iter().copied().fold(f64::MIN, f64::max);
    max * loads.len() as f64 / total
}

/// The placement of one layer whose logical experts carry `loads` (non-negative, finite).
pub fn place(loads: &[f64], shape: PlacementShape) -> Result<Placement> {
    check(loads, shape)?;
    let (groups, nodes) = if shape.num_groups % shape.num_nodes == 0 {
        (shape.num_groups, shape.num_nodes)
    } else {
        (1, 1)
    };
    let e = loads.len();
    let group_size = e / groups;
    let groups_per_node = groups / nodes;
    let (experts_per_node, slots_per_node) = (e / nodes, shape.num_physical / nodes);
    let gpus_per_node = shape.num_gpus / nodes;
    let slots_per_gpu = shape.num_physical / shape.num_gpus;
    // 1. Whole groups onto nodes; `node_experts[n]` lists node n's experts in pack order.
    let group_loads: Vec<f64> = (0..groups)
        .map(|g| loads[g * group_size..(g + 1) * group_size].iter().sum())
        .collect();
    let group_packs = pack(&group_loads, nodes);
    let mut node_experts = vec![vec![0usize; experts_per_node]; nodes];
    for (g, &(node, rank)) in group_packs.iter().enumerate() {
        for j in 0..group_size {
            node_experts[node][(rank * group_size) + j] = g * group_size + j;
        }
    }
    debug_assert!(node_experts
        .iter()
        .all(|v| v.len() == groups_per_node * group_size));
    // 2. and 3. Per node: replicate its experts into its slots, pack the replicas onto its GPUs.
    let mut phy_to_log = vec![0usize; shape.num_physical];
    let mut replica = vec![0usize; shape.num_physical];
    for (node, experts) in node_experts.iter().enumerate() {
        let node_loads: Vec<f64> = experts.iter().map(|&x| loads[x]).collect();
        let (slot_expert, slot_replica, counts) = replicate(&node_loads, slots_per_node);
        let slot_loads: Vec<f64> = slot_expert
            .iter()
            .map(|&m| node_loads[m] / counts[m] as f64)
            .collect();
        let gpu_packs = pack(&slot_loads, gpus_per_node);
        let mut gpu_slots = vec![vec![0usize; slots_per_gpu]; gpus_per_node];
        for (slot, &(gpu, rank)) in gpu_packs.iter().enumerate() {
            gpu_slots[gpu][rank] = slot;
        }
        spread_replicas(&mut gpu_slots, &slot_expert, &slot_loads);
        for (gpu, slots) in gpu_slots.iter().enumerate() {
            for (rank, &slot) in slots.iter().enumerate() {
                let s = node * slots_per_node + gpu * slots_per_gpu + rank;
                phy_to_log[s] = experts[slot_expert[slot]];
                replica[s] = slot_replica[slot];
            }
        }
    }
    let mut log_to_phy = vec![Vec::new(); e];
    for (s, &x) in phy_to_log.iter().enumerate() {
        log_to_phy[x].push((replica[s], s));
    }
    let log_to_phy = log_to_phy
        .into_iter()
        .map(|mut v| {
            v.sort_unstable();
            v.into_iter().map(|(_, s)| s).collect()
        })
        .collect();
    Ok(Placement {
        phy_to_log,
        replica,
        log_to_phy,
    })
}

/// Swaps slots of equal load between GPUs (`gpus[g]`: the slots of GPU `g`; `expert[slot]`,
/// `load[slot]`) so that no GPU holds two replicas of one expert where such a swap allows it.
/// Every GPU's load stays exactly as packed; what it buys is that a lost GPU leaves each of its
/// experts a replica on another GPU (`Placement::without_gpus`) whenever the slots allow.
fn spread_replicas(gpus: &mut [Vec<usize>], expert: &[usize], load: &[f64]) {
    let holds = |g: &[usize], x: usize| g.iter().filter(|&&s| expert[s] == x).count();
    let slots: usize = gpus.iter().map(Vec::len).sum();
    // Each swap lowers the number of doubled replicas by at least one.
    for _ in 0..=slots {
        let mut swapped = false;
        for a in 0..gpus.len() {
            for i in 0..gpus[a].len() {
                let s = gpus[a][i];
                let x = expert[s];
                if holds(&gpus[a], x) < 2 {
                    continue;
                }
                let partner = (0..gpus.len())
                    .filter(|&b| b != a && holds(&gpus[b], x) == 0)
                    .find_map(|b| {
                        (0..gpus[b].len())
                            .find(|&j| {
                                let t = gpus[b][j];
                                load[t] == load[s] && holds(&gpus[a], expert[t]) == 0
                            })
                            .map(|j| (b, j))
                    });
                if let Some((b, j)) = partner {
                    let t = gpus[b][j];
                    gpus[b][j] = s;
                    gpus[a][i] = t;
                    swapped = true;
                }
            }
        }
        if !swapped {
            return;
        }
    }
}

/// Checks the loads and the shape; errors name the value and the limit.
fn check(loads: &[f64], s: PlacementShape) -> Result<()> {
    let e = loads.len();
    if let Some((i, v)) = loads
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite() || **v < 0.0)
    {
        return Err(Error::invalid(
            "loads",
            format!("loads[{i}] = {v}"),
            "must be finite and non-negative",
        ));
    }
    let bad =
        |arg: &'static str, value: usize, limit: String| Err(Error::invalid(arg, value, limit));
    if e == 0 {
        return bad("loads", 0, "at least one expert is needed".into());
    }
    if s.num_gpus == 0 || s.num_nodes == 0 || s.num_gpus % s.num_nodes != 0 {
        return bad(
            "num_gpus",
            s.num_gpus,
            format!("must be a positive multiple of num_nodes = {}", s.num_nodes),
        );
    }
    if s.num_physical < e || s.num_physical % s.num_gpus != 0 {
        return bad(
            "num_physical",
            s.num_physical,
            format!(
                "must be at least the {e} experts and a multiple of num_gpus = {}",
                s.num_gpus
            ),
        );
    }
    if s.num_groups == 0 || e % s.num_groups != 0 {
        return bad(
            "num_groups",
            s.num_groups,
            format!("must divide the {e} experts"),
        );
    }
    if s.num_groups % s.num_nodes == 0 && (s.num_physical / s.num_nodes) < e / s.num_nodes {
        return bad(
            "num_physical",
            s.num_physical,
            "must give every node at least its experts' slots".into(),
        );
    }
    Ok(())
}

/// Balanced packing: `(pack, rank in pack)` of each item of `weights` over `packs` packs of
/// `weights.len() / packs` items each. Heaviest first (ties: lower index), each item into the
/// lightest pack with room (ties: lower pack).
fn pack(weights: &[f64], packs: usize) -> Vec<(usize, usize)> {
    let per_pack = weights.len() / packs;
    if per_pack == 1 {
        return (0..weights.len()).map(|i| (i, 0)).collect();
    }
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; packs];
    let mut items = vec![0usize; packs];
    let mut out = vec![(0, 0); weights.len()];
    for i in order {
        let p = (0..packs)
            .filter(|&p| items[p] < per_pack)
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .expect("the packs hold all items");
        out[i] = (p, items[p]);
        load[p] += weights[i];
        items[p] += 1;
    }
    out
}

/// Replication of `loads.len()` experts into `slots` slots: slot `i < E` holds expert `i`, each
/// further slot the expert of the highest load per replica so far (ties: lower expert). Returns
/// each slot's expert and replica index, and each expert's replica count.
fn replicate(loads: &[f64], slots: usize) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let e = loads.len();
    let mut expert: Vec<usize> = (0..e).collect();
    let mut replica = vec![0usize; e];
    let mut counts = vec![1usize; e];
    for _ in e..slots {
        let mut best = 0;
        for x in 1..e {
            if loads[x] / counts[x] as f64 > loads[best] / counts[best] as f64 {
                best = x;
            }
        }
        expert.push(best);
        replica.push(counts[best]);
        counts[best] += 1;
    }
    (expert, replica, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligning_keeps_each_gpus_experts_and_moves_only_what_changes_gpu() {
        let shape = PlacementShape {
            num_physical: 24,
            num_groups: 1,
            num_nodes: 1,
            num_gpus: 4,
        };
        let even = place(&[1.0; 16], shape).unwrap();
        let skew: Vec<f64> = (0..16).map(|x| 1.0 / (1 + x) as f64).collect();
        let next = place(&skew, shape).unwrap();
        let aligned = next.aligned_to(&even, 4);
        // The same experts on every GPU, so the same balance.
        for g in 0..4 {
            let mut a: Vec<usize> = aligned.phy_to_log[g * 6..(g + 1) * 6].to_vec();
            let mut b: Vec<usize> = next.phy_to_log[g * 6..(g + 1) * 6].to_vec();
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "gpu {g}");
        }
        assert_eq!(aligned.imbalance(&skew, 4), next.imbalance(&skew, 4));
        // The map holds together, and no more slots change than before aligning.
        for (x, slots) in aligned.log_to_phy.iter().enumerate() {
            assert!(slots.iter().all(|&s| aligned.phy_to_log[s] == x));
        }
        let changed = |p: &Placement| {
            (0..24)
                .filter(|&s| p.phy_to_log[s] != even.phy_to_log[s])
                .count()
        };
        assert!(changed(&aligned) <= changed(&next));
        // A placement aligned to itself is itself.
        assert_eq!(next.aligned_to(&next, 4), next);
    }

    fn shape(p: usize, groups: usize, nodes: usize, gpus: usize) -> PlacementShape {
        PlacementShape {
            num_physical: p,
            num_groups: groups,
            num_nodes: nodes,
            num_gpus: gpus,
        }
    }

    #[test]
    fn the_published_example_places_as_deepseeks_balancer() {
        // DeepSeek's EPLB README: 2 layers of 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs.
        let layers: [[f64; 12]; 2] = [
            [
                90., 132., 40., 61., 104., 165., 39., 4., 73., 56., 183., 86.,
            ],
            [
                20., 107., 104., 64., 19., 197., 187., 157., 172., 86., 16., 27.,
            ],
        ];
        let want: [[usize; 16]; 2] = [
            [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
            [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
        ];
        for (loads, want) in layers.iter().zip(want) {
            let p = place(loads, shape(16, 4, 2, 8)).unwrap();
            assert_eq!(p.phy_to_log, want);
        }
    }

    #[test]
    fn equal_loads_put_an_expert_s_replicas_on_different_gpus() {
        // 16 experts twice over 4 GPUs (a rank lost keeps every expert served), one node, and
        // over 2 nodes of 2 GPUs (4 groups).
        for (groups, nodes) in [(1, 1), (4, 2)] {
            let p = place(&[1.0; 16], shape(32, groups, nodes, 4)).unwrap();
            for g in 0..4 {
                let mut held: Vec<usize> = p.phy_to_log[g * 8..(g + 1) * 8].to_vec();
                held.sort_unstable();
                held.dedup();
                assert_eq!(held.len(), 8, "gpu {g} of {:?}", p.phy_to_log);
                let mut lost = vec![false; 4];
                lost[g] = true;
                p.without_gpus(&lost).unwrap();
            }
            assert_eq!(p.gpu_loads(&[1.0; 16], 4), vec![4.0; 4]);
        }
    }

    /// Zipf-like loads: expert `i` of a random order draws `1 / (rank + 1)^s`.
    fn zipf(e: usize, s: f64, seed: u64) -> Vec<f64> {
        let mut order: Vec<usize> = (0..e).collect();
        let mut x = seed | 1;
        for i in (1..e).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let mut loads = vec![0.0; e];
        for (rank, &i) in order.iter().enumerate() {
            loads[i] = 1000.0 / ((rank + 1) as f64).powf(s);
        }
        loads
    }

    #[test]
    fn every_expert_has_a_replica_every_gpu_its_slots_and_groups_stay_on_a_node() {
        for (seed, (e, p, groups, nodes, gpus)) in [
            (256, 288, 8, 2, 8),
            (256, 256, 8, 1, 4),
            (64, 72, 8, 2, 8),
            (64, 96, 1, 1, 4),
            (12, 16, 3, 2, 8), // 3 groups over 2 nodes: the global policy
        ]
        .into_iter()
        .enumerate()
        {
            let loads = zipf(e, 1.0, seed as u64 + 7);
            let pl = place(&loads, shape(p, groups, nodes, gpus)).unwrap();
            assert_eq!(pl.num_physical(), p);
            assert!(pl.log_to_phy.iter().all(|v| !v.is_empty()));
            let counted: usize = pl.log_to_phy.iter().map(Vec::len).sum();
            assert_eq!(counted, p);
            for (x, slots) in pl.log_to_phy.iter().enumerate() {
                for (r, &s) in slots.iter().enumerate() {
                    assert_eq!((pl.phy_to_log[s], pl.replica[s]), (x, r));
                }
            }
            if groups % nodes == 0 {
                let (group_size, per_node) = (e / groups, p / nodes);
                for g in 0..groups {
                    let node_of = |x: usize| pl.log_to_phy[x][0] / per_node;
                    let n = node_of(g * group_size);
                    for x in g * group_size..(g + 1) * group_size {
                        assert!(pl.log_to_phy[x].iter().all(|&s| s / per_node == n));
                    }
                }
            }
        }
    }

    #[test]
    fn redundant_slots_even_out_skewed_loads() {
        // DeepSeek-V3's 256 experts over 8 GPUs of one node with Zipf s = 1 loads.
        let loads = zipf(256, 1.0, 3);
        let fixed = Placement::identity(256).imbalance(&loads, 8);
        let balanced = place(&loads, shape(256, 8, 1, 8))
            .unwrap()
            .imbalance(&loads, 8);
        let redundant = place(&loads, shape(256 + 8 * 8, 8, 1, 8))
            .unwrap()
            .imbalance(&loads, 8);
        assert!(fixed > 1.3, "fixed placement {fixed:.3}");
        assert!(balanced < fixed, "{balanced:.3} against {fixed:.3}");
        assert!(
            redundant <= 1.05,
            "with 8 redundant slots per GPU: {redundant:.3}"
        );
    }

    #[test]
    fn bad_shapes_and_loads_are_refused_naming_them() {
        let loads = vec![1.0; 16];
        for (s, arg) in [
            (shape(15, 1, 1, 1), "num_physical"),
            (shape(18, 1, 1, 4), "num_physical"),
            (shape(16, 3, 1, 4), "num_groups"),
            (shape(16, 4, 3, 4), "num_gpus"),
        ] {
            let err = place(&loads, s).unwrap_err().to_string();
            assert!(err.contains(arg), "{err}");
        }
        let err = place(&[1.0, f64::NAN], shape(2, 1, 1, 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("loads[1]"), "{err}");
    }
}
