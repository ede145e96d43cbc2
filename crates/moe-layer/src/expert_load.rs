//! [`ExpertLoad`]: the tokens a layer's router sends to each logical expert, counted on the
//! layer's device as the steps run (no host read in a step) and read out on demand: the
//! statistics behind expert placement ([`crate::placement`]).
//!
//! A step's picks are added in place (so that captured steps count too) into partial counts
//! `[E + 1, C]`: pick `j` goes to column `j mod C`, and a scatter-add runs one thread per column
//! (a scatter into one `[E]` row would run one thread over every pick). Row `E` takes the
//! padding of the last row of picks. A read sums the columns.

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// Columns of the partial counts (threads of the scatter-add).
const COLUMNS: usize = 256;

/// Per-logical-expert token counts of a layer since the last [`ExpertLoad::take`]. Counts are
/// exact up to 2^24 picks per expert and column between two reads.
#[derive(Debug)]
pub(crate) struct ExpertLoad {
    /// `[E + 1, COLUMNS]` f32.
    partial: Tensor,
    num_experts: usize,
}

impl ExpertLoad {
    /// Zero counts for `num_experts` logical experts on `device`.
    pub(crate) fn new(num_experts: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            partial: Tensor::zeros((num_experts + 1, COLUMNS), DType::F32, device)?,
            num_experts,
        })
    }

    /// Adds a step's logical picks `topk_idx` (`[T, K]` integer ids below `E`).
    pub(crate) fn record(&self, topk_idx: &Tensor) -> Result<()> {
        let n = topk_idx.elem_count();
        if n == 0 {
            return Ok(());
        }
        let dev = topk_idx.device();
        let rows = n.div_ceil(COLUMNS);
        let mut ids = topk_idx.flatten_all()?.to_dtype(DType::U32)?;
        if rows * COLUMNS > n {
            let pad = Tensor::full(self.num_experts as u32, rows * COLUMNS - n, dev)?;
            ids = Tensor::cat(&[&ids, &pad], 0)?;
        }
        let ids = ids.reshape((rows, COLUMNS))?;
        let ones = Tensor::ones((rows, COLUMNS), DType::F32, dev)?;
        self.partial.scatter_add_set(&ids, &ones, 0)?;
        Ok(())
    }

    /// The counts since the last take (one device-to-host copy), then zero.
    pub(crate) fn take(&self) -> Result<Vec<f64>> {
        let v: Vec<f32> = self
            .partial
            .narrow(0, 0, self.num_experts)?
            .sum(1)?
            .to_vec1()?;
        self.partial.zero_set()?;
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

    #[test]
    fn more_picks_than_columns_count_alike() {
        let load = ExpertLoad::new(3, &Device::Cpu).unwrap();
        let ids: Vec<i64> = (0..1000).map(|j| (j * j % 7 % 3) as i64).collect();
        let mut want = vec![0.0; 3];
        for &x in &ids {
            want[x as usize] += 1.0;
        }
        load.record(&Tensor::from_vec(ids, (500, 2), &Device::Cpu).unwrap())
            .unwrap();
        assert_eq!(load.take().unwrap(), want);
    }
}
