//! Redundant experts for the example (`--num-redundant-experts`, `--expert-loads`): each MoE
//! layer's placement of `E + r` physical expert slots over the ranks, computed on every rank
//! alike by DeepSeek's EPLB algorithm ([`moe_layer::placement::place`]) from a file of expert
//! loads, or from equal loads without one.
//!
//! The loads file is JSON: an array of `E` numbers (every MoE layer), or an object mapping a
//! layer index to its array (layers it does not name take equal loads), e.g. what a run's
//! `MoeLayer::take_expert_load` summed over the ranks wrote.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use moe_layer::placement::{place, Placement, PlacementShape};

use crate::config::DeepSeekV3Config;

/// The placement of every MoE layer of a model.
#[derive(Clone, Debug)]
pub struct ExpertPlacements {
    /// Physical slots of every MoE layer (`E + r`).
    pub num_physical: usize,
    shape: PlacementShape,
    layers: BTreeMap<usize, Placement>,
}

impl ExpertPlacements {
    /// The placements of `cfg`'s MoE layers with `redundant` extra slots over `world_size`
    /// ranks in nodes of `gpus_per_node`, from the loads in `loads` (see the module docs), or
    /// `None` without redundant slots or loads.
    pub fn plan(
        cfg: &DeepSeekV3Config,
        world_size: usize,
        gpus_per_node: usize,
        redundant: usize,
        loads: Option<&Path>,
    ) -> Result<Option<Self>> {
        if redundant == 0 && loads.is_none() {
            return Ok(None);
        }
        Self::plan_always(cfg, world_size, gpus_per_node, redundant, loads).map(Some)
    }

    /// [`ExpertPlacements::plan`] even without redundant slots or loads (equal loads): what
    /// re-placement while serving starts from (`--eplb-interval`).
    pub fn plan_always(
        cfg: &DeepSeekV3Config,
        world_size: usize,
        gpus_per_node: usize,
        redundant: usize,
        loads: Option<&Path>,
    ) -> Result<Self> {
        let Some(e) = cfg.n_routed_experts.filter(|_| cfg.has_moe()) else {
            bail!("--num-redundant-experts / --expert-loads: the model has no routed experts");
        };
        let p = e + redundant;
        if p % world_size != 0 {
            bail!(
                "--num-redundant-experts {redundant}: n_routed_experts + {redundant} = {p} physical \
                 slots must be divisible by WORLD_SIZE = {world_size}"
            );
        }
        let given = match loads {
            Some(path) => read_loads(path, e)?,
            None => Loads::Every(vec![1.0; e]),
        };
        let shape = PlacementShape {
            num_physical: p,
            num_groups: cfg.n_group.max(1),
            num_nodes: (world_size / gpus_per_node.max(1)).max(1),
            num_gpus: world_size,
        };
        let mut layers = BTreeMap::new();
        for i in (0..cfg.num_hidden_layers).filter(|&i| cfg.is_moe_layer(i)) {
            let l = match &given {
                Loads::Every(v) => v.clone(),
                Loads::ByLayer(m) => m.get(&i).cloned().unwrap_or_else(|| vec![1.0; e]),
            };
            let placement =
                place(&l, shape).with_context(|| format!("expert placement of layer {i}"))?;
            layers.insert(i, placement);
        }
        Ok(Self {
            num_physical: p,
            shape,
            layers,
        })
    }

    /// The slots and machines the placements are for.
    pub fn shape(&self) -> PlacementShape {
        self.shape
    }

    /// The placement of layer `i` (a MoE layer).
    pub fn for_layer(&self, i: usize) -> Option<&Placement> {
        self.layers.get(&i)
    }

    /// The number of MoE layers placed.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
}

/// Loads as a file gives them.
enum Loads {
    Every(Vec<f64>),
    ByLayer(BTreeMap<usize, Vec<f64>>),
}

fn read_loads(path: &Path, e: usize) -> Result<Loads> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the expert loads {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let array = |v: &serde_json::Value, what: &str| -> Result<Vec<f64>> {
        let a = v
            .as_array()
            .with_context(|| format!("{}: {what} is not an array of loads", path.display()))?;
        if a.len() != e {
            bail!(
                "{}: {what} has {} loads, the model has {e} routed experts",
                path.display(),
                a.len()
            );
        }
        a.iter()
            .map(|x| {
                x.as_f64()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .with_context(|| format!("{}: {what}: {x} is not a load", path.display()))
            })
            .collect()
    };
    match &json {
        serde_json::Value::Array(_) => Ok(Loads::Every(array(&json, "the file")?)),
        serde_json::Value::Object(m) => {
            let mut out = BTreeMap::new();
            for (k, v) in m {
                let layer: usize = k.parse().with_context(|| {
                    format!("{}: key {k:?} is not a layer index", path.display())
                })?;
                out.insert(layer, array(v, &format!("layer {layer}"))?);
            }
            Ok(Loads::ByLayer(out))
        }
        _ => bail!(
            "{}: expected an array of loads or an object of layer -> loads",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DeepSeekV3Config {
        let mut c = DeepSeekV3Config::tiny();
        c.n_routed_experts = Some(8);
        c.n_group = 2;
        c.topk_group = 1;
        c
    }

    #[test]
    fn every_moe_layer_gets_its_slots_and_hot_experts_their_replicas() {
        let c = cfg();
        let dir = std::env::temp_dir().join(format!("ds-loads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("loads.json");
        let first = (0..c.num_hidden_layers)
            .find(|&i| c.is_moe_layer(i))
            .unwrap();
        std::fs::write(
            &file,
            format!("{{\"{first}\": [100, 1, 1, 1, 1, 1, 1, 1]}}"),
        )
        .unwrap();
        let p = ExpertPlacements::plan(&c, 2, 2, 4, Some(&file))
            .unwrap()
            .unwrap();
        assert_eq!(p.num_physical, 12);
        let hot = p.for_layer(first).unwrap();
        assert!(hot.log_to_phy[0].len() >= 4, "{:?}", hot.log_to_phy);
        assert_eq!(
            p.num_layers(),
            (0..c.num_hidden_layers)
                .filter(|&i| c.is_moe_layer(i))
                .count()
        );
        std::fs::write(&file, "[1, 2, 3]").unwrap();
        let err = ExpertPlacements::plan(&c, 2, 2, 4, Some(&file)).unwrap_err();
        assert!(format!("{err:#}").contains("3 loads"), "{err:#}");
        std::fs::remove_dir_all(&dir).ok();
        let err = ExpertPlacements::plan(&c, 4, 4, 2, None).unwrap_err();
        assert!(format!("{err:#}").contains("10 physical"), "{err:#}");
        assert!(ExpertPlacements::plan(&c, 2, 2, 0, None).unwrap().is_none());
    }
}
