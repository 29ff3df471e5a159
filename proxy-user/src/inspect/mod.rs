//! The operator's commands that read the datapath: `kpr status`, `kpr services`, `kpr diff`,
//! `kpr conntrack`, `kpr trace`. Each builds a report (serializable for `--output json`) and renders it as
//! text.
pub mod conntrack;
pub mod diff;
pub mod services;
pub mod status;
pub mod trace;
