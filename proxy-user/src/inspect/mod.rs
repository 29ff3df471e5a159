//! The operator's commands that read the datapath: `kpr status`, `kpr services`, `kpr diff`,
//! `kpr conntrack`, `kpr trace`, `kpr events`. Each builds a report (serializable for `--output json`) and renders it as
//! text.
pub mod conntrack;
pub mod diff;
pub mod events;
pub mod services;
pub mod status;
pub mod trace;

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, Result};

/// `GET path` over HTTP/1.1 (one request, then close): (status code, body).
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, String)> {
    let mut conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    write!(conn, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").context("no end of headers")?;
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).context("no status code")?;
    Ok((status, body.to_owned()))
}

/// The endpoints the agent whose metrics server is at `address` has sidelined now; none when
/// no agent answers there (an older one, or none running).
pub fn sidelined(address: SocketAddr) -> Vec<crate::model::outliers::Sidelined> {
    let answer = http_get(address, "/sidelined", Duration::from_secs(2));
    match answer {
        Ok((200, body)) => serde_json::from_str(&body).unwrap_or_default(),
        _ => Vec::new(),
    }
}
