//! [`ExpertLoad`]: the tokens a layer's router sends to each logical expert, counted on the
//! layer's device as the steps run (one scatter-add of the step's picks into an `[E]` f32
//! tensor updated in place, so that captured steps count too; no host read in a step) and read
//! out on demand: the statistics behind expert placement ([`crate::placement`]).

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// Per-logical-expert token counts of a layer since the last [`ExpertLoad::take`]. Counts are
/// exact up to 2^24 tokens per expert between two reads.
#[derive(Debug)]
pub(crate) struct ExpertLoad {
    counts: Tensor,
}

impl ExpertLoad {
    /// Zero counts for `num_experts` logical experts on `device`.
    pub(crate) fn new(num_experts: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            counts: Tensor::zeros(num_experts, DType::F32, device)?,
        })
    }

    /// Adds a step's logical picks `topk_idx` (`[T, K]` integer ids below `E`).
    pub(crate) fn record(&self, topk_idx: &Tensor) -> Result<()> {
        let n = topk_idx.elem_count();
        if n == 0 {
            return Ok(());
        }
        let ids = topk_idx.flatten_all()?.to_dtype(DType::U32)?;
        let ones = Tensor::ones(n, DType::F32, topk_idx.device())?;
        self.counts.scatter_add_set(&ids, &ones, 0)?;
        Ok(())
    }

    /// The counts since the last take (one device-to-host copy), then zero.
    pub(crate) fn take(&self) -> Result<Vec<f64>> {
        let v: Vec<f32> = self.counts.to_vec1()?;
        self.counts.zero_set()?;
        Ok(v.into_iter().map(f64::from).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_pick_and_starts_again_after_a_take() {
        let load = ExpertLoad::new(4, &Device::Cpu).unwrap();
        let idx = Tensor::new(&[[1i64, 3], [1, 0], [2, 1]], &Device::Cpu).unwrap();
        load.record(&idx).unwrap();
        load.record(&Tensor::zeros((0, 2), DType::I64, &Device::Cpu).unwrap())
            .unwrap();
        load.record(&idx.narrow(0, 0, 1).unwrap()).unwrap();
        assert_eq!(load.take().unwrap(), vec![1.0, 4.0, 1.0, 2.0]);
        assert_eq!(load.take().unwrap(), vec![0.0; 4]);
    }
}
