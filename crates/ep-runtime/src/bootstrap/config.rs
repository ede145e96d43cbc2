//! [`StoreConfig`]: who this rank is and where the store lives, from the usual launcher
//! variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`) or given explicitly.

use crate::error::{Error, Result};
use std::time::Duration;

/// How long a store operation waits by default (overridden by `EP_STORE_TIMEOUT_SECS`).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// Where the bootstrap store lives and which rank this process is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// This process's global rank, `0..world_size`. Rank 0 hosts the store server.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// This process's rank within its node, `0..local_world_size`.
    pub local_rank: usize,
    /// Number of ranks on this node.
    pub local_world_size: usize,
    /// Host name or IP address of the rank-0 host (the store server).
    pub master_addr: String,
    /// TCP port of the store server; 0 lets rank 0 pick a free port (tests), which the other
    /// ranks must then learn from [`crate::bootstrap::Store::server_addr`].
    pub master_port: u16,
    /// Default time limit of every store operation that waits (connecting included).
    pub timeout: Duration,
}

impl StoreConfig {
    /// A configuration for a job on one node (`local_rank = rank`,
    /// `local_world_size = world_size`) with the default timeout; refine it with
    /// [`StoreConfig::with_local`] and [`StoreConfig::with_timeout`].
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Result<Self> {
        let cfg = Self {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: master_addr.into(),
            master_port,
            timeout: DEFAULT_STORE_TIMEOUT,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Sets this rank's place within its node.
    pub fn with_local(mut self, local_rank: usize, local_world_size: usize) -> Result<Self> {
        self.local_rank = local_rank;
        self.local_world_size = local_world_size;
        self.validate()?;
        Ok(self)
    }

    /// Sets the default time limit of store operations.
    pub fn with_timeout(mut self, timeout: Duration) -> Result<Self> {
        self.timeout = timeout;
        self.validate()?;
        Ok(self)
    }

    /// Checks that the fields are consistent.
    pub fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(Error::invalid("world_size", 0, "must be at least 1"));
        }
        if self.rank >= self.world_size {
            return Err(Error::invalid(
                "rank",
                self.rank,
                format!("must be below world_size = {}", self.world_size),
            ));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return Err(Error::invalid(
                "local_world_size",
                self.local_world_size,
                format!("must be in 1..={} (world_size)", self.world_size),
            ));
        }
        if self.local_rank >= self.local_world_size {
            return Err(Error::invalid(
                "local_rank",
                self.local_rank,
                format!("must be below local_world_size = {}", self.local_world_size),
            ));
        }
        if self.master_addr.trim().is_empty() {
            return Err(Error::invalid(
                "master_addr",
                format!("{:?}", self.master_addr),
                "must be a host name or IP address",
            ));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid(
                "timeout",
                format!("{:?}", self.timeout),
                "must be positive",
            ));
        }
        Ok(())
    }

    /// The environment a launcher of `world_size` processes on this host gives rank `rank`
    /// (what [`StoreConfig::from_env`] reads): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR` (127.0.0.1) and `MASTER_PORT`.
    pub fn one_host_env(
        rank: usize,
        world_size: usize,
        master_port: u16,
    ) -> [(&'static str, String); 6] {
        [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world_size.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", world_size.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", master_port.to_string()),
        ]
    }

    /// Reads the configuration from the process environment: `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (all required) and
    /// `EP_STORE_TIMEOUT_SECS` (optional, seconds, fractions allowed). Errors name the
    /// variable and its value.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Like [`StoreConfig::from_env`], reading the variables through `lookup` (which returns
    /// `None` for an unset variable), so that launchers and tests need not touch the process
    /// environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let rank = parse_usize(&lookup, "RANK")?;
        let world_size = parse_usize(&lookup, "WORLD_SIZE")?;
        let local_rank = parse_usize(&lookup, "LOCAL_RANK")?;
        let local_world_size = parse_usize(&lookup, "LOCAL_WORLD_SIZE")?;
        let master_addr = required(&lookup, "MASTER_ADDR")?.trim().to_string();
        let port_text = required(&lookup, "MASTER_PORT")?;
        let master_port = port_text.trim().parse::<u16>().map_err(|_| {
            Error::invalid(
                "MASTER_PORT",
                format!("{port_text:?}"),
                "must be a TCP port number in 0..=65535",
            )
        })?;
        let timeout = match lookup("EP_STORE_TIMEOUT_SECS") {
            None => DEFAULT_STORE_TIMEOUT,
            Some(text) => {
                let secs = text
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0);
                match secs.and_then(|s| Duration::try_from_secs_f64(s).ok()) {
                    Some(d) => d,
                    None => {
                        return Err(Error::invalid(
                            "EP_STORE_TIMEOUT_SECS",
                            format!("{text:?}"),
                            "must be a positive number of seconds",
                        ))
                    }
                }
            }
        };
        let cfg = Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            timeout,
        };
        cfg.validate().map_err(|e| match e {
            // Name the environment variable rather than the field.
            Error::InvalidArgument { arg, value, limit } => Error::InvalidArgument {
                arg: env_name_of(arg),
                value,
                limit: limit
                    .replace("world_size", "WORLD_SIZE")
                    .replace("local_WORLD_SIZE", "LOCAL_WORLD_SIZE"),
            },
            other => other,
        })?;
        Ok(cfg)
    }
}

fn env_name_of(field: &'static str) -> &'static str {
    match field {
        "rank" => "RANK",
        "world_size" => "WORLD_SIZE",
        "local_rank" => "LOCAL_RANK",
        "local_world_size" => "LOCAL_WORLD_SIZE",
        "master_addr" => "MASTER_ADDR",
        "timeout" => "EP_STORE_TIMEOUT_SECS",
        other => other,
    }
}

fn required(lookup: &impl Fn(&str) -> Option<String>, name: &'static str) -> Result<String> {
    lookup(name).ok_or_else(|| {
        Error::invalid(
            name,
            "<unset>",
            "must be set (by the launcher, e.g. torchrun-style RANK/WORLD_SIZE/MASTER_ADDR)",
        )
    })
}

fn parse_usize(lookup: &impl Fn(&str) -> Option<String>, name: &'static str) -> Result<usize> {
    let text = required(lookup, name)?;
    text.trim()
        .parse::<usize>()
        .map_err(|_| Error::invalid(name, format!("{text:?}"), "must be a non-negative integer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_env_reads_back_as_the_config() {
        let env = StoreConfig::one_host_env(2, 4, 29500);
        let cfg = StoreConfig::from_lookup(|name| {
            env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
        })
        .unwrap();
        assert_eq!(
            (
                cfg.rank,
                cfg.world_size,
                cfg.local_rank,
                cfg.local_world_size
            ),
            (2, 4, 2, 4)
        );
        assert_eq!(
            (cfg.master_addr.as_str(), cfg.master_port),
            ("127.0.0.1", 29500)
        );
    }
}
